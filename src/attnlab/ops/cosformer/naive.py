"""cosFormer's naive reference: the state update and readout position by position (causal), global
sums (non-causal), and over packed documents the same restarted at each document (causal) or the
(T, T) scores masked to same-document pairs (non-causal)."""

from __future__ import annotations

import torch

from ..common.packed import Packing, document_states
from .features import readout


def cosformer_naive(qf, kf, v, kv, k_sum, causal, normalize, eps):
    """The state update and readout position by position. qf, kf (B, H, T, F), v (B, H, T, Dv)."""
    outs = []
    if causal:
        for q_t, k_t, v_t in zip(qf.unbind(2), kf.unbind(2), v.unbind(2)):
            kv = kv + k_t[..., :, None] * v_t[..., None, :]  # (B, H, F, Dv)
            k_sum = k_sum + k_t
            outs.append(readout((q_t[..., None, :] @ kv).squeeze(-2), (q_t * k_sum).sum(-1), normalize, eps))
        return torch.stack(outs, dim=2), kv, k_sum
    for k_t, v_t in zip(kf.unbind(2), v.unbind(2)):
        kv = kv + k_t[..., :, None] * v_t[..., None, :]
        k_sum = k_sum + k_t
    for q_t in qf.unbind(2):
        outs.append(readout((q_t[..., None, :] @ kv).squeeze(-2), (q_t * k_sum).sum(-1), normalize, eps))
    return torch.stack(outs, dim=2), kv, k_sum


def cosformer_naive_packed(qf, kf, v, kv, k_sum, causal, normalize, eps, packed: Packing):
    """The reference over packed documents: the causal state update with kv and k_sum restarting at
    each document's first position, or (non-causal) the (T, T) scores masked to same-document pairs.
    The state returned: each document's sums with cu_seqlens, else each row's last document's."""
    if causal:
        outs, kvs, sums = [], [], []
        for t, (q_t, k_t, v_t) in enumerate(zip(qf.unbind(2), kf.unbind(2), v.unbind(2))):
            fresh = packed.starts[:, t, None, None]  # (B, 1, 1)
            kv = torch.where(fresh[..., None], torch.zeros_like(kv), kv) + k_t[..., :, None] * v_t[..., None, :]
            k_sum = torch.where(fresh, torch.zeros_like(k_sum), k_sum) + k_t
            outs.append(readout((q_t[..., None, :] @ kv).squeeze(-2), (q_t * k_sum).sum(-1), normalize, eps))
            kvs.append(kv)
            sums.append(k_sum)
        if packed.cu is not None:
            kv = document_states(torch.stack(kvs, 2), packed.cu)
            k_sum = document_states(torch.stack(sums, 2), packed.cu)
        return torch.stack(outs, dim=2), kv, k_sum
    same = packed.same().to(qf.dtype)  # (B, 1, T, T)
    scores = (qf @ kf.transpose(-1, -2)) * same  # (B, H, T, T)
    o = readout(scores @ v, scores.sum(-1), normalize, eps)
    if packed.cu is not None:  # every document of the one row: (N, T) which positions it holds
        t = torch.arange(qf.shape[2], device=qf.device)
        w = ((packed.cu[:-1, None] <= t) & (t < packed.cu[1:, None])).to(qf.dtype)
        return o, torch.einsum("nt,htf,htd->nhfd", w, kf[0], v[0]), torch.einsum("nt,htf->nhf", w, kf[0])
    w = (packed.seg == packed.seg[:, -1:]).to(qf.dtype)  # (B, T): each row's last document
    return o, torch.einsum("bt,bhtf,bhtd->bhfd", w, kf, v), torch.einsum("bt,bhtf->bhf", w, kf)
