"""The scalar family's argument checks and parameter handling, shared by every path (naive, fused,
chunked, Triton, windowed, approximate, FlexAttention) and by the decode caches: scalar queries and
keys, values, the temperature tau and the hybrid's gain lam as tensors of the work dtype, the kernel's
name, and each public op's options, all checked before any work; and what a keep_fn of
`windowed_attention` returns, checked as it returns it (`checked_indices`, `checked_keep`)."""

from __future__ import annotations

import math

import torch

from ...checks import (
    TRITON_IMPLS, check_finite, check_groups, check_impl, check_int, check_lengths, check_like, check_param,
    check_positive, check_same, check_tensor, check_window,
)
from ..common.args import check_causal, check_qkv
from ..common.packed import packing
from ..common.precision import upcast
from ..common.triton_route import triton_missing

__all__ = [
    "KERNELS", "check_approx", "check_heads", "check_hybrid", "check_kernel", "check_options", "check_pairing",
    "check_scalars", "check_tol", "check_values", "check_windowed", "checked_indices", "checked_keep",
    "scalar_scale_tensor", "tau_tensor",
]

KERNELS = ("gaussian", "cauchy")


def check_kernel(kernel) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")


def check_scalars(qs, ks, like=None, like_name="", causal: bool = True) -> tuple[int, int, int]:
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


def check_values(v, qs, B: int, H: int, T: int) -> None:
    """v (B, G, T, Dv) of qs's dtype and device, G dividing H, finite."""
    check_tensor("v", v, 4)
    check_like("v", v, qs, "qs")
    check_same("qs", B, "v", v.shape[0], "batch size (dim 0)")
    check_same("ks", T, "v", v.shape[2], "sequence length (dim 2)")
    check_groups(H, v.shape[1], "v")
    check_finite("v", v)


def check_hybrid(q, k, v, qs, ks, causal: bool) -> tuple[int, int, int, int]:
    """q, k, v as `check_qkv` takes them, and qs (B, H, Tq), ks (B, H, Tk) of their shapes (v: k stands
    in for it where there are no values). Returns (B, H, Tq, D)."""
    B, H, T, D = check_qkv(q, k, v, causal)
    check_scalars(qs, ks, q, "q", causal)
    if tuple(qs.shape) != (B, H, T) or ks.shape[2] != k.shape[2]:
        raise ValueError(
            f"qs must have shape (B, H, Tq) = {(B, H, T)} and ks (B, H, Tk) = {(B, H, k.shape[2])} "
            f"from q and k, got {tuple(qs.shape)} and {tuple(ks.shape)}"
        )
    return B, H, T, D


def check_pairing(q, k, scalar_scale) -> None:
    """Hybrid heads give q and k, scalar heads neither; the gain lam scales the hybrid's scalar term."""
    if (q is None) != (k is None):
        raise ValueError("q and k must be given together (hybrid) or both be None (scalar)")
    if scalar_scale is not None and q is None:
        raise ValueError("scalar_scale scales the hybrid's scalar term: give q and k with it")


def check_heads(qs, ks, v, q, k) -> tuple[int, int, int]:
    """Causal scalar heads (q, k None: qs, ks and v) or hybrid heads (q, k, v, qs, ks). Returns (B, H, Tq)."""
    if q is None:
        B, H, T = check_scalars(qs, ks)
        check_values(v, qs, B, H, ks.shape[2])
    else:
        B, H, T, _ = check_qkv(q, k, v, True)
        check_scalars(qs, ks, q, "q")
    return B, H, T


def tau_tensor(tau, B: int, H: int, T: int, dtype: torch.dtype, device) -> torch.Tensor:
    """tau (finite float, (H,) or (B, H, Tq), all > 0) as a tensor of `dtype` broadcastable to (B, H, Tq)."""
    out = check_param("tau", tau, B, H, T, torch.empty(0, dtype=dtype, device=device))
    check_positive("tau", tau)
    return out


def scalar_scale_tensor(scale, H: int, dtype, device) -> torch.Tensor:
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


def check_options(impl: str, causal, kernel, window, n_prefix) -> None:
    """The options of `scalar_attention` and `hybrid_attention`."""
    check_impl(impl, TRITON_IMPLS)
    check_causal(causal)
    check_kernel(kernel)
    check_window(window, causal)
    check_int("n_prefix", n_prefix, 0)


