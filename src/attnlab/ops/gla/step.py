"""One decode step of `gla_attention` / `ssd_attention`: the recurrence (`naive.recurrence_step`) on the
state so far."""

from __future__ import annotations

import torch

from ..common.precision import upcast
from .args import check_step
from .naive import recurrence_step


def _step_public(q_t, k_t, v_t, log_decay_t, state, scale, vector):
    _, scale, state = check_step(q_t, k_t, v_t, log_decay_t, state, scale, vector)
    dt = upcast(q_t.dtype)
    ld = log_decay_t.to(dt) if vector else log_decay_t.to(dt)[..., None]
    o_t, state = recurrence_step(q_t.to(dt) * scale, k_t.to(dt), v_t.to(dt), ld, state)
    return o_t.to(q_t.dtype), state


def gla_step(q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, log_decay_t: torch.Tensor,
             state: torch.Tensor | None = None, *, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of gla_attention.

    Args:
        q_t: the token's query (B, H, Dk).
        k_t: its key (B, H, Dk).
        v_t: its value (B, H, Dv).
        log_decay_t: its log decay per key channel (B, H, Dk), finite and <= 0.
        state: the state so far (B, H, Dk, Dv), in the compute dtype; None for zeros.
        scale: a float > 0 multiplying q_t; None for 1/sqrt(Dk).

    Returns:
        o_t (B, H, Dv) in q_t's dtype, and the new state (B, H, Dk, Dv).

    Raises:
        TypeError: a tensor argument that is not a tensor, not floating or not of q_t's dtype (the
            state: not in the compute dtype); scale is not a float.
        ValueError: shapes that do not fit, another device, NaN or inf, log_decay_t > 0, or
            scale <= 0.
    """
    return _step_public(q_t, k_t, v_t, log_decay_t, state, scale, True)


def ssd_step(q_t: torch.Tensor, k_t: torch.Tensor, v_t: torch.Tensor, log_decay_t: torch.Tensor,
             state: torch.Tensor | None = None, *, scale: float | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """One decode step of ssd_attention: `gla_step` with one decay per head.

    Args:
        log_decay_t: each head's log decay at this step (B, H), finite and <= 0.
        q_t: the token's query (B, H, Dk).
        k_t: its key (B, H, Dk).
        v_t: its value (B, H, Dv).
        state: the state so far (B, H, Dk, Dv), in the compute dtype; None for zeros.
        scale: a float > 0 multiplying q_t; None for 1/sqrt(Dk) (1.0 for the plain Mamba-2
            readout).

    Returns:
        o_t (B, H, Dv) in q_t's dtype, and the new state (B, H, Dk, Dv).

    Raises:
        TypeError: as `gla_step`.
        ValueError: as `gla_step`, with log_decay_t of shape (B, H).
    """
    return _step_public(q_t, k_t, v_t, log_decay_t, state, scale, False)
