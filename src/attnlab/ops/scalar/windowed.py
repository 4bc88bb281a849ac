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
head) and masks outside the window: the reference (`window_naive`). impl="auto" / "fast" (no budget,
no keep_fn) selects each query's keys first (`window.window_indices`, under no_grad: O(query_chunk x
Tk) per chunk for the distances, kept only as O(T x m) indices, m = k + w + n_prefix) and scores,
normalises and reads only those (`selected` under the Gaussian kernel, `chunked` under the Cauchy
one): memory O(T x m) per head and never T x T, the chunk's gathers recomputed in the backward pass
(activation checkpointing) so training through the window keeps O(T x m) as well. On the CPU the
compiled kernels (`window_cpu`, csrc/window.cpp) do both steps with no T x T pass at all: the
selection from one sort per head (O(T log T + T k)), the attention over the m selected keys forward
and backward (O(T x m)); impl="triton" reads them in the kernel of `triton_selected`. Tests compare
the paths' outputs and every gradient, with ties and the local window, on the kernels and without
them.

Packed documents (``docs`` / ``cu_seqlens``, `attnlab.ops.common.packed`): a query's candidates and
local keys are the keys of its own document, so each document reads what it would alone; both paths and
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

from ..common.precision import upcast
from ..common.triton_route import triton_route
from . import window_cpu
from .args import check_windowed, checked_indices, scalar_scale_tensor, tau_tensor
from .chunked import selected_kernel_attention
from .selected import selected_attention
from .window import select_chunk, window_indices
from .window_naive import windowed_naive

__all__ = ["windowed_attention"]


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
        docs: packed documents (`attnlab.ops.common.packed`), (B, T) integer document ids: each query's
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
    (B, H, T), seg, indexed = check_windowed(qs, ks, v, tau, window, q, k, n_prefix, budget, query_chunk, keep_fn,
                                             local, impl, scalar_scale, kernel, docs, cu_seqlens)
    window = T if window is None else window
    if impl == "naive" or budget is not None or (keep_fn is not None and not indexed):
        return windowed_naive(qs, ks, v, tau, window, q, k, n_prefix, budget, history, query_chunk, keep_fn, local,
                              scalar_scale, kernel, seg)
    chunk = select_chunk(query_chunk, B, H, T, qs.device)
    if keep_fn is None:
        idx, ok = window_indices(qs, ks, max(window, 1), n_prefix=n_prefix, local=local, query_chunk=chunk, seg=seg)
    else:
        idx, ok = checked_indices(keep_fn, B, H, T, qs.device)
    cdt = upcast(v.dtype)
    if triton_route(impl, qs.device):  # the selected keys only, gathered inside the kernel
        from .triton_selected import triton_selected_attention

        lam = None if scalar_scale is None else scalar_scale_tensor(scalar_scale, H, torch.float32, qs.device)
        return triton_selected_attention(qs, ks, v, tau_tensor(tau, B, H, T, torch.float32, qs.device), idx, ok, q=q,
                                         k=k, lam_b=lam, kernel=kernel)
    if window_cpu.available(qs.device, cdt):  # the compiled CPU kernel: O(T x m) forward and backward
        lam = None if scalar_scale is None else scalar_scale_tensor(scalar_scale, H, cdt, qs.device)
        out = window_cpu.selected_cpu(qs, ks, v.to(cdt), tau_tensor(tau, B, H, T, cdt, qs.device), idx, ok, q, k, lam,
                                      kernel)
        return out.to(v.dtype)
    if kernel != "gaussian":
        return selected_kernel_attention(qs, ks, v, tau, idx, ok, q, k, kernel, scalar_scale, chunk)
    return selected_attention(qs, ks, v, tau, idx, ok, q, k, chunk, scalar_scale)
