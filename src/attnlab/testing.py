"""Helpers for comparing a fast path with its naive reference (used by the tests; public for users' own checks)."""

from __future__ import annotations

from typing import Callable, Sequence

import torch


def rel_rms(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error ||a - b|| / ||b|| in float64 (0 when both are zero)."""
    a64, b64 = a.detach().double(), b.detach().double()
    den = b64.pow(2).mean().sqrt().item()
    num = (a64 - b64).pow(2).mean().sqrt().item()
    return num / den if den > 0 else num


def compare_fwd_bwd(
    fn_a: Callable[..., torch.Tensor],
    fn_b: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor],
    *,
    seed: int = 0,
) -> dict[str, float]:
    """Run fn_a and fn_b on fresh leaf copies of `inputs`, backprop the same random cotangent,
    and return the relative RMS error of the outputs and of each input's gradient
    (keys "out", "grad0", "grad1", ...; inputs that do not require grad are skipped)."""
    def run(fn):
        leaves = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in inputs]
        out = fn(*leaves)
        out = out[0] if isinstance(out, tuple) else out
        g = torch.Generator().manual_seed(seed)
        cot = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.dtype)
        out.backward(cot)
        grads = [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in leaves]
        return out, grads

    out_a, grads_a = run(fn_a)
    out_b, grads_b = run(fn_b)
    errs = {"out": rel_rms(out_a, out_b)}
    for i, (ga, gb) in enumerate(zip(grads_a, grads_b)):
        if gb is None and ga is None:
            continue
        if ga is None or gb is None:
            errs[f"grad{i}"] = float("inf")
            continue
        errs[f"grad{i}"] = rel_rms(ga, gb)
    return errs
