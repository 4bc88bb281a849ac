"""Softmax (dot-product) attention with the scalings of "Alternatives to the Scaled Dot Product".

Besides the usual 1/sqrt(d), the logits q.k can be divided by a statistic of the key norms
the query can see. Every such divisor depends only on the query position (and batch/head),
so it folds into the query: q_t / c_t, and the fast path is one fused SDPA call.
"""

from __future__ import annotations

import math

import torch

from ..checks import check_choice, check_impl, check_positive, check_window
from ..masks import key_counts, visible_keys
from ._packed import Packing, packing, segment_logcumsumexp, segment_logsumexp, segment_sum
from ._sdpa import check_causal, check_qkv, expand_heads, fused_attention, packed_attention, upcast

SCALES = ("sqrt_d", "ktotal", "kmean", "krms", "pnorm", "n_sqrt_d")


def softmax_attention(q, k, v, *, causal: bool = True, scale="sqrt_d", p: float = 2.0, impl: str = "auto",
                      window: int | None = None, cu_seqlens=None, docs: torch.Tensor | None = None):
    """o_t = sum_s softmax_s(q_t . k_s / c_t) v_s over the keys s visible to query t.

    N_t is the set of keys query t sees (s <= t + Tk - Tq if ``causal``, else all Tk) and
    n_t = |N_t|. Under causal masking the key-norm divisors are prefix sums over s <= t, so a query
    never depends on later keys; key norms are taken per key head (group). A divisor of zero (all
    visible keys zero) is not guarded against.

    Args:
        q: queries (B, H, Tq, D).
        k: keys (B, G, Tk, D), G dividing H (GQA: head h reads group h // (H / G)).
        v: values (B, G', Tk, Dv), G' dividing H.
        causal: hide the keys after each query. The queries are the last Tq positions, so causal
            masking needs Tq <= Tk (decode: one query against n keys).
        scale: the divisor c_t, by name, or a float:

            - ``"sqrt_d"``: c_t = sqrt(D), standard attention (the default);
            - ``"ktotal"``: c_t = sum_{s in N_t} ||k_s||, the sum of key lengths;
            - ``"kmean"``: c_t = (1 / n_t) sum_{s in N_t} ||k_s||, the mean key length;
            - ``"krms"``: c_t = sqrt((1 / n_t) sum_{s in N_t} ||k_s||^2), the RMS key length;
            - ``"pnorm"``: c_t = (sum_{s in N_t} ||k_s||^p)^(1/p) (p = 1 is ktotal);
            - ``"n_sqrt_d"``: c_t = n_t sqrt(D), a cheap stand-in for ktotal;
            - a float a > 0: the logits are a * q_t . k_s (a multiplier, as SDPA's ``scale``).
        p: the exponent of ``"pnorm"``, a float > 0; ignored by the other scalings.
        window: a causal sliding window: N_t is only the last ``window`` keys up to query t, itself
            included (Mistral / Gemma's sliding-window attention; the key-norm divisors then sum
            over the window too); None (default) for every earlier key. Needs causal=True.
        impl: ``"naive"`` builds the (Tq, Tk) logits and the divisors from the visibility mask, as
            the formula reads; ``"fast"`` and ``"auto"`` compute the divisors with cumulative sums
            and run one fused SDPA call on q / c_t, memory linear in T.
        cu_seqlens: packed documents, flash-linear-attention's convention (`attnlab.ops._packed`): an
            int32/int64 tensor (or list) of N + 1 offsets [0, ..., Tk] into one packed row (B = 1).
            N_t is then only the keys of query t's own document (intersected with the causal mask and
            the window), so every scaling's divisor and n_t restart at each document: the result
            equals running each document alone, outputs and gradients. The fast path stays on the
            device: per-document prefix reductions (a float64 log-sum-exp with a shift per document)
            and a same-document mask composed with the causal and window masks (FlexAttention's
            block mask on CUDA, masked SDPA over query chunks elsewhere).
        docs: packed documents as (B, Tk) integer ids, a document being a run of equal ids in its row
            (any batch size); as cu_seqlens otherwise. Give at most one of the two.

    Returns:
        (B, H, Tq, Dv) in v's dtype.

    Raises:
        TypeError: q, k or v is not a tensor, not floating or not of q's dtype; causal is not a
            bool; scale is neither a name nor a float; p is not a float.
        ValueError: a shape that does not fit the others (batch, lengths, D, groups, Tq > Tk under
            causal masking), a tensor on another device, NaN or inf in q, k or v, an unknown
            scale or impl, a scale or p that is not finite and > 0, a window that is not an int
            >= 1 or comes without causal masking; cu_seqlens that is not an int tensor of offsets
            from 0 to Tk (non-decreasing) or comes with a batch size other than 1; docs of another
            shape or device, or both cu_seqlens and docs.
    """
    check_impl(impl)
    check_causal(causal)
    check_window(window, causal)
    B, H, T, D = check_qkv(q, k, v, causal)
    packed = packing(cu_seqlens, docs, B, k.shape[2], q)
    if isinstance(scale, str):
        check_choice("scale", scale, SCALES)
    elif isinstance(scale, (int, float)) and not isinstance(scale, bool):
        check_positive("scale", float(scale))
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale}")
    else:
        raise TypeError(f"scale must be one of {SCALES} or a float, got {type(scale).__name__}")
    if scale == "pnorm":
        if isinstance(p, bool) or not isinstance(p, (int, float)):
            raise TypeError(f"p must be a float, got {type(p).__name__}")
        check_positive("p", float(p))
    if impl == "naive":
        return _softmax_naive(q, k, v, causal, scale, float(p), window, packed)
    if packed is not None:
        return _softmax_packed(q, k, v, causal, scale, float(p), window, packed)
    return _softmax_fast(q, k, v, causal, scale, float(p), window)


