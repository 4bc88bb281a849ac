"""The argument checks of `gla_attention`, `ssd_attention` and their decode steps, all before any work:
q, k, v, the log-decay (<= 0: a decay factor in (0, 1]), the scale, the states, and the refusals of
packed documents (no initial state; docs never on the fla route)."""

from __future__ import annotations

import math

import torch

from ...checks import FLA_IMPLS
from ...checks import (
    check_finite, check_impl, check_like, check_positive, check_linear_qkv, check_qkv_step, check_state, check_tensor,
    assert_values, value_check_mode,
)
from ..common.packed import packing
from ..common.precision import upcast


def check_scale(scale, Dk: int) -> float:
    if scale is None:
        return 1.0 / math.sqrt(Dk)
    if isinstance(scale, bool) or not isinstance(scale, (int, float)):
        raise TypeError(f"scale must be a float or None (1/sqrt(d_k)), got {type(scale).__name__}")
    check_positive("scale", scale)
    return float(scale)


def check_log_decay(log_decay, shape: tuple, layout: str, like: torch.Tensor, like_name: str, name="log_decay") -> None:
    check_tensor(name, log_decay, len(shape))
    if tuple(log_decay.shape) != shape:
        raise ValueError(f"{name} must have shape {layout} = {shape}, got {tuple(log_decay.shape)}")
    check_like(name, log_decay, like, like_name)
    check_finite(name, log_decay)
    ld = log_decay.detach()
    mode = value_check_mode(ld) if ld.numel() else "off"
    if mode == "assert":
        assert_values((ld <= 0).all(), f"{name} must be <= 0 (checked in a compiled graph)")
    elif mode == "eager" and bool((ld > 0).any()):
        raise ValueError(
            f"{name} must be <= 0 (a decay factor exp(log_decay) in (0, 1]), got max {ld.max().item():.4g}"
        )


def check_call(q, k, v, log_decay, scale, initial_state, causal, impl, chunk_size, vector: bool, op: str,
               cu_seqlens=None, docs=None):
    """Every check of `gla_attention` (vector, per-channel decay) or `ssd_attention` (op names it in the
    messages). Returns (B, H, T, Dk, Dv), the scale as a float and the `Packing` (or None)."""
    check_impl(impl, FLA_IMPLS)
    if not causal:
        raise ValueError(f"{op} is a recurrence in time and has no non-causal form: causal must be True, got {causal!r}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    B, H, T, Dk, Dv = check_linear_qkv(q, k, v)
    if vector:
        check_log_decay(log_decay, (B, H, T, Dk), "(B, H, T, Dk)", q, "q")
    else:
        check_log_decay(log_decay, (B, H, T), "(B, H, T)", q, "q")
    if initial_state is not None:
        check_state("initial_state", initial_state, (B, H, Dk, Dv), upcast(q.dtype), q)
    scale = check_scale(scale, Dk)
    packed = packing(cu_seqlens, docs, B, T, q)
    if packed is not None and initial_state is not None:
        raise ValueError(f"initial_state must be None with packed documents (cu_seqlens or docs): every document "
                         f"starts from a zero state (continue one document from a state by calling {op} on it alone)")
    if docs is not None and impl == "fla":
        raise ValueError("impl='fla' takes packed documents as cu_seqlens (fla's varlen kernels), not docs: give "
                         "cu_seqlens for one packed row, or impl='auto' / 'fast' for docs")
    return (B, H, T, Dk, Dv), scale, packed


def check_step(q_t, k_t, v_t, log_decay_t, state, scale, vector: bool):
    """Every check of `gla_step` / `ssd_step`. Returns (B, H, Dk, Dv), the scale as a float and the
    state (zeros in the compute dtype when None)."""
    B, H, Dk, Dv = check_qkv_step(q_t, k_t, v_t)
    if vector:
        check_log_decay(log_decay_t, (B, H, Dk), "(B, H, Dk)", q_t, "q_t", "log_decay_t")
    else:
        check_log_decay(log_decay_t, (B, H), "(B, H)", q_t, "q_t", "log_decay_t")
    scale = check_scale(scale, Dk)
    dt = upcast(q_t.dtype)
    if state is None:
        state = torch.zeros(B, H, Dk, Dv, dtype=dt, device=q_t.device)
    else:
        check_state("state", state, (B, H, Dk, Dv), dt, q_t)
    return (B, H, Dk, Dv), scale, state
