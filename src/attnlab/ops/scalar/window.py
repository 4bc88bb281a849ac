"""Each query's scalar window: the `window` keys nearest to it in scalar space among the keys it sees
(the newest first on equal distances), plus the last `local` keys and any prefix entries (a sink).

`window_mask` is the rule as a dense (Tq, Tk) mask, the reference; `window_indices` returns the same keys
as O(T x m) indices, by one of three routes (the compiled CPU kernels of `window_cpu`, the merge-sort
tree of `tree`, or query chunks scored densely, `nearest`), for the selected-keys paths of
`windowed_attention` (`windowed`). `prefix_columns` lays out the prefix for any selection rule, and
`select_chunk` sizes the selected-keys path's query chunks.
"""

from __future__ import annotations

import torch

from ...checks import check_int
from ...masks import visible_keys
from ..common.precision import upcast
from . import window_cpu
from .nearest import nearest_newest
from .tree import tree_select

__all__ = ["prefix_columns", "select_chunk", "window_indices", "window_mask"]

TREE_FROM = 1024  # sequences at least this long select through the merge-sort tree where no compiled kernel runs
SELECT_CHUNK = 64  # query rows per chunk of the selected-keys path on the CPU
CUDA_CHUNK_ELEMENTS = 1 << 26  # on CUDA: query rows per chunk such that B x H x rows x T scores stay below this


