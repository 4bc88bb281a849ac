"""Scalar (Gaussian-kernel) attention and the hybrid dot-product + scalar score.

scalar: softmax_s(-(qs_t - ks_s)^2 / tau) v_s
hybrid: softmax_s(q_t . k_s / sqrt(d) - (qs_t - ks_s)^2 / tau) v_s

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

Memory: linear in T. When v (or k) has fewer heads than qs, it is repeated to H heads for
the kernel, since the augmented keys are per head.
"""

from __future__ import annotations

import math

import torch

from ._checks import check_finite, check_groups, check_impl, check_like, check_param, check_positive, check_same, check_tensor
from ._sdpa import check_causal, check_qkv, expand_heads, fused_attention, upcast


def _check_scalars(qs, ks, like=None, like_name="") -> tuple[int, int, int]:
    """qs, ks: finite (B, H, T) floating tensors of one shape (and the dtype of `like` if given)."""
    check_tensor("qs", qs, 3)
    check_tensor("ks", ks, 3)
    ref, ref_name = (qs, "qs") if like is None else (like, like_name)
    check_like("qs", qs, ref, ref_name)
    check_like("ks", ks, ref, ref_name)
    if ks.shape != qs.shape:
        raise ValueError(f"ks must have the shape of qs (B, H, T) = {tuple(qs.shape)}, got {tuple(ks.shape)}")
    check_finite("qs", qs)
    check_finite("ks", ks)
    return tuple(qs.shape)


def _tau(tau, B: int, H: int, T: int, dtype: torch.dtype, device) -> torch.Tensor:
    """tau (finite float, (H,) or (B, H, T), all > 0) as a tensor of `dtype` broadcastable to (B, H, T)."""
    out = check_param("tau", tau, B, H, T, torch.empty(0, dtype=dtype, device=device))
    check_positive("tau", tau)
    return out


def _causal_mask(logits: torch.Tensor, causal: bool) -> torch.Tensor:
    if not causal:
        return logits
    T = logits.shape[-1]
    future = torch.ones(T, T, dtype=torch.bool, device=logits.device).triu(1)
    return logits.masked_fill(future, float("-inf"))


def scalar_logits(qs, ks, tau, causal: bool = True) -> torch.Tensor:
    """-(qs_t - ks_s)^2 / tau_t as a (B, H, T, T) tensor, -inf at s > t when causal.

    Materialises T x T: meant for analysis and regularizers at small T.
    """
    check_causal(causal)
    B, H, T = _check_scalars(qs, ks)
    tau_b = _tau(tau, B, H, T, qs.dtype, qs.device)  # (1|B, 1|H, 1|T)
    diff = qs.unsqueeze(-1) - ks.unsqueeze(-2)  # (B, H, T, T)
    return _causal_mask(-diff.pow(2) / tau_b.unsqueeze(-1), causal)


def hybrid_logits(q, k, qs, ks, tau, causal: bool = True) -> torch.Tensor:
    """q_t . k_s / sqrt(d) - (qs_t - ks_s)^2 / tau_t as (B, H, T, T), -inf at s > t when causal.

    k may have G heads dividing H (GQA). Materialises T x T: for analysis at small T.
    """
    B, H, T, D = check_qkv(q, k, k)  # no values here: k stands in for v's checks
    _check_scalars(qs, ks, q, "q")
    if tuple(qs.shape) != (B, H, T):
        raise ValueError(f"qs must have shape (B, H, T) = {(B, H, T)} from q, got {tuple(qs.shape)}")
    dots = q @ expand_heads(k, H).transpose(-1, -2) / math.sqrt(D)  # (B, H, T, T)
    return dots + scalar_logits(qs, ks, tau, causal)


