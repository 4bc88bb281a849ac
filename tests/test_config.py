"""The run config: TOML + dotted overrides, validation at the edge, dump and reload, key listing."""

import json
import math
import re
import sys
from pathlib import Path

import pytest

from attnlab.train.config_help import config_keys, format_config_keys
from attnlab.train.config import (
    ConfigError, RunConfig, TrainConfig, apply_overrides, config_from_dict, dumps_toml,
    load_config, save_config, to_dict,
)
from attnlab.train.overrides import parse_value

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
TINY = ROOT / "configs" / "tiny.toml"


def test_tiny_config_loads_with_derived_fields():
    cfg = load_config(TINY)
    assert cfg.model.layer_attn == ["softmax", "hybrid"]
    assert cfg.model.ffn_hidden == 96  # 8/3 * 32 = 85 -> next multiple of 16
    assert cfg.model.max_seq_len == cfg.data.seq_len == 32
    assert cfg.train.tokens_per_step == 4 * 1 * 32
    assert cfg.run_dir == str(Path("runs") / "tiny")


@pytest.mark.parametrize("path", sorted((ROOT / "configs").glob("*.toml")), ids=lambda p: p.name)
def test_every_example_config_is_valid(path):
    assert isinstance(load_config(path), RunConfig)


@pytest.mark.parametrize(
    "text, value",
    [("500", 500), ("3e-4", 3e-4), ("true", True), ("hybrid", "hybrid"), ('"hybrid"', "hybrid"),
     ('["softmax", "hybrid"]', ["softmax", "hybrid"]), ("[softmax,hybrid]", ["softmax", "hybrid"]),
     ("[0.9, 0.99]", [0.9, 0.99]), ("{sink = true}", {"sink": True}), ("runs/a b", "runs/a b")],
    ids=["int", "float", "bool", "bare", "quoted", "list", "bare-list", "floats", "table", "path"],
)
def test_override_values_parse_as_toml_literals_or_strings(text, value):
    assert parse_value(text) == value


def test_overrides_reach_nested_keys_and_types():
    cfg = load_config(TINY, [
        "model.attn=hybrid", "train.steps=500", "train.lr=3e-4", "train.betas=[0.9,0.99]",
        "model.attention.tau=token", "model.attention.tau_max=1", "data.cross_doc=false",
    ])
    assert cfg.model.layer_attn == ["hybrid", "hybrid"]
    assert cfg.train.steps == 500 and cfg.train.lr == 3e-4 and cfg.train.betas == (0.9, 0.99)
    assert cfg.model.attention == {"tau": "token", "tau_max": 1}
    a = cfg.model.attention_configs()[0]
    assert a.options.tau == "token" and a.options.tau_max == 1.0 and a.mechanism == "hybrid"
    assert cfg.data.cross_doc is False


