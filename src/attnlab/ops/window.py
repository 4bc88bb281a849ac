"""Windowed scalar and hybrid attention: each query reads only the `window` keys nearest to it
in scalar space among the keys it sees (plus any prefix entries, such as a sink, always).

This is what decoding through `attnlab.cache.SortedScalarCache(window=k)` computes, token by
token; here it is computed for a whole sequence at once, so the loss of windowed decoding can
be measured at long contexts without stepping the model (`attnlab.eval.window`). For query t
(causal) the candidates are the keys s <= t; the window is the `window` of them with the
smallest |qs_t - ks_s| (all of them while t sees fewer; among keys at the same distance the
newest are taken first), and the softmax runs over the window
plus the prefix columns 0 .. n_prefix - 1. Logits come from `scalar_logits` / `hybrid_logits`,
the mechanisms' one score formula.

Ties. Identical scalar keys are common: with no position embedding, a first layer's keys are a
function of the token alone, so repeated tokens tie. The sorted cache breaks exact ties in its
own order, which for a scalar head does not matter (tied keys carry the same value) but for a
hybrid head with RoPE does (tied entries differ in their rotated vector keys); there the cache
and this op can differ by which of the tied entries fill the last places of the window.

Queries are processed in row chunks (`query_chunk`), so memory is O(query_chunk x Tk) per head
rather than O(Tk^2).

Other selection rules. `keep_fn` replaces the window rule by any other choice of keys (the key
selectors of `attnlab.eval.selectors`: oracle top-K, Quest pages, learned search vectors): it is
called once per query chunk as keep_fn(a, b, logits) with the chunk's query rows a..b-1 (the keys
are 0..b-1) and their logits (B, H, b - a, b), -inf where a key is hidden, and returns the
(B, H, b - a, b) bool mask of the keys each query reads. The softmax then runs over those keys,
as it does over a window; the rule itself decides whether the prefix entries are in.
"""

from __future__ import annotations

from typing import Callable

import torch

from ..checks import check_int, check_same, visible_keys
from ._sdpa import check_qkv, expand_heads, upcast
from .scalar import _check_scalars, _check_values, _tau, hybrid_logits, scalar_logits

__all__ = ["budget_evictions", "range_distance", "window_mask", "windowed_attention"]

NEVER = torch.iinfo(torch.int64).max


