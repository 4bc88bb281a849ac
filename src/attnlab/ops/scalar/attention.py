"""scalar_attention and hybrid_attention: the arguments checked once (`args`), then `impl`, the
device and the inputs choose the path; the paths are leaves.

impl="naive" materialises the logits (`naive`); "fast" runs the fused SDPA route under the Gaussian
kernel (`fused`) and query chunks of explicit scores under the Cauchy kernel or a sliding window
(`chunked`); "triton" runs the fused Triton kernel (`triton_op`), which "auto" picks on CUDA
where Triton is installed and no sliding window is asked for, and "fast" elsewhere.

Packed documents (``cu_seqlens`` or ``docs``, `attnlab.ops.common.packed`): the Triton kernel masks other
documents and skips their tiles; the naive path masks its logits; "fast" runs the explicit-score
query chunks (`chunked`) under a same-document mask (the fused route's shift by the first key would
read a key of another document), memory O(chunk x Tk), the work of causal attention.
"""

from __future__ import annotations

import torch

from ..common.packed import packing
from ..common.precision import without_autocast
from ..common.triton_route import use_triton
from .args import check_hybrid, check_options, check_scalars, check_values, scalar_scale_tensor, tau_tensor
from .chunked import chunked_kernel_attention
from .fused import fused_hybrid_attention, fused_scalar_attention
from .naive import hybrid_naive, scalar_naive


@without_autocast
def scalar_attention(qs, ks, v, tau, *, causal: bool = True, impl: str = "auto", kernel: str = "gaussian",
                     window: int | None = None, n_prefix: int = 0, docs: torch.Tensor | None = None,
                     cu_seqlens=None) -> torch.Tensor:
    """Scalar attention o_t = sum_s softmax_s(-(qs_t - ks_s)^2 / tau_t) v_s.

    Gradients reach qs, ks, v and a tensor tau.

    Args:
        qs: scalar queries (B, H, Tq).
        ks: scalar keys (B, H, Tk).
        v: values (B, G, Tk, Dv) with H % G == 0: head h reads value group h // (H / G)
            (grouped value attention).
        tau: temperature > 0: a float, per head (H,) or per query (B, H, Tq).
        causal: hide the keys after each query. The queries are the last Tq positions, so causal
            masking needs Tq <= Tk (decode: one query against n cached keys).
        impl: ``"naive"`` materialises the (Tq, Tk) logits; ``"fast"`` and ``"auto"`` run one
            fused SDPA call on the shifted augmented vectors of the module docstring (memory
            linear in T).
            ``"triton"`` runs the fused Triton kernel (`attnlab.ops.scalar.triton_op`: CUDA, or the CPU
            under TRITON_INTERPRET=1), which "auto" picks on CUDA when no sliding window is given.
        kernel: ``"gaussian"`` (default) or ``"cauchy"``, weight 1 / (1 + (qs_t - ks_s)^2 / tau_t)
            (module docstring): no fused SDPA path, "fast" (and "auto" off CUDA) run query chunks.
        window: a causal sliding window: each query reads only the last ``window`` keys up to it
            (itself included); None (default) for every earlier key.
        n_prefix: with a window, the first n_prefix keys (a sink) are read by every query too.
        docs: packed documents: (B, Tk) integer document ids of the keys (query t is key t + Tk - Tq),
            a document being a run of equal ids; each query reads its own document's keys only (with
            a window, the first n_prefix keys too only from their document), equal to running each
            document alone. Every route takes them (module docstring).
        cu_seqlens: packed documents, flash-linear-attention's convention: an int32/int64 tensor (or
            list) of N + 1 offsets [0, ..., Tk] into one packed row (B = 1); as docs otherwise. Give
            at most one of the two.

    Returns:
        (B, H, Tq, Dv) in v's dtype.

    Raises:
        TypeError: qs, ks, v or tau is not a tensor (tau: nor a float) or not floating, or ks or v
            has another dtype than qs; causal is not a bool.
        ValueError: shapes that do not fit (batch, heads, lengths, groups, tau's shape, Tq > Tk
            under causal masking), another device, NaN or inf in any input, tau <= 0, an unknown
            impl or kernel, a window that is not an int >= 1 or comes without causal masking;
            cu_seqlens that is not an int tensor of offsets from 0 to Tk (non-decreasing) or comes
            with B != 1, docs of another shape or device, or both.
    """
    check_options(impl, causal, kernel, window, n_prefix)
    B, H, T = check_scalars(qs, ks, causal=causal)
    check_values(v, qs, B, H, ks.shape[2])
    packed = packing(cu_seqlens, docs, B, ks.shape[2], qs)
    seg = None if packed is None else packed.seg  # (B, Tk): each key's document
    if impl == "naive":
        return scalar_naive(qs, ks, v, tau, causal, kernel, window, n_prefix, packed)
    if use_triton(impl, qs.device, window):
        from .triton_op import triton_scalar_attention

        return triton_scalar_attention(None, None, v, qs, ks, tau_tensor(tau, B, H, T, torch.float32, qs.device), None,
                                       kernel, causal, docs=seg)
    if seg is not None or kernel != "gaussian" or _banded(window, causal, ks.shape[2], n_prefix):
        return chunked_kernel_attention(qs, ks, v, tau, None, None, kernel, causal, None, window=window,
                                        n_prefix=n_prefix, docs=seg)
    return fused_scalar_attention(qs, ks, v, tau, causal, window, n_prefix)