def select_chunk(query_chunk: int, B: int, H: int, T: int, device: torch.device) -> int:
    """Query rows per chunk of the selected-keys path: SELECT_CHUNK on the CPU; on CUDA as many as keep
    a chunk's B x H x rows x T scores within CUDA_CHUNK_ELEMENTS (at least SELECT_CHUNK), since there
    every chunk costs a few dozen kernel launches whatever its size."""
    if device.type != "cuda":
        return min(query_chunk, SELECT_CHUNK)
    return max(SELECT_CHUNK, min(T, CUDA_CHUNK_ELEMENTS // max(1, B * H * T)))


def window_mask(qs: torch.Tensor, ks: torch.Tensor, window: int, *, n_prefix: int = 0,
                causal: bool = True, evicted_at: torch.Tensor | None = None, local: int = 0,
                seg: torch.Tensor | None = None) -> torch.Tensor:
    """Which keys are in each query's window: the `window` candidates nearest to it in scalar
    space, the newest first among equal distances.

    Args:
        qs: scalar queries (B, H, Tq), the last Tq of the Tk positions.
        ks: scalar keys (B, H, Tk).
        window: keys per window, an int >= 1 (all candidates while a query has fewer).
        n_prefix: leading keys (a sink) that are always in and do not count toward `window`,
            an int >= 0.
        causal: only keys s <= t + Tk - Tq are candidates; False makes every key one.
        evicted_at: (B, H, Tk) from `budget.budget_evictions`: key s is a candidate for query t only
            while evicted_at[s] >= t; None keeps every key.
        local: (causal only) the last `local` keys t - local < s <= t are always in too, and the
            window's keys are the nearest among the older ones (module docstring); an int >= 0.
        seg: packed documents, (B, Tk) run index of each key's document (`attnlab.ops.common.packed`):
            only keys of the query's own document are candidates (or local keys); None for one
            document per row.

    Returns:
        (B, H, Tq, Tk) bool, True where key s is in query t's window.

    Raises:
        ValueError: window, n_prefix or local is not an int in range (for a non-int, a
            NotAnIntError, which is a TypeError too). qs, ks and evicted_at are not checked.
    """
    check_int("window", window, 1)
    check_int("n_prefix", n_prefix, 0)
    check_int("local", local, 0)
    Tq, Tk = qs.shape[-1], ks.shape[-1]
    cdt = upcast(qs.dtype)
    dist = (qs.to(cdt).unsqueeze(-1) - ks.to(cdt).unsqueeze(-2)).abs()  # (B, H, Tq, Tk)
    pos_q = torch.arange(Tk - Tq, Tk, device=qs.device)[:, None]
    candidate = visible_keys(Tq, Tk, causal, qs.device)  # (Tq, Tk)
    candidate[:, :n_prefix] = False
    if seg is not None:  # (B, 1, Tq, Tk): and the keys of the query's document only
        candidate = candidate & (seg[:, None, Tk - Tq:, None] == seg[:, None, None, :])
    recent = None
    if local:
        pos_k = torch.arange(Tk, device=qs.device)
        recent = candidate & (pos_k > pos_q - local)  # (Tq, Tk): the local window
        candidate = candidate & ~recent
    if evicted_at is not None:
        candidate = candidate & (evicted_at[..., None, :Tk] >= pos_q)  # (B, H, Tq, Tk)
    dist = dist.masked_fill(~candidate, float("inf"))
    n = min(window, max(Tk - n_prefix, 0))
    keep = nearest_newest(dist, n) & candidate if n else torch.zeros(dist.shape, dtype=torch.bool, device=qs.device)
    if recent is not None:
        keep |= recent
    if n_prefix:
        keep[..., :n_prefix] = True
    return keep


def prefix_columns(B: int, H: int, T: int, m: int, n_prefix: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
    """idx, ok (B, H, T, m) with the first n_prefix columns the prefix keys (kept from their own
    position on: a query before the sink's end) and the other columns unused, for a selection rule
    to fill (`window_indices`, `attnlab.index.keep.learned_indices`)."""
    idx = torch.zeros(B, H, T, m, dtype=torch.long, device=device)
    ok = torch.zeros(B, H, T, m, dtype=torch.bool, device=device)
    if n_prefix:  # no write to an empty slice: torch 2.11's Inductor cannot compile one into int64 on the CPU
        pre = torch.arange(n_prefix, device=device)
        idx[..., :n_prefix] = pre
        ok[..., :n_prefix] = pre <= torch.arange(T, device=device)[:, None]
    return idx, ok


def window_indices(qs: torch.Tensor, ks: torch.Tensor, window: int, *, n_prefix: int = 0, local: int = 0,
                   query_chunk: int = 256, seg: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The keys of `window_mask` (causal, Tq = Tk = T) as indices.

    Three routes to the same keys, none with a gradient or a value read back to the host: on the CPU
    with the compiled kernels `window_cpu.select_nearest` (O(T log T + T k) per head); from TREE_FROM
    positions on (float32 work, one document per row) the merge-sort tree of `tree.tree_select`
    (O(T (k log T + c)), any device); otherwise query chunks scored densely, O(query_chunk x T) memory
    per head while computing. O(T x m) kept. The arguments are not checked (`windowed_attention` checks
    them before calling this).

    Args:
        qs: scalar queries (B, H, T).
        ks: scalar keys (B, H, T).
        window: keys per window, an int >= 1.
        n_prefix: leading keys (a sink) selected by every query at or after them, not counted toward `window`.
        local: the last `local` keys each query sees, always selected.
        query_chunk: query rows whose distances are computed at once.
        seg: packed documents, (B, T) run index of each position's document: a query selects
            among the keys of its own document only (local keys included); the tree is not used.
            None for one document per row.

    Returns:
        idx (B, H, T, m) int64 key indices and ok (B, H, T, m) bool, True where the column
        holds a key (a query that sees fewer keys leaves columns unused), with
        m = n_prefix + local + min(window, T - n_prefix). Columns: the prefix, the local keys
        (newest first), then the window's keys.
    """
    B, H, T = ks.shape
    k = min(window, max(T - n_prefix, 0))
    idx, ok = prefix_columns(B, H, T, n_prefix + local + k, n_prefix, ks.device)
    if T == 0:
        return idx, ok
    pos = torch.arange(T, device=ks.device)
    if local:
        rec = pos[:, None] - torch.arange(local, device=ks.device)  # (T, local): t, t-1, ...
        idx[..., n_prefix : n_prefix + local] = rec.clamp_min(0)
        ok[..., n_prefix : n_prefix + local] = rec >= n_prefix
        if seg is not None:  # (B, 1, T, local): a local key of another document is no key
            ok[..., n_prefix : n_prefix + local] &= (seg[:, None, rec.clamp_min(0)] == seg[:, None, :, None])
    if not k:
        return idx, ok
    cdt = upcast(qs.dtype)
    win = slice(n_prefix + local, None)  # the window's columns
    with torch.no_grad():
        q32, k32 = qs.detach().to(cdt), ks.detach().to(cdt)
        if window_cpu.available(qs.device, cdt):  # the compiled CPU kernel: one sort per head, O(T x k) after it
            idx[..., win], ok[..., win] = window_cpu.select_nearest(q32, k32, k, n_prefix, local, seg)
            return idx, ok
        if cdt == torch.float32 and seg is None and T >= TREE_FROM:  # long contexts, any device: no T x T pass
            idx[..., win], ok[..., win] = tree_select(q32, k32, k, n_prefix, local)
            return idx, ok
        for a in range(0, T, query_chunk):
            b = min(T, a + query_chunk)
            dist = (q32[..., a:b, None] - k32[..., None, :b]).abs()  # (B, H, c, b)
            cand = (pos[:b] >= n_prefix) & (pos[:b] <= pos[a:b, None] - local)  # (c, b)
            if seg is not None:  # (B, 1, c, b): the keys of each query's document
                cand = cand & (seg[:, None, a:b, None] == seg[:, None, None, :b])
            dist = dist.masked_fill(~cand, float("inf"))
            kk = min(k, b)  # a chunk's keys 0..b-1 may be fewer than k
            if dist.dtype == torch.float32:  # one exact top-k: (distance bits, newest first) as one int64
                order = (dist.view(torch.int32).to(torch.int64) << 32) | (b - 1 - pos[:b])
                sel = order.topk(kk, dim=-1, largest=False).indices  # (B, H, c, kk)
                idx[:, :, a:b, n_prefix + local : n_prefix + local + kk] = sel
                ok[:, :, a:b, n_prefix + local : n_prefix + local + kk] = dist.gather(-1, sel) < float("inf")
                continue
            kth = dist.topk(kk, dim=-1, largest=False).values[..., -1:]  # (B, H, c, 1): the k-th distance
            below = dist < kth
            tied = (dist == kth) & cand
            need = kk - below.sum(-1, keepdim=True)  # places the ties at the k-th distance fill, newest first
            from_newest = tied.flip(-1).cumsum(-1).flip(-1)  # rank among the tied, counted from the newest
            keep = below | (tied & (from_newest <= need))
            sel = keep.to(torch.int8).topk(kk, dim=-1).indices  # (B, H, c, kk), kept ones first
            idx[:, :, a:b, n_prefix + local : n_prefix + local + kk] = sel
            ok[:, :, a:b, n_prefix + local : n_prefix + local + kk] = keep.gather(-1, sel)
    return idx, ok
