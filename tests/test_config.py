"""The run config: TOML + dotted overrides, validation at the edge, dump and reload, key listing."""

import json
import math
import sys
from pathlib import Path

import pytest

from attnlab.train.config import (
    ConfigError, RunConfig, TrainConfig, apply_overrides, config_from_dict, config_keys, dumps_toml,
    format_config_keys, load_config, parse_value, save_config, to_dict,
)

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
    assert a.tau == "token" and a.tau_max == 1.0 and a.mechanism == "hybrid"
    assert cfg.data.cross_doc is False


def test_per_layer_mechanisms_and_tables():
    cfg = load_config(None, [
        "model.n_layers=3", "model.attn=[softmax,scalar,hybrid]", "model.layer_attention=[{},{n_value_groups=2},{sink=true}]",
    ])
    convs = cfg.model.attention_configs()
    assert [c.mechanism for c in convs] == ["softmax", "scalar", "hybrid"]
    assert convs[1].n_value_groups == 2 and convs[2].sink and not convs[0].sink
    assert [c.rope for c in convs] == [True, True, True]  # dot-product parts rotate by default
    assert load_config(None, ["model.attn=gla"]).model.attention_configs()[0].rope is False


@pytest.mark.parametrize(
    "overrides, words",
    [
        (["train.stepz=3"], ["unknown key train.stepz", "steps"]),
        (["trian.steps=3"], ["unknown key trian", "model", "train"]),
        (["train.steps=abc"], ["train.steps", "int", "'abc'"]),
        (["train.steps=1.5"], ["train.steps", "int"]),
        (["train.dtype=fp16"], ["train.dtype", "'float32'", "'bfloat16'"]),
        (["model.attn=foo"], ["model.attn[0]", "'softmax'", "'hybrid'", "'foo'"]),
        (["model.attn=[softmax]"], ["model.attn", "model.n_layers"]),
        (["model.d_model=48", "model.n_heads=6", "model.attn=scalar", "model.attention.n_value_groups=4"],
         ["model.attention.n_value_groups", "4", "6 scalar heads"]),
        (["model.attention.taux=1"], ["unknown key model.attention.taux", "tau_max"]),
        (["model.attn=scalar", "model.attention.tau=blah"], ["model.attention.tau", "'global'", "'token'"]),
        (["model.attention.mechanism=scalar"], ["model.attention.mechanism", "model.attn"]),
        (["model.attn=[softmax,scalar]", "model.attention.n_value_groups=2"], ["model.attention.n_value_groups", "model.layer_attention"]),
        (["train.warmup_steps=50", "train.steps=10"], ["train.warmup_steps", "train.steps"]),
        (["model.attn=softmax", "regularizers.align=0.1"], ["regularizers", "model.attn"]),
        (["data.source=/no/such/folder"], ["data.source", "stdlib"]),
        (["data.source=mqar"], ["model.vocab_size", "mqar"]),
        (["train.steps"], ["section.key=value"]),
        (["train.steps.x=1"], ["train.steps", "not a table"]),
    ],
    ids=["unknown-key", "unknown-section", "wrong-type", "float-for-int", "bad-literal", "bad-mechanism",
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