@without_autocast
def hybrid_attention(q, k, v, qs, ks, tau, *, causal: bool = True, impl: str = "auto",
                     scalar_scale=None, kernel: str = "gaussian", window: int | None = None,
                     n_prefix: int = 0, docs: torch.Tensor | None = None, cu_seqlens=None) -> torch.Tensor:
    """Hybrid attention o_t = sum_s softmax_s(q_t . k_s / sqrt(d) - lam (qs_t - ks_s)^2 / tau_t) v_s.

    As tau -> inf this is standard scaled dot-product attention. Gradients reach every tensor
    argument, a tensor tau and a tensor scalar_scale among them.

    Args:
        q: vector queries (B, H, Tq, D).
        k: vector keys (B, G, Tk, D), G dividing H (GQA).
        v: values (B, G', Tk, Dv), G' dividing H.
        qs: scalar queries (B, H, Tq).
        ks: scalar keys (B, H, Tk).
        tau: temperature > 0: a float, (H,) or (B, H, Tq).
        causal: hide the keys after each query; the queries are the last Tq positions, so causal
            masking needs Tq <= Tk.
        impl: ``"naive"`` materialises the (Tq, Tk) logits; ``"fast"`` and ``"auto"`` run one
            fused SDPA call on [q / sqrt(d), q'] . [k, k'] with the shifted scalar parts of the
            module docstring; ``"triton"`` the fused Triton kernel, as `scalar_attention` says.
        scalar_scale: lam >= 0 scaling the scalar term, a float or an (H,) tensor; None for
            lam = 1. At lam = 0 this is exactly standard attention, and the gradient of lam is
            not zero there (docs/retrofit.md: the hybrid's silent start).
        kernel: ``"gaussian"`` (default) or ``"cauchy"``: the scalar term -lam log(1 + (qs_t -
            ks_s)^2 / tau_t) (module docstring); "auto" / "fast" run query chunks.
        window: a causal sliding window, as `scalar_attention` takes it.
        n_prefix: with a window, the leading keys (a sink) every query still reads.
        docs: packed documents, as `scalar_attention` takes them.
        cu_seqlens: packed documents in one row (B = 1), as `scalar_attention` takes them.

    Returns:
        (B, H, Tq, Dv) in v's dtype.

    Raises:
        TypeError: a tensor argument that is not a tensor, not floating or not of q's dtype; tau
            neither a float nor a tensor; causal is not a bool.
        ValueError: shapes that do not fit (batch, heads, lengths, D, groups, qs and ks against q
            and k, Tq > Tk under causal masking), another device, NaN or inf in any input,
            tau <= 0, a scalar_scale that is negative, not finite or not (H,), an unknown impl
            or kernel, a bad window, or packed documents given badly (as `scalar_attention`).
    """
    check_options(impl, causal, kernel, window, n_prefix)
    B, H, T, _ = check_hybrid(q, k, v, qs, ks, causal)
    packed = packing(cu_seqlens, docs, B, k.shape[2], q)
    seg = None if packed is None else packed.seg  # (B, Tk): each key's document
    if impl == "naive":
        return hybrid_naive(q, k, v, qs, ks, tau, causal, scalar_scale, kernel, window, n_prefix, packed)
    if use_triton(impl, q.device, window):
        from .triton_op import triton_scalar_attention

        lam = None if scalar_scale is None else scalar_scale_tensor(scalar_scale, H, torch.float32, q.device)
        return triton_scalar_attention(q, k, v, qs, ks, tau_tensor(tau, B, H, T, torch.float32, q.device), lam, kernel,
                                       causal, docs=seg)
    if seg is not None or kernel != "gaussian" or _banded(window, causal, k.shape[2], n_prefix):
        return chunked_kernel_attention(qs, ks, v, tau, q, k, kernel, causal, scalar_scale, window=window,
                                        n_prefix=n_prefix, docs=seg)
    return fused_hybrid_attention(q, k, v, qs, ks, tau, causal, scalar_scale, window, n_prefix)


def _banded(window, causal: bool, Tk: int, n_prefix: int) -> bool:
    """A sliding window that hides some key: the scores are formed explicitly over each query chunk's
    band (`chunked.chunked_kernel_attention`), not by the shifted expansion, whose reference key
    (the first) a windowed query may not see: a far-past outlier there would cost every later row
    precision through a key it cannot read."""
    return causal and window is not None and window < Tk - n_prefix
