"""Torch's fused attention kernels, reached with every shape they need.

``F.scaled_dot_product_attention`` takes its fused (flash) CPU kernel only when q, k and v
share one head dimension, carry no mask that needs a gradient, and k/v heads either match
q's or are a GQA divisor of them; otherwise it falls back to an unfused math path that
materialises T x T. `fused_attention` brings the augmented queries/keys of the scalar, hybrid,
GOAT and key-norm-scaled ops into that shape; `packed_attention` adds a same-document mask;
`flex_call` runs FlexAttention (compiled on CUDA) at any head width.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...masks import visible_keys
from .band import band_keys, band_mask, band_spans, chunk_spans, document_mask
from .heads import expand_heads
from .precision import LOW_PRECISION


def sdpa_width(width: int, device: torch.device) -> int:
    """The head width to pad an SDPA call to: on CUDA a multiple of 8, which the fused backends
    (flash, memory-efficient, cuDNN) need; the math backend they would otherwise fall to
    materialises T x T. Zero columns are exact (`fused_attention`)."""
    return -(-width // 8) * 8 if device.type == "cuda" else width


def fused_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool, scale: float = 1.0,
    window: int | None = None, n_prefix: int = 0, width: int | None = None,
) -> torch.Tensor:
    """softmax(scale * q k^T, causally masked if asked) v through the fused kernel.

    q (B, H, Tq, E); k (B, Gk, Tk, E); v (B, Gv, Tk, Dv) with Gk, Gv dividing H and Tq <= Tk
    under causal masking: the queries are the last Tq positions (one decode query sees every
    key; SDPA's own is_causal would align them with the first keys instead).
    Zero columns appended to q/k add nothing to any score, and zero columns appended to v
    are sliced off the output, so padding to one head width is exact. Returns (B, H, Tq, Dv).

    window (causal only): each query sees only the last `window` keys up to it, and the first
    `n_prefix` keys always; it runs as query chunks of `band.BAND_CHUNK` rows over their band of keys
    under a bool mask (no gradient: the kernel stays fused), memory O(Tq x (chunk + window)).

    width: the head width to pad q, k and v to (at least max(E, Dv)); None for `sdpa_width`'s.
    """
    H, E, Dv = q.shape[1], q.shape[-1], v.shape[-1]
    if k.shape[1] != v.shape[1]:  # SDPA wants one grouping of k and v: the coarsest that refines both
        G = math.lcm(k.shape[1], v.shape[1])
        k, v = expand_heads(k, G), expand_heads(v, G)
    width = max(E, Dv, width or sdpa_width(max(E, Dv), q.device))
    if E < width:
        q = F.pad(q, (0, width - E))  # (B, H, T, width)
        k = F.pad(k, (0, width - E))
    if Dv < width:
        v = F.pad(v, (0, width - Dv))
    Tq, Tk = q.shape[2], k.shape[2]
    masked = Tq != Tk or (causal and window is not None)
    if q.is_cuda and k.shape[1] != H and (masked or q.dtype not in LOW_PRECISION):
        # only flash (16-bit, no mask) takes enable_gqa on CUDA; memory-efficient and cuDNN need every head
        k, v = expand_heads(k, H), expand_heads(v, H)
    gqa = k.shape[1] != H
    if causal and window is not None and window < Tk - n_prefix:  # some key lies outside some window
        outs = []
        for a, b, lo, hi in band_spans(Tq, Tk, window, n_prefix=n_prefix):
            mask = band_mask(a, b, lo, hi, Tk - Tq, window, n_prefix, q.device)
            outs.append(F.scaled_dot_product_attention(
                q[:, :, a:b], band_keys(k, lo, hi, n_prefix), band_keys(v, lo, hi, n_prefix), attn_mask=mask,
                scale=float(scale), enable_gqa=gqa))  # (B, H, b - a, width)
        out = torch.cat(outs, dim=2) if outs else q.new_zeros(*q.shape[:3], width)
        return out[..., :Dv] if Dv < width else out
    mask = None
    if causal and Tq != Tk:  # bottom-right alignment: a bool mask (no grad) keeps the fused kernel
        mask = visible_keys(Tq, Tk, True, q.device) if Tq > 1 else None
        causal = False
    out = F.scaled_dot_product_attention(
        q, k, v, attn_mask=mask, is_causal=causal, scale=float(scale), enable_gqa=gqa
    )  # (B, H, Tq, width)
    return out[..., :Dv] if Dv < width else out


def packed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seg: torch.Tensor, *, causal: bool,
                     scale: float, window: int | None = None) -> torch.Tensor:
    """softmax(scale * q k^T) v over packed documents: query t (the last Tq of the Tk positions) reads
    the keys of its own document only (seg (B, Tk): the document index of each key, `packed.Packing`),
    up to itself under `causal`, its last `window` with a sliding window. q (B, H, Tq, E), k (B, Gk,
    Tk, E), v (B, Gv, Tk, Dv), Gk and Gv dividing H. Returns (B, H, Tq, Dv); every query reads at least
    itself under causal masking (non-causal: its document), so no row is empty.

    On CUDA one FlexAttention call whose block mask is built from seg on the device (blocks of other
    documents skipped; no host sync, no T x T matrix). Elsewhere query chunks of `band.BAND_CHUNK` rows, each
    one fused SDPA call over its band of keys (the causal prefix, or the window's band) under a bool
    mask of same-document pairs: memory O(chunk x band), the work of causal attention."""
    H, E, Dv = q.shape[1], q.shape[-1], v.shape[-1]
    Tq, Tk = q.shape[2], k.shape[2]
    off = Tk - Tq
    if k.shape[1] != v.shape[1]:
        G = math.lcm(k.shape[1], v.shape[1])
        k, v = expand_heads(k, G), expand_heads(v, G)
    gqa = k.shape[1] != H
    if q.is_cuda:
        from torch.nn.attention.flex_attention import create_block_mask

        def same_document(b, h, t, s):
            keep = seg[b, s] == seg[b, t + off]
            if causal:
                keep = keep & (s <= t + off)
            if window is not None:
                keep = keep & (s > t + off - window)
            return keep

        mask = create_block_mask(same_document, B=q.shape[0], H=None, Q_LEN=Tq, KV_LEN=Tk, device=q.device)
        return flex_call(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa)
    width = max(E, Dv)
    if E < width:
        q, k = F.pad(q, (0, width - E)), F.pad(k, (0, width - E))
    if Dv < width:
        v = F.pad(v, (0, width - Dv))
    outs = []
    for a, b, lo, hi in chunk_spans(Tq, Tk, causal, window):
        mask = document_mask(seg, a, b, lo, hi, off, causal, window)  # (B, 1, b - a, hi - lo)
        outs.append(F.scaled_dot_product_attention(q[:, :, a:b], k[:, :, lo:hi], v[:, :, lo:hi], attn_mask=mask,
                                                   scale=float(scale), enable_gqa=gqa))  # (B, H, b - a, width)
    out = torch.cat(outs, dim=2) if outs else q.new_zeros(*q.shape[:3], width)
    return out[..., :Dv] if Dv < width else out


_FLEX = []


def _compiled_flex():
    """flex_attention compiled once (its fused kernel; the eager form is a reference implementation)."""
    if not _FLEX:
        from torch.nn.attention.flex_attention import flex_attention

        _FLEX.append(torch.compile(flex_attention, dynamic=False))
    return _FLEX[0]


FLEX_MIN_WIDTH = 16  # FlexAttention's smallest head width, for q/k and for v alike (torch 2.11 on CUDA refuses less)


def flex_call(q, k, v, *, block_mask, score_mod=None, scale=None, enable_gqa: bool = False) -> torch.Tensor:
    """flex_attention, compiled on CUDA, eager elsewhere; q/k or v narrower than FLEX_MIN_WIDTH zero-padded
    to it (a zero column adds nothing to q.k; the scale stays that of the true width) and the output's
    padding sliced off."""
    from torch.nn.attention.flex_attention import flex_attention

    E, Dv = q.shape[-1], v.shape[-1]
    if scale is None:
        scale = 1.0 / math.sqrt(E)
    if E < FLEX_MIN_WIDTH:
        q, k = F.pad(q, (0, FLEX_MIN_WIDTH - E)), F.pad(k, (0, FLEX_MIN_WIDTH - E))
    if Dv < FLEX_MIN_WIDTH:
        v = F.pad(v, (0, FLEX_MIN_WIDTH - Dv))
    fn = _compiled_flex() if q.device.type == "cuda" else flex_attention
    out = fn(q, k, v, score_mod=score_mod, block_mask=block_mask, scale=float(scale), enable_gqa=enable_gqa)
    return out[..., :Dv] if Dv < out.shape[-1] else out
