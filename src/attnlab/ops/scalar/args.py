"""The scalar family's argument checks and parameter handling, shared by every path (naive, fused,
chunked, Triton, windowed, approximate, FlexAttention): scalar queries and keys, values, the temperature
tau and the hybrid's gain lam as tensors of the work dtype, and the kernel's name."""

from __future__ import annotations

import math

import torch

from ...checks import (
    check_finite, check_groups, check_lengths, check_like, check_param, check_positive, check_same, check_tensor,
)

__all__ = ["KERNELS", "check_kernel"]


def _check_scalars(qs, ks, like=None, like_name="", causal: bool = True) -> tuple[int, int, int]:
    """qs (B, H, Tq), ks (B, H, Tk): finite floating tensors (of the dtype of `like` if given),
    Tq <= Tk under causal masking. Returns (B, H, Tq)."""
    check_tensor("qs", qs, 3)
    check_tensor("ks", ks, 3)
    ref, ref_name = (qs, "qs") if like is None else (like, like_name)
    check_like("qs", qs, ref, ref_name)
    check_like("ks", ks, ref, ref_name)
    if ks.shape[:2] != qs.shape[:2]:
        raise ValueError(f"ks must have the (B, H) of qs = {tuple(qs.shape[:2])}, got shape {tuple(ks.shape)}")
    check_lengths(qs.shape[2], ks.shape[2], causal, "qs", "ks")
    check_finite("qs", qs)
    check_finite("ks", ks)
    return tuple(qs.shape)


def _tau(tau, B: int, H: int, T: int, dtype: torch.dtype, device) -> torch.Tensor:
    """tau (finite float, (H,) or (B, H, Tq), all > 0) as a tensor of `dtype` broadcastable to (B, H, Tq)."""
    out = check_param("tau", tau, B, H, T, torch.empty(0, dtype=dtype, device=device))
    check_positive("tau", tau)
    return out


KERNELS = ("gaussian", "cauchy")


def check_kernel(kernel) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")


def _scalar_scale(scale, H: int, dtype, device) -> torch.Tensor:
    """The hybrid's scalar-term scale lam (a float >= 0 or an (H,) tensor) as (1, H, 1)."""
    if isinstance(scale, torch.Tensor):
        if tuple(scale.shape) != (H,) or not scale.is_floating_point():
            raise ValueError(f"scalar_scale must be a float or a floating (H,) = ({H},) tensor, got shape "
                             f"{tuple(scale.shape)} dtype {scale.dtype}")
        check_finite("scalar_scale", scale)
        return scale.to(dtype=dtype, device=device)[None, :, None]
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 <= scale < math.inf:
        raise ValueError(f"scalar_scale must be a finite float >= 0 or an (H,) tensor, got {scale!r}")
    return torch.full((1, H, 1), float(scale), dtype=dtype, device=device)


def _check_values(v, qs, B: int, H: int, T: int) -> None:
    check_tensor("v", v, 4)
    check_like("v", v, qs, "qs")
    check_same("qs", B, "v", v.shape[0], "batch size (dim 0)")
    check_same("ks", T, "v", v.shape[2], "sequence length (dim 2)")
    check_groups(H, v.shape[1], "v")
    check_finite("v", v)
