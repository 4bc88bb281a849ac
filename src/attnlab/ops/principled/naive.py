"""Naive reference for principled attention (the formula of docs/mechanisms.md#principled-attention).

Materialises the (B, H, Tq, Tk) score matrices and follows the formula line by line:

    s = q.k / sqrt(d)                      semantic score
    g = qg.kg                              gate score
    b = softplus(beta) softplus(-g)        gate suppression
    m = (1 + softplus(alpha) log K)(s - gamma)   amplified margin, K = keys the query sees
    a = gamma + m - b                      final logit
    z = sum_j exp(max(gamma, a_j))         ground-aware normaliser
    w = exp(a) / z,  w0 = 1 - sum_j w_j    key weights and ground weight
    o = w0 v0 + sum_j w_j v_j
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...masks import key_counts, visible_keys
from .._sdpa import BAND_CHUNK, band_spans


def principled_naive(
    q: torch.Tensor,
    k: torch.Tensor,
    qg: torch.Tensor,
    kg: torch.Tensor,
    v: torch.Tensor,
    alpha: torch.Tensor,
    beta: torch.Tensor,
    gamma: torch.Tensor,
    v0: torch.Tensor | None,
    causal: bool,
    window: int | None = None,
    visible: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference on validated inputs with equal head counts.

    q (B, H, Tq, D), k (B, H, Tk, D), qg (B, H, Tq, Dg), kg (B, H, Tk, Dg), v (B, H, Tk, Dv);
    alpha, beta, gamma broadcastable to (B, H, Tq); v0 (1 or H, Dv) or None.
    Returns o (B, H, Tq, Dv) and w0 (B, H, Tq). With a causal sliding `window` each query sees
    its last `window` keys and K counts those. `visible` (Tq, Tk), a bool mask with a key in every
    row, replaces causal and window: each query sees the keys it marks, and K counts them (a static
    decoder's buffers, written up to the step's position), or per row (B, 1, Tq, Tk) (packed documents).
    """
    Tq, Tk, D = q.shape[-2], k.shape[-2], q.shape[-1]
    if visible is None:
        visible = visible_keys(Tq, Tk, causal, q.device, window)  # (Tq, Tk)
        log_k = key_counts(Tq, Tk, causal, q.device, q.dtype, window).log()[:, None]  # (Tq, 1)
    else:
        log_k = visible.sum(-1, keepdim=True).to(q.dtype).log()
    al, be, ga = alpha[..., None], beta[..., None], gamma[..., None]  # broadcast to (B, H, Tq, 1)

    s = q @ k.transpose(-1, -2) / math.sqrt(D)  # (B, H, Tq, Tk)
    g = qg @ kg.transpose(-1, -2)  # (B, H, Tq, Tk)
    b = F.softplus(be) * F.softplus(-g)
    m = (1 + F.softplus(al) * log_k) * (s - ga)
    a = (ga + m - b).masked_fill(~visible, float("-inf"))
    u = torch.maximum(a, ga).masked_fill(~visible, float("-inf"))  # max(gamma, a) on visible keys
    # A per-row shift cancels between w's numerator and z; it only keeps exp finite.
    shift = u.amax(-1, keepdim=True).detach()
    z = torch.exp(u - shift).sum(-1, keepdim=True)  # (B, H, Tq, 1)
    w = torch.exp(a - shift) / z  # (B, H, Tq, Tk)
    w0 = 1 - w.sum(-1)  # (B, H, Tq)
    o = w @ v  # (B, H, Tq, Dv)
    if v0 is not None:
        o = o + w0[..., None] * v0[:, None, :]
    return o, w0


def principled_band(q, k, qg, kg, v, params, v0, window, causal: bool = True, docs: torch.Tensor | None = None):
    """The sliding-window fast path: `principled_naive` on each query chunk's band of keys, under
    activation checkpointing when a gradient is needed (inputs validated, heads expanded). With packed
    documents, docs (B, Tk) the run index of each key's document: each chunk reads its causal prefix
    (or band, or every key when not causal) under a same-document mask, and K counts those keys."""
    from torch.utils.checkpoint import checkpoint

    Tq, Tk = q.shape[2], k.shape[2]
    off = Tk - Tq
    grad = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, qg, kg, v, v0, *params.values()))
    if window is not None:
        spans = band_spans(Tq, Tk, window)
    else:
        spans = ((a, min(Tq, a + BAND_CHUNK), 0, min(Tq, a + BAND_CHUNK) + off if causal else Tk)
                 for a in range(0, Tq, BAND_CHUNK))
    outs, grounds = [], []
    for a, b, lo, hi in spans:
        rows = [x[..., a:b] if x.shape[-1] > 1 else x for x in (params["alpha"], params["beta"], params["gamma"])]
        seen = None
        if docs is not None:  # (B, 1, b - a, hi - lo): the chunk's visible keys of its own documents
            pos = torch.arange(a + off, b + off, device=q.device)[:, None]
            cols = torch.arange(lo, hi, device=q.device)[None, :]
            seen = docs[:, None, a + off:b + off, None] == docs[:, None, None, lo:hi]
            if causal:
                seen = seen & (cols <= pos)
            if window is not None:
                seen = seen & (cols > pos - window)
        args = (q[:, :, a:b], k[:, :, lo:hi], qg[:, :, a:b], kg[:, :, lo:hi], v[:, :, lo:hi], *rows, v0, True, window,
                seen)
        o, w0 = checkpoint(principled_naive, *args, use_reentrant=False) if grad else principled_naive(*args)
        outs.append(o)
        grounds.append(w0)
    return torch.cat(outs, dim=2), torch.cat(grounds, dim=2)
