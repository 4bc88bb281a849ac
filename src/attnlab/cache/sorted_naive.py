"""Reference decode for the sorted scalar cache: the formula over every cached entry.

No binary search: every entry of every head is scored, the window (the k nearest, and/or
those within the radius) is chosen by a full sort of the distances, everything else is
masked, and the softmax-weighted values are summed. ``attend(..., impl="naive")`` runs
this; the fast path must match it on outputs and gradients.
"""

from __future__ import annotations

import math

import torch

from .sorted_index import run_keys


def attend_naive(cache, qr, q_rows, tau_r, r, window) -> torch.Tensor:
    """qr (R, 1), q_rows (R, Dk) or None, tau_r float or (R, 1), r None/float/(R, 1) -> (B, H, Dv)."""
    B, H, R, Dv = cache.batch, cache.n_heads, cache.rows, cache.d_v
    ent = cache.index.all_entries()  # (C, R, N)
    keys, slots = run_keys(ent), ent[1].long()
    d = keys - qr  # (R, N)
    score = -(d ** 2) / tau_r
    if cache.index.weighted:
        score = score + ent[2].view(torch.float32)  # + log(count)
    if cache.hybrid:
        kv = cache.vkeys.reshape(B * H, -1, cache.d_k)[cache._row_head, slots].float()  # (R, N, Dk)
        score = score + (kv * q_rows[:, None, :]).sum(-1) / math.sqrt(cache.d_k)
    keep = torch.isfinite(keys)
    if r is not None:
        keep = keep & (d.abs() <= r)
    k = cache._n_max if window is None else min(window, cache._n_max)
    order = torch.where(keep, d.abs(), float("inf")).argsort(dim=1, stable=True)
    ranks = torch.arange(order.shape[1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(1, order, ranks)  # rank of each entry by distance
    score = score.masked_fill(~(keep & (rank < k)), float("-inf"))
    vals = cache.values.reshape(B * cache.n_groups, -1, Dv)[cache._row_group, slots].float()  # (R, N, Dv)
    if cache.has_sink:
        sink = -((qr - cache._sink_k) ** 2) / tau_r  # (R, 1)
        if cache.hybrid:
            sink = sink + (q_rows * cache._sink_vk).sum(1, keepdim=True) / math.sqrt(cache.d_k)
        score = torch.cat([score, sink], 1)
        vals = torch.cat([vals, cache._sink_v[:, None, :].float()], 1)
    w = torch.softmax(score, 1).nan_to_num(0.0)  # a head with no candidate outputs 0
    out = (w.unsqueeze(-1) * vals).sum(1)  # (R, Dv)
    return out.to(cache.dtype).view(B, H, Dv)
