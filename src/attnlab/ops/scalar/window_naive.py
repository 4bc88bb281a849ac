"""`windowed_attention`'s reference: every key scored (query rows in chunks of `query_chunk`,
O(query_chunk x T) per head) with the one score formula (`naive.scalar_logits`, `naive.hybrid_logits`)
and masked outside each query's window (`window.window_mask`, the keys a budget left, `budget`) or
outside the keys keep_fn marks. Also the path of a budget and of a keep_fn without indices."""

from __future__ import annotations

import torch

from ..common.heads import expand_heads
from ..common.precision import upcast
from .args import checked_keep
from .budget import budget_evictions
from .naive import hybrid_logits, scalar_logits
from .window import window_mask


def windowed_naive(qs, ks, v, tau, window: int, q, k, n_prefix: int, budget, history: int, query_chunk: int, keep_fn,
                   local: int, scalar_scale, kernel: str, seg) -> torch.Tensor:
    """Causal scalar (q, k None) or hybrid attention over each query's window, on checked inputs: qs, ks
    (B, H, T), v (B, G, T, Dv), seg (B, T) packed documents or None -> (B, H, T, Dv) in v's dtype."""
    B, H, T = qs.shape
    cdt = upcast(v.dtype)
    vals = expand_heads(v, H)
    per_query_tau = torch.is_tensor(tau) and tau.dim() == 3
    evicted = None if budget is None else budget_evictions(qs, ks, budget, history=history, n_prefix=n_prefix,
                                                           local=local)
    outs = []
    for a in range(0, T, query_chunk):
        b = min(T, a + query_chunk)
        tau_c = tau[..., a:b] if per_query_tau else tau
        if q is None:
            logits = scalar_logits(qs[..., a:b], ks[..., :b], tau_c, kernel=kernel)
        else:
            logits = hybrid_logits(q[:, :, a:b], k[:, :, :b], qs[..., a:b], ks[..., :b], tau_c,
                                   scalar_scale=scalar_scale, kernel=kernel)
        if keep_fn is None:
            keep = window_mask(qs[..., a:b], ks[..., :b], max(window, 1), n_prefix=n_prefix, evicted_at=evicted,
                               local=local, seg=None if seg is None else seg[:, :b])
        else:
            keep = checked_keep(keep_fn, a, b, logits)
        w = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
        outs.append(w.to(cdt) @ vals[:, :, :b].to(cdt))
    if not outs:
        return v.new_zeros(B, H, 0, v.shape[-1])
    return torch.cat(outs, dim=2).to(v.dtype)
