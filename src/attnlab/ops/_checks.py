"""Argument validation shared by every op: errors name the argument, what it got, what it needs."""

from __future__ import annotations

from typing import Iterable, Sequence

import torch

IMPLS = ("auto", "naive", "fast")


def check_impl(impl: str) -> str:
    if impl not in IMPLS:
        raise ValueError(f"impl must be one of {IMPLS}, got {impl!r}")
    return impl


def check_choice(name: str, value, allowed: Iterable) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def check_tensor(name: str, x, ndim: int | Sequence[int]) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    dims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if x.dim() not in dims:
        raise ValueError(f"{name} must have {' or '.join(map(str, dims))} dims, got shape {tuple(x.shape)}")
    return x


def check_same(name_a: str, a: int, name_b: str, b: int, what: str) -> None:
    if a != b:
        raise ValueError(f"{name_a} and {name_b} must agree in {what}: got {a} and {b}")


def check_groups(n_heads: int, n_groups: int, name: str = "v") -> None:
    """H query/key heads read G value groups: G <= H and H % G == 0."""
    if n_groups < 1 or n_groups > n_heads or n_heads % n_groups != 0:
        raise ValueError(
            f"{name} has {n_groups} heads but the queries have {n_heads}: "
            f"the number of heads H must be divisible by the number of value groups G (G <= H)"
        )


def broadcast_param(name: str, value, B: int, H: int, T: int, like: torch.Tensor) -> torch.Tensor:
    """A float, (H,) or (B, H, T) parameter as a tensor broadcastable to (B, H, T)."""
    if isinstance(value, (int, float)):
        return torch.tensor(float(value), dtype=like.dtype, device=like.device).view(1, 1, 1)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a float or a tensor, got {type(value).__name__}")
    if value.dim() == 0:
        return value.view(1, 1, 1)
    if value.dim() == 1:
        if value.shape[0] != H:
            raise ValueError(f"{name} of shape (H,) must have H={H} entries, got shape {tuple(value.shape)}")
        return value.view(1, H, 1)
    if value.dim() == 3:
        if tuple(value.shape) != (B, H, T):
            raise ValueError(f"{name} of shape (B, H, T) must be {(B, H, T)}, got {tuple(value.shape)}")
        return value
    raise ValueError(f"{name} must be a float, (H,) or (B, H, T), got shape {tuple(value.shape)}")


def check_positive(name: str, value) -> None:
    if isinstance(value, (int, float)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    elif isinstance(value, torch.Tensor):
        if not bool((value > 0).all()):
            raise ValueError(f"{name} must be > 0 everywhere, got min {value.detach().min().item():.4g}")


def check_qkv(q, k, v) -> tuple[int, int, int, int, int]:
    """Floating (B, H, T, Dk) q and k of one shape, v (B, H, T, Dv), T >= 1: returns B, H, T, Dk, Dv."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, 4)
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    B, H, T, Dk = q.shape
    check_same("q", tuple(q.shape), "k", tuple(k.shape), "shape (B, H, T, Dk)")
    check_same("q", tuple(q.shape[:3]), "v", tuple(v.shape[:3]), "(B, H, T)")
    if T < 1:
        raise ValueError(f"q must have at least one position (T >= 1), got shape {tuple(q.shape)}")
    return B, H, T, Dk, v.shape[-1]
