"""benchmarks/gpu.py's paths, checked on the CPU: each builds its inputs, runs its fast path (Triton
kernels in the interpreter) and its float64 reference, and agrees with it, so the GPU check spends its
time measuring rather than failing on a typo."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu  # noqa: E402
from gpu_paths import NEEDS_CUDA, PATHS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")
CPU_PATHS = [pytest.param(n, marks=pytest.mark.skip(reason="its kernels run on CUDA only")) if n in NEEDS_CUDA else
             pytest.param(n, marks=pytest.mark.heavy) if "window" in n and n.endswith("/triton") else n  # 3-4 s each
             for n in PATHS if n != "sdpa-flash"]


@pytest.mark.parametrize("name", CPU_PATHS)
def test_path_runs_and_matches_its_reference(name):
    e, eg, worst = gpu.errors(name, torch.float32, 40, torch.device("cpu"), H=2, D=16)
    assert e < 1e-4 and eg < 1e-3, (e, eg, worst)


def test_keep_carries_only_what_was_not_run_again():
    old = {"command": "python benchmarks/gpu.py", "rows": [{"path": "a", "T": 1, "ms": 1.0}, {"path": "b", "T": 1, "ms": 2.0}],
           "errors": [{"path": "a", "dtype": "bfloat16"}, {"path": "b", "dtype": "bfloat16"}],
           "models": [{"model": "ssd", "ms": 1.0}, {"model": "gla", "ms": 2.0}]}
    doc = {"rows": [{"path": "a", "T": 1, "ms": 0.5}], "errors": [{"path": "a", "dtype": "bfloat16"}],
           "models": [{"model": "ssd", "ms": 0.7}]}
    gpu.keep(doc, old)
    assert [(r["path"], r["ms"], r.get("from")) for r in doc["rows"]] == [("a", 0.5, None), ("b", 2.0, old["command"])]
    assert [e["path"] for e in doc["errors"]] == ["a", "b"] and doc["errors"][1]["from"] == old["command"]
    assert [(m["model"], m["ms"]) for m in doc["models"]] == [("ssd", 0.7), ("gla", 2.0)]


def test_train_benchmark_baseline_matches_the_softmax_lm():
    """benchmarks/gpu_train.py's plain PyTorch baseline has attnlab's softmax LM's parameter count at
    a small shape, and a measured row (CPU, one step) carries the fields the JSON promises."""
    import gpu_train

    shape = dict(vocab=64, d_model=32, n_layers=2, n_heads=4)
    base, lm = gpu_train.build("baseline", 16, shape), gpu_train.build("softmax", 16, shape)
    assert sum(p.numel() for p in base.parameters()) == sum(p.numel() for p in lm.parameters())
    for name in ("baseline", "windowed"):
        row = gpu_train.measure(name, 16, 2, steps=1, warmup=1, compile_it=False, device=torch.device("cpu"),
                                shape=shape)
        assert {"model", "T", "tokens_per_s", "mfu", "peak_bytes"} <= set(row) and row["tokens_per_s"] > 0


@pytest.mark.heavy  # two small trainings on the CPU: seconds
def test_train_benchmark_times_attnlab_train_against_its_step():
    """The `trainer` row: `attnlab train` of configs/gpt2-small.toml at a given shape (byte tokenizer) runs
    and is timed from its own log rows after the compile's, beside this script's step of the same model."""
    import gpu_train

    shape = dict(vocab=0, d_model=32, n_layers=2, n_heads=4)  # the vocabulary: the byte tokenizer's
    row = gpu_train.measure_trainer(32, 2, steps=3, warmup=2, compile_it=False, device=torch.device("cpu"),
                                    shape=shape, log_every=1)
    assert row["model"] == "trainer" and row["vocab"] == 257 and row["tokens_per_s"] > 0
    assert row["benchmark_tokens_per_s"] > 0 and row["vs_benchmark"] == pytest.approx(
        row["tokens_per_s"] / row["benchmark_tokens_per_s"], rel=1e-2)
    assert len(row["log_tokens_per_s"]) == 5  # 2 warm-up rows, 3 timed
