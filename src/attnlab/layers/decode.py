"""One decode query against a cache of n keys, for the KV-cached mechanisms.

The ops take queries and keys of one length; at decode time one new query sees every cached
key, which is the last row of the op's causal formula. These functions compute that row
directly, in O(n) per step: softmax (with every scaling of `softmax_attention`, whose key-norm
statistics run over all n visible keys), scalar and hybrid. (Principled attention's op accepts
fewer queries than keys and is called directly.) `step == forward` in
the layer tests ties each one to its op.

Shapes: q (B, H, 1, D); k (B, G, n, D); v (B, G', n, Dv) with G, G' dividing H; scalar
qs (B, H, 1), ks (B, H, n); every function returns (B, H, 1, Dv) in v's dtype.
"""

from __future__ import annotations

import math

import torch

from ..ops._checks import broadcast_param


def _heads(x: torch.Tensor, H: int) -> torch.Tensor:
    G = x.shape[1]
    return x if G == H else x.repeat_interleave(H // G, dim=1)


def _cdt(x: torch.Tensor) -> torch.dtype:
    return torch.float32 if x.dtype in (torch.float16, torch.bfloat16) else x.dtype


def _divisor(k: torch.Tensor, scale, p: float) -> torch.Tensor | float:
    """The softmax op's divisor c for a query that sees all n keys k (B, G, n, D): (B, G, 1, 1) or a float."""
    n, D = k.shape[2], k.shape[3]
    if scale == "sqrt_d":
        return math.sqrt(D)
    if scale == "n_sqrt_d":
        return n * math.sqrt(D)
    if scale == "krms":
        return (k.pow(2).sum(-1).sum(-1) / n).sqrt()[..., None, None]
    norms = torch.linalg.vector_norm(k, dim=-1)  # (B, G, n)
    if scale == "ktotal":
        c = norms.sum(-1)
    elif scale == "kmean":
        c = norms.mean(-1)
    else:  # pnorm, in log space as the op does
        log_norms = norms.clamp_min(torch.finfo(k.dtype).tiny).log() * p
        c = (torch.logsumexp(log_norms, dim=-1) / p).exp()
    return c[..., None, None]  # (B, G, 1, 1)


def softmax_readout(q, k, v, *, scale="sqrt_d", p: float = 2.0) -> torch.Tensor:
    """softmax_s(q·k_s / c) v_s over all cached keys (scale a float a: logits a·q·k_s)."""
    H, dt = q.shape[1], _cdt(q)
    qf, kf = q.to(dt), k.to(dt)
    if isinstance(scale, str):
        c = _divisor(kf, scale, p)
        qf = qf / (_heads(c, H) if isinstance(c, torch.Tensor) else c)  # (B, H, 1, D)
    else:
        qf = qf * float(scale)
    logits = qf @ _heads(kf, H).transpose(-1, -2)  # (B, H, 1, n)
    return (torch.softmax(logits, -1) @ _heads(v, H).to(dt)).to(v.dtype)


def _scalar_logits(qs, ks, tau) -> torch.Tensor:
    B, H = qs.shape[:2]
    tau_b = broadcast_param("tau", tau, B, H, 1, qs).to(_cdt(qs))  # (1|B, 1|H, 1)
    d = qs.to(tau_b.dtype).unsqueeze(-1) - ks.to(tau_b.dtype).unsqueeze(-2)  # (B, H, 1, n)
    return -d.pow(2) / tau_b.unsqueeze(-1)


def scalar_readout(qs, ks, v, tau) -> torch.Tensor:
    """softmax_s(−(qs − ks_s)²/τ) v_s; τ a float, (H,) or (B, H, 1)."""
    logits = _scalar_logits(qs, ks, tau)  # (B, H, 1, n)
    return (torch.softmax(logits, -1) @ _heads(v, qs.shape[1]).to(logits.dtype)).to(v.dtype)


def hybrid_readout(q, k, v, qs, ks, tau) -> torch.Tensor:
    """softmax_s(q·k_s/√d − (qs − ks_s)²/τ) v_s."""
    H, D = q.shape[1], q.shape[-1]
    logits = _scalar_logits(qs, ks, tau)
    logits = logits + (q.to(logits.dtype) @ _heads(k, H).to(logits.dtype).transpose(-1, -2)) / math.sqrt(D)
    return (torch.softmax(logits, -1) @ _heads(v, H).to(logits.dtype)).to(v.dtype)
