"""Principled attention (docs/mechanisms.md#principled-attention; R. Vermillion, "Principled
Attention"): gated logits, a learned ground state and log K margin amplification, with fast paths
whose memory is linear in T.

`principled_attention` checks its arguments (`args`) and chooses: the naive reference (`naive`), the
banded path for a sliding window or packed documents off the kernel (`band`), the Triton kernel on
CUDA (`triton_kernel`), the compiled CPU kernel (`cpu`) or the tiled PyTorch path (`tiled`, whose
docstring states the online algorithm every fused path shares).
"""

from __future__ import annotations

import torch

from ...checks import check_param, empty_result
from ...masks import visible_keys
from .._ext import usable
from ..common.heads import broadcast_heads
from ..common.packed import packing
from ..common.triton_route import use_triton
from .args import check_call, fused_rows
from .band import principled_band
from .cpu import principled_cpu
from .naive import principled_naive
from .tiled import principled_tiled


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
            runs the formula over query chunks and their band of keys (`attnlab.ops.common.band`), each
            recomputed in the backward pass (`band`): memory O(chunk x (chunk + window)) per head.
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
    check_call(q, k, qg, kg, v, v0, causal, impl, block_q, block_k, window)
    B, H, Tq, _ = q.shape
    Tk, Dv = k.shape[2], v.shape[3]
    out_dtype = q.dtype
    triton = use_triton(impl, q.device, window)
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
        seen = None if packed is None else visible_keys(Tq, Tk, causal, q.device, window) & packed.same(Tq)
        k, kg, v = broadcast_heads(k, H), broadcast_heads(kg, H), broadcast_heads(v, H)
        o, w0 = principled_naive(q, k, qg, kg, v, params["alpha"], params["beta"], params["gamma"], v0, causal, window,
                                 seen)
    elif (seg is not None and not triton) or (window is not None and window < Tk):
        k, kg, v = broadcast_heads(k, H), broadcast_heads(kg, H), broadcast_heads(v, H)
        o, w0 = principled_band(q, k, qg, kg, v, params, v0, window, causal, seg)
    else:
        c, spb, gam = fused_rows(params, B, H, Tq, Tk, causal, seg, work, q.device)
        if triton:
            from .triton_kernel import triton_principled

            o, w0 = triton_principled(*given, c, spb, gam, causal, seg)
        elif usable(q):  # the fused kernel reads grouped k, kg, v in place
            o, w0 = principled_cpu(q, k, qg, kg, v, c, spb, gam, causal, block_q, block_k)
        else:
            o, w0 = principled_tiled(q, k, qg, kg, v, c, spb, gam, causal, block_q, block_k)
        if v0 is not None:
            o = o + w0[..., None] * v0[:, None, :]
    o = o.to(out_dtype)
    return (o, w0.to(out_dtype)) if return_ground else o
