"""Windowed scalar and hybrid attention: each query reads only the `window` keys nearest to it
in scalar space among the keys it sees (plus any prefix entries, such as a sink, always).

This is what decoding through `attnlab.cache.SortedScalarCache(window=k)` computes, token by
token; here it is computed for a whole sequence at once, so the loss of windowed decoding can
be measured at long contexts without stepping the model (`attnlab.eval.window`). For query t
(causal) the candidates are the keys s <= t; the window is the `window` of them with the
smallest |qs_t - ks_s| (all of them while t sees fewer; among keys at the same distance the
newest are taken first), and the softmax runs over the window plus the prefix columns
0 .. n_prefix - 1. Logits come from `scalar_logits` / `hybrid_logits` (one score formula).

Ties. Identical scalar keys are common (with no position embedding a first layer's keys depend on
the token alone). The sorted cache breaks exact ties in its own order: no matter for a scalar head
(tied keys carry the same value), but a hybrid head with RoPE can differ from this op in which
tied entries fill the window's last places.

Local window. With `local = w`, the last w keys a query sees (its own among them) are always in,
and the window's k keys are the nearest among the older ones: k + w keys (+ the prefix). A decoder
keeps the last w keys in a ring and the older ones in the sorted cache (`train_window` / `local_window`).

Two paths. impl="naive" scores every key (row chunks of `query_chunk`, O(query_chunk x Tk) per
head) and masks outside the window: the reference. impl="auto" / "fast" (no budget, no keep_fn)
selects each query's keys first (under no_grad: O(query_chunk x Tk) per chunk for the distances,
kept only as O(T x m) indices, m = k + w + n_prefix) and scores, normalises and reads only those:
memory O(T x m) per head and never T x T, the chunk's gathers recomputed in the backward pass
(activation checkpointing) so training through the window keeps O(T x m) as well. On the CPU the
compiled kernels (`window_cpu`, csrc/window.cpp) do both steps with no T x T pass at all: the
selection from one sort per head (O(T log T + T k)), the attention over the m selected keys forward
and backward (O(T x m)). Tests compare the paths' outputs and every gradient, with ties and the
local window, on the kernels and without them.

Packed documents (``docs`` / ``cu_seqlens``, `attnlab.ops._packed`): a query's candidates and local
keys are the keys of its own document, so each document reads what it would alone; both paths and
the Triton kernel take them (the selected indices carry the documents), the tree steps
aside for the dense one. A sink, a budget or keep_fn are rules about one sequence's positions and
are refused beside them.

Other selection rules. `keep_fn` replaces the window rule by any other choice of keys (the key
selectors of `attnlab.eval.selectors`: oracle top-K, Quest pages, learned search vectors): it is
called once per query chunk as keep_fn(a, b, logits) with the chunk's query rows a..b-1 (the keys
are 0..b-1) and their logits (B, H, b - a, b), -inf where a key is hidden, and returns the
(B, H, b - a, b) bool mask of the keys each query reads (the prefix entries too, if it wants them).
A keep_fn that also has the same keys as indices (an `attnlab.index.keep.IndexedKeep`: its
`indices()` gives idx / ok (B, H, T, m) as `window_indices` lays them out) is read through the
selected-keys path on impl "auto" / "fast", O(T x m) like the window rule's; impl="naive" still
masks the dense scores with its keep_fn, the reference.
"""

from __future__ import annotations

from typing import Callable

import torch

from ...checks import check_int, check_same
from ...masks import visible_keys
from .._packed import packing
from .._sdpa import check_qkv, expand_heads, upcast
from .budget import budget_evictions
from .nearest import nearest_newest
from .tree import tree_select
from .route import triton_missing, triton_route
from . import window_cpu
from .selected import checked_indices, selected_attention
from .naive import hybrid_logits, scalar_logits
from .args import _check_scalars, _check_values, _scalar_scale, _tau, check_kernel

__all__ = ["window_indices", "window_mask", "windowed_attention"]

