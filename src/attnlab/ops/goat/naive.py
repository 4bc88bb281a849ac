"""GOAT attention's naive reference: the (Tq, Tk) scores q . k / sqrt(d) plus the explicit log-prior
(`prior.goat_prior`) and the hybrid term's logits (`attnlab.ops.scalar.naive.scalar_logits`), masked,
softmax, times v."""

from __future__ import annotations

import math

import torch

from ..common.heads import expand_heads
from ..common.packed import Packing
from ..common.precision import upcast
from ..scalar.naive import scalar_logits
from .prior import goat_prior


def goat_naive(q, k, v, freqs, lam_sym, lam_asym, u, qs, ks, tau, causal: bool, window,
               packed: Packing | None = None) -> torch.Tensor:
    """`goat_attention` materialising its (B, H, Tq, Tk) scores, on checked inputs (qs, ks, tau None
    without the hybrid term) -> (B, H, Tq, Dv) in v's dtype."""
    B, H, Tq, D = q.shape
    cdt = upcast(q.dtype)
    scores = q.to(cdt) @ expand_heads(k, H).to(cdt).transpose(-1, -2) / math.sqrt(D)  # (B, H, Tq, Tk)
    scores = scores + expand_heads(goat_prior(freqs, lam_sym, lam_asym, u, Tq, causal, window), H)
    if qs is not None:
        scores = scores + scalar_logits(qs, ks, tau, causal, window=window)
    if packed is not None:
        scores = scores.masked_fill(~packed.same(Tq), float("-inf"))
    w = torch.softmax(scores, dim=-1)
    return (w @ expand_heads(v, H).to(w.dtype)).to(v.dtype)  # (B, H, Tq, Dv)
