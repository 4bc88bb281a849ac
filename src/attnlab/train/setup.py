"""What a training run is built from: the device, the seeds, the model, the optimizer, autocast."""

from __future__ import annotations

import contextlib
import dataclasses
import random

import numpy as np
import torch

from attnlab.models import LM
from attnlab.models.config import ConfigError

from .config import RunConfig


DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str = "auto", key: str = "run.device") -> torch.device:
    """A device setting: 'auto' (CUDA when available, else the CPU), 'cpu' or 'cuda'; ValueError naming
    `key` for any other value, and for 'cuda' where no CUDA device is available. The one resolution of
    `run.device`, `attnlab eval --device` and the search and retrofit commands' `device`."""
    if name not in DEVICES:
        raise ValueError(f"{key} must be one of {DEVICES}, got {name!r}")
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ValueError(f"{key} is 'cuda' but no CUDA device is available; use 'auto' or 'cpu'")
    return torch.device(name)


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


def build_model(cfg: RunConfig, vocab_size: int) -> LM:
    """The LM of `cfg` with model.vocab_size resolved (0 takes the tokenizer's), recomputing its blocks'
    activations in the backward pass when train.checkpoint_activations says so."""
    mcfg = cfg.model if cfg.model.vocab_size else dataclasses.replace(cfg.model, vocab_size=vocab_size)
    if mcfg.vocab_size < vocab_size:
        raise ValueError(f"model.vocab_size ({mcfg.vocab_size}) is smaller than the tokenizer's vocabulary ({vocab_size})")
    model = LM(mcfg)
    model.gradient_checkpointing = cfg.train.checkpoint_activations
    freeze(model, cfg.train.freeze)
    return model


def freeze(model: torch.nn.Module, patterns: list[str]) -> list[str]:
    """train.freeze: every parameter whose name matches one of `patterns` (fnmatch) set to zero and taken
    out of training (requires_grad False: no gradient, no optimizer state). Returns the names frozen;
    a pattern that matches no parameter is a ConfigError naming it and a few names that exist."""
    import fnmatch

    names = [n for n, _ in model.named_parameters()]
    for pattern in patterns:
        if not fnmatch.filter(names, pattern):
            raise ConfigError(f"train.freeze: {pattern!r} matches no parameter of the model; its parameters are "
                              f"named like {', '.join(names[:3])}, ...")
    frozen = []
    with torch.no_grad():
        for name, p in model.named_parameters():
            if any(fnmatch.fnmatchcase(name, pat) for pat in patterns):
                p.zero_()
                p.requires_grad_(False)
                frozen.append(name)
    return frozen


class DataError(ValueError):
    """The configured data source could not be loaded (missing, unreachable or empty)."""


def make_optimizer(model: torch.nn.Module, tcfg, device: torch.device | None = None) -> torch.optim.AdamW:
    """AdamW; weight decay on matrices (dim >= 2) only, not on norms, biases, τ or other vectors. On CUDA
    the fused implementation (one kernel for every parameter's update)."""
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.dim() >= 2]
    no_decay = [p for p in params if p.dim() < 2]
    groups = [{"params": decay, "weight_decay": tcfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    fused = device is not None and device.type == "cuda"
    return torch.optim.AdamW(groups, lr=tcfg.lr, betas=tcfg.betas, eps=tcfg.eps, fused=fused or None)


def allow_tf32(device: torch.device, allow: bool) -> None:
    """train.tf32 on CUDA: float32 matmuls (and cuDNN convolutions) on the TF32 matrix units, or not."""
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = allow
        torch.backends.cudnn.allow_tf32 = allow


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A batch tensor onto the device: from pinned memory and without waiting on CUDA, plainly elsewhere."""
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)


def has_unused_parameters(model: LM, device: torch.device) -> bool:
    """Whether some parameter gets no gradient from a forward pass (probed on 2 tokens;
    parameters and RNG are left untouched)."""
    logits, _ = model(torch.zeros(1, 2, dtype=torch.long, device=device))
    logits.sum().backward()
    unused = any(p.grad is None for p in model.parameters() if p.requires_grad)
    model.zero_grad(set_to_none=True)
    return unused


def autocast(device: torch.device, dtype: str):
    if dtype == "bfloat16":
        return torch.autocast(device_type=device.type, dtype=torch.bfloat16)
    return contextlib.nullcontext()


def compile_model(model: torch.nn.Module, device: torch.device) -> torch.nn.Module:
    """torch.compile(model), on the CPU after loading attnlab's compiled CPU kernels: a graph traced before
    they load never uses them (`attnlab.ops._ext`)."""
    if device.type == "cpu":
        from attnlab.ops import _ext

        _ext.library()
    return torch.compile(model)
