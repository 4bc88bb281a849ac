"""Principled attention (docs/mechanisms.md#principled-attention; R. Vermillion, "Principled
Attention"): gated logits, a learned ground state and log K margin amplification, with a tiled
fast path whose memory is linear in T.

`principled_attention` checks its arguments and routes: the naive reference (`naive`), the Triton
kernel on CUDA (`triton_kernel`), the compiled CPU kernel (csrc/principled.cpp through ops/_ext.py)
or the tiled PyTorch path (`tiled`, whose docstring states the online algorithm every fast path
shares).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ...checks import (
    check_finite, check_groups, check_impl, check_like, check_param, check_same, check_tensor, empty_result,
)
from ...checks import TRITON_IMPLS, check_window
from ...masks import key_counts, visible_keys
from .. import _ext
from .._packed import packing
from .naive import principled_band, principled_naive
from .tiled import _PrincipledTiled, _block_sizes
from ..scalar.attention import _use_triton


def _check_inputs(q, k, qg, kg, v):
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


def _check_v0(v0, H: int, Dv: int, v: torch.Tensor) -> None:
    """v0: None, or a finite (Dv,) or (H, Dv) tensor with v's dtype and device."""
    if v0 is None:
        return
    if not isinstance(v0, torch.Tensor):
        raise TypeError(f"v0 must be a tensor of shape (Dv,) or (H, Dv), or None; got {type(v0).__name__}")
    check_like("v0", v0, v, "v")
    if not (v0.dim() == 1 and v0.shape[0] == Dv) and not (v0.dim() == 2 and tuple(v0.shape) == (H, Dv)):
        raise ValueError(f"v0 must have shape (Dv,)=({Dv},) or (H, Dv)=({H}, {Dv}), got {tuple(v0.shape)}")
    check_finite("v0", v0)


