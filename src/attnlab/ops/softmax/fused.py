"""Softmax attention's fast path: every divisor c_t depends only on the query position, so it folds into
the query (q_t / c_t) and the attention is one fused SDPA call (`attnlab.ops.common.sdpa`); the divisors
come from prefix (causal), windowed or full reductions, memory linear in T (`divisor_fast`), and with
packed documents from per-document reductions (`divisor_packed`) before a same-document masked call."""

from __future__ import annotations

import math

import torch

from ...masks import key_counts
from ..common.heads import expand_heads
from ..common.packed import Packing, segment_logcumsumexp, segment_logsumexp, segment_sum
from ..common.precision import upcast
from ..common.sdpa import fused_attention, packed_attention


def softmax_fused(q, k, v, causal, scale, p, window=None):
    B, H, T, D = q.shape
    if not isinstance(scale, str):
        return fused_attention(q, k, v, causal=causal, scale=float(scale), window=window).to(v.dtype)
    if scale == "sqrt_d":
        return fused_attention(q, k, v, causal=causal, scale=1.0 / math.sqrt(D), window=window).to(v.dtype)
    c = divisor_fast(k, T, causal, scale, p, window)  # (B, G, Tq) or (1, 1, Tq), in fp32 or wider
    if c.shape[1] != 1:
        c = expand_heads(c.unsqueeze(-1), H).squeeze(-1)  # (B, H, T)
    q_scaled = (q.to(c.dtype) / c.unsqueeze(-1)).to(q.dtype)  # (B, H, Tq, D)
    return fused_attention(q_scaled, k, v, causal=causal, scale=1.0, window=window).to(v.dtype)


def softmax_packed(q, k, v, causal, scale, p, window, packed: Packing):
    """The fast path over packed documents: per-document divisors (`divisor_packed`) folded into q,
    then `packed_attention` (a same-document mask composed with the causal and window masks)."""
    B, H, T, D = q.shape
    if not isinstance(scale, str):
        sm_scale, q_scaled = float(scale), q
    elif scale == "sqrt_d":
        sm_scale, q_scaled = 1.0 / math.sqrt(D), q
    else:
        c = divisor_packed(k, T, causal, scale, p, window, packed)  # (B, G | 1, Tq)
        if c.shape[1] != 1:
            c = expand_heads(c.unsqueeze(-1), H).squeeze(-1)  # (B, H, Tq)
        sm_scale, q_scaled = 1.0, (q.to(c.dtype) / c.unsqueeze(-1)).to(q.dtype)
    return packed_attention(q_scaled, k, v, packed.seg, causal=causal, scale=sm_scale, window=window).to(v.dtype)


def divisor_packed(k, Tq, causal, scale, p, window, packed: Packing):
    """c_t over the keys of query t's own document (the last Tq of the Tk positions), O(T) memory
    (O(T x window) with a sliding window), no host sync. Causal sums without a window run in log space
    (`segment_logcumsumexp`, float64), so no document's terms are subtracted from a row prefix."""
    B, G, Tk, D = k.shape
    kf = k.to(upcast(k.dtype))
    if causal:
        n = packed.pos + 1 if window is None else (packed.pos + 1).clamp_max(window)
    else:
        n = packed.length
    n = n[:, None, Tk - Tq:].to(kf.dtype)  # (B, 1, Tq): the keys query t sees
    if scale == "n_sqrt_d":
        return n * math.sqrt(D)
    terms = kf.pow(2).sum(-1) if scale == "krms" else torch.linalg.vector_norm(kf, dim=-1)  # (B, G, Tk)
    if causal and window is None:
        log_terms = terms.clamp_min(torch.finfo(kf.dtype).tiny).log() * (p if scale == "pnorm" else 1.0)
        lse = segment_logcumsumexp(log_terms, packed)[..., Tk - Tq:]  # (B, G, Tq), float64
        if scale == "ktotal":
            return lse.exp().to(kf.dtype)
        if scale == "kmean":
            return (lse - n.double().log()).exp().to(kf.dtype)
        if scale == "krms":
            return ((lse - n.double().log()) / 2).exp().to(kf.dtype)
        return (lse / p).exp().to(kf.dtype)  # pnorm
    if scale == "pnorm":
        log_terms = terms.clamp_min(torch.finfo(kf.dtype).tiny).log() * p
        if causal:  # the window's keys of the query's own document
            seen = _windows(packed.seg[:, None], window, -1) == packed.seg[:, None, :, None]  # (B, 1, Tk, window)
            lse = torch.logsumexp(_windows(log_terms, window, float("-inf")).masked_fill(~seen, float("-inf")), -1)
        else:
            lse = segment_logsumexp(log_terms, packed)
        return (lse[..., Tk - Tq:] / p).exp()
    if causal:
        seen = _windows(packed.seg[:, None], window, -1) == packed.seg[:, None, :, None]  # (B, 1, Tk, window)
        total = (_windows(terms, window, 0.0) * seen).sum(-1)  # (B, G, Tk)
    else:
        total = segment_sum(terms, packed)
    total = total[..., Tk - Tq:]
    if scale == "ktotal":
        return total
    if scale == "kmean":
        return total / n
    return (total / n).sqrt()  # krms


