"""The scalar family's fused SDPA path: the Gaussian score as a dot product of augmented vectors.

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
query fills only its own slot with zeros elsewhere (`group_slots`): q'_h . k'_g is exactly head h's
score, and SDPA reads the G groups of values in place (enable_gqa).

`fused_scalar_attention` and `fused_hybrid_attention` run this path for `scalar_attention` and
`hybrid_attention`; `augment` also builds the scores of the selected-keys path (`selected`), of
GOAT's hybrid term and of the exact decode cache.
"""

from __future__ import annotations

import math

import torch

from ..common.heads import expand_heads
from ..common.precision import upcast
from ..common.sdpa import fused_attention
from .args import scalar_scale_tensor, tau_tensor


def augment(qs, ks, inv_tau, cdt, causal: bool, ref=None):
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


def group_slots(qa: torch.Tensor, ka: torch.Tensor, G: int):
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


def fused_scalar_attention(qs, ks, v, tau, causal: bool, window, n_prefix: int) -> torch.Tensor:
    """`scalar_attention` under the Gaussian kernel as one fused SDPA call on the shifted augmented
    vectors, checked inputs -> (B, H, Tq, Dv) in v's dtype."""
    B, H, T = qs.shape
    cdt = upcast(qs.dtype)
    inv_tau = 1.0 / tau_tensor(tau, B, H, T, cdt, qs.device)  # (1|B, 1|H, 1|T)
    qa, ka = augment(qs, ks, inv_tau, cdt, causal)  # (B, H, T, 2) each
    qa, ka = group_slots(qa, ka, v.shape[1])  # (B, H, Tq, 2H/G), (B, G, Tk, 2H/G)
    return fused_attention(qa, ka, v.to(cdt), causal=causal, window=window, n_prefix=n_prefix).to(v.dtype)


def fused_hybrid_attention(q, k, v, qs, ks, tau, causal: bool, scalar_scale, window, n_prefix: int) -> torch.Tensor:
    """`hybrid_attention` under the Gaussian kernel as one fused SDPA call on [q / sqrt(d), q'] . [k, k'],
    checked inputs -> (B, H, Tq, Dv) in v's dtype."""
    B, H, T, D = q.shape
    cdt = upcast(q.dtype)
    inv_tau = 1.0 / tau_tensor(tau, B, H, T, cdt, q.device)
    if scalar_scale is not None:
        inv_tau = inv_tau * scalar_scale_tensor(scalar_scale, H, cdt, q.device)  # lam / tau: (1|B, H, 1|T)
    qa, ka = augment(qs, ks, inv_tau, cdt, causal)  # (B, H, T, 2) each
    G = math.lcm(k.shape[1], v.shape[1])  # one grouping for keys and values
    qa, ka = group_slots(qa, ka, G)  # (B, H, Tq, 2H/G), (B, G, Tk, 2H/G)
    qa = torch.cat([q.to(cdt) * (1.0 / math.sqrt(D)), qa], dim=-1)  # (B, H, T, D + 2H/G)
    ka = torch.cat([expand_heads(k, G).to(cdt), ka], dim=-1)  # (B, G, T, D + 2H/G)
    return fused_attention(qa, ka, expand_heads(v, G).to(cdt), causal=causal, window=window,
                           n_prefix=n_prefix).to(v.dtype)
