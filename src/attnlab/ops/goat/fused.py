"""GOAT attention's fused path: the whole score as one dot product of augmented vectors, run as one
fused SDPA call (memory linear in T; the module docstring of `attnlab.ops.goat.attention` derives the
columns): [q / sqrt(d), a cos wi + b sin wi, a sin wi - b cos wi, 1] . [k, cos wj, sin wj, u_j], and
the hybrid term's shifted scalar columns (`attnlab.ops.scalar.fused.augment`) after them."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...masks import visible_keys
from ..common.heads import expand_heads
from ..common.packed import Packing
from ..common.precision import upcast
from ..common.sdpa import fused_attention
from ..scalar.args import tau_tensor
from ..scalar.fused import augment
from .prior import phases


def goat_fused(q, k, v, freqs, lam_sym, lam_asym, u, qs, ks, tau, causal: bool, window,
               packed: Packing | None = None) -> torch.Tensor:
    """`goat_attention`'s fast path on checked inputs (qs, ks, tau None without the hybrid term) ->
    (B, H, Tq, Dv) in v's dtype. Packed documents: one masked SDPA call over every head."""
    B, H, Tq, D = q.shape
    G, Tk = k.shape[1], k.shape[2]
    cdt = upcast(q.dtype)
    cos_q, sin_q = phases(freqs, Tk - Tq, Tq, cdt)  # (Tq, R)
    cos_k, sin_k = phases(freqs, 0, Tk, cdt)  # (Tk, R)
    a = expand_heads(lam_sym.to(cdt)[None, :, None, :], H)  # (1, H, 1, R)
    b = expand_heads(lam_asym.to(cdt)[None, :, None, :], H)
    qa = torch.cat([
        q.to(cdt) * (1.0 / math.sqrt(D)),
        (a * cos_q + b * sin_q).expand(B, H, Tq, -1),
        (a * sin_q - b * cos_q).expand(B, H, Tq, -1),
        q.new_ones(B, H, Tq, 1, dtype=cdt),
    ], dim=-1)  # (B, H, Tq, D + 2R + 1)
    ka = torch.cat([
        k.to(cdt),
        torch.cat([cos_k, sin_k], dim=-1).expand(B, G, Tk, -1),
        u.to(cdt).expand(B, G, Tk)[..., None],
    ], dim=-1)  # (B, G, Tk, D + 2R + 1)
    if qs is not None:
        inv_tau = 1.0 / tau_tensor(tau, B, H, Tq, cdt, q.device)
        sq, sk = augment(qs, ks, inv_tau, cdt, causal)  # (B, H, Tq, 2), (B, H, Tk, 2)
        qa = torch.cat([qa, sq], dim=-1)
        ka = torch.cat([expand_heads(ka, H), sk], dim=-1)  # the scalar keys are per head
    if packed is not None:  # one masked call: each query's own document, causal and windowed as asked
        keep = packed.same(Tq)
        if causal:
            keep = keep & visible_keys(Tq, Tk, True, q.device, window)
        return F.scaled_dot_product_attention(qa, expand_heads(ka, H), expand_heads(v.to(cdt), H), attn_mask=keep,
                                              scale=1.0).to(v.dtype)
    return fused_attention(qa, ka, v.to(cdt), causal=causal, window=window).to(v.dtype)
