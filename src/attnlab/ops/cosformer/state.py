"""The state cosFormer carries between calls and into its decode steps, and its check."""

from __future__ import annotations

from typing import NamedTuple

import torch

from ...checks import check_state
from ..common.precision import upcast


class CosformerState(NamedTuple):
    """State of cosformer_attention after ``offset`` positions.

    F = 2 Dk with reweighting (cos channels then sin channels), Dk without. kv and k_sum are in the
    compute dtype (float32 for 16-bit inputs).

    Attributes:
        kv: (B, H, F, Dv), the sum of phi(k_j) v_j^T.
        k_sum: (B, H, F), the sum of phi(k_j) (the normaliser).
        offset: the position of the next token.
        max_len: the horizon M; None without reweighting.
    """

    kv: torch.Tensor
    k_sum: torch.Tensor
    offset: int
    max_len: int | None


def check_cosformer_state(state, B: int, H: int, F: int, Dv: int, name: str, like: torch.Tensor) -> None:
    """A CosformerState of these sizes (F = 2 Dk with reweighting, Dk without), finite, in the compute dtype."""
    if not isinstance(state, CosformerState):
        raise TypeError(f"{name} must be a CosformerState or None, got {type(state).__name__}")
    dt = upcast(like.dtype)
    check_state(f"{name}.kv", state.kv, (B, H, F, Dv), dt, like)
    check_state(f"{name}.k_sum", state.k_sum, (B, H, F), dt, like)
    if isinstance(state.offset, bool) or not isinstance(state.offset, int) or state.offset < 0:
        raise ValueError(f"{name}.offset must be a non-negative int, got {state.offset!r}")