TREE_FROM = 1024  # sequences at least this long select through the merge-sort tree where no compiled kernel runs
SELECT_CHUNK = 64  # query rows per chunk of the selected-keys path (fastest of 32, 64, 128 measured at T = 256)
CUDA_CHUNK_ELEMENTS = 1 << 26  # on CUDA: query rows per chunk such that B x H x rows x T scores stay below this


def select_chunk(query_chunk: int, B: int, H: int, T: int, device: torch.device) -> int:
    """Query rows per chunk of the selected-keys path: SELECT_CHUNK on the CPU (measured fastest);
    on CUDA as many as keep a chunk's B x H x rows x T scores within CUDA_CHUNK_ELEMENTS (at least
    SELECT_CHUNK), since there every chunk costs a few dozen kernel launches whatever its size."""
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
        evicted_at: (B, H, Tk) from `budget_evictions`: key s is a candidate for query t only
            while evicted_at[s] >= t; None keeps every key.
        local: (causal only) the last `local` keys t - local < s <= t are always in too, and the
            window's keys are the nearest among the older ones (module docstring); an int >= 0.
        seg: packed documents, (B, Tk) run index of each key's document (`attnlab.ops._packed`):
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
    local: int = 0,
    impl: str = "auto",
    scalar_scale=None,
    kernel: str = "gaussian",
    docs: torch.Tensor | None = None,
    cu_seqlens=None,
) -> torch.Tensor:
    """Causal scalar attention (q, k None) or hybrid attention (q, k given) over each query's
    scalar window; see the module docstring.

    Args:
        qs: scalar queries (B, H, T).
        ks: scalar keys (B, H, T).
        v: values (B, G, T, Dv), G dividing H.
        tau: temperature > 0, as `scalar_attention` takes it: a float, (H,) or (B, H, T).
        window: keys per query (an int >= 1); None for every key the query sees.
        q: vector queries (B, H, T, D) of hybrid heads; None for scalar heads.
        k: vector keys (B, G', T, D), G' dividing H; given with q.
        n_prefix: leading positions (a sink) every query reads, not counted toward `window`;
            an int >= 0.
        budget: read only the keys a sorted cache capped at `budget` entries per head still holds
            (`budget_evictions`); None for no cap.
        history: recent queries that span the budget rule's range (with budget).
        query_chunk: query rows scored at once by the dense path (the selected-keys path takes
            at most 64), an int >= 1.
        keep_fn: another rule for the keys each query reads, in place of the window (module
            docstring); it takes no window, budget or local.
        local: the last `local` keys are always read and the window's keys are the nearest among
            the older ones; an int >= 0.
        impl: ``"naive"`` scores every key and masks; ``"fast"`` reads the selected keys only;
            ``"auto"`` is ``"fast"``, or ``"naive"`` with a budget or a keep_fn without indices.
        scalar_scale: hybrid only: lam in q·k/√D − lam (qs − ks)²/τ, as `hybrid_attention` takes it;
            None for 1. It changes the scores, not which keys the window selects.
        kernel: the scalar term's kernel, "gaussian" or "cauchy" (`attnlab.ops.scalar`); both
            select the same keys.
        docs: packed documents (`attnlab.ops._packed`), (B, T) integer document ids: each query's
            window (and local keys) holds keys of its own document only, as if each document ran
            alone. Not with a prefix, a budget or keep_fn (position rules of one sequence).
        cu_seqlens: packed documents as N + 1 offsets [0, ..., T] into one row (B = 1), as
            flash-linear-attention's ops take them; as docs otherwise. Give at most one of the two.

    Returns:
        (B, H, T, Dv) in v's dtype.

    Raises:
        TypeError: a tensor argument that is not a tensor, not floating or not of the first
            query's dtype; tau neither a float nor a tensor; keep_fn not callable.
        ValueError: shapes that do not fit (batch, heads, groups, ks of another length than qs),
            another device, NaN or inf, tau <= 0, window, query_chunk, n_prefix, local, budget
            or history out of range (a non-int: NotAnIntError, a TypeError too), q without k,
            impl="fast" with a budget or a keep_fn without indices, keep_fn with a window, budget
            or local, a keep_fn mask (or indices) not bool of the chunk's shape (or not of
            `window_indices`' layout) or leaving a query no key, an
            unknown impl, docs or cu_seqlens (both; with n_prefix, budget or keep_fn; of another
            shape, device or dtype; offsets not from 0 to T; cu_seqlens with B != 1).
    """
    if window is not None:
        check_int("window", window, 1)
    check_int("query_chunk", query_chunk, 1)
    check_int("n_prefix", n_prefix, 0)
    check_int("local", local, 0)
    if impl not in ("auto", "naive", "fast", "triton"):
        raise ValueError(f"impl must be 'auto', 'naive', 'fast' or 'triton', got {impl!r}")
    check_kernel(kernel)
    indexed = keep_fn is not None and callable(getattr(keep_fn, "indices", None))
    if impl in ("fast", "triton") and (budget is not None or (keep_fn is not None and not indexed)):
        raise ValueError(f"impl={impl!r} reads selected keys: it takes no budget, nor a keep_fn without indices "
                         f"(an IndexedKeep)")
    if impl == "triton" and (why := triton_missing(qs.device)) is not None:
        raise ValueError(f"impl='triton': {why}")
    if local and keep_fn is not None:
        raise ValueError(f"keep_fn replaces the window rule: give local=0, got local={local!r}")
    if (q is None) != (k is None):
        raise ValueError("q and k must be given together (hybrid) or both be None (scalar)")
    if scalar_scale is not None and q is None:
        raise ValueError("scalar_scale scales the hybrid's scalar term: give q and k with it")
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
    if scalar_scale is not None:
        _scalar_scale(scalar_scale, H, upcast(qs.dtype), qs.device)
    seg = None
    if docs is not None or cu_seqlens is not None:
        if n_prefix or budget is not None or keep_fn is not None:
            raise ValueError(f"packed documents (docs / cu_seqlens) take no prefix, budget or keep_fn (rules for the "
                             f"positions of one sequence), got n_prefix={n_prefix!r}, budget={budget!r}, "
                             f"keep_fn={'given' if keep_fn is not None else None}")
        seg = packing(cu_seqlens, docs, B, T, qs).seg  # (B, T): each position's document
    cdt = upcast(v.dtype)
    vals = expand_heads(v, H)
    per_query_tau = torch.is_tensor(tau) and tau.dim() == 3
    window = T if window is None else window
    if impl != "naive" and budget is None and (keep_fn is None or indexed):
        chunk = select_chunk(query_chunk, B, H, T, qs.device)
        if keep_fn is None:
            idx, ok = window_indices(qs, ks, max(window, 1), n_prefix=n_prefix, local=local, query_chunk=chunk,
                                     seg=seg)
        else:
            idx, ok = checked_indices(keep_fn, B, H, T, qs.device)
        if triton_route(impl, qs.device):  # the selected keys only, gathered inside the kernel
            from .triton_selected import triton_selected_attention

            lam = None if scalar_scale is None else _scalar_scale(scalar_scale, H, torch.float32, qs.device)
            return triton_selected_attention(qs, ks, v, _tau(tau, B, H, T, torch.float32, qs.device), idx, ok, q=q,
                                             k=k, lam_b=lam, kernel=kernel)
        if window_cpu.available(qs.device, cdt):  # the compiled CPU kernel: O(T x m) forward and backward
            lam = None if scalar_scale is None else _scalar_scale(scalar_scale, H, cdt, qs.device)
            out = window_cpu.selected_cpu(qs, ks, v.to(cdt), _tau(tau, B, H, T, cdt, qs.device), idx, ok, q, k, lam,
                                          kernel)
            return out.to(v.dtype)
        return selected_attention(qs, ks, v, tau, idx, ok, q, k, chunk, scalar_scale, kernel)
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
