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
