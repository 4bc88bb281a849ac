"""Softmax (dot-product) attention with the scalings of "Alternatives to the Scaled Dot Product".

Besides the usual 1/sqrt(d), the logits q.k can be divided by a statistic of the key norms
the query can see. Every such divisor depends only on the query position (and batch/head),
so it folds into the query: q_t / c_t, and the fast path is one fused SDPA call.

`softmax_attention` checks its arguments (`args`) and chooses: the naive reference (`naive`) or the
fast path (`fused`: one fused SDPA call, or per-document divisors and a masked call for packed documents).
"""

from __future__ import annotations

import torch

from .args import check_call
from .fused import softmax_fused, softmax_packed
from .naive import softmax_naive


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
        cu_seqlens: packed documents, flash-linear-attention's convention (`attnlab.ops.common.packed`): an
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
    packed = check_call(q, k, v, causal, scale, p, impl, window, cu_seqlens, docs)
    if impl == "naive":
        return softmax_naive(q, k, v, causal, scale, float(p), window, packed)
    if packed is not None:
        return softmax_packed(q, k, v, causal, scale, float(p), window, packed)
    return softmax_fused(q, k, v, causal, scale, float(p), window)


def document_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, docs: torch.Tensor) -> torch.Tensor:
    """Causal scaled dot-product attention over packed documents given as (B, T) ids:
    `softmax_attention(q, k, v, docs=docs)` (its fast path). q (B, H, T, D), k and v (B, G, T, D) with
    G dividing H. Returns (B, H, T, Dv) in v's dtype."""
    return softmax_attention(q, k, v, docs=docs)
