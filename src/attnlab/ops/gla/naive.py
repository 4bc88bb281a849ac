"""The recurrence of GLA and SSD, S_t = diag(exp(log_decay_t)) S_{t-1} + k_t v_t^T, o_t = q_t^T S_t
(q already scaled), applied one step at a time: the reference of the chunked forms (`chunked`,
`cpu`, `fla`), and the decode step."""

from __future__ import annotations

import torch

from ..common.packed import Packing, document_states


def recurrence_step(q_t, k_t, v_t, ld_t, state):
    """One step of the recurrence; q_t already scaled. q_t, k_t (B, H, Dk), v_t (B, H, Dv),
    ld_t (B, H, Dk) or (B, H, 1), state (B, H, Dk, Dv)."""
    state = torch.exp(ld_t)[..., None] * state + k_t[..., :, None] * v_t[..., None, :]  # (B, H, Dk, Dv)
    o_t = (q_t[..., None, :] @ state).squeeze(-2)  # (B, H, Dv)
    return o_t, state


def recurrence_naive(q, k, v, log_decay, state, packed: Packing | None = None):
    """The recurrence, one step at a time. log_decay (B, H, T, Dk) or (B, H, T, 1). Packed documents:
    the state restarts from zero at each document's first step; with cu_seqlens the second result is
    every document's final state (N, H, Dk, Dv)."""
    outs, states = [], []
    for t, (q_t, k_t, v_t, ld_t) in enumerate(zip(q.unbind(2), k.unbind(2), v.unbind(2), log_decay.unbind(2))):
        if packed is not None:
            state = torch.where(packed.starts[:, t, None, None, None], torch.zeros_like(state), state)
        o_t, state = recurrence_step(q_t, k_t, v_t, ld_t, state)
        outs.append(o_t)
        if packed is not None and packed.cu is not None:
            states.append(state)
    if states:
        state = document_states(torch.stack(states, dim=2), packed.cu)
    return torch.stack(outs, dim=2), state  # (B, H, T, Dv)
