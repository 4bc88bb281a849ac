"""GOAT attention's argument checks, all before any work: q, k, v, the prior's frequencies, spectral
weights and key-only term, the optional hybrid term (qs, ks and tau together) and the options."""

from __future__ import annotations

import torch

from ...checks import TRITON_IMPLS, check_finite, check_impl, check_tensor, check_window
from ..common.args import check_causal, check_qkv
from ..common.packed import packing
from ..scalar.args import check_scalars


def check_prior(freqs, lam_sym, lam_asym, u, B: int, G: int, Tk: int, like: torch.Tensor) -> None:
    for name, x, ndim in (("freqs", freqs, 1), ("lam_sym", lam_sym, 2), ("lam_asym", lam_asym, 2), ("u", u, 3)):
        check_tensor(name, x, ndim)
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
        if x.device != like.device:
            raise ValueError(f"{name} must be on the device of q ({like.device}), got {x.device}")
    R = freqs.shape[0]
    for name, x in (("lam_sym", lam_sym), ("lam_asym", lam_asym)):
        if tuple(x.shape) != (G, R):
            raise ValueError(f"{name} must have shape (G, R) = {(G, R)} (key groups, frequencies), got {tuple(x.shape)}")
    if u.shape[0] not in (1, B) or tuple(u.shape[1:]) != (G, Tk):
        raise ValueError(f"u must have shape (B or 1, G, Tk) = ({B}, {G}, {Tk}), got {tuple(u.shape)}")
    for name, x in (("freqs", freqs), ("lam_sym", lam_sym), ("lam_asym", lam_asym), ("u", u)):
        check_finite(name, x)


def check_call(q, k, v, freqs, lam_sym, lam_asym, u, qs, ks, tau, causal, impl: str, window, cu_seqlens, docs):
    """Every check of `goat_attention`. Returns (B, H, Tq, D), the `Packing` (or None) and whether the
    hybrid term is there."""
    check_impl(impl, TRITON_IMPLS)
    check_causal(causal)
    check_window(window, causal)
    B, H, Tq, D = check_qkv(q, k, v, causal)
    G, Tk = k.shape[1], k.shape[2]
    check_prior(freqs, lam_sym, lam_asym, u, B, G, Tk, q)
    packed = packing(cu_seqlens, docs, B, Tk, q)
    scalar = qs is not None or ks is not None or tau is not None
    if scalar:
        if qs is None or ks is None or tau is None:
            raise ValueError("qs, ks and tau go together: give all three for the hybrid term, or none")
        check_scalars(qs, ks, q, "q", causal)
        if tuple(qs.shape) != (B, H, Tq) or ks.shape[2] != Tk:
            raise ValueError(
                f"qs must have shape (B, H, Tq) = {(B, H, Tq)} and ks (B, H, Tk) = {(B, H, Tk)}, "
                f"got {tuple(qs.shape)} and {tuple(ks.shape)}"
            )
    return (B, H, Tq, D), packed, scalar
