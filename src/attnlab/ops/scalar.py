"""Scalar (Gaussian-kernel) attention and the hybrid dot-product + scalar score.

scalar: softmax_s(-(qs_t - ks_s)^2 / tau) v_s
hybrid: softmax_s(q_t . k_s / sqrt(d) - (qs_t - ks_s)^2 / tau) v_s

Kernel. kernel="cauchy" replaces the Gaussian weight exp(-x), x = (qs - ks)^2 / tau, by the
heavier-tailed 1 / (1 + x) (ZETA's kernel), i.e. the scalar logit -x by -log(1 + x). It has no
fused path (the logit is not a quadratic in qs - ks): impl="naive" materialises Tq x Tk and
"auto" / "fast" run query chunks (`attnlab.ops.kernel`). Both kernels fall with |qs - ks|, so
the nearest keys in scalar space are the heaviest under either, and every window and sorted
cache selects the same keys.

Fast path. -(qs - ks)^2 = -qs^2 + 2 qs ks - ks^2 and -qs^2 is constant along a softmax
row, so the score equals (up to that row constant) the dot product of augmented vectors
q' = [2 qs / tau, -1 / tau] and k' = [ks, ks^2] (hybrid: concatenated after q / sqrt(d)
and k). That runs through torch's fused SDPA kernel, never building T x T.

Precision. The expanded form cancels: with |ks| ~ 10 and tau ~ 0.01 the terms 2 qs ks / tau
and ks^2 / tau are ~1e4 while their differences along a row are O(1); in bf16 (8-bit
mantissa) that is an error of ~40 in every logit. The fast path therefore (1) subtracts a
per-(B, H) reference r from qs and ks -- the score depends only on qs - ks, so this is
exact, and r is detached because the gradient through it is identically zero -- which brings
the terms down to the scale of the key spread, and (2) forms q', k' and runs the SDPA in
float32 whenever inputs are bf16/fp16, casting the output back. Under causal masking r is
the first key ks_0, which every query sees, so no row depends on a later key even through
rounding (a mean over all keys would let a future outlier shift every row's terms);
without causal masking every key is visible and r is their mean. Remaining error is float32
rounding on terms of size max|qs - r|^2 / tau. Measured at T=257 with |ks| ~ 10, key spread
0.5, tau = 0.01, against the naive formula in float64: bf16 inputs give relative RMS error
~2.5e-3 on the output and every gradient (the bf16 rounding of the results themselves); the
unshifted expansion in bf16 gives 1.6, i.e. noise.

Memory: linear in T. Grouped values (G < H heads) are not copied to all heads: the scalar keys
are per head, so each group's key carries one 2-column slot per head of the group, and each head's
query fills only its own slot with zeros elsewhere (`_slots`): q'_h . k'_g is exactly head h's
score, and SDPA reads the G groups of values in place (enable_gqa).
"""

from __future__ import annotations

import math

import torch

from ..checks import (
    TRITON_IMPLS, check_finite, check_groups, check_impl, check_int, check_lengths, check_like, check_param, check_positive,
    check_same, check_tensor, check_window, visible_keys,
)
from ._sdpa import check_causal, check_qkv, expand_heads, fused_attention, upcast, without_autocast


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


