"""Principled attention's argument checks and parameter handling, all before any work: the five
tensors (q, k, gate q, gate k, v) and their groups, v0, the causal flag, impl, tile sizes and window,
and the per-query rows (c, softplus(beta), gamma) every fused path takes."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...checks import (
    TRITON_IMPLS, check_finite, check_groups, check_impl, check_like, check_same, check_tensor, check_window,
)
from ...masks import key_counts


def check_inputs(q, k, qg, kg, v):
    for name, x in (("q", q), ("k", k), ("qg", qg), ("kg", kg), ("v", v)):
        check_tensor(name, x, 4)
        check_like(name, x, q, "q")
    B, H, Tq, D = q.shape
    for name, x in (("k", k), ("qg", qg), ("kg", kg), ("v", v)):
        check_same("q", B, name, x.shape[0], "batch size (dim 0)")
    check_same("q", D, "k", k.shape[3], "head dim (dim 3)")
    check_same("q", H, "qg", qg.shape[1], "heads (dim 1)")
    check_same("q", Tq, "qg", qg.shape[2], "length (dim 2)")
    check_same("qg", qg.shape[3], "kg", kg.shape[3], "gate dim (dim 3)")
    for name, x in (("kg", kg), ("v", v)):
        check_same("k", k.shape[2], name, x.shape[2], "length (dim 2)")
    for name, x in (("k", k), ("kg", kg), ("v", v)):
        check_groups(H, x.shape[1], name)
    if Tq > 0 and k.shape[2] < 1:
        raise ValueError(f"k must hold at least one position for the Tq={Tq} queries, got shape {tuple(k.shape)}")
    for name, x in (("q", q), ("k", k), ("qg", qg), ("kg", kg), ("v", v)):
        check_finite(name, x)


def check_v0(v0, H: int, Dv: int, v: torch.Tensor) -> None:
    """v0: None, or a finite (Dv,) or (H, Dv) tensor with v's dtype and device."""
    if v0 is None:
        return
    if not isinstance(v0, torch.Tensor):
        raise TypeError(f"v0 must be a tensor of shape (Dv,) or (H, Dv), or None; got {type(v0).__name__}")
    check_like("v0", v0, v, "v")
    if not (v0.dim() == 1 and v0.shape[0] == Dv) and not (v0.dim() == 2 and tuple(v0.shape) == (H, Dv)):
        raise ValueError(f"v0 must have shape (Dv,)=({Dv},) or (H, Dv)=({H}, {Dv}), got {tuple(v0.shape)}")
    check_finite("v0", v0)


def check_call(q, k, qg, kg, v, v0, causal, impl: str, block_q, block_k, window) -> None:
    """Every check of `principled_attention` but the parameters' (`attnlab.checks.check_param`) and the
    packed documents' (`attnlab.ops.common.packed.packing`)."""
    check_impl(impl, TRITON_IMPLS)
    check_inputs(q, k, qg, kg, v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    check_window(window, causal)
    for name, n in (("block_q", block_q), ("block_k", block_k)):
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ValueError(f"{name} must be a positive int or None, got {n!r}")
    Tq, Tk = q.shape[2], k.shape[2]
    if causal and Tq > Tk:
        raise ValueError(f"causal masking needs at least as many keys as queries: q has Tq={Tq}, k has Tk={Tk}")
    check_v0(v0, q.shape[1], v.shape[3], v)


def fused_rows(params: dict, B: int, H: int, Tq: int, Tk: int, causal: bool, seg, work: torch.dtype, device):
    """(c, softplus(beta), gamma), each (B, H, Tq): c = 1 + softplus(alpha) log K the margin amplification,
    K the keys each query sees (with packed documents, seg (B, Tk), those of its own document)."""
    if seg is None:
        log_k = key_counts(Tq, Tk, causal, device, work).log()  # (Tq,)
    else:  # packed documents (the kernel's): K counts the keys of each query's own document
        from .triton_kernel import document_log_counts

        log_k = document_log_counts(seg, Tq, causal, work)  # (B, 1, Tq)
    c = (1 + F.softplus(params["alpha"]) * log_k).expand(B, H, Tq)  # margin amplification
    spb = F.softplus(params["beta"]).expand(B, H, Tq)
    gam = params["gamma"].expand(B, H, Tq)
    return c, spb, gam
