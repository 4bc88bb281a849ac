"""Routing dot-product-shaped attention through torch's fused SDPA kernel.

``F.scaled_dot_product_attention`` takes its fused (flash) CPU kernel only when q, k and v
share one head dimension, carry no mask that needs a gradient, and k/v heads either match
q's or are a GQA divisor of them; otherwise it silently falls back to an unfused math path
that is several times slower and materialises T x T. The helpers here bring the augmented
queries/keys of the scalar, hybrid and key-norm-scaled ops into that shape.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..checks import check_finite, check_groups, check_lengths, check_like, check_same, check_tensor, visible_keys

LOW_PRECISION = (torch.bfloat16, torch.float16)


def upcast(dtype: torch.dtype) -> torch.dtype:
    """The dtype in which to compute scores: float32 for bf16/fp16, else unchanged."""
    return torch.float32 if dtype in LOW_PRECISION else dtype


def expand_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, G, T, D) -> (B, n, T, D) for n a multiple of G: copy i reads group i // (n // G)."""
    G = x.shape[1]
    if G == n_heads:
        return x
    return x.repeat_interleave(n_heads // G, dim=1)


def fused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float = 1.0
) -> torch.Tensor:
    """softmax(scale * q k^T, causally masked if asked) v through the fused kernel.

    q (B, H, Tq, E); k (B, Gk, Tk, E); v (B, Gv, Tk, Dv) with Gk, Gv dividing H and Tq <= Tk
    under causal masking: the queries are the last Tq positions (one decode query sees every
    key; SDPA's own is_causal would align them with the first keys instead).
    Zero columns appended to q/k add nothing to any score, and zero columns appended to v
    are sliced off the output, so padding to one head width is exact. Returns (B, H, Tq, Dv).
    """
    H, E, Dv = q.shape[1], q.shape[-1], v.shape[-1]
    if k.shape[1] != v.shape[1]:  # SDPA wants one grouping of k and v: the coarsest that refines both
        G = math.lcm(k.shape[1], v.shape[1])
        k, v = expand_heads(k, G), expand_heads(v, G)
    width = max(E, Dv)
    if E < width:
        q = F.pad(q, (0, width - E))  # (B, H, T, width)
        k = F.pad(k, (0, width - E))
    if Dv < width:
        v = F.pad(v, (0, width - Dv))
    Tq, Tk = q.shape[2], k.shape[2]
    mask = None
    if causal and Tq != Tk:  # bottom-right alignment: a bool mask (no grad) keeps the fused kernel
        mask = visible_keys(Tq, Tk, True, q.device) if Tq > 1 else None
        causal = False
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=float(scale), enable_gqa=k.shape[1] != H
    )  # (B, H, Tq, width)
    return out[..., :Dv] if Dv < width else out


def check_qkv(q, k, v, causal: bool = True) -> tuple[int, int, int, int]:
    """Validate finite q (B, H, Tq, D), k (B, Gk, Tk, D), v (B, Gv, Tk, Dv) of one dtype and
    device, Tq <= Tk under causal masking; return (B, H, Tq, D)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, 4)
        check_like(name, x, q, "q")
    B, H, T, D = q.shape
    for name, x in (("k", k), ("v", v)):
        check_same("q", B, name, x.shape[0], "batch size (dim 0)")
    check_same("k", k.shape[2], "v", v.shape[2], "sequence length (dim 2)")
    check_lengths(T, k.shape[2], causal)
    check_same("q", D, "k", k.shape[3], "head dimension (dim 3)")
    check_groups(H, k.shape[1], "k")
    check_groups(H, v.shape[1], "v")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_finite(name, x)
    return B, H, T, D


def check_causal(causal) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
