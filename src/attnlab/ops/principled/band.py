"""Principled attention's banded fast path: the formula (`naive.principled_naive`) on each query chunk
and only the keys it reads, a sliding window's band or, with packed documents, its causal prefix under a
same-document mask; each chunk recomputed in the backward pass. Memory O(chunk x (chunk + window))
per head with a window, O(chunk x Tk) with documents, never Tq x Tk."""

from __future__ import annotations

import torch

from ..common.band import chunk_spans, document_mask
from .naive import principled_naive


def principled_band(q, k, qg, kg, v, params, v0, window, causal: bool = True, docs: torch.Tensor | None = None):
    """The sliding-window fast path: `principled_naive` on each query chunk's band of keys, under
    activation checkpointing when a gradient is needed (inputs validated, heads expanded). With packed
    documents, docs (B, Tk) the run index of each key's document: each chunk reads its causal prefix
    (or band, or every key when not causal) under a same-document mask, and K counts those keys."""
    from torch.utils.checkpoint import checkpoint

    Tq, Tk = q.shape[2], k.shape[2]
    off = Tk - Tq
    grad = torch.is_grad_enabled() and any(
        isinstance(x, torch.Tensor) and x.requires_grad for x in (q, k, qg, kg, v, v0, *params.values()))
    outs, grounds = [], []
    for a, b, lo, hi in chunk_spans(Tq, Tk, causal, window):
        rows = [x[..., a:b] if x.shape[-1] > 1 else x for x in (params["alpha"], params["beta"], params["gamma"])]
        seen = None  # with documents (B, 1, b - a, hi - lo): the chunk's visible keys of its own documents
        if docs is not None:
            seen = document_mask(docs, a, b, lo, hi, off, causal, window)
        args = (q[:, :, a:b], k[:, :, lo:hi], qg[:, :, a:b], kg[:, :, lo:hi], v[:, :, lo:hi], *rows, v0, True, window,
                seen)
        o, w0 = checkpoint(principled_naive, *args, use_reentrant=False) if grad else principled_naive(*args)
        outs.append(o)
        grounds.append(w0)
    return torch.cat(outs, dim=2), torch.cat(grounds, dim=2)
