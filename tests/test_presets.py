"""The presets at real sizes load and build the models they state: configs/25m.toml (the at-scale
experiment's shape, 25.4M parameters) and configs/gpt2-small.toml (124M); the 25m preset is the
experiment spec's base run, and benchmarks/gpu_train.py times the same model."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from attnlab.train import load_config
from attnlab.train.trainer import build_model

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))


def _params(cfg) -> int:
    with torch.device("meta"):  # shapes only: no memory, no time
        return sum(p.numel() for p in build_model(cfg, cfg.vocab_size).parameters())


@pytest.mark.parametrize("name, vocab, params", [("25m", 257, 25_437_184), ("gpt2-small", 50_304, 123_587_328)])
def test_preset_builds_a_model_of_its_size(name, vocab, params):
    cfg = load_config(ROOT / "configs" / f"{name}.toml")
    assert cfg.vocab_size == vocab and cfg.data.seq_len == 1024
    assert _params(cfg) == params


def test_25m_preset_is_the_at_scale_experiments_base_run():
    """Every model, data and train key of experiments/seed000/at-scale/spec.toml's [base] has the same
    value in configs/25m.toml (its softmax variant)."""
    spec = tomllib.loads((ROOT / "experiments" / "seed000" / "at-scale" / "spec.toml").read_text())["base"]
    cfg = load_config(ROOT / "configs" / "25m.toml")
    for section in ("model", "data", "train"):
        for key, value in spec[section].items():
            assert getattr(getattr(cfg, section), key) == value, f"{section}.{key}"
    assert cfg.model.attn == "softmax" and (cfg.model.d_model, cfg.model.n_layers, cfg.model.n_heads) == (512, 8, 8)


def test_gpu_train_times_the_25m_shape(tmp_path):
    """benchmarks/gpu_train.py's 25m shape is the preset's model, and its CPU mode times several shapes
    (NAME:T:BATCH) in the same interleaved rounds (two small ones here: the 25m model takes seconds a
    step on the CPU)."""
    import gpu_train

    cfg = load_config(ROOT / "configs" / "25m.toml")
    with torch.device("meta"):
        bench = sum(p.numel() for p in gpu_train.build("softmax", 1024, gpu_train.SHAPE_25M).parameters())
    assert bench == _params(cfg) and gpu_train.CPU_SHAPES["25m"] is gpu_train.SHAPE_25M
    out = tmp_path / "train_cpu.json"
    gpu_train.main(["--device", "cpu", "--models", "softmax", "--compile", "none", "--cpu-shape",
                    "quickstart:8:2,quickstart:16:1", "--rounds", "2", "--steps", "1", "--warmup", "0",
                    "--out", str(out)])
    doc = json.loads(out.read_text())
    assert [(r["shape"], r["T"], r["batch"], r["params"]) for r in doc["rows"]] == [
        ("quickstart", 8, 2, 836_736), ("quickstart", 16, 1, 836_736)]
    assert all(r["ms"] > 0 and len(r["round_ms"]) == 2 for r in doc["rows"]) and doc["max_rss_bytes"] > 0
    for bad in ("huge", "25m:1024"):
        with pytest.raises(SystemExit, match="--cpu-shape"):
            gpu_train.main(["--device", "cpu", "--cpu-shape", bad, "--out", str(out)])
