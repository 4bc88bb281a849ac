"""The dtypes ops compute in: scores of 16-bit inputs in float32 (`upcast`), and autocast kept away
from an op whose precision policy is its own (`without_autocast`)."""

from __future__ import annotations

import functools

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)


def upcast(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which to compute scores: float32 for bf16/fp16, else unchanged."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def without_autocast(fn):
    """Run an op with autocast off: its precision policy is its own (scores in float32 for 16-bit
    inputs, the scalar term in float32 always), which autocast would otherwise undo by casting the
    float32 operands it builds on purpose back to bf16 inside matmul and SDPA. Inputs that arrive
    in bf16 stay bf16; the output is in v's dtype as without autocast."""

    @functools.wraps(fn)
    def run(*args, **kwargs):
        on = [d for d in ("cuda", "cpu") if torch.is_autocast_enabled(d)]
        if not on:
            return fn(*args, **kwargs)
        with torch.autocast(on[0], enabled=False):
            if len(on) == 1:
                return fn(*args, **kwargs)
            with torch.autocast(on[1], enabled=False):
                return fn(*args, **kwargs)

    return run
