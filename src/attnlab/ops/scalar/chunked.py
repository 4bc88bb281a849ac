"""Scalar and hybrid attention under a kernel with no fused path (kernel="cauchy").

The Gaussian scalar logit -(qs - ks)^2 / tau is a quadratic in qs - ks and runs through SDPA as
an augmented dot product (`fused`). The Cauchy logit -log(1 + (qs - ks)^2 / tau)
is not, so its scores are formed explicitly, with the ops' one score formula
(`scores`), in two shapes that bound memory:

- `chunked_kernel_attention`, the exact op's "auto" path: query rows in chunks of `chunk`,
  each chunk's (chunk x Tk) logits recomputed in the backward pass (activation checkpointing),
  so memory is O(chunk x Tk) per head, never Tq x Tk; the naive path of the ops is its reference.
- `selected_kernel_attention`, `windowed_attention`'s selected-keys path: query rows in chunks,
  each chunk's scores masked to its queries' m selected keys (window, local window, prefix;
  `window_indices`) and recomputed in the backward pass, as the Gaussian's SDPA path does: the
  indices kept are O(T x m) per head. (Gathering the m keys per query instead would make the
  backward pass scatter into the keys.) Without a gradient (evaluation, a decode cache's prefill)
  it gathers: O(T x m) work instead of O(T^2). The dense masked path (`window_naive`) is its
  reference.

Both take checked inputs (the public ops check before calling them); under the Gaussian kernel the
windowed op reads its selected keys through `selected` instead.
"""

from __future__ import annotations

import math

import torch

from ...masks import visible_keys
from ..common.band import band_keys, band_mask, chunk_spans
from ..common.heads import expand_heads
from ..common.precision import upcast
from .args import scalar_scale_tensor, tau_tensor
from .scores import hybrid_scores, kernel_term, scalar_scores

__all__ = ["chunk_bias", "chunk_mask", "chunked_kernel_attention", "selected_kernel_attention"]

CHUNK = 256  # query rows per chunk of the explicit-score paths


def _needs_grad(*xs) -> bool:
    return torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad for x in xs)


def _per_query(x: torch.Tensor, a: int, b: int) -> torch.Tensor:
    """Rows a..b-1 of a tensor broadcastable to (B, H, Tq) (a per-head one is returned whole)."""
    return x[..., a:b] if x.shape[-1] > 1 else x


def _dense_chunk(qs, ks, vals, tau_b, lam, q, k, hidden, kernel):
    scores = scalar_scores(qs, ks, tau_b, kernel, lam) if q is None else hybrid_scores(q, k, qs, ks, tau_b, kernel, lam)
    w = torch.softmax(scores.masked_fill(hidden, float("-inf")), dim=-1)
    return w.to(vals.dtype) @ vals


def chunked_kernel_attention(qs, ks, v, tau, q, k, kernel: str, causal: bool, scalar_scale,
                             chunk: int = CHUNK, window: int | None = None, n_prefix: int = 0,
                             docs: torch.Tensor | None = None) -> torch.Tensor:
    """softmax over keys of the kernel's scores (`hybrid_logits` when q is given) times v, query
    rows `chunk` at a time: qs (B, H, Tq), ks (B, H, Tk), v (B, G, Tk, Dv), q (B, H, Tq, D) and
    k (B, G', Tk, D) or None; queries are the last Tq positions under `causal` -> (B, H, Tq, Dv).
    With a sliding `window` each chunk reads only its band of keys and the first n_prefix
    (`attnlab.ops.common.band`): O(chunk x (chunk + window)) per head. docs (B, Tk): packed documents' run
    index of each key (`attnlab.ops.common.packed.Packing.seg`); a query also hides every key of another document
    (the first n_prefix included)."""
    from torch.utils.checkpoint import checkpoint

    B, H, Tq = qs.shape
    Tk = ks.shape[2]
    cdt = upcast(v.dtype)
    tau_b = tau_tensor(tau, B, H, Tq, cdt, qs.device)
    lam = None if scalar_scale is None else scalar_scale_tensor(scalar_scale, H, cdt, qs.device)
    vals = expand_heads(v, H).to(cdt)
    kk = None if k is None else expand_heads(k, H)
    grad = _needs_grad(qs, ks, v, q, k, tau, scalar_scale)
    off = Tk - Tq
    n_prefix = min(n_prefix, Tk)
    outs = []
    for a, b, lo, hi in chunk_spans(Tq, Tk, causal, window, chunk, n_prefix):
        if causal and window is not None:
            hidden, pre = ~band_mask(a, b, lo, hi, off, window, n_prefix, qs.device), n_prefix
        else:
            hidden, pre = ~visible_keys(b - a, hi, causal, qs.device), 0  # rows a..b-1 only
        if docs is not None:  # (B, 1, b - a, keys): and the keys of other documents
            keys = band_keys(docs, lo, hi, pre, dim=1)
            hidden = hidden | (docs[:, None, a + off:b + off, None] != keys[:, None, None, :])
        args = (qs[..., a:b], band_keys(ks, lo, hi, pre), band_keys(vals, lo, hi, pre), _per_query(tau_b, a, b), lam,
                None if q is None else q[:, :, a:b], None if kk is None else band_keys(kk, lo, hi, pre), hidden, kernel)
        outs.append(checkpoint(_dense_chunk, *args, use_reentrant=False) if grad else _dense_chunk(*args))
    if not outs:
        return v.new_zeros(B, H, 0, v.shape[-1])
    return torch.cat(outs, dim=2).to(v.dtype)