def scalar_logits(qs, ks, tau, causal: bool = True, kernel: str = "gaussian", window: int | None = None,
                  n_prefix: int = 0) -> torch.Tensor:
    """-(qs_t - ks_s)^2 / tau_t as a (B, H, Tq, Tk) tensor, -inf where key s is hidden from query t
    (kernel="cauchy": -log(1 + (qs_t - ks_s)^2 / tau_t)).

    Materialises Tq x Tk: meant for the naive path, analysis, regularizers at small T, and scoring
    a decode window (Tq = 1, causal=False).

    Args:
        qs: scalar queries (B, H, Tq).
        ks: scalar keys (B, H, Tk), of qs's dtype and device.
        tau: temperature > 0: a float, per head (H,) or per query (B, H, Tq).
        causal: hide key s from query t when s > t + Tk - Tq (the queries are the last Tq of the
            Tk positions; needs Tq <= Tk).
        window: a causal sliding window (`checks.visible_keys`): also hide the keys before each
            query's last `window`, except the first n_prefix.
        n_prefix: with a window, the leading keys (a sink) every query still sees.

    Returns:
        The logits (B, H, Tq, Tk), in qs's dtype (float32 for 16-bit inputs).

    Raises:
        TypeError: qs, ks or tau is not a tensor (tau: nor a float) or not floating, or ks has
            another dtype than qs; causal is not a bool.
        ValueError: shapes that do not fit (qs and ks (B, H), tau's shape, Tq > Tk under causal
            masking), another device, NaN or inf in qs, ks or tau, or tau <= 0.
    """
    check_causal(causal)
    check_kernel(kernel)
    check_window(window, causal)
    B, H, T = _check_scalars(qs, ks, causal=causal)
    cdt = upcast(qs.dtype)
    tau_b = _tau(tau, B, H, T, cdt, qs.device)  # (1|B, 1|H, 1|Tq)
    logits = scalar_scores(qs, ks, tau_b, kernel)
    if not causal:
        return logits
    return logits.masked_fill(~visible_keys(T, ks.shape[2], True, qs.device, window, n_prefix), float("-inf"))


KERNELS = ("gaussian", "cauchy")


def check_kernel(kernel) -> None:
    if kernel not in KERNELS:
        raise ValueError(f"kernel must be one of {KERNELS}, got {kernel!r}")


def kernel_term(x: torch.Tensor, kernel: str = "gaussian") -> torch.Tensor:
    """The scalar logit of x = (qs - ks)^2 / tau >= 0: -x (Gaussian) or -log(1 + x) (Cauchy)."""
    return -x if kernel == "gaussian" else -torch.log1p(x)


def scalar_scores(qs, ks, tau_b, kernel: str = "gaussian", lam=None) -> torch.Tensor:
    """The formula of `scalar_logits` with no checks and no mask: qs (B, H, Tq), ks (B, H, Tk), tau_b
    a tensor broadcastable to (B, H, Tq) -> (B, H, Tq, Tk); lam (broadcastable to (B, H, Tq), any
    sign) multiplies the kernel's term. For callers whose inputs were checked once already (a
    decode cache's stored keys and its checked query)."""
    cdt = upcast(qs.dtype)
    diff = qs.to(cdt).unsqueeze(-1) - ks.to(cdt).unsqueeze(-2)  # (B, H, Tq, Tk)
    if kernel == "gaussian":
        out = -diff.pow(2) / tau_b.to(cdt).unsqueeze(-1)
    else:
        out = kernel_term(diff.pow(2) / tau_b.to(cdt).unsqueeze(-1), kernel)
    return out if lam is None else out * lam.to(cdt).unsqueeze(-1)


def hybrid_scores(q, k, qs, ks, tau_b, kernel: str = "gaussian", lam=None) -> torch.Tensor:
    """The formula of `hybrid_logits` with no checks and no mask: q (B, H, Tq, D), k (B, G, Tk, D),
    qs (B, H, Tq), ks (B, H, Tk), tau_b and lam (the scalar term's gain, or None) broadcastable
    to (B, H, Tq) -> (B, H, Tq, Tk)."""
    scal = scalar_scores(qs, ks, tau_b, kernel, lam)
    dots = q.to(scal.dtype) @ expand_heads(k, q.shape[1]).to(scal.dtype).transpose(-1, -2)
    return dots / math.sqrt(q.shape[-1]) + scal


