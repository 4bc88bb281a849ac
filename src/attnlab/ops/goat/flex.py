"""GOAT attention through FlexAttention: the generated kernel the GOAT Triton kernel is compared with
(`benchmarks/gpu_paths.py`). The prior log pi_ij = sum_r [a_r cos(w_r (i - j)) + b_r sin(w_r (i - j))] + u_j
(`prior.goat_prior`) is a `score_mod` over the captured spectral weights and key terms; causality is a block
mask. On the CPU FlexAttention runs its reference form and has no backward, so the tests compare forwards
there and the GPU check compares every gradient. Arguments are checked as `goat_attention` checks them
(no hybrid term, window or packing here); the router does not pick this path."""

from __future__ import annotations

import torch

from ..common.args import check_qkv
from ..common.heads import expand_heads
from ..common.sdpa import flex_call
from .args import check_prior

__all__ = ["flex_goat_attention"]


def flex_goat_attention(q, k, v, freqs, lam_sym, lam_asym, u) -> torch.Tensor:
    """Causal GOAT attention of q (B, H, T, D), k (B, G, T, D), v (B, G', T, Dv), freqs (R,), lam_sym and
    lam_asym (G, R), u (B or 1, G, T) through FlexAttention -> (B, H, T, Dv) in v's dtype."""
    from torch.nn.attention.flex_attention import create_block_mask

    B, H, T, _ = check_qkv(q, k, v, True)
    G = k.shape[1]
    check_prior(freqs, lam_sym, lam_asym, u, B, G, k.shape[2], q)
    if T == 0:
        return v.new_zeros(B, H, 0, v.shape[-1])
    work = torch.float64 if q.dtype == torch.float64 else torch.float32
    w, a, b_, uu = (x.to(work) for x in (freqs, lam_sym, lam_asym, u))
    per_group = H // G
    ub = uu.shape[0]
    # the prior's offset term per group and offset i - j in -(T - 1) .. T - 1 (the masked ones too: FlexAttention
    # may score them), built once: one read per score, and each tensor the score reads indexed once (its
    # backward cannot take a tensor indexed twice)
    phase = w[:, None] * torch.arange(-(T - 1), T, device=q.device, dtype=work)[None, :]  # (R, 2T - 1)
    table = a @ torch.cos(phase) + b_ @ torch.sin(phase)  # (G, 2T - 1)

    def score_mod(score, b, h, i, j):
        g = h // per_group
        return score + uu[b if ub > 1 else 0, g, j] + table[g, i - j + (T - 1)]

    gqa = G != H or v.shape[1] != H
    if gqa and G != v.shape[1]:  # FlexAttention groups k and v alike
        k, v, gqa = expand_heads(k, H), expand_heads(v, H), False
    mask = create_block_mask(lambda b, h, i, j: i >= j, None, None, T, T, device=q.device)
    return flex_call(q, k, v, score_mod=score_mod, block_mask=mask, enable_gqa=gqa).to(v.dtype)
