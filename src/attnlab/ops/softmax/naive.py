"""Softmax attention's naive reference: the (Tq, Tk) logits and the divisor c_t read off the visibility
matrix, as the formula reads (`divisor_naive`, which a static decoder also folds into its query)."""

from __future__ import annotations

import math

import torch

from ...masks import visible_keys
from ..common.heads import expand_heads
from ..common.packed import Packing


def softmax_naive(q, k, v, causal, scale, p, window=None, packed: Packing | None = None):
    B, H, T, D = q.shape
    k_h, v_h = expand_heads(k, H), expand_heads(v, H)  # (B, H, Tk, D), (B, H, Tk, Dv)
    dots = q @ k_h.transpose(-1, -2)  # (B, H, Tq, Tk)
    visible = visible_keys(T, k.shape[2], causal, q.device, window)  # (Tq, Tk)
    if packed is not None:
        visible = visible & packed.same(T)  # (B, 1, Tq, Tk): and in the query's own document
    if isinstance(scale, str):
        c = divisor_naive(k_h, visible, scale, p)  # (B, H, Tq) or (Tq,)
        logits = dots / (c.unsqueeze(-1) if c.dim() == 3 else c.view(T, 1))
    else:
        logits = dots * scale
    logits = logits.masked_fill(~visible, float("-inf"))
    w = torch.softmax(logits, dim=-1)  # (B, H, T, T)
    return (w @ v_h).to(v.dtype)  # (B, H, T, Dv)


def divisor_naive(k_h, visible, scale, p):
    """c_t read off the (Tq, Tk) (or per row (B, 1, Tq, Tk)) visibility matrix: row t sums over the
    keys query t sees."""
    D = k_h.shape[-1]
    vis = visible.to(k_h.dtype)  # (Tq, Tk) or (B, 1, Tq, Tk)
    n = vis.sum(-1)  # (Tq,) or (B, 1, Tq)
    if scale == "sqrt_d":
        return torch.full_like(n, math.sqrt(D))
    if scale == "n_sqrt_d":
        return n * math.sqrt(D)
    norms = torch.linalg.vector_norm(k_h, dim=-1)  # (B, H, T)

    def row_sum(x):  # (B, H, Tk) over keys -> (B, H, Tq) over queries
        return (x.unsqueeze(-2) * vis).sum(-1)

    if scale == "ktotal":
        return row_sum(norms)
    if scale == "kmean":
        return row_sum(norms) / n
    if scale == "krms":
        return (row_sum(norms**2) / n).sqrt()
    return row_sum(norms**p) ** (1.0 / p)  # pnorm