def hybrid_logits(q, k, qs, ks, tau, causal: bool = True, scalar_scale=None, kernel: str = "gaussian",
                  window: int | None = None, n_prefix: int = 0) -> torch.Tensor:
    """q_t . k_s / sqrt(d) - lam (qs_t - ks_s)^2 / tau_t as (B, H, Tq, Tk), -inf where key s is hidden
    (kernel="cauchy": the scalar term -lam log(1 + (qs_t - ks_s)^2 / tau_t)).

    Materialises Tq x Tk (see `scalar_logits`).

    Args:
        q: vector queries (B, H, Tq, D).
        k: vector keys (B, G, Tk, D), G dividing H (GQA).
        qs: scalar queries (B, H, Tq).
        ks: scalar keys (B, H, Tk).
        tau: temperature > 0: a float, (H,) or (B, H, Tq).
        causal: hide key s from query t when s > t + Tk - Tq (needs Tq <= Tk).
        scalar_scale: lam, as `hybrid_attention` takes it; None for lam = 1.
        window: a causal sliding window, as `scalar_logits` takes it.
        n_prefix: with a window, the leading keys (a sink) every query still sees.

    Returns:
        The logits (B, H, Tq, Tk), in float32 for 16-bit inputs, else in q's dtype.

    Raises:
        TypeError: a tensor argument that is not a tensor, not floating or not of q's dtype;
            causal is not a bool.
        ValueError: shapes that do not fit q and k (batch, heads, lengths, D, groups), another
            device, NaN or inf in any input, tau <= 0, or a bad scalar_scale.
    """
    B, H, T, D = check_qkv(q, k, k, causal)  # no values here: k stands in for v's checks
    _check_scalars(qs, ks, q, "q", causal)
    if tuple(qs.shape) != (B, H, T) or ks.shape[2] != k.shape[2]:
        raise ValueError(
            f"qs must have shape (B, H, Tq) = {(B, H, T)} and ks (B, H, Tk) = {(B, H, k.shape[2])} "
            f"from q and k, got {tuple(qs.shape)} and {tuple(ks.shape)}"
        )
    scal = scalar_logits(qs, ks, tau, causal, kernel, window, n_prefix)  # (B, H, Tq, Tk)
    if scalar_scale is not None:  # hidden keys stay -inf; the product never sees them (no 0 * inf in grads)
        lam = _scalar_scale(scalar_scale, H, scal.dtype, q.device)[..., None]  # (1, H, 1, 1)
        hidden = torch.isinf(scal)
        scal = (scal.masked_fill(hidden, 0.0) * lam).masked_fill(hidden, float("-inf"))
    dots = q.to(scal.dtype) @ expand_heads(k, H).to(scal.dtype).transpose(-1, -2)
    return dots / math.sqrt(D) + scal


