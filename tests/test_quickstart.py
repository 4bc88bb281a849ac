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
        d["model"].pop("attn"), d["model"].pop("layer_attn"), d["run"].pop("out_dir"), d.pop("run_dir")
    assert dicts[0] == dicts[1] == dicts[2]
    assert [Path(c.run_dir) for c in cfgs] == [tmp_path / "runs" / m / "seed0" for m in qs.COMPARED]


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


@pytest.mark.heavy
def test_quickstart_end_to_end(report, capsys):
    """The quickstart is the sweep of experiments/quickstart/spec.toml: same results format, same code."""
    out, argv = report
    assert main(argv) == 0
    printed = capsys.readouterr().out
    results = json.loads((out / "results.json").read_text())
    for name in ("report.md", "loss_curves.png", "metrics.png"):
        assert (out / name).read_bytes()[:8] == PNG_MAGIC or name == "report.md", name
    v = results["variants"]
    assert list(v) == ["softmax", "scalar", "hybrid"] and results["seeds"] == [0]
    assert {(x["steps"], x["tokens_per_run"]) for x in v.values()} == {(3, 3 * 2 * 40)}
    for name in v:
        run = out / "runs" / name / "seed0"
        summary = json.loads((run / "summary.json").read_text())
        metrics = json.loads((run / "sweep.json").read_text())["metrics"]
        assert v[name]["mean"]["val_loss"] == summary["val_loss"] and summary["steps"] == 3
        # evaluated on the same text as the trainer's last evaluation, at the training length and twice it
        assert metrics["loss@40"] == pytest.approx(summary["val_loss"], rel=1e-5)
        assert math.isfinite(metrics["loss@80"])
        assert len(summary["history"]["train"]) == 3
    assert v["softmax"]["mean"]["topk_mass@8"] is None and v["softmax"]["mean"]["wgap@16"] is None
    for name in ("scalar", "hybrid"):
        assert all(t > 0 for t in v[name]["tau"])
        mass = [v[name]["mean"][f"topk_mass@{k}"] for k in (8, 16, 32, 64)]
        assert all(0 < m <= 1 + 1e-6 for m in mass) and mass == sorted(mass)
        assert mass[-1] == pytest.approx(1.0, abs=1e-5)  # 40 keys < 64: every key is in the window
        assert abs(v[name]["mean"]["wgap@64"]) < 1e-5  # ... so the 64-window decodes exactly
    report_md = (out / "report.md").read_text()
    assert "attnlab quickstart --out" in report_md and "softmax vs scalar vs hybrid" in report_md
    for col in ("val_loss", "loss@80", "tokens_per_s", "τ per layer", "topk_mass@8", "wgap@16"):
        assert col in printed and col in report_md, col
    # run again: the finished models are kept, only the report is rebuilt
    before = (out / "runs" / "hybrid" / "seed0" / "summary.json").read_text()
    assert main(argv) == 0
    assert "3 done" in capsys.readouterr().out
    assert (out / "runs" / "hybrid" / "seed0" / "summary.json").read_text() == before


@pytest.mark.slow
def test_full_quickstart(tmp_path):
    """The default quickstart (what `make quickstart` runs): several minutes on a 2-core CPU."""
    results = qs.run(tmp_path, progress=False)
    assert list(results["variants"]) == list(qs.COMPARED)
    base_steps = qs.base_config()["train"]["steps"]
    for v in results["variants"].values():
        assert v["steps"] == base_steps and math.isfinite(v["mean"]["val_loss"])
        assert v["mean"]["val_loss"] < math.log(257) - 1.0, "training did not get well below the uniform byte loss"
    assert (tmp_path / "report.md").is_file()