def _windows(x: torch.Tensor, window: int, fill: float) -> torch.Tensor:
    """(..., Tk) -> (..., Tk, window): row s holds x at s - window + 1 .. s, `fill` before 0 (a view
    of one padded copy: the sliding window's reductions read it without a Tk x Tk matrix)."""
    pad = x.new_full((*x.shape[:-1], window - 1), fill)
    return torch.cat([pad, x], dim=-1).unfold(-1, window, 1)


def divisor_fast(k, Tq, causal, scale, p, window=None):
    """c_t by prefix reductions (causal) or full reductions (non-causal), O(T) memory; the
    queries are the last Tq of the Tk key positions. With a sliding window the reductions run
    over each query's last `window` keys (O(T x window) for pnorm's log-sum-exp, a view otherwise).

    Reductions run in at least fp32, since bf16 prefix sums over long T lose the digits.
    """
    B, G, Tk, D = k.shape
    kf = k.to(upcast(k.dtype))
    n = key_counts(Tq, Tk, causal, k.device, kf.dtype, window)  # (Tq,)
    if causal and window is not None:
        def reduce(x):  # (B, G, Tk) -> (B, G, Tq): the window each query sees
            return _windows(x[..., max(0, Tk - Tq - window + 1):], window, 0.0)[..., -Tq:, :].sum(-1)
    elif causal:
        def reduce(x):  # (B, G, Tk) -> (B, G, Tq): the prefix each query sees
            return x.cumsum(-1)[..., Tk - Tq:]
    else:
        def reduce(x):
            return x.sum(-1, keepdim=True).expand(*x.shape[:-1], Tq)

    if scale == "n_sqrt_d":
        return (n * math.sqrt(D)).view(1, 1, Tq)
    if scale == "krms":
        return (reduce(kf.pow(2).sum(-1)) / n).sqrt()  # (B, G, Tq)
    norms = torch.linalg.vector_norm(kf, dim=-1)  # (B, G, Tk)
    if scale == "ktotal":
        return reduce(norms)
    if scale == "kmean":
        return reduce(norms) / n
    # pnorm in log space, (1/p) log sum exp(p log ||k||), so ||k||^p cannot overflow or
    # underflow for large p. Zero norms are floored at the smallest normal float: their
    # term (tiny^p) is zero to working precision and their gradient stays finite.
    log_norms = norms.clamp_min(torch.finfo(kf.dtype).tiny).log() * p  # (B, G, Tk)
    if causal and window is not None:
        lse = torch.logsumexp(_windows(log_norms, window, float("-inf"))[..., Tk - Tq:, :], dim=-1)
    elif causal:
        lse = torch.logcumsumexp(log_norms, dim=-1)[..., Tk - Tq:]
    else:
        lse = torch.logsumexp(log_norms, dim=-1, keepdim=True).expand(B, G, Tq)
    return (lse / p).exp()