def test_per_layer_mechanisms_and_tables():
    cfg = load_config(None, [
        "model.n_layers=3", "model.attn=[softmax,scalar,hybrid]", "model.layer_attention=[{},{n_value_groups=2},{sink=true}]",
    ])
    convs = cfg.model.attention_configs()
    assert [c.mechanism for c in convs] == ["softmax", "scalar", "hybrid"]
    assert convs[1].options.n_value_groups == 2 and convs[2].options.sink and convs[0].options is None
    assert [c.rope for c in convs] == [True, True, True]  # dot-product parts rotate by default
    assert load_config(None, ["model.attn=gla"]).model.attention_configs()[0].rope is False


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["train.stepz=3"], ["unknown key train.stepz", "did you mean 'steps'?"]),
        (["trian.steps=3"], ["unknown key trian", "model", "train"]),
        (["train.steps=abc"], ["train.steps", "int", "'abc'"]),
        (["train.steps=1.5"], ["train.steps", "int"]),
        (["train.dtype=fp16"], ["train.dtype", "'float32'", "'bfloat16'"]),
        (["model.attn=foo"], ["model.attn must", "'softmax'", "'hybrid'", "'foo'"]),
        (["model.attn=[softmax,hybird]", "model.n_layers=2"], ["model.attn[1] must", "did you mean 'hybrid'?"]),
        (["model.attn=[softmax]"], ["model.attn", "model.n_layers"]),
        (["model.d_model=48", "model.n_heads=6", "model.attn=scalar", "model.attention.n_value_groups=4"],
         ["model.attention.n_value_groups", "4", "6 scalar heads"]),
        (["model.attention.taux=1"], ["unknown key model.attention.taux", "did you mean 'tau'?", "tau_max"]),
        (["model.attn=scalar", "model.attention.tau=blah"], ["model.attention.tau", "'global'", "'token'"]),
        (["model.attention.mechanism=scalar"], ["model.attention.mechanism", "model.attn"]),
        (["model.attn=[softmax,hybrid]", "model.attention.n_value_groups=2"], ["model.attention.n_value_groups", "applies to no layer"]),
        (["train.warmup_steps=50", "train.steps=10"], ["train.warmup_steps", "train.steps"]),
        (["model.attn=softmax", "regularizers.align=0.1"], ["regularizers", "model.attn"]),
        (["data.source=/no/such/folder"], ["data.source", "stdlib"]),
        (["data.source=mqar"], ["model.vocab_size", "mqar"]),
        (["train.steps"], ["section.key=value"]),
        (["train.steps.x=1"], ["train.steps", "not a table"]),
    ],
    ids=["unknown-key", "unknown-section", "wrong-type", "float-for-int", "bad-literal", "bad-mechanism", "bad-mechanism-in-list",
         "attn-list-length", "heads-in-groups", "unknown-attention-key", "bad-tau", "model-owned-key",
         "shared-field-of-one-mechanism", "warmup-past-steps", "regularizers-without-scalar", "missing-source",
         "mqar-vocab", "override-syntax", "override-into-value"],
)
def test_bad_config_names_the_key_and_the_allowed_values(overrides, words):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, overrides)
    for word in words:
        assert word in str(info.value), (word, str(info.value))


def test_bad_config_file_errors(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "missing.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[train\nsteps = 3\n")
    with pytest.raises(ConfigError, match="not valid TOML"):
        load_config(bad)


def test_dump_and_reload_round_trip(tmp_path):
    cfg = load_config(TINY, [
        "model.attn=[scalar,hybrid]", "model.layer_attention=[{n_value_groups=2},{sink=true}]",
        "model.attention.tau_max=2.0", "train.betas=[0.8,0.9]", "run.name=x y",
    ])
    toml_path, json_path = save_config(cfg, tmp_path)
    again = config_from_dict(tomllib.loads(toml_path.read_text()))
    assert again == cfg
    dumped = json.loads(json_path.read_text())
    assert dumped["model"]["layer_attn"] == ["scalar", "hybrid"] and dumped["run_dir"] == cfg.run_dir
    assert dumps_toml(to_dict(again)) == toml_path.read_text().rstrip("\n")


def test_config_keys_list_every_key_with_type_and_help():
    rows = {key: (tp, default, help_text) for key, tp, default, help_text in config_keys()}
    assert rows["train.steps"][0] == "int" and rows["train.steps"][1] == 200 and rows["train.steps"][2]
    assert "'float32'" in rows["train.dtype"][0]
    for key in ("model.attn", "data.cross_doc", "regularizers.align", "run.resume", "model.attention.tau",
                "model.attention.n_value_groups", "model.attention.output_gate"):
        assert key in rows
    assert "model.attention.mechanism" not in rows  # set by model.attn
    assert "n_value_groups" in format_config_keys()


def test_lr_schedule_is_linear_warmup_then_cosine():
    t = TrainConfig(steps=110, warmup_steps=10, lr=1.0, min_lr_ratio=0.1)
    assert [t.lr_at(s) for s in range(3)] == pytest.approx([0.1, 0.2, 0.3])
    assert t.lr_at(9) == pytest.approx(1.0)
    assert t.lr_at(10) == pytest.approx(1.0)
    assert t.lr_at(60) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert t.lr_at(110) == pytest.approx(0.1)
    lrs = [t.lr_at(s) for s in range(10, 111)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))


def test_apply_overrides_builds_tables():
    raw = apply_overrides({"train": {"steps": 1}}, ["train.steps=2", "model.attention.sink=true"])
    assert raw == {"train": {"steps": 2}, "model": {"attention": {"sink": True}}}


# --------------------------------------------------------------------------- typed fields: finite floats, real bools, ints