def check_windowed(qs, ks, v, tau, window, q, k, n_prefix, budget, query_chunk, keep_fn, local, impl, scalar_scale,
                   kernel, docs, cu_seqlens):
    """Every check of `windowed_attention`, in its order. Returns (B, H, T), the packed documents'
    index of each position's document (B, T) or None, and whether keep_fn gives its keys as indices."""
    if window is not None:
        check_int("window", window, 1)
    check_int("query_chunk", query_chunk, 1)
    check_int("n_prefix", n_prefix, 0)
    check_int("local", local, 0)
    if impl not in ("auto", "naive", "fast", "triton"):
        raise ValueError(f"impl must be 'auto', 'naive', 'fast' or 'triton', got {impl!r}")
    check_kernel(kernel)
    indexed = keep_fn is not None and callable(getattr(keep_fn, "indices", None))
    if impl in ("fast", "triton") and (budget is not None or (keep_fn is not None and not indexed)):
        raise ValueError(f"impl={impl!r} reads selected keys: it takes no budget, nor a keep_fn without indices "
                         f"(an IndexedKeep)")
    if impl == "triton" and (why := triton_missing(qs.device)) is not None:
        raise ValueError(f"impl='triton': {why}")
    if local and keep_fn is not None:
        raise ValueError(f"keep_fn replaces the window rule: give local=0, got local={local!r}")
    check_pairing(q, k, scalar_scale)
    if keep_fn is not None:
        if not callable(keep_fn):
            raise TypeError(f"keep_fn must be callable as keep_fn(a, b, logits), got {type(keep_fn).__name__}")
        if window is not None or budget is not None:
            raise ValueError(f"keep_fn replaces the window rule: give window=None and budget=None, "
                             f"got window={window!r}, budget={budget!r}")
    B, H, T = check_heads(qs, ks, v, q, k)
    check_same("qs", T, "ks", ks.shape[2], "sequence length (windowed attention runs on whole sequences)")
    tau_tensor(tau, B, H, T, upcast(qs.dtype), qs.device)
    if scalar_scale is not None:
        scalar_scale_tensor(scalar_scale, H, upcast(qs.dtype), qs.device)
    seg = None
    if docs is not None or cu_seqlens is not None:
        if n_prefix or budget is not None or keep_fn is not None:
            raise ValueError(f"packed documents (docs / cu_seqlens) take no prefix, budget or keep_fn (rules for the "
                             f"positions of one sequence), got n_prefix={n_prefix!r}, budget={budget!r}, "
                             f"keep_fn={'given' if keep_fn is not None else None}")
        seg = packing(cu_seqlens, docs, B, T, qs).seg  # (B, T): each position's document
    return (B, H, T), seg, indexed


def check_tol(tol) -> float:
    if isinstance(tol, bool) or not isinstance(tol, (int, float)):
        raise TypeError(f"tol must be a float in (0, 1), got {type(tol).__name__}")
    if not (math.isfinite(tol) and 0.0 < tol < 1.0):
        raise ValueError(f"tol must be a finite float in (0, 1), got {tol}")
    return float(tol)


def check_approx(qs, ks, v, tau, tol, block, max_window):
    """Every check of `scalar_attention_approx`. Returns (B, H, T, tol, tau broadcastable to (B, H, T))."""
    tol = check_tol(tol)
    check_int("block", block, 1)
    if max_window is not None:
        check_int("max_window", max_window, 1)
    B, H, T = check_scalars(qs, ks, causal=True)
    check_same("qs", T, "ks", ks.shape[2], "sequence length (the approximate path runs on whole sequences)")
    check_values(v, qs, B, H, T)
    tau_b = tau_tensor(tau, B, H, T, upcast(qs.dtype), qs.device)  # (1|B, 1|H, 1|T)
    return B, H, T, tol, tau_b


def checked_indices(keep_fn, B: int, H: int, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The idx / ok of a keep_fn with indices (`attnlab.index.keep.IndexedKeep`), checked for the
    selected-keys path: int64 and bool (B, H, T, m) on the op's device, every index in 0 .. T - 1 and
    a key its query sees (<= t) where ok, and at least one key per query."""
    out = keep_fn.indices()
    idx, ok = out if isinstance(out, tuple) and len(out) == 2 else (None, None)
    if not (isinstance(idx, torch.Tensor) and isinstance(ok, torch.Tensor) and idx.dtype == torch.long
            and ok.dtype == torch.bool and idx.dim() == 4 and tuple(idx.shape[:3]) == (B, H, T)
            and idx.shape == ok.shape and idx.device == ok.device == device):
        got = tuple(type(x).__name__ if not isinstance(x, torch.Tensor) else f"{x.dtype} {tuple(x.shape)}"
                    for x in (out if isinstance(out, tuple) else (out,)))
        raise ValueError(f"keep_fn.indices() must return (idx int64, ok bool), both (B, H, T, m) = ({B}, {H}, {T}, m) "
                         f"on {device}, got {got}")
    pos = torch.arange(T, device=device).view(1, 1, T, 1)
    if not bool(((idx >= 0) & (idx < T) & ((idx <= pos) | ~ok)).all()):
        raise ValueError("keep_fn.indices(): an index outside 0 .. T - 1, or a kept one after its query (> t)")
    if T and not bool(ok.any(-1).all()):  # an empty softmax would be NaN
        raise ValueError("keep_fn.indices() must keep at least one key each query sees")
    return idx, ok


def checked_keep(keep_fn, a: int, b: int, logits: torch.Tensor) -> torch.Tensor:
    """keep_fn's mask for query rows a..b-1, checked: a bool tensor of the logits' shape."""
    keep = keep_fn(a, b, logits)
    if not isinstance(keep, torch.Tensor) or keep.dtype != torch.bool or keep.shape != logits.shape:
        got = f"{keep.dtype} {tuple(keep.shape)}" if isinstance(keep, torch.Tensor) else type(keep).__name__
        raise ValueError(f"keep_fn must return a bool mask of the chunk's logits shape {tuple(logits.shape)}, got {got}")
    if not bool((keep & (logits > float("-inf"))).any(-1).all()):  # an empty softmax would be NaN
        raise ValueError(f"keep_fn must keep at least one key each query sees, for every query of rows {a}..{b - 1}")
    return keep
