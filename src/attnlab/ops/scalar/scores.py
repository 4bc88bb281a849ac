"""The scalar family's score, once, with no checks and no mask: the kernel's term of x = (qs - ks)^2 /
tau (`kernel_term`) and the scalar and hybrid scores of every query and key (`scalar_scores`, which
also scores each query's own gathered keys, and `hybrid_scores`), which the naive reference (`naive`),
the explicit-score paths (`chunked`), the decode caches and the static decode states form from
checked inputs.

scalar: -(qs_t - ks_s)^2 / tau_t, or -log(1 + (qs_t - ks_s)^2 / tau_t) under the Cauchy kernel
hybrid: q_t . k_s / sqrt(d) plus the scalar score, times the gain lam when given
"""

from __future__ import annotations

import math

import torch

from ..common.heads import expand_heads
from ..common.precision import upcast


def kernel_term(x: torch.Tensor, kernel: str = "gaussian") -> torch.Tensor:
    """The scalar logit of x = (qs - ks)^2 / tau >= 0: -x (Gaussian) or -log(1 + x) (Cauchy)."""
    return -x if kernel == "gaussian" else -torch.log1p(x)


def scalar_scores(qs, ks, tau_b, kernel: str = "gaussian", lam=None) -> torch.Tensor:
    """The formula of `naive.scalar_logits` with no checks and no mask: qs (B, H, Tq), ks (B, H, Tk)
    (every query against every key) or (B, H, Tq, m) (each query against its own m keys, gathered;
    any dimension of size 1 broadcasts), tau_b a tensor broadcastable to (B, H, Tq) -> (B, H, Tq, Tk)
    or (B, H, Tq, m); lam (broadcastable to (B, H, Tq), any sign) multiplies the kernel's term. For
    callers whose inputs were checked once already (a decode cache's stored keys and its checked query)."""
    cdt = upcast(qs.dtype)
    ks = ks.to(cdt)
    diff = qs.to(cdt).unsqueeze(-1) - (ks.unsqueeze(-2) if ks.dim() == 3 else ks)  # (B, H, Tq, Tk | m)
    if kernel == "gaussian":
        out = -diff.pow(2) / tau_b.to(cdt).unsqueeze(-1)
    else:
        out = kernel_term(diff.pow(2) / tau_b.to(cdt).unsqueeze(-1), kernel)
    return out if lam is None else out * lam.to(cdt).unsqueeze(-1)


def hybrid_scores(q, k, qs, ks, tau_b, kernel: str = "gaussian", lam=None) -> torch.Tensor:
    """The formula of `naive.hybrid_logits` with no checks and no mask: q (B, H, Tq, D), k (B, G, Tk, D),
    qs (B, H, Tq), ks (B, H, Tk), tau_b and lam (the scalar term's gain, or None) broadcastable
    to (B, H, Tq) -> (B, H, Tq, Tk)."""
    scal = scalar_scores(qs, ks, tau_b, kernel, lam)
    dots = q.to(scal.dtype) @ expand_heads(k, q.shape[1]).to(scal.dtype).transpose(-1, -2)
    return dots / math.sqrt(q.shape[-1]) + scal
