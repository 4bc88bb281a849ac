"""The quickstart: same budget for every model, its report folder, and its config file.

The end-to-end test runs the real pipeline on a shrunken model; the full default run
(minutes) is marked slow."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from attnlab.cli import main
from attnlab.experiments import quickstart as qs
from attnlab.models.config import ConfigError
from attnlab.train.config import config_from_dict, load_config, to_dict

ROOT = Path(__file__).resolve().parents[1]
SMALL = ["model.d_model=16", "model.n_layers=2", "model.n_heads=2", "data.seq_len=40", "train.batch_size=2",
         "data.max_docs=20", "train.eval_every=2", "train.log_every=1", "train.ckpt_every=0", "run.tensorboard=false"]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_config_file_matches_the_built_in_base():
    from_file = load_config(ROOT / "configs" / "quickstart.toml")
    built_in = config_from_dict(json.loads(json.dumps(qs.base_config())))
    assert to_dict(from_file, derived=True) == to_dict(built_in, derived=True)


def test_models_differ_only_in_attention(tmp_path):
    cfgs = qs.quickstart_configs(tmp_path, steps=7, overrides=["model.d_model=32"])
    assert [c.model.attn for c in cfgs] == ["softmax", "scalar", "hybrid"]
    dicts = [to_dict(c, derived=True) for c in cfgs]
    for d in dicts:
        assert d["train"]["steps"] == 7 and d["model"]["d_model"] == 32
        d["model"].pop("attn"), d["model"].pop("layer_attn"), d["run"].pop("name"), d.pop("run_dir")
    assert dicts[0] == dicts[1] == dicts[2]
    assert [Path(c.run_dir) for c in cfgs] == [tmp_path / m for m in qs.COMPARED]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        ({"overrides": ["model.attn=scalar"]}, "model.attn"),
        ({"overrides": ["train.steps=5"]}, "--steps"),
        ({"overrides": ["model.bogus=1"]}, "model.bogus"),
        ({"mechanisms": []}, "at least one"),
        ({"mechanisms": ["softmax", "softmax"]}, "repeat"),
        ({"mechanisms": ["dot"]}, "'dot'"),
        ({"steps": 0}, "steps"),
    ],
    ids=["owns-attn", "owns-steps", "unknown-key", "no-mechanisms", "repeated", "unknown-mechanism", "zero-steps"],
)
def test_bad_quickstart_input(kwargs, message, tmp_path):
    with pytest.raises(ConfigError, match=message.replace("-", r"\-")):
        qs.quickstart_configs(tmp_path, **kwargs)
    assert list(tmp_path.iterdir()) == []


def test_steps_and_minutes_exclude_each_other(tmp_path):
    with pytest.raises(ConfigError, match="steps or minutes"):
        qs.run(tmp_path, steps=3, minutes=1.0, quiet=True)
    with pytest.raises(ConfigError, match="minutes"):
        qs.steps_for_minutes(qs.quickstart_configs(tmp_path, overrides=SMALL), minutes=-1)


def test_minutes_budget_scales_with_time(tmp_path):
    cfgs = qs.quickstart_configs(tmp_path, overrides=SMALL)
    steps, per_step = qs.steps_for_minutes(cfgs, minutes=5.0)
    assert set(per_step) == set(qs.COMPARED) and all(v > 0 for v in per_step.values())
    assert steps == int(5.0 * 60 * 0.85 / sum(per_step.values()))
    with pytest.raises(ConfigError, match="too short"):
        qs.steps_for_minutes(cfgs, minutes=1e-9)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    """The quickstart pipeline run through `attnlab quickstart` on a shrunken model (3 steps)."""
    out = tmp_path_factory.mktemp("qs")
    argv = ["quickstart", "--out", str(out), "--steps", "3", "--no-progress", *SMALL]
    return out, argv


def test_quickstart_end_to_end(report, capsys):
    out, argv = report
    assert main(argv) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    for name in ("report.md", "loss_curves.png", "tau.png"):
        assert (out / name).is_file(), name
    for png in ("loss_curves.png", "tau.png"):
        assert (out / png).read_bytes()[:8] == PNG_MAGIC

    models = {m["mechanism"]: m for m in results["models"]}
    assert list(models) == ["softmax", "scalar", "hybrid"]
    assert {(m["steps"], m["tokens"]) for m in models.values()} == {(3, 3 * 2 * 40)}
    assert results["tokens_per_model"] == 240 and results["steps"] == 3
    for name, m in models.items():
        ev = json.loads((out / name / "eval.json").read_text())
        summary = json.loads((out / name / "summary.json").read_text())
        assert m["val_loss"] == ev["loss"]["40"]["loss"] and m["val_loss_2x"] == ev["loss"]["80"]["loss"]
        assert math.isclose(m["val_ppl"], math.exp(m["val_loss"]), rel_tol=1e-9)
        assert m["tau"] == summary["tau"] and m["tokens_per_s"] == summary["tokens_per_s"]
        assert (out / name / "eval.md").is_file()
        assert len(results["curves"][name]["train"]) == 3 and results["curves"][name]["val"][-1][0] == 3
        # the table's val loss is measured on the same text as the trainer's last evaluation
        assert m["val_loss"] == pytest.approx(results["curves"][name]["val"][-1][1], rel=1e-5)
        assert m["val_tokens"] == ev["loss"]["40"]["tokens"] == summary["history"]["eval"][-1]["val_tokens"]
    assert models["softmax"]["tau"] == [None, None] and models["softmax"]["topk_mass"] == {}
    for name in ("scalar", "hybrid"):
        assert all(t > 0 for t in models[name]["tau"])
        mass = [models[name]["topk_mass"][str(k)] for k in qs.TOPK]
        assert all(0 < v <= 1 + 1e-6 for v in mass) and mass == sorted(mass)
        assert mass[-1] == pytest.approx(1.0, abs=1e-5)  # 40 keys < 64: every key is in the window

    table = qs.comparison_table(results)
    assert table in printed and table in (out / "report.md").read_text()
    header = table.splitlines()[0]
    for col in ("val loss", "val ppl", "loss @80", "tokens/s", "τ per layer", "top-8 mass", "top-64 mass"):
        assert col in header
    assert "attnlab quickstart --out" in (out / "report.md").read_text()


@pytest.mark.slow
def test_full_quickstart(tmp_path):
    """The default quickstart (what `make quickstart` runs): several minutes on a 2-core CPU."""
    results = qs.run(tmp_path, progress=False)
    assert [m["mechanism"] for m in results["models"]] == list(qs.COMPARED)
    base_steps = qs.base_config()["train"]["steps"]
    for m in results["models"]:
        assert m["steps"] == base_steps and math.isfinite(m["val_loss"])
        assert m["val_loss"] < math.log(257) - 1.0, "training did not get well below the uniform byte loss"
    assert (tmp_path / "report.md").is_file()