@without_autocast
def scalar_attention(qs, ks, v, tau, *, causal: bool = True, impl: str = "auto", kernel: str = "gaussian",
                     window: int | None = None, n_prefix: int = 0) -> torch.Tensor:
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
            ``"triton"`` runs the fused Triton kernel (`attnlab.ops.scalar_triton`: CUDA, or the CPU
            under TRITON_INTERPRET=1), which "auto" picks on CUDA when no sliding window is given.
        kernel: ``"gaussian"`` (default) or ``"cauchy"``, weight 1 / (1 + (qs_t - ks_s)^2 / tau_t)
            (module docstring): no fused SDPA path, "fast" (and "auto" off CUDA) run query chunks.
        window: a causal sliding window: each query reads only the last ``window`` keys up to it
            (itself included); None (default) for every earlier key.
        n_prefix: with a window, the first n_prefix keys (a sink) are read by every query too.

    Returns:
        (B, H, Tq, Dv) in v's dtype.

    Raises:
        TypeError: qs, ks, v or tau is not a tensor (tau: nor a float) or not floating, or ks or v
            has another dtype than qs; causal is not a bool.
        ValueError: shapes that do not fit (batch, heads, lengths, groups, tau's shape, Tq > Tk
            under causal masking), another device, NaN or inf in any input, tau <= 0, an unknown
            impl or kernel, a window that is not an int >= 1 or comes without causal masking.
    """
    check_impl(impl, TRITON_IMPLS)
    check_causal(causal)
    check_kernel(kernel)
    check_window(window, causal)
    check_int("n_prefix", n_prefix, 0)
    B, H, T = _check_scalars(qs, ks, causal=causal)
    _check_values(v, qs, B, H, ks.shape[2])
    if impl == "naive":
        w = torch.softmax(scalar_logits(qs, ks, tau, causal, kernel, window, n_prefix), dim=-1)  # (B, H, Tq, Tk)
        return (w @ expand_heads(v, H).to(w.dtype)).to(v.dtype)  # (B, H, Tq, Dv)
    if _use_triton(impl, qs.device, window):
        from .scalar_triton import triton_scalar_attention

        return triton_scalar_attention(None, None, v, qs, ks, _tau(tau, B, H, T, torch.float32, qs.device), None,
                                       kernel, causal)
    if kernel != "gaussian" or _banded(window, causal, ks.shape[2], n_prefix):
        from .kernel import chunked_kernel_attention

        _tau(tau, B, H, T, upcast(qs.dtype), qs.device)
        return chunked_kernel_attention(qs, ks, v, tau, None, None, kernel, causal, None, window=window,
                                        n_prefix=n_prefix)
    cdt = upcast(qs.dtype)
    inv_tau = 1.0 / _tau(tau, B, H, T, cdt, qs.device)  # (1|B, 1|H, 1|T)
    qa, ka = _augment(qs, ks, inv_tau, cdt, causal)  # (B, H, T, 2) each
    qa, ka = _slots(qa, ka, v.shape[1])  # (B, H, Tq, 2H/G), (B, G, Tk, 2H/G)
    return fused_attention(qa, ka, v.to(cdt), causal=causal, window=window, n_prefix=n_prefix).to(v.dtype)


@without_autocast
def hybrid_attention(q, k, v, qs, ks, tau, *, causal: bool = True, impl: str = "auto",
                     scalar_scale=None, kernel: str = "gaussian", window: int | None = None,
                     n_prefix: int = 0) -> torch.Tensor:
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

    Returns:
        (B, H, Tq, Dv) in v's dtype.

    Raises:
        TypeError: a tensor argument that is not a tensor, not floating or not of q's dtype; tau
            neither a float nor a tensor; causal is not a bool.
        ValueError: shapes that do not fit (batch, heads, lengths, D, groups, qs and ks against q
            and k, Tq > Tk under causal masking), another device, NaN or inf in any input,
            tau <= 0, a scalar_scale that is negative, not finite or not (H,), an unknown impl
            or kernel, or a bad window (as `scalar_attention`).
    """
    check_impl(impl, TRITON_IMPLS)
    check_causal(causal)
    check_kernel(kernel)
    check_window(window, causal)
    check_int("n_prefix", n_prefix, 0)
    B, H, T, D = check_qkv(q, k, v, causal)
    _check_scalars(qs, ks, q, "q", causal)
    if tuple(qs.shape) != (B, H, T) or ks.shape[2] != k.shape[2]:
        raise ValueError(
            f"qs must have shape (B, H, Tq) = {(B, H, T)} and ks (B, H, Tk) = {(B, H, k.shape[2])} "
            f"from q and k, got {tuple(qs.shape)} and {tuple(ks.shape)}"
        )
    if impl == "naive":
        w = torch.softmax(hybrid_logits(q, k, qs, ks, tau, causal, scalar_scale, kernel, window, n_prefix), dim=-1)
        return (w @ expand_heads(v, H).to(w.dtype)).to(v.dtype)  # (B, H, Tq, Dv)
    if _use_triton(impl, q.device, window):
        from .scalar_triton import triton_scalar_attention

        lam = None if scalar_scale is None else _scalar_scale(scalar_scale, H, torch.float32, q.device)
        return triton_scalar_attention(q, k, v, qs, ks, _tau(tau, B, H, T, torch.float32, q.device), lam, kernel,
                                       causal)
    if kernel != "gaussian" or _banded(window, causal, k.shape[2], n_prefix):
        from .kernel import chunked_kernel_attention

        _tau(tau, B, H, T, upcast(q.dtype), q.device)
        if scalar_scale is not None:
            _scalar_scale(scalar_scale, H, upcast(q.dtype), q.device)
        return chunked_kernel_attention(qs, ks, v, tau, q, k, kernel, causal, scalar_scale, window=window,
                                        n_prefix=n_prefix)
    cdt = upcast(q.dtype)
    inv_tau = 1.0 / _tau(tau, B, H, T, cdt, q.device)
    if scalar_scale is not None:
        inv_tau = inv_tau * _scalar_scale(scalar_scale, H, cdt, q.device)  # lam / tau: (1|B, H, 1|T)
    qa, ka = _augment(qs, ks, inv_tau, cdt, causal)  # (B, H, T, 2) each
    G = math.lcm(k.shape[1], v.shape[1])  # one grouping for keys and values
    qa, ka = _slots(qa, ka, G)  # (B, H, Tq, 2H/G), (B, G, Tk, 2H/G)
    qa = torch.cat([q.to(cdt) * (1.0 / math.sqrt(D)), qa], dim=-1)  # (B, H, T, D + 2H/G)
    ka = torch.cat([expand_heads(k, G).to(cdt), ka], dim=-1)  # (B, G, T, D + 2H/G)
    return fused_attention(qa, ka, expand_heads(v, G).to(cdt), causal=causal, window=window,
                           n_prefix=n_prefix).to(v.dtype)


