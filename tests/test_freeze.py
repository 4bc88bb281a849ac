"""train.freeze: parameters named by pattern are zero and stay zero through training (no gradient, no
optimizer state, weight decay cannot move them), a checkpoint keeps them so, and a pattern that names
no parameter is refused before anything is written. Frozen at zero, a window's scalar projections make
every key tie, so the window reads its newest keys: a sliding window of the same keys and parameters."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from attnlab.models.config import ConfigError
from attnlab.train import load_config, train
from attnlab.train.setup import build_model

ROOT = Path(__file__).resolve().parents[1]
SCALAR = ['train.freeze=["blocks.*.attn.wqs.*", "blocks.*.attn.wks.*"]']
TINY = ["model.attn=hybrid", "model.attention.train_window=2", "model.attention.local_window=2",
        "model.d_model=16", "model.n_heads=2", "data.seq_len=16", "train.steps=3", "train.warmup_steps=0",
        "train.ckpt_every=3", "train.eval_every=0", "run.progress=false", "run.tensorboard=false", "run.threads=1"]


def test_frozen_parameters_are_zero_and_stay_zero(tmp_path):
    cfg = load_config(ROOT / "configs" / "tiny.toml", TINY + SCALAR + [f"run.out_dir={tmp_path}", "run.name=r"])
    model = build_model(cfg, 256)
    frozen = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen and all(".wqs." in n or ".wks." in n for n in frozen)
    assert all(float(p.abs().max()) == 0.0 for n, p in model.named_parameters() if n in frozen)
    train(cfg)
    from safetensors.torch import load_file

    weights = load_file(str(next((tmp_path / "r" / "checkpoints").glob("step_*")) / "model.safetensors"))
    assert all(float(weights[n].abs().max()) == 0.0 for n in frozen)
    assert any(float(weights[n].abs().max()) > 0 for n in weights if n not in frozen)


def test_with_zero_scalar_keys_the_window_reads_its_newest_keys():
    """Every key at distance 0 ties; newest first, the k "nearest" are the k just before the local
    window: each query reads its last k + w keys, as a sliding window of k + w does."""
    from attnlab.ops import window_mask

    B, H, T, k, w = 1, 2, 20, 3, 2
    zeros = torch.zeros(B, H, T)
    keep = window_mask(zeros, zeros, k, local=w)  # (B, H, T, T) which keys each query reads
    i, j = torch.arange(T)[:, None], torch.arange(T)[None, :]
    assert torch.equal(keep[0, 0], (j <= i) & (j > i - (k + w)))


def test_a_pattern_that_names_nothing_is_refused(tmp_path):
    cfg = load_config(ROOT / "configs" / "tiny.toml", TINY + ['train.freeze=["blocks.*.attn.nope"]',
                                                              f"run.out_dir={tmp_path}", "run.name=r"])
    with pytest.raises(ConfigError, match=r"train.freeze: 'blocks.\*.attn.nope' matches no parameter"):
        train(cfg)
    assert not (tmp_path / "r").exists()
