"""GOAT attention on the scalar family's fused Triton kernel: its product carries the prior's columns
and its key-only bias the term u. Imports the kernel only when called."""

from __future__ import annotations

import math

import torch

from ..common.heads import expand_heads
from ..scalar.args import tau_tensor
from .prior import phases


def goat_triton(q, k, v, freqs, lam_sym, lam_asym, u, qs, ks, tau, causal: bool, docs=None) -> torch.Tensor:
    """GOAT through the scalar family's Triton kernel (`attnlab.ops.scalar.triton_op`), checked inputs: the
    spectral prior as 2R columns appended to q / sqrt(d) and k in the inputs' dtype (its terms are of the
    size of its weights, so 16-bit columns cost it only their rounding), the key-only term u as a float32
    bias per key, the hybrid term (if any) in float32."""
    from ..scalar.triton_op import triton_scalar_attention

    B, H, Tq, D = q.shape
    G, Tk = k.shape[1], k.shape[2]
    cos_q, sin_q = phases(freqs, Tk - Tq, Tq, torch.float32)  # (Tq, R)
    cos_k, sin_k = phases(freqs, 0, Tk, torch.float32)  # (Tk, R)
    a = expand_heads(lam_sym.float()[None, :, None, :], H)  # (1, H, 1, R)
    b = expand_heads(lam_asym.float()[None, :, None, :], H)
    prior_q = torch.cat([a * cos_q + b * sin_q, a * sin_q - b * cos_q], dim=-1)  # (1, H, Tq, 2R)
    qa = torch.cat([q * (1.0 / math.sqrt(D)), prior_q.to(q.dtype).expand(B, H, Tq, -1)], dim=-1)
    ka = torch.cat([k, torch.cat([cos_k, sin_k], dim=-1).to(k.dtype).expand(B, G, Tk, -1)], dim=-1)
    tau_b = None if qs is None else tau_tensor(tau, B, H, Tq, torch.float32, q.device)
    return triton_scalar_attention(qa, ka, v, qs, ks, tau_b, None, None if qs is None else "gaussian", causal,
                                   sm_scale=1.0, u=expand_heads(u.float(), H), docs=docs)