def _softmax_naive(q, k, v, causal, scale, p, window=None, packed: Packing | None = None):
    B, H, T, D = q.shape
    k_h, v_h = expand_heads(k, H), expand_heads(v, H)  # (B, H, Tk, D), (B, H, Tk, Dv)
    dots = q @ k_h.transpose(-1, -2)  # (B, H, Tq, Tk)
    visible = visible_keys(T, k.shape[2], causal, q.device, window)  # (Tq, Tk)
    if packed is not None:
        visible = visible & packed.same(T)  # (B, 1, Tq, Tk): and in the query's own document
    if isinstance(scale, str):
        c = _divisor_naive(k_h, visible, scale, p)  # (B, H, Tq) or (Tq,)
        logits = dots / (c.unsqueeze(-1) if c.dim() == 3 else c.view(T, 1))
    else:
        logits = dots * scale
    logits = logits.masked_fill(~visible, float("-inf"))
    w = torch.softmax(logits, dim=-1)  # (B, H, T, T)
    return (w @ v_h).to(v.dtype)  # (B, H, T, Dv)


def _divisor_naive(k_h, visible, scale, p):
    """c_t read off the (Tq, Tk) (or per row (B, 1, Tq, Tk)) visibility matrix: row t sums over the
    keys query t sees."""
    D = k_h.shape[-1]
    vis = visible.to(k_h.dtype)  # (Tq, Tk) or (B, 1, Tq, Tk)
    n = vis.sum(-1)  # (Tq,) or (B, 1, Tq)
    if scale == "sqrt_d":
        return torch.full_like(n, math.sqrt(D))
    if scale == "n_sqrt_d":
        return n * math.sqrt(D)
    norms = torch.linalg.vector_norm(k_h, dim=-1)  # (B, H, T)

    def row_sum(x):  # (B, H, Tk) over keys -> (B, H, Tq) over queries
        return (x.unsqueeze(-2) * vis).sum(-1)

    if scale == "ktotal":
        return row_sum(norms)
    if scale == "kmean":
        return row_sum(norms) / n
    if scale == "krms":
        return (row_sum(norms**2) / n).sqrt()
    return row_sum(norms**p) ** (1.0 / p)  # pnorm


def _softmax_fast(q, k, v, causal, scale, p, window=None):
    B, H, T, D = q.shape
    if not isinstance(scale, str):
        return fused_attention(q, k, v, causal=causal, scale=float(scale), window=window).to(v.dtype)
    if scale == "sqrt_d":
        return fused_attention(q, k, v, causal=causal, scale=1.0 / math.sqrt(D), window=window).to(v.dtype)
    c = _divisor_fast(k, T, causal, scale, p, window)  # (B, G, Tq) or (1, 1, Tq), in fp32 or wider
    if c.shape[1] != 1:
        c = expand_heads(c.unsqueeze(-1), H).squeeze(-1)  # (B, H, T)
    q_scaled = (q.to(c.dtype) / c.unsqueeze(-1)).to(q.dtype)  # (B, H, Tq, D)
    return fused_attention(q_scaled, k, v, causal=causal, scale=1.0, window=window).to(v.dtype)


def _softmax_packed(q, k, v, causal, scale, p, window, packed: Packing):
    """The fast path over packed documents: per-document divisors (`_divisor_packed`) folded into q,
    then `packed_attention` (a same-document mask composed with the causal and window masks)."""
    B, H, T, D = q.shape
    if not isinstance(scale, str):
        sm_scale, q_scaled = float(scale), q
    elif scale == "sqrt_d":
        sm_scale, q_scaled = 1.0 / math.sqrt(D), q
    else:
        c = _divisor_packed(k, T, causal, scale, p, window, packed)  # (B, G | 1, Tq)
        if c.shape[1] != 1:
            c = expand_heads(c.unsqueeze(-1), H).squeeze(-1)  # (B, H, Tq)
        sm_scale, q_scaled = 1.0, (q.to(c.dtype) / c.unsqueeze(-1)).to(q.dtype)
    return packed_attention(q_scaled, k, v, packed.seg, causal=causal, scale=sm_scale, window=window).to(v.dtype)


def _divisor_packed(k, Tq, causal, scale, p, window, packed: Packing):
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


def _divisor_fast(k, Tq, causal, scale, p, window=None):
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


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """Causal scaled dot-product attention over packed documents given as (B, T) ids:
    `softmax_attention(q, k, v, docs=docs)` (its fast path). q (B, H, T, D), k and v (B, G, T, D) with
    G dividing H. Returns (B, H, T, Dv) in v's dtype."""
    return softmax_attention(q, k, v, docs=docs)