def triton_missing(device: torch.device) -> str | None:
    """Why the Triton kernel cannot run on `device` (None when it can)."""
    try:
        from .scalar_triton import available
    except ImportError:
        return "Triton is not installed (pip install triton; it comes with torch's CUDA builds)"
    return available(device)


def _use_triton(impl: str, device: torch.device, window) -> bool:
    """impl="triton" (checked: a clear error where it cannot run), or "auto" on CUDA with Triton there.
    A sliding window keeps the banded path (`kernel.chunked_kernel_attention`), which the kernel lacks."""
    if impl == "triton":
        if window is not None:
            raise ValueError(f"window must be None with impl='triton' (the kernel has no sliding window; "
                             f"impl='auto' runs it banded), got {window!r}")
        reason = triton_missing(device)
        if reason is not None:
            raise ValueError(f"impl='triton' cannot run: {reason}")
        return True
    return impl == "auto" and device.type == "cuda" and window is None and triton_missing(device) is None


def _banded(window, causal: bool, Tk: int, n_prefix: int) -> bool:
    """A sliding window that hides some key: the scores are formed explicitly over each query chunk's
    band (`kernel.chunked_kernel_attention`), not by the shifted expansion, whose reference key
    (the first) a windowed query may not see: a far-past outlier there would cost every later row
    precision through a key it cannot read."""
    return causal and window is not None and window < Tk - n_prefix


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


def _augment(qs, ks, inv_tau, cdt, causal: bool, ref=None):
    """q' = [2 (qs - r) / tau, -1 / tau], k' = [ks - r, (ks - r)^2], with r per (B, H) the first
    key when causal (seen by every query) and the mean key otherwise, unless `ref` (B, H, 1)
    gives it (a decode cache keeps the first key's, so each key is augmented once).

    q'_t . k'_s = -(qs_t - ks_s)^2 / tau_t + (qs_t - r)^2 / tau_t, the second term constant
    along the row. Returns (B, H, Tq, 2) and (B, H, Tk, 2), in `cdt`.
    """
    if ref is None:
        ks_ref = ks.detach().to(cdt)
        ref = ks_ref[..., :1] if causal else ks_ref.mean(-1, keepdim=True)  # (B, H, 1)
    qc = qs.to(cdt) - ref  # (B, H, T)
    kc = ks.to(cdt) - ref
    inv_tau = inv_tau.expand_as(qc)
    qa = torch.stack([2.0 * qc * inv_tau, -inv_tau], dim=-1)  # (B, H, T, 2)
    ka = torch.stack([kc, kc * kc], dim=-1)  # (B, H, T, 2)
    return qa, ka


def _slots(qa: torch.Tensor, ka: torch.Tensor, G: int):
    """Per-head augmented vectors qa (B, H, Tq, E), ka (B, H, Tk, E) on G key/value groups:
    group g's key is [ka_h for its H/G heads h] (B, G, Tk, E H/G), and head h's query is qa_h
    in its own slot, zeros in the others, so q'_h . k'_g = qa_h . ka_h exactly (products with
    0 and 1 are exact). With G = H it returns the inputs."""
    B, H, Tq, E = qa.shape
    r = H // G
    if r == 1:
        return qa, ka
    own = torch.eye(r, dtype=qa.dtype, device=qa.device).view(1, 1, r, 1, r, 1)  # head j of a group -> slot j
    qw = (qa.view(B, G, r, Tq, 1, E) * own).reshape(B, H, Tq, r * E)
    kw = ka.view(B, G, r, ka.shape[2], E).transpose(2, 3).reshape(B, G, ka.shape[2], r * E)
    return qw, kw
