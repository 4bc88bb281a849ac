"""Softmax attention's argument checks, all before any work: q, k, v, the options, the packed documents
and the scaling (a name of `SCALES` or a float, and pnorm's exponent)."""

from __future__ import annotations

import math

from ...checks import check_choice, check_impl, check_positive, check_window
from ..common.args import check_causal, check_qkv
from ..common.packed import packing

SCALES = ("sqrt_d", "ktotal", "kmean", "krms", "pnorm", "n_sqrt_d")


def check_call(q, k, v, causal, scale, p, impl: str, window, cu_seqlens, docs):
    """Every check of `softmax_attention`. Returns the `Packing` of the documents (or None)."""
    check_impl(impl)
    check_causal(causal)
    check_window(window, causal)
    B, H, T, D = check_qkv(q, k, v, causal)
    packed = packing(cu_seqlens, docs, B, k.shape[2], q)
    if isinstance(scale, str):
        check_choice("scale", scale, SCALES)
    elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
        check_positive("scale", float(scale))
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
    else:
        raise TypeError(f"scale must be one of {SCALES} or a float, got {type(scale).__name__}")
    if scale == "pnorm":
        if isinstance(p, bool) or not isinstance(p, (int, float)):
            raise TypeError(f"p must be a float, got {type(p).__name__}")
        check_positive("p", float(p))
    return packed
