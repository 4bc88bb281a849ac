"""The window's nearest keys for a chunk of queries at long contexts, found through sorted keys.

`window.window_indices` picks, for query t, the k keys nearest to qs_t in scalar space among
positions n_prefix .. t - local (newest first on equal distances). Scoring every key costs
O(T) per query, O(T^2) per head for a sequence: minutes at 64K tokens on a CPU. For a chunk of
queries a .. b - 1 the keys up to a - local are visible to every query of the chunk; sorted by
value, the k nearest among them lie within k places of the query's insertion point on either side.
So a query scores only those 2k candidates plus the chunk's partly visible recent keys, and the
chunk costs one sort of the old keys and O(c x (k + c)) distances instead of O(c x T).

Exactness. The candidates' distances are the very float32 values the dense rule compares, and
the choice among them is the dense rule's (distance bits, newest first) order. A key left out has
a distance at least that of the first one left out on its side; a row whose k-th choice is not
strictly nearer than both of those (a tie across the boundary, as when every scalar key is equal)
is not decided here: `nearest_sorted` returns None and the caller scores the chunk densely.
"""

from __future__ import annotations

import torch

__all__ = ["SORTED_FROM", "SORTED_ON", "nearest_newest", "nearest_newest_naive", "nearest_sorted"]

SORTED_FROM = 4096  # a chunk sees at least this many old keys before the sorted search is used
# Devices the sorted search runs on: deciding whether a chunk's candidates settle it reads a bool on
# the host, free on the CPU and a sync on an accelerator, where dense chunks keep a step sync-free.
SORTED_ON = ("cpu",)


def nearest_sorted(q32: torch.Tensor, k32: torch.Tensor, a: int, b: int, n_prefix: int, local: int,
                   kk: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """For queries a .. b - 1 of float32 scalar queries q32 (B, H, T) over keys k32 (B, H, T): the kk
    nearest candidate keys (positions n_prefix .. t - local, newest first on ties) -> positions
    (B, H, c, kk) and their validity, in the order of the dense rule's top-k; None where a row's
    choice is not decided by its candidates (the caller scores the chunk densely)."""
    B, H = q32.shape[:2]
    hi_old = a - local + 1  # keys n_prefix .. a - local: visible to every query of the chunk
    N = hi_old - n_prefix
    if N < 2 * kk + 1:
        return None
    dev = q32.device
    sv, si = k32[..., n_prefix:hi_old].sort(dim=-1)  # (B, H, N)
    sv = sv.contiguous()
    qc = q32[..., a:b].contiguous()  # (B, H, c)
    c = qc.shape[-1]
    p = torch.searchsorted(sv, qc)  # (B, H, c): the first sorted key >= the query
    j = p[..., None] + torch.arange(-kk, kk, device=dev)  # (B, H, c, 2kk) places around it
    inside = (j >= 0) & (j < N)
    jc = j.clamp(0, N - 1).view(B, H, -1)
    old_pos = si.gather(-1, jc).view(B, H, c, 2 * kk) + n_prefix
    pos_q = torch.arange(a, b, device=dev)
    recent = torch.arange(max(hi_old, n_prefix), b, device=dev)  # visible to some queries of the chunk only
    cand = torch.cat([old_pos, recent.expand(B, H, c, -1)], -1)  # (B, H, c, 2kk + R)
    ok = torch.cat([inside, (recent <= pos_q[:, None] - local).expand(B, H, c, -1)], -1)
    dist = (qc[..., None] - k32.gather(-1, cand.view(B, H, -1)).view(cand.shape)).abs()
    dist = dist.masked_fill(~ok, float("inf"))
    order = (dist.view(torch.int32).to(torch.int64) << 32) | (b - 1 - cand)
    top = order.topk(kk, dim=-1, largest=False).indices  # (B, H, c, kk)
    sel, d_sel = cand.gather(-1, top), dist.gather(-1, top)
    # the nearest keys left out on either side: each must be strictly farther than the kk-th choice
    left, right = p - kk - 1, p + kk
    d_left = torch.where(left >= 0, qc - sv.gather(-1, left.clamp_min(0)), float("inf")).abs()
    d_right = torch.where(right < N, sv.gather(-1, right.clamp(max=N - 1)) - qc, float("inf")).abs()
    kth = d_sel[..., -1]
    if not bool(((kth < d_left) & (kth < d_right)).all()):
        return None
    return sel, d_sel < float("inf")


def nearest_newest_naive(dist: torch.Tensor, n: int) -> torch.Tensor:
    """The reference of `nearest_newest`: a stable sort of each row, newest first."""
    Tk = dist.shape[-1]
    keep = torch.zeros(dist.shape, dtype=torch.bool, device=dist.device)
    keep.scatter_(-1, Tk - 1 - dist.flip(-1).sort(dim=-1, stable=True).indices[..., :n], True)
    return keep


def nearest_newest(dist: torch.Tensor, n: int) -> torch.Tensor:
    """Bool mask of the n smallest entries of each row of dist (..., Tk), the newest (rightmost)
    first among equal values. A topk of n + 1 finds them; only the rows where the n-th and the
    (n+1)-th smallest are equal (a tie at the boundary, e.g. rows with fewer than n finite entries)
    are redone: every entry below the n-th value, and of the entries equal to it the rightmost ones
    still needed. Equal to the stable sort of `nearest_newest_naive` (tested with ties and
    infinities; a tensor holding NaN takes the sort throughout)."""
    Tk = dist.shape[-1]
    if n >= Tk or bool(torch.isnan(dist).any()):
        return nearest_newest_naive(dist, n)
    vals, idx = dist.topk(n + 1, dim=-1, largest=False, sorted=True)
    keep = torch.zeros(dist.shape, dtype=torch.bool, device=dist.device)
    keep.scatter_(-1, idx[..., :n], True)
    tied = (vals[..., n - 1] == vals[..., n]).reshape(-1)
    if bool(tied.any()):  # those rows: everything below the n-th value, then the newest of its ties
        rows = tied.nonzero().squeeze(1)
        d = dist.reshape(-1, Tk)[rows]
        thr = vals.reshape(-1, n + 1)[rows, n - 1 : n]
        below, tie = d < thr, d == thr
        need = n - below.sum(-1, keepdim=True, dtype=torch.int32)
        from_right = tie.flip(-1).cumsum(-1, dtype=torch.int32).flip(-1)  # ties at or right of each slot
        keep.view(-1, Tk)[rows] = below | (tie & (from_right <= need))
    return keep