def range_distance(keys: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Distance of each key to the interval [lo, hi] (0 inside): budget eviction's ranking, shared
    by `budget_evictions` and `attnlab.cache.eviction.evict_to_budget`."""
    return torch.clamp(torch.maximum(lo - keys, keys - hi), min=0.0)


def budget_evictions(qs: torch.Tensor, ks: torch.Tensor, budget: int, *, history: int = 256,
                     n_prefix: int = 0) -> torch.Tensor:
    """(B, H, T) int64: the step after whose query each key is evicted when a sorted cache decoding
    this sequence calls `evict_to_budget(budget)` after every step (query t still sees it when
    evicted_at >= t); NEVER for keys still held at the end, and for the n_prefix sink positions.

    At step t the cache holds the surviving keys <= t; when that is more than `budget`, the key
    farthest from the range [min, max] of the last `history` queries (distance 0 inside) goes,
    the oldest first among equal distances (`attnlab.cache.eviction.evict_to_budget`'s rule:
    keep the nearest, the newest first). Sequential over t, vectorised over batch x heads."""
    check_int("budget", budget)
    check_int("history", history)
    B, H, T = ks.shape
    q, k = qs.detach().float(), ks.detach().float()
    evicted = torch.full((B, H, T), NEVER, dtype=torch.long, device=ks.device)
    alive = torch.zeros(B, H, T, dtype=torch.bool, device=ks.device)
    pos = torch.arange(T, device=ks.device)
    for t in range(n_prefix, T):
        alive[..., t] = True
        if t - n_prefix + 1 <= budget:
            continue
        window = q[..., max(n_prefix, t - history + 1) : t + 1]
        lo, hi = window.amin(-1, keepdim=True), window.amax(-1, keepdim=True)
        cand = alive[..., : t + 1]
        dist = range_distance(k[..., : t + 1], lo, hi).masked_fill(~cand, float("-inf"))
        worst = cand & (dist == dist.amax(-1, keepdim=True))
        out = torch.where(worst, pos[: t + 1], T).amin(-1, keepdim=True)  # the oldest of the farthest
        alive.scatter_(-1, out, False)
        evicted.scatter_(-1, out, t)
    return evicted


def window_mask(qs: torch.Tensor, ks: torch.Tensor, window: int, *, n_prefix: int = 0,
                causal: bool = True, evicted_at: torch.Tensor | None = None) -> torch.Tensor:
    """(B, H, Tq, Tk) bool: key s is in query t's window. Queries are the last Tq of the Tk
    positions (causal; causal=False: every key is a candidate); the first `n_prefix` keys are
    always in and do not count toward `window`. evicted_at (B, H, Tk), from `budget_evictions`:
    key s is a candidate for query t only while evicted_at[s] >= t."""
    check_int("window", window, 1)
    check_int("n_prefix", n_prefix, 0)
    Tq, Tk = qs.shape[-1], ks.shape[-1]
    cdt = upcast(qs.dtype)
    dist = (qs.to(cdt).unsqueeze(-1) - ks.to(cdt).unsqueeze(-2)).abs()  # (B, H, Tq, Tk)
    pos_q = torch.arange(Tk - Tq, Tk, device=qs.device)[:, None]
    candidate = visible_keys(Tq, Tk, causal, qs.device)  # (Tq, Tk)
    candidate[:, :n_prefix] = False
    if evicted_at is not None:
        candidate = candidate & (evicted_at[..., None, :Tk] >= pos_q)  # (B, H, Tq, Tk)
    dist = dist.masked_fill(~candidate, float("inf"))
    n = min(window, max(Tk - n_prefix, 0))
    keep = torch.zeros(dist.shape, dtype=torch.bool, device=qs.device)
    if n:  # nearest first; at equal distance (identical keys) the newest first
        newest_first = dist.flip(-1).sort(dim=-1, stable=True).indices[..., :n]
        keep.scatter_(-1, Tk - 1 - newest_first, True)
        keep &= candidate
    if n_prefix:
        keep[..., :n_prefix] = True
    return keep


def windowed_attention(
    qs: torch.Tensor,
    ks: torch.Tensor,
    v: torch.Tensor,
    tau,
    window: int | None,
    *,
    q: torch.Tensor | None = None,
    k: torch.Tensor | None = None,
    n_prefix: int = 0,
    budget: int | None = None,
    history: int = 256,
    query_chunk: int = 512,
    keep_fn: Callable[[int, int, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Causal scalar attention (q, k None) or hybrid attention (q, k given) over each query's
    scalar window; see the module docstring. window None: every key the query sees. budget: the
    keys are those a sorted cache capped at `budget` entries still holds (`budget_evictions`).
    keep_fn: another rule for the keys each query reads, in place of the window (see the module
    docstring); it takes no window or budget.

    qs, ks: (B, H, T); v: (B, G, T, Dv) with G dividing H; tau: as `scalar_attention` takes it
    ((H,) or (B, H, T)); q: (B, H, T, D), k: (B, G', T, D). Returns (B, H, T, Dv) in v's dtype.
    """
    if window is not None:
        check_int("window", window, 1)
    check_int("query_chunk", query_chunk, 1)
    check_int("n_prefix", n_prefix, 0)
    if (q is None) != (k is None):
        raise ValueError("q and k must be given together (hybrid) or both be None (scalar)")
    if keep_fn is not None:
        if not callable(keep_fn):
            raise TypeError(f"keep_fn must be callable as keep_fn(a, b, logits), got {type(keep_fn).__name__}")
        if window is not None or budget is not None:
            raise ValueError(f"keep_fn replaces the window rule: give window=None and budget=None, "
                             f"got window={window!r}, budget={budget!r}")
    # the exact ops' checks, all before any work (attnlab's input policy)
    if q is None:
        B, H, T = _check_scalars(qs, ks)
        _check_values(v, qs, B, H, ks.shape[2])
    else:
        B, H, T, _ = check_qkv(q, k, v, True)
        _check_scalars(qs, ks, q, "q")
    check_same("qs", T, "ks", ks.shape[2], "sequence length (windowed attention runs on whole sequences)")
    _tau(tau, B, H, T, upcast(qs.dtype), qs.device)
    cdt = upcast(v.dtype)
    vals = expand_heads(v, H)
    per_query_tau = torch.is_tensor(tau) and tau.dim() == 3
    window = T if window is None else window
    evicted = None if budget is None else budget_evictions(qs, ks, budget, history=history, n_prefix=n_prefix)
    outs = []
    for a in range(0, T, query_chunk):
        b = min(T, a + query_chunk)
        tau_c = tau[..., a:b] if per_query_tau else tau
        if q is None:
            logits = scalar_logits(qs[..., a:b], ks[..., :b], tau_c)
        else:
            logits = hybrid_logits(q[:, :, a:b], k[:, :, :b], qs[..., a:b], ks[..., :b], tau_c)
        if keep_fn is None:
            keep = window_mask(qs[..., a:b], ks[..., :b], max(window, 1), n_prefix=n_prefix, evicted_at=evicted)
        else:
            keep = _chunk_keep(keep_fn, a, b, logits)
        w = torch.softmax(logits.masked_fill(~keep, float("-inf")), dim=-1)
        outs.append(w.to(cdt) @ vals[:, :, :b].to(cdt))
    if not outs:
        return v.new_zeros(B, H, 0, v.shape[-1])
    return torch.cat(outs, dim=2).to(v.dtype)


def _chunk_keep(keep_fn, a: int, b: int, logits: torch.Tensor) -> torch.Tensor:
    """keep_fn's mask for query rows a..b-1, checked: a bool tensor of the logits' shape."""
    keep = keep_fn(a, b, logits)
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.shape != logits.shape:
        got = f"{keep.dtype} {tuple(keep.shape)}" if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise ValueError(f"keep_fn must return a bool mask of the chunk's logits shape {tuple(logits.shape)}, got {got}")
    if not bool((keep & (logits > float("-inf"))).any(-1).all()):  # an empty softmax would be NaN
        raise ValueError(f"keep_fn must keep at least one key each query sees, for every query of rows {a}..{b - 1}")
    return keep
