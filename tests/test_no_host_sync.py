"""A training step of `attnlab train` reads no value back from the device: no caller anywhere in the
package (decided by module, never by file path) calls `.item()`, `float()`, `int()`, `bool()`,
`.nonzero()` or `.tolist()` on a tensor inside `Trainer.train_step`; the loop reads the step's scalars
at its log rows only. The CPU stands in for an accelerator: value checks run the way they run on a
GPU (device-side asserts inside `async_value_checks`, a read outside it), so a check left outside the
model's block shows here as a read. The host-side data pipeline (`attnlab.data`), which builds each
batch on the CPU before it moves to the device, is the one exception."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from attnlab import checks
from attnlab.train import load_config
from attnlab.train.trainer import Trainer

TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"
sys.path.insert(0, str(Path(__file__).resolve().parent / "read_spy"))
from read_spy import install  # noqa: E402  (shared with torchrun's workers in tests/test_ddp.py)


@pytest.fixture(scope="module")
def corpus(argparse_corpus) -> str:
    return argparse_corpus


@pytest.fixture
def reads(monkeypatch):
    """The (method, module, line) of every value read by package code while the spy is on."""
    return install(monkeypatch.setattr)


CASES = {
    "softmax+hybrid": [],
    "regularizers": ["model.attn=hybrid", "regularizers.align=1", "regularizers.spread=0.1", "regularizers.tau=0.1",
                     "regularizers.kl_dense=1", "regularizers.kl_queries=8"],
    "packed-documents": ["model.attn=softmax", "data.pack=documents"],
    "window": ["model.attn=hybrid", "model.attention.train_window=4", "model.attention.local_window=4"],
    "gate-sink-gqa": ["model.attn=hybrid", "model.attention.output_gate=elementwise", "model.attention.sink=true",
                      "model.attention.n_kv_heads=2"],
}


@pytest.mark.parametrize("case", list(CASES))
def test_a_training_step_reads_nothing_back(tmp_path, corpus, reads, case):
    seen, on = reads
    t = Trainer(load_config(TINY, [f"run.out_dir={tmp_path}", f"data.source={corpus}", "run.threads=1",
                                   "train.eval_every=0", "train.log_every=5", f"run.name={case}", *CASES[case]]))
    t.train_step()  # the first step may set things up
    on[0] = True
    row = t.train_step()
    on[0] = False
    t.close()
    assert seen == [], f"{case}: values read back inside a training step: {sorted(set(seen))}"
    assert isinstance(row["loss"], torch.Tensor) and isinstance(row["grad_norm"], torch.Tensor)


def test_the_spy_sees_a_read(reads):
    """The spy itself: a read by package code outside the model's block is caught."""
    seen, on = reads
    on[0] = True
    checks.check_finite("x", torch.ones(300))  # outside async_value_checks: read, as on a GPU
    on[0] = False
    assert seen and seen[0][1] == "attnlab.checks"