def _heads(x: torch.Tensor, H: int) -> torch.Tensor:
    """(B, G, T, D) -> (B, H, T, D): head h reads group h // (H / G)."""
    B, G, T, D = x.shape
    if G == H:
        return x
    return x[:, :, None].expand(B, G, H // G, T, D).reshape(B, H, T, D)


def principled_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    qg: torch.Tensor,
    kg: torch.Tensor,
    v: torch.Tensor,
    *,
    alpha,
    beta,
    gamma,
    v0: torch.Tensor | None = None,
    causal: bool = True,
    impl: str = "auto",
    return_ground: bool = False,
    block_q: int | None = None,
    block_k: int | None = None,
    window: int | None = None,
    docs: torch.Tensor | None = None,
    cu_seqlens=None,
):
    """Principled attention: semantic scores s = q.k/sqrt(d), suppress-only gates from qg.kg,
    a ground state v0 with relevance threshold gamma, and log K margin amplification.

    As alpha, beta, gamma -> -inf this is standard scaled softmax attention. Low-precision inputs
    (fp16, bf16) are computed in float32 and the outputs cast back.

    Args:
        q: queries (B, H, Tq, D).
        k: keys (B, G, Tk, D); each of G, Gg, Gv divides H (head h reads group h // (H / G)).
        qg: gate queries (B, H, Tq, Dg).
        kg: gate keys (B, Gg, Tk, Dg).
        v: values (B, Gv, Tk, Dv).
        alpha: the margin amplification's parameter: a float, (H,) or per query (B, H, Tq).
        beta: the gate's strength, in the same forms.
        gamma: the relevance threshold, in the same forms.
        v0: the ground value (Dv,) or (H, Dv), of v's dtype; None for zeros.
        causal: query t sees keys 0 .. t + Tk - Tq (needs Tq <= Tk) and K = t + 1 + Tk - Tq.
        impl: ``"fast"`` tiles queries and keys in block_q x block_k blocks and never builds a
            Tq x Tk matrix (on the CPU the fused compiled kernel when it is available); ``"naive"``
            does; ``"triton"`` runs the fused Triton kernel (`principled.triton_kernel`: CUDA, or the CPU
            under TRITON_INTERPRET=1; no sliding window); ``"auto"`` is ``"triton"`` on CUDA when
            Triton is installed and there is no window, else ``"fast"``.
        return_ground: also return the ground weight w0.
        block_q: queries per tile, an int >= 1; None for the default (128 in the compiled
            kernel; in the PyTorch fallback a size that holds about 2M scores over all heads).
        block_k: keys per tile, an int >= 1; None for 128 (compiled kernel) or 256 (fallback).
        window: a causal sliding window: query t sees only its last ``window`` keys (itself
            included) and K counts them; None (default) for every earlier key. The fast path then
            runs the formula over query chunks and their band of keys (`_sdpa.band_spans`), each
            recomputed in the backward pass: memory O(chunk x (chunk + window)) per head.
        docs: packed documents: (B, Tk) integer document ids of the keys (query t is key t + Tk - Tq),
            a document being a run of equal ids; each query reads its own document's keys only and K
            counts those, equal to running each document alone. The Triton kernel masks other
            documents and skips their tiles; the naive path masks its scores; "fast" off the kernel
            runs the naive formula over query chunks of its causal prefix (or window band) under a
            same-document mask, recomputed in the backward pass: memory O(chunk x Tk) per head, the
            work of causal attention (the compiled CPU kernel and the tiled fallback take no documents).
        cu_seqlens: packed documents, flash-linear-attention's convention: an int32/int64 tensor (or
            list) of N + 1 offsets [0, ..., Tk] into one packed row (B = 1); as docs otherwise. Give at
            most one of the two.

    Returns:
        o (B, H, Tq, Dv) in q's dtype; with return_ground, (o, w0) with w0 (B, H, Tq).

    Raises:
        TypeError: a tensor argument that is not a tensor, not floating or not of q's dtype (v0:
            of v's); alpha, beta or gamma neither a float nor a floating tensor; causal not a bool.
        ValueError: shapes that do not fit (batch, heads, lengths, D, Dg, groups, v0, the
            parameters' forms, Tq > Tk under causal masking), another device, NaN or inf in any
            input, a block size that is not a positive int, an unknown impl, a window that is
            not an int >= 1 or comes without causal masking, cu_seqlens that is not an int tensor of
            offsets from 0 to Tk (non-decreasing) or comes with B != 1, docs of another shape or
            device, or both.
    """
    check_impl(impl, TRITON_IMPLS)
    _check_inputs(q, k, qg, kg, v)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    check_window(window, causal)
    for name, n in (("block_q", block_q), ("block_k", block_k)):
        if n is not None and (not isinstance(n, int) or n < 1):
            raise ValueError(f"{name} must be a positive int or None, got {n!r}")
    B, H, Tq, _ = q.shape
    Tk, Dv = k.shape[2], v.shape[3]
    if causal and Tq > Tk:
        raise ValueError(f"causal masking needs at least as many keys as queries: q has Tq={Tq}, k has Tk={Tk}")
    _check_v0(v0, H, Dv, v)
    out_dtype = q.dtype
    triton = _use_triton(impl, q.device, window)
    packed = packing(cu_seqlens, docs, B, Tk, q)
    seg = None if packed is None else packed.seg  # (B, Tk): each key's document
    given = (q, k, qg, kg, v)  # the kernel's products run in the inputs' dtype
    work = torch.float32 if q.dtype in (torch.float16, torch.bfloat16) else q.dtype
    q, k, qg, kg, v = (x.to(work) for x in (q, k, qg, kg, v))
    params = {
        name: check_param(name, value, B, H, Tq, q)
        for name, value in (("alpha", alpha), ("beta", beta), ("gamma", gamma))
    }
    if v0 is not None:
        v0 = v0.to(work).view(-1, Dv)  # (1 | H, Dv)
    if Tq == 0:
        tensors = (q, k, qg, kg, v, *params.values()) + ((v0,) if v0 is not None else ())
        o, w0 = empty_result((B, H, 0, Dv), *tensors), empty_result((B, H, 0), *tensors)
        return (o.to(out_dtype), w0.to(out_dtype)) if return_ground else o.to(out_dtype)

    if impl == "naive":
        k, kg, v = _heads(k, H), _heads(kg, H), _heads(v, H)
        seen = None if packed is None else visible_keys(Tq, Tk, causal, q.device, window) & packed.same(Tq)
        o, w0 = principled_naive(q, k, qg, kg, v, params["alpha"], params["beta"], params["gamma"], v0, causal, window,
                                 seen)
    elif seg is not None and not triton:
        o, w0 = principled_band(q, _heads(k, H), qg, _heads(kg, H), _heads(v, H), params, v0, window, causal, seg)
    elif window is not None and window < Tk:
        o, w0 = principled_band(q, _heads(k, H), qg, _heads(kg, H), _heads(v, H), params, v0, window)
    else:
        if seg is None:
            log_k = key_counts(Tq, Tk, causal, q.device, work).log()  # (Tq,)
        else:  # packed documents (the kernel's): K counts the keys of each query's own document
            from .triton_kernel import document_log_counts

            log_k = document_log_counts(seg, Tq, causal, work)  # (B, 1, Tq)
        c = (1 + F.softplus(params["alpha"]) * log_k).expand(B, H, Tq)  # margin amplification
        spb = F.softplus(params["beta"]).expand(B, H, Tq)
        gam = params["gamma"].expand(B, H, Tq)
        if triton:
            from .triton_kernel import triton_principled

            o, w0 = triton_principled(*given, c, spb, gam, causal, seg)
        elif _ext.usable(q):  # the fused kernel reads grouped k, kg, v in place
            o, w0 = _ext.principled(q, k, qg, kg, v, c, spb, gam, causal, block_q, block_k)
        else:
            k, kg, v = _heads(k, H), _heads(kg, H), _heads(v, H)
            flat = [x.reshape(B * H, x.shape[2], x.shape[3]) for x in (q, k, qg, kg, v)]
            rows = [x.reshape(B * H, Tq) for x in (c, spb, gam)]
            ok, w0 = _PrincipledTiled.apply(*flat, *rows, causal, *_block_sizes(B * H, block_q, block_k))
            o, w0 = ok.view(B, H, Tq, Dv), w0.view(B, H, Tq)
        if v0 is not None:
            o = o + w0[..., None] * v0[:, None, :]
    o = o.to(out_dtype)
    return (o, w0.to(out_dtype)) if return_ground else o
