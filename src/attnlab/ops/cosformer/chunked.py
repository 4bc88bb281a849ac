"""cosFormer's fast path: the chunked form of linear attention (`attnlab.ops.gla.chunked`, no decay)
under causal masking, global sums without it; memory linear in T."""

from __future__ import annotations

import torch

from ..common.packed import Packing
from ..gla.chunked import chunked_linear_attention
from .features import readout


def cosformer_chunked(qf, kf, v, kv, k_sum, causal, normalize, eps, chunk_size, packed: Packing | None = None):
    """Chunked (causal) or global-sum (non-causal) form; the normaliser rides along as an extra value column of ones.
    Packed documents: the chunked form with the state reset at each document's start; non-causal, a
    causal pass plus one over the reversed row (each document's later keys) less the diagonal."""
    Dv = v.shape[-1]
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # (B, H, T, Dv + 1)
    state = torch.cat([kv, k_sum[..., None]], dim=-1)  # (B, H, F, Dv + 1)
    if packed is not None:
        o1, final = chunked_linear_attention(qf, kf, v1, None, state, chunk_size, packed.starts, packed.cu)
        if not causal:  # each document's later keys: the causal form over the reversed row
            back, _ = chunked_linear_attention(qf.flip(2), kf.flip(2), v1.flip(2), None, state, chunk_size,
                                               packed.ends.flip(1))
            o1 = o1 + back.flip(2) - (qf * kf).sum(-1, keepdim=True) * v1  # the diagonal was counted twice
        state = final
    elif causal:
        o1, state = chunked_linear_attention(qf, kf, v1, None, state, chunk_size)  # (B, H, T, Dv + 1)
    else:
        state = state + kf.transpose(-1, -2) @ v1
        o1 = qf @ state
    return readout(o1[..., :Dv], o1[..., Dv], normalize, eps), state[..., :Dv], state[..., Dv]