def _keys_of(kind):
    """Dotted keys whose type (as listed by config_keys) admits `kind`: "float", "bool" or "int"."""
    return [key for key, tp, _, _ in config_keys() if kind in tp.split(" | ") and key != "run.name"]


FLOAT_KEYS = _keys_of("float")
BOOL_KEYS = _keys_of("bool")
INT_KEYS = _keys_of("int")


def test_typed_key_lists_cover_the_known_fields():
    for key in ("model.attention.tau_max", "model.attention.scale", "model.attention.alpha_init",
                "model.attention.sink_key", "train.lr", "regularizers.align", "model.norm_eps", "data.mqar_power_a"):
        assert key in FLOAT_KEYS
    assert {"model.attention.rope", "model.attention.sink", "run.resume", "data.cross_doc"} <= set(BOOL_KEYS)
    assert {"train.steps", "model.d_model", "model.attention.head_dim"} <= set(INT_KEYS)


@pytest.mark.parametrize("text", ["nan", "inf", "-inf"])
@pytest.mark.parametrize("key", FLOAT_KEYS)
def test_every_float_key_rejects_non_finite_values(key, text):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [f"{key}={text}"])
    msg = str(info.value)
    assert key in msg and text.lstrip("-") in msg and "finite" in msg, msg


@pytest.mark.parametrize("text", ["nan", "inf"])
def test_non_finite_items_of_float_lists_are_rejected(text):
    with pytest.raises(ConfigError, match=rf"train\.betas\[1\] must be a finite number, got {text}"):
        load_config(TINY, [f"train.betas=[0.9, {text}]"])
    with pytest.raises(ConfigError, match=r"model\.layer_attention\[1\]\.tau_max.*finite"):
        load_config(TINY, [f"model.layer_attention=[{{}}, {{tau_max = {text}}}]"])


@pytest.mark.parametrize("text", ["yes", "1", "0", '"true"', "True", "[true]"])
@pytest.mark.parametrize("key", BOOL_KEYS)
def test_every_bool_key_takes_only_true_or_false(key, text):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [f"{key}={text}"])
    assert key in str(info.value) and "bool" in str(info.value), str(info.value)




def test_shared_key_reaches_the_layers_that_read_it():
    cfg = load_config(TINY, ["model.attn=[softmax,scalar]", "model.attention.n_value_groups=2", "model.attention.tau=global"])
    soft, scal = cfg.model.attention_configs()
    assert scal.options.n_value_groups == 2 and scal.options.tau == "global"
    assert soft.options is None  # softmax reads neither: it has no options of its own


@pytest.mark.parametrize("key", ["model.attention.rope", "model.attention.cosformer_normalize", "run.resume", "data.cross_doc"])
def test_bool_keys_take_true_and_false(key):
    from attnlab.layers import MECHANISMS, mechanism_class

    for text, value in (("true", True), ("false", False)):
        if key.startswith("model.attention."):  # on a model whose layers read the key
            name = key.rsplit(".", 1)[1]
            mech = next(m for m in MECHANISMS if name in mechanism_class(m).options)
            cfg = load_config(TINY, [f"model.attn={mech}", f"{key}={text}"])
            assert cfg.model.attention_configs()[0].flat()[name] is value
        else:
            cfg = load_config(TINY, [f"{key}={text}"])
            section, name = key.split(".")
            assert getattr(getattr(cfg, section), name) is value


@pytest.mark.parametrize("text", ["true", "false", "2.0"])
@pytest.mark.parametrize("key", INT_KEYS)
def test_every_int_key_rejects_bools_and_floats(key, text):
    with pytest.raises(ConfigError) as info:
        load_config(TINY, [f"{key}={text}"])
    assert key in str(info.value), str(info.value)


def _config_classes():
    from attnlab.models.config import ModelConfig
    from attnlab.train.config import RegularizersConfig, RunSection
    from attnlab.train.data_config import DataConfig

    return [(ModelConfig, "model."), (DataConfig, "data."), (TrainConfig, "train."),
            (RegularizersConfig, "regularizers."), (RunSection, "run.")]


