"""Reference decode for the sorted scalar cache: the formula over every cached entry.

No binary search: every entry of every head is scored by the mechanism's own logits op
(`ops.scalar_logits`, `ops.hybrid_logits`), the window (the k nearest, and/or those within
the radius) is chosen by a full sort of the distances, everything else is masked, and the
softmax-weighted values are summed. ``attend(..., impl="naive")`` runs this; the fast path
must match it on outputs and gradients.
"""

from __future__ import annotations

import torch

from ..ops import hybrid_logits, scalar_logits
from .sorted_index import run_keys
from .sorted_read import newest_first


def attend_naive(cache, query) -> torch.Tensor:
    """A checked DecodeQuery (see SortedScalarCache.query) -> (B, H, Dv)."""
    B, H, Dv = cache.batch, cache.n_heads, cache.d_v
    ent = cache.index.all_entries()  # (C, R, N)
    keys, slots = run_keys(ent), ent[1].long()  # (R, N)
    live = torch.isfinite(keys)
    ks = torch.where(live, keys, query.qs.detach())  # dead entries and pads: any finite key, masked below
    vals = cache.values.reshape(B * cache.n_groups, -1, Dv)[cache.row_group, slots].float()  # (R, N, Dv)
    kv = None
    if cache.hybrid:
        rows = torch.arange(B * H, device=slots.device)[:, None]
        kv = cache.vkeys.reshape(B * H, -1, cache.d_k)[rows, slots].float()  # (R, N, Dk)
    sink = cache.sink
    if sink is not None:  # one more key, always visible
        ks = torch.cat([ks, sink.key], 1)  # (R, N + 1)
        kv = None if kv is None else torch.cat([kv, sink.vkey[:, None]], 1)
        vals = torch.cat([vals, sink.value[:, None, :].float()], 1)
    tau = query.tau if isinstance(query.tau, float) else query.tau.view(B, H, 1)
    qs, ks = query.qs.view(B, H, 1), ks.view(B, H, -1)
    if kv is None:
        score = scalar_logits(qs, ks, tau, causal=False, kernel=cache.kernel)  # (B, H, 1, N [+ 1])
    else:
        score = hybrid_logits(query.q.view(B, H, 1, -1), kv.view(B, H, -1, cache.d_k), qs, ks, tau, causal=False,
                              scalar_scale=query.lam, kernel=cache.kernel)
    score = score.view(B * H, -1)

    def with_sink(x: torch.Tensor) -> torch.Tensor:  # (R, N) -> (R, N [+ 1]), 0 / False for the sink
        return x if sink is None else torch.cat([x, x.new_zeros(x.shape[0], 1)], 1)

    if cache.index.weighted:
        score = score + with_sink(ent[2].view(torch.float32))  # + log(count)
    if sink is not None:
        score = torch.cat([score[:, :-1], score[:, -1:] + sink.logw], 1)  # the sink's weight in the normaliser
    d = keys - query.qs  # (R, N)
    keep = live if query.radius is None else live & (d.abs() <= query.radius)
    k = cache.max_entries if query.window is None else min(query.window, cache.max_entries)
    order = newest_first(torch.where(keep, d.abs(), float("inf")), slots)  # nearest first, then the newest
    ranks = torch.arange(order.shape[1], device=order.device).expand_as(order)
    rank = torch.empty_like(order).scatter_(1, order, ranks)  # rank of each entry by distance
    score = score.masked_fill(with_sink(~(keep & (rank < k))), float("-inf"))
    w = torch.softmax(score, 1).nan_to_num(0.0)  # a head with no candidate outputs 0
    out = (w.unsqueeze(-1) * vals).sum(1)  # (R, Dv)
    return out.to(cache.dtype).view(B, H, Dv)
