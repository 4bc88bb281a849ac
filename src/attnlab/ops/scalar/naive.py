"""Scalar attention and the hybrid dot-product + scalar score: the formula and its naive reference.

scalar: softmax_s(-(qs_t - ks_s)^2 / tau) v_s
hybrid: softmax_s(q_t . k_s / sqrt(d) - (qs_t - ks_s)^2 / tau) v_s

The reference: the masked logits (`scalar_logits`, `hybrid_logits`, on the score of `scores`) and the
softmax over them that `scalar_attention` and `hybrid_attention` run with impl="naive"
(`scalar_naive`, `hybrid_naive`). Every fast path of the family (`fused`, `chunked`, `triton_kernel`,
`selected`, `approx`) is tested against them; the family's argument checks are in `args`.

Kernel. kernel="cauchy" replaces the Gaussian weight exp(-x), x = (qs - ks)^2 / tau, by the
heavier-tailed 1 / (1 + x) (ZETA's kernel), i.e. the scalar logit -x by -log(1 + x). It has no
fused path (the logit is not a quadratic in qs - ks): impl="naive" materialises Tq x Tk and
"auto" / "fast" run query chunks (`chunked`). Both kernels fall with |qs - ks|, so
the nearest keys in scalar space are the heaviest under either, and every window and sorted
cache selects the same keys.
"""

from __future__ import annotations

import math

import torch

from ...checks import check_window
from ...masks import visible_keys
from ..common.args import check_causal
from ..common.heads import expand_heads
from ..common.packed import Packing
from ..common.precision import upcast
from .args import check_hybrid, check_kernel, check_scalars, scalar_scale_tensor, tau_tensor
from .scores import scalar_scores


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
        window: a causal sliding window (`masks.visible_keys`): also hide the keys before each
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
    B, H, T = check_scalars(qs, ks, causal=causal)
    cdt = upcast(qs.dtype)
    tau_b = tau_tensor(tau, B, H, T, cdt, qs.device)  # (1|B, 1|H, 1|Tq)
    logits = scalar_scores(qs, ks, tau_b, kernel)
    if not causal:
        return logits
    return logits.masked_fill(~visible_keys(T, ks.shape[2], True, qs.device, window, n_prefix), float("-inf"))


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
    B, H, T, D = check_hybrid(q, k, k, qs, ks, causal)  # no values here: k stands in for v's checks
    scal = scalar_logits(qs, ks, tau, causal, kernel, window, n_prefix)  # (B, H, Tq, Tk)
    if scalar_scale is not None:  # hidden keys stay -inf; the product never sees them (no 0 * inf in grads)
        lam = scalar_scale_tensor(scalar_scale, H, scal.dtype, q.device)[..., None]  # (1, H, 1, 1)
        hidden = torch.isinf(scal)
        scal = (scal.masked_fill(hidden, 0.0) * lam).masked_fill(hidden, float("-inf"))
    dots = q.to(scal.dtype) @ expand_heads(k, H).to(scal.dtype).transpose(-1, -2)
    return dots / math.sqrt(D) + scal


def scalar_naive(qs, ks, v, tau, causal: bool, kernel: str, window, n_prefix: int,
                 packed: Packing | None = None) -> torch.Tensor:
    """`scalar_attention` materialising its (B, H, Tq, Tk) logits (checked inputs; packed documents
    hide the keys of other documents) -> (B, H, Tq, Dv) in v's dtype."""
    return _attend(scalar_logits(qs, ks, tau, causal, kernel, window, n_prefix), v, packed)


def hybrid_naive(q, k, v, qs, ks, tau, causal: bool, scalar_scale, kernel: str, window, n_prefix: int,
                 packed: Packing | None = None) -> torch.Tensor:
    """`hybrid_attention` materialising its (B, H, Tq, Tk) logits, as `scalar_naive`."""
    return _attend(hybrid_logits(q, k, qs, ks, tau, causal, scalar_scale, kernel, window, n_prefix), v, packed)


def _attend(logits: torch.Tensor, v: torch.Tensor, packed: Packing | None) -> torch.Tensor:
    """softmax over keys of logits (B, H, Tq, Tk), times v (B, G, Tk, Dv) -> (B, H, Tq, Dv) in v's dtype."""
    if packed is not None:
        logits = logits.masked_fill(~packed.same(logits.shape[2]), float("-inf"))
    w = torch.softmax(logits, dim=-1)
    return (w @ expand_heads(v, logits.shape[1]).to(w.dtype)).to(v.dtype)  # (B, H, Tq, Dv)