def scalar_attention(qs, ks, v, tau, *, causal: bool = True, impl: str = "auto") -> torch.Tensor:
    """Scalar attention o_t = sum_s softmax_s(-(qs_t - ks_s)^2 / tau_t) v_s.

    qs, ks (B, H, T); v (B, G, T, Dv) with H % G == 0: head h reads value group h // (H / G)
    (grouped value attention). tau > 0: a float, per head (H,) or per query (B, H, T).
    Returns (B, H, T, Dv) in v's dtype; gradients reach qs, ks, v and a tensor tau.

    impl: "naive" materialises the (T, T) logits; "fast"/"auto" runs one fused SDPA call on
    the shifted augmented vectors described in the module docstring (memory linear in T).
    """
    check_impl(impl)
    check_causal(causal)
    B, H, T = _check_scalars(qs, ks)
    _check_values(v, qs, B, H, T)
    if impl == "naive":
        w = torch.softmax(scalar_logits(qs, ks, tau, causal), dim=-1)  # (B, H, T, T)
        return (w @ expand_heads(v, H).to(w.dtype)).to(v.dtype)  # (B, H, T, Dv)
    cdt = upcast(qs.dtype)
    inv_tau = 1.0 / _tau(tau, B, H, T, cdt, qs.device)  # (1|B, 1|H, 1|T)
    qa, ka = _augment(qs, ks, inv_tau, cdt, causal)  # (B, H, T, 2) each
    return fused_attention(qa, ka, v.to(cdt), causal=causal).to(v.dtype)


def hybrid_attention(q, k, v, qs, ks, tau, *, causal: bool = True, impl: str = "auto") -> torch.Tensor:
    """Hybrid attention o_t = sum_s softmax_s(q_t . k_s / sqrt(d) - (qs_t - ks_s)^2 / tau_t) v_s.

    q (B, H, T, D); k (B, G, T, D), v (B, G', T, Dv) with G, G' dividing H (GQA);
    qs, ks (B, H, T); tau > 0: a float, (H,) or (B, H, T). Returns (B, H, T, Dv) in v's dtype.
    As tau -> inf this is standard scaled dot-product attention.

    impl: "naive" materialises the (T, T) logits; "fast"/"auto" runs one fused SDPA call on
    [q / sqrt(d), q'] . [k, k'] with the shifted scalar parts of the module docstring.
    """
    check_impl(impl)
    check_causal(causal)
    B, H, T, D = check_qkv(q, k, v)
    _check_scalars(qs, ks, q, "q")
    if tuple(qs.shape) != (B, H, T):
        raise ValueError(f"qs must have shape (B, H, T) = {(B, H, T)} from q, got {tuple(qs.shape)}")
    if impl == "naive":
        w = torch.softmax(hybrid_logits(q, k, qs, ks, tau, causal), dim=-1)  # (B, H, T, T)
        return (w @ expand_heads(v, H).to(w.dtype)).to(v.dtype)  # (B, H, T, Dv)
    cdt = upcast(q.dtype)
    inv_tau = 1.0 / _tau(tau, B, H, T, cdt, q.device)
    qa, ka = _augment(qs, ks, inv_tau, cdt, causal)  # (B, H, T, 2) each
    qa = torch.cat([q.to(cdt) * (1.0 / math.sqrt(D)), qa], dim=-1)  # (B, H, T, D + 2)
    ka = torch.cat([expand_heads(k, H).to(cdt), ka], dim=-1)  # (B, H, T, D + 2)
    return fused_attention(qa, ka, v.to(cdt), causal=causal).to(v.dtype)


def _check_values(v, qs, B: int, H: int, T: int) -> None:
    check_tensor("v", v, 4)
    check_like("v", v, qs, "qs")
    check_same("qs", B, "v", v.shape[0], "batch size (dim 0)")
    check_same("qs", T, "v", v.shape[2], "sequence length (dim 2)")
    check_groups(H, v.shape[1], "v")
    check_finite("v", v)


def _augment(qs, ks, inv_tau, cdt, causal: bool):
    """q' = [2 (qs - r) / tau, -1 / tau], k' = [ks - r, (ks - r)^2], with r per (B, H) the first
    key when causal (seen by every query) and the mean key otherwise.

    q'_t . k'_s = -(qs_t - ks_s)^2 / tau_t + (qs_t - r)^2 / tau_t, the second term constant
    along the row. Returns (B, H, T, 2) each, in `cdt`.
    """
    ks_ref = ks.detach().to(cdt)
    ref = ks_ref[..., :1] if causal else ks_ref.mean(-1, keepdim=True)  # (B, H, 1)
    qc = qs.to(cdt) - ref  # (B, H, T)
    kc = ks.to(cdt) - ref
    inv_tau = inv_tau.expand_as(qc)
    qa = torch.stack([2.0 * qc * inv_tau, -inv_tau], dim=-1)  # (B, H, T, 2)
    ka = torch.stack([kc, kc * kc], dim=-1)  # (B, H, T, 2)
    return qa, ka
