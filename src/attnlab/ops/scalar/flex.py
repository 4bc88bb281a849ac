"""Scalar and hybrid attention through FlexAttention (`torch.nn.attention.flex_attention`): the generated
kernel that every hand-written kernel of the family is measured against (`benchmarks/gpu_paths.py`).

The scalar term is a `score_mod` reading the per-query and per-key scalars and the per-head (or
per-query) temperature and gain, captured tensors whose gradients FlexAttention computes itself;
causality is a block mask, so fully hidden tiles are skipped. On CUDA the compiled kernel runs, forward
and backward; on the CPU FlexAttention runs its reference form and has no backward (it raises there),
so the tests compare forwards on the CPU and the GPU check compares every gradient. The formula is
`naive`'s: q·k/√d + lam·phi((qs − ks)² / tau), phi(x) = −x (Gaussian) or −log(1 + x) (Cauchy);
scalar heads (q, k None) read zero vectors of width 16 (FlexAttention's smallest head), so only the
scalar term scores. Arguments are checked as `hybrid_attention` checks them; the router does not pick
this path (benchmarks/gpu_paths.py times it against the kernels, on the GPU).
"""

from __future__ import annotations

import torch

from ..common.heads import expand_heads
from ..common.precision import upcast
from ..common.sdpa import FLEX_MIN_WIDTH, flex_call
from .args import check_heads, check_kernel, check_pairing, scalar_scale_tensor, tau_tensor

__all__ = ["flex_scalar_attention"]

ZERO_WIDTH = FLEX_MIN_WIDTH  # the head width scalar heads give FlexAttention (the smallest it tiles)


def flex_scalar_attention(qs: torch.Tensor, ks: torch.Tensor, v: torch.Tensor, tau, *, q: torch.Tensor | None = None,
                          k: torch.Tensor | None = None, scalar_scale=None, kernel: str = "gaussian") -> torch.Tensor:
    """Causal scalar attention (q, k None) or hybrid attention through FlexAttention.

    Args:
        qs, ks: scalar queries and keys (B, H, T).
        v: values (B, G, T, Dv), G dividing H.
        tau: temperature > 0: a float, (H,) or (B, H, T).
        q, k: vector queries (B, H, T, D) and keys (B, G', T, D) of hybrid heads; None for scalar heads.
        scalar_scale: hybrid only: the gain lam of the scalar term, a float or (H,); None for 1.
        kernel: "gaussian" or "cauchy".

    Returns:
        (B, H, T, Dv) in v's dtype.

    Raises:
        TypeError / ValueError: as `hybrid_attention` and `scalar_attention` raise them.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    check_kernel(kernel)
    check_pairing(q, k, scalar_scale)
    B, H, T = check_heads(qs, ks, v, q, k)
    cdt = upcast(qs.dtype)
    tau_b = tau_tensor(tau, B, H, T, torch.float32 if cdt != torch.float64 else cdt, qs.device).expand(B, H, T)
    lam = None if scalar_scale is None else scalar_scale_tensor(scalar_scale, H, tau_b.dtype, qs.device).reshape(H)
    if T == 0:
        return v.new_zeros(B, H, 0, v.shape[-1])
    work = tau_b.dtype
    qs_w, ks_w = qs.to(work), ks.to(work)
    cauchy = kernel == "cauchy"

    def score_mod(score, b, h, qi, ki):
        d = qs_w[b, h, qi] - ks_w[b, h, ki]
        x = d * d / tau_b[b, h, qi]
        term = -torch.log1p(x) if cauchy else -x
        return score + (term if lam is None else lam[h] * term)

    if q is None:
        q = k = qs.new_zeros(B, H, T, ZERO_WIDTH, dtype=v.dtype)
    gqa = k.shape[1] != H or v.shape[1] != H
    if gqa and k.shape[1] != v.shape[1]:  # FlexAttention groups k and v alike
        k, v = expand_heads(k, H), expand_heads(v, H)
        gqa = False
    mask = create_block_mask(lambda b, h, qi, ki: qi >= ki, None, None, T, T, device=qs.device)
    out = flex_call(q.to(v.dtype), k.to(v.dtype), v, score_mod=score_mod, block_mask=mask, enable_gqa=gqa)
    return out.to(v.dtype)