def chunk_mask(idx: torch.Tensor, ok: torch.Tensor, b: int) -> torch.Tensor:
    """Indices (B, H, c, m) and their validity -> the (B, H, c, b) bool mask of the keys they select."""
    return _mark_selected(idx, ok, b, False, True, torch.bool)


def chunk_bias(idx: torch.Tensor, ok: torch.Tensor, b: int, dtype: torch.dtype) -> torch.Tensor:
    """`chunk_mask` as an additive mask of `dtype`: 0 on the selected keys, -inf elsewhere. SDPA turns
    a bool mask into this one itself on every call, the recomputed forward and the backward included;
    given it ready, it skips that `where` and its outputs and gradients are the same bit for bit."""
    return _mark_selected(idx, ok, b, float("-inf"), 0.0, dtype)


def _mark_selected(idx, ok, b, other, selected, dtype):
    """(B, H, c, b) of `dtype`: `selected` at the keys idx / ok (B, H, c, m) select, `other` elsewhere."""
    idx = idx.masked_fill(~ok, b)  # invalid picks land on a spare column b, sliced off
    out = torch.full((*idx.shape[:3], b + 1), other, dtype=dtype, device=idx.device)
    return out.scatter_(-1, idx, selected)[..., :b]


def _selected_chunk(qs, ks, vals, tau_b, lam, q, k, idx, ok, kernel):
    """Query rows qs (B, H, c) (and q (B, H, c, D)) over keys ks (B, H, b) (k (B, H, b, D)), reading
    only those idx / ok (B, H, c, m) select -> (B, H, c, Dv)."""
    return _dense_chunk(qs, ks, vals, tau_b, lam, q, k, ~chunk_mask(idx, ok, ks.shape[2]), kernel)


def _gathered_chunk(qs, ks, vals, tau_b, lam, q, k, idx, ok, kernel):
    """`_selected_chunk` without a gradient: the m selected keys of each query row gathered, so a row
    costs O(m) instead of O(b) -> (B, H, c, Dv)."""
    B, H, c, m = idx.shape
    cdt = vals.dtype
    flat = idx.reshape(B, H, c * m)

    def pick(x):  # (B, H, b[, D]) -> (B, H, c, m[, D])
        if x.dim() == 3:
            return x.gather(2, flat).view(B, H, c, m)
        return x.gather(2, flat[..., None].expand(-1, -1, -1, x.shape[-1])).view(B, H, c, m, x.shape[-1])

    x = (qs.to(cdt)[..., None] - pick(ks).to(cdt)).pow(2) / tau_b.to(cdt)[..., None]  # (B, H, c, m)
    scores = kernel_term(x, kernel)
    if lam is not None:
        scores = scores * lam.to(cdt)[..., None]
    if q is not None:
        dots = torch.einsum("bhcd,bhcmd->bhcm", q.to(cdt), pick(k).to(cdt))
        scores = scores + dots / math.sqrt(q.shape[-1])
    w = torch.softmax(scores.masked_fill(~ok, float("-inf")), dim=-1)
    return torch.einsum("bhcm,bhcmd->bhcd", w, pick(vals))


def selected_kernel_attention(qs, ks, v, tau, idx, ok, q, k, kernel: str, scalar_scale,
                              query_chunk: int) -> torch.Tensor:
    """`windowed_attention`'s selected-keys path under `kernel`: each query row reads only the keys
    idx / ok (B, H, T, m) of `window_indices`, gathered (module docstring) -> (B, H, T, Dv)."""
    from torch.utils.checkpoint import checkpoint

    B, H, T = qs.shape
    cdt = upcast(v.dtype)
    tau_b = tau_tensor(tau, B, H, T, cdt, qs.device)
    lam = None if scalar_scale is None else scalar_scale_tensor(scalar_scale, H, cdt, qs.device)
    vals = expand_heads(v, H).to(cdt)
    kk = None if k is None else expand_heads(k, H)
    grad = _needs_grad(qs, ks, v, q, k, tau, scalar_scale)
    outs = []
    for a in range(0, T, query_chunk):
        b = min(T, a + query_chunk)
        args = (qs[..., a:b], ks[..., :b], vals[:, :, :b], _per_query(tau_b, a, b), lam,
                None if q is None else q[:, :, a:b], None if kk is None else kk[:, :, :b],
                idx[:, :, a:b], ok[:, :, a:b], kernel)
        outs.append(checkpoint(_selected_chunk, *args, use_reentrant=False) if grad else _gathered_chunk(*args))
    if not outs:
        return v.new_zeros(B, H, 0, v.shape[-1])
    return torch.cat(outs, dim=2).to(v.dtype)