def test_config_dataclasses_built_in_python_check_their_fields():
    """Not only the loader: each section's __post_init__ walks its own fields by annotation."""
    import dataclasses
    import typing

    checked = 0
    for cls, prefix in _config_classes():
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            bad = {float: float("nan"), bool: "yes", int: True}.get(hints[f.name])
            if bad is None:
                continue
            with pytest.raises(ConfigError, match=rf"^{re.escape(prefix + f.name)} must be"):
                cls(**{f.name: bad})
            checked += 1
    assert checked >= 30
    with pytest.raises(ConfigError, match=r"train\.betas\[0\] must be a finite number, got inf"):
        TrainConfig(betas=(float("inf"), 0.9))


@pytest.mark.parametrize(
    "kw, field",
    [(dict(rope="yes"), "rope"), (dict(mechanism="hybrid", sink=1), "sink"), (dict(bias=0), "bias"),
     (dict(tau_init=float("nan")), "tau_init"), (dict(tau_max=float("inf")), "tau_max"), (dict(scale=float("inf")), "scale"),
     (dict(alpha_init=float("-inf")), "alpha_init"), (dict(sink_key=float("nan")), "sink_key"),
     (dict(gla_rank=True), "gla_rank"), (dict(head_dim=8.0), "head_dim")],
    ids=lambda v: v if isinstance(v, str) else None,
)
def test_attention_config_checks_field_types_and_finiteness(kw, field):
    from attnlab.layers import AttentionConfig

    with pytest.raises(ValueError, match=rf"^AttentionConfig\.{field}: got .*, need "):
        AttentionConfig(d_model=16, n_heads=2, **kw)


def test_cosformer_horizon_shorter_than_seq_len_is_a_config_error():
    with pytest.raises(ConfigError, match=r"model\.attention\.cosformer_max_len of layer 0 is 8.*data\.seq_len \(32\)"):
        load_config(TINY, ["model.attn=cosformer", "model.attention.cosformer_max_len=8"])
    with pytest.raises(ConfigError, match=r"cosformer_max_len.*data\.seq_len"):
        load_config(TINY, ["model.attn=cosformer", "model.max_seq_len=16"])
    assert load_config(TINY, ["model.attn=cosformer", "model.attention.cosformer_max_len=64"])


def test_windowed_config_is_the_evidence_winner():
    """configs/windowed.toml trains exactly the variant with the lowest mean windowed loss at 4x the
    training length (the spec's selection rule: a window-trained model's own loss, which is its
    windowed decode; an exact-trained one's loss through a k = 64 window) over the candidates of
    experiments/seed000/train-through-window and its Cauchy follow-up, and that variant also beats
    the earlier choices: the exact-trained pure scalar model through k = 64, and the Gaussian hybrid
    trained through the same window."""
    import json
    from pathlib import Path

    from attnlab.experiments.sweep import load_spec, run_config
    from attnlab.train import load_config
    from attnlab.train.config import to_dict

    root = Path(__file__).resolve().parents[1]
    candidates = {}
    for name in ("train-through-window", "train-through-window-cauchy"):
        folder = root / "experiments" / "seed000" / name
        spec = load_spec(folder / "spec.toml")
        means = {v: m["mean"] for v, m in json.loads((folder / "results.json").read_text())["variants"].items()}
        for variant in spec.variants:
            m = means.get(variant.name)
            if m is None:
                continue
            trained_through = "train_window" in " ".join(variant.overrides)
            loss = m.get("loss/T=1024") if trained_through else m.get("wloss@64/T=1024")
            if loss is not None:  # softmax has no window
                candidates.setdefault(variant.name, (loss, spec, variant))
    best = min(candidates, key=lambda k: candidates[k][0])
    assert best == "hybrid-k16-local32-cauchy"
    assert candidates[best][0] < candidates["scalar"][0] and candidates[best][0] < candidates["hybrid-k16-local32"][0]
    _, spec, variant = candidates[best]
    want, _ = run_config(spec, variant, 0, spec.out)
    got = load_config(root / "configs" / "windowed.toml")
    for section in ("model", "data", "train", "regularizers"):
        assert to_dict(getattr(got, section)) == to_dict(getattr(want, section)), section


def test_every_attention_field_has_help():
    """`attnlab train --help` describes every model.attention key from AttentionConfig's docstring."""
    from attnlab.train.config_help import config_keys

    rows = [r for r in config_keys() if r[0].startswith("model.attention.")]
    assert len(rows) > 30
    missing = [r[0] for r in rows if not r[3] or r[3].startswith("see attnlab.layers")]
    assert not missing, missing
