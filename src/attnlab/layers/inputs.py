"""The checks of what a layer is called with: its input tensor and a call's start position."""

from __future__ import annotations

import torch

from ..checks import check_finite


def check_layer_input(x, d_model: int, dtype: torch.dtype, name: str = "x") -> None:
    """x: a finite floating (B, T, d_model) tensor in the layer's parameters' dtype (any float dtype
    under torch.autocast, which casts at each projection); TypeError or ValueError naming `name`."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor (B, T, d_model={d_model}), got {type(x).__name__}")
    if x.dim() != 3 or x.shape[-1] != d_model:
        raise ValueError(f"{name} must be (B, T, d_model={d_model}), got {tuple(x.shape)}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor ({dtype}, the layer's dtype), got {x.dtype}")
    if x.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
        raise TypeError(
            f"{name} must have the layer's dtype {dtype} (cast it or the layer, or run under torch.autocast), "
            f"got {x.dtype}"
        )
    check_finite(name, x)


def check_start(start_pos) -> None:
    """start_pos, the absolute position of a call's first token, must be an int >= 0
    (ValueError naming it otherwise)."""
    if isinstance(start_pos, torch.Tensor) and start_pos.dim() == 2 and not start_pos.is_floating_point():
        return  # every token's position (B, T): packed documents, from `forward(x, docs=...)`
    if isinstance(start_pos, bool) or not isinstance(start_pos, int) or start_pos < 0:
        raise ValueError(f"start_pos must be an int >= 0, got {start_pos!r}")
