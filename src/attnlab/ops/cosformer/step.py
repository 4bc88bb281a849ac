"""One causal decode step of cosFormer (`attention.cosformer_attention`'s recurrence at one position):
`cosformer_step` checks and carries a CosformerState; `step_update` is its arithmetic on checked
inputs, which a static decoder calls with a position tensor."""

from __future__ import annotations

import torch

from ...checks import check_positive, check_qkv_step
from ..common.precision import upcast
from .args import resolve_horizon
from .features import features, readout
from .state import CosformerState, check_cosformer_state

__all__ = ["cosformer_step", "step_update"]


def cosformer_step(
    q_t: torch.Tensor,
    k_t: torch.Tensor,
    v_t: torch.Tensor,
    state: CosformerState | None = None,
    *,
    max_len: int | None = None,
    normalize: bool = True,
    reweight: bool = True,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, CosformerState]:
    """One causal decode step of cosformer_attention at position state.offset (0 without a state).

    Args:
        q_t: the token's query (B, H, Dk).
        k_t: its key (B, H, Dk).
        v_t: its value (B, H, Dv).
        state: the CosformerState so far; None for the first token.
        max_len: the horizon M; required with reweighting when state is None, else the state's
            (a given value must agree with it).
        normalize: divide by the cosFormer normaliser (+ eps), as `cosformer_attention`.
        reweight: apply the cos reweighting, as `cosformer_attention`.
        eps: added to the normaliser, > 0 (read only with normalize).

    Returns:
        o_t (B, H, Dv) in q_t's dtype, and the new CosformerState (offset + 1).

    Raises:
        TypeError: q_t, k_t or v_t is not a tensor, not floating or not of q_t's dtype; state is
            not a CosformerState (or its tensors not in the compute dtype).
        ValueError: shapes that do not fit, another device, NaN or inf, eps <= 0, a missing,
            disagreeing or too small max_len, or a state without horizon under reweighting.
    """
    B, H, Dk, Dv = check_qkv_step(q_t, k_t, v_t)
    if normalize:
        check_positive("eps", eps)
    F = 2 * Dk if reweight else Dk
    if state is not None:
        check_cosformer_state(state, B, H, F, Dv, "state", q_t)
    offset = 0 if state is None else state.offset
    M = resolve_horizon(max_len, reweight, state, offset, 1, default_T=False)

    dt = upcast(q_t.dtype)
    if state is None:
        kv, k_sum = q_t.new_zeros(B, H, F, Dv, dtype=dt), q_t.new_zeros(B, H, F, dtype=dt)
    else:
        kv, k_sum = state.kv, state.k_sum
    o_t, kv, k_sum = step_update(q_t, k_t, v_t, kv, k_sum, offset, M, normalize, eps)
    return o_t, CosformerState(kv, k_sum, offset + 1, M)


def step_update(q_t, k_t, v_t, kv, k_sum, offset, max_len, normalize: bool, eps: float = 1e-6):
    """The step's arithmetic on checked inputs: q_t, k_t (B, H, Dk), v_t (B, H, Dv), the state's kv
    and k_sum at position offset (an int, or a 0-d tensor: a static decoder's position) ->
    (o_t in q_t's dtype, kv, k_sum). `cosformer_step` checks and calls it."""
    dt = kv.dtype
    qf = features(q_t.to(dt)[..., None, :], offset, max_len)[..., 0, :]  # (B, H, F)
    kf = features(k_t.to(dt)[..., None, :], offset, max_len)[..., 0, :]
    kv = kv + kf[..., :, None] * v_t.to(dt)[..., None, :]  # (B, H, F, Dv)
    k_sum = k_sum + kf
    o_t = readout((qf[..., None, :] @ kv).squeeze(-2), (qf * k_sum).sum(-1), normalize, eps)
    return o_t.to(q_t.dtype), kv, k_sum
