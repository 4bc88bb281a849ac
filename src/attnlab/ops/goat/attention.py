"""GOAT attention: dot-product scores plus a learned log-prior over positions
(docs/mechanisms.md#goat; Litman, "You Need Better Attention Priors", arXiv 2601.15380).

    score_ij = q_i . k_j / sqrt(d) + log pi_ij
    log pi_ij = sum_r [ a_r cos(w_r (i - j)) + b_r sin(w_r (i - j)) ] + u_j

a (symmetric) and b (antisymmetric) are spectral weights per key/value group over R frequencies
w_r; u_j is a key-only term (the layer evaluates it: a small network of absolute position
features, a first-token bump and, under causal masking, a recency slope). Optionally the hybrid
scalar term -(qs_i - ks_j)^2 / tau_i is added as well.

Fast path. cos(w(i - j)) = cos wi cos wj + sin wi sin wj and sin(w(i - j)) = sin wi cos wj -
cos wi sin wj, so the prior is the dot product of the query columns
[a cos wi + b sin wi, a sin wi - b cos wi, 1] with the key columns [cos wj, sin wj, u_j]. Appended to
q / sqrt(d) and k (and to the scalar columns of `attnlab.ops.scalar.fused.augment` for the hybrid term), the whole
score is one dot product, so the op is one fused SDPA call with memory linear in T. Positions:
key j is at position j, and the Tq queries are the last Tq positions (a decode step is one query
at position Tk - 1 against every cached key). Phases are built in float64 and cast, so long
positions keep their accuracy; 16-bit inputs compute in float32.

Shapes and cost. q (B, H, Tq, D), k (B, G, Tk, D), v (B, G', Tk, Dv); freqs (R,), lam_sym and
lam_asym (G, R), u (B or 1, G, Tk). The augmented vectors are D + 2R + 1 wide (+ 2 with the hybrid
term, which also repeats k to H heads since the scalar keys are per head), so the fused call costs
O(B H Tq Tk (D + 2R + 1)) time and O(B H (Tq + Tk)(D + 2R + 3)) extra memory; a layer that gives the
content product D = head_dim - 2R - 1 dims (as the authors' module does) runs it at the head size
of standard attention. The naive path materialises the (Tq, Tk) prior and scores.

`goat_attention` checks its arguments (`args`) and chooses: the naive reference (`naive`), the fused
SDPA path (`fused`) or the scalar family's Triton kernel (`triton_op`); the prior's formula is in
`prior`. FlexAttention's form is `attnlab.ops.goat.flex`.
"""

from __future__ import annotations

import torch

from ..common.precision import without_autocast
from ..common.triton_route import use_triton
from .args import check_call
from .fused import goat_fused
from .naive import goat_naive
from .triton_op import goat_triton


@without_autocast
def goat_attention(
    q, k, v, freqs, lam_sym, lam_asym, u, *, qs=None, ks=None, tau=None, causal: bool = True, impl: str = "auto",
    window: int | None = None, cu_seqlens=None, docs: torch.Tensor | None = None,
) -> torch.Tensor:
    """GOAT attention o_i = sum_j softmax_j(q_i . k_j / sqrt(d) + log pi_ij [- (qs_i - ks_j)^2 / tau_i]) v_j.

    Gradients reach q, k, v, lam_sym, lam_asym, u (and qs, ks, a tensor tau).

    Args:
        q: queries (B, H, Tq, D).
        k: keys (B, G, Tk, D), G dividing H (head h reads group h // (H / G)).
        v: values (B, G', Tk, Dv), G' dividing H.
        freqs: the prior's frequencies w_r (R,).
        lam_sym: the symmetric (cosine) spectral weights (G, R), one row per key group.
        lam_asym: the antisymmetric (sine) spectral weights (G, R).
        u: the key-only term (B or 1, G, Tk).
        qs: scalar queries (B, H, Tq) of the hybrid term; qs, ks and tau go together, or all None.
        ks: scalar keys (B, H, Tk) of the hybrid term.
        tau: the hybrid term's temperature > 0: a float, (H,) or (B, H, Tq).
        causal: hide the keys after each query; the queries are the last Tq positions, so causal
            masking needs Tq <= Tk.
        impl: ``"naive"`` adds the explicit (Tq, Tk) prior to the scores; ``"fast"`` (and ``"auto"``
            off CUDA) run one fused SDPA call on the augmented vectors of the module docstring;
            ``"triton"`` (what ``"auto"`` runs on CUDA without a window) the scalar family's Triton
            kernel with the prior's columns in the product and u added in float32 (`triton_op`).
        window: a causal sliding window: each query reads only its last ``window`` keys (itself
            included); None (default) for every earlier key. u still holds every key position's
            term (a decode cache passes the held keys' terms).
        cu_seqlens: packed documents (`attnlab.ops.common.packed`: offsets of the documents packed in a
            batch of one row), each query reading the keys of its own document only. The spectral
            part reads i - j, the same wherever a document lies, so packing changes only u: give it
            at each key's position inside its document (`attnlab.data.positions_in_doc`).
        docs: packed documents as (B, Tk) integer ids (a run of equal ids is a document); as
            cu_seqlens otherwise. Give at most one of the two.

    Returns:
        (B, H, Tq, Dv) in v's dtype.

    Raises:
        TypeError: a tensor argument that is not a tensor or not floating (q, k, v, qs, ks: not
            of q's dtype); tau neither a float nor a tensor; causal is not a bool.
        ValueError: shapes that do not fit (batch, groups, lengths, (G, R) weights, u, qs and
            ks), another device, NaN or inf in any input, tau <= 0, only some of qs, ks and tau
            given, an unknown impl, or a window that is not an int >= 1 or comes without causal;
            cu_seqlens or docs that do not describe packed documents (`attnlab.ops.common.packed`), or both.
    """
    (B, H, Tq, D), packed, scalar = check_call(q, k, v, freqs, lam_sym, lam_asym, u, qs, ks, tau, causal, impl,
                                               window, cu_seqlens, docs)
    if impl == "naive":
        return goat_naive(q, k, v, freqs, lam_sym, lam_asym, u, qs, ks, tau, causal, window, packed)
    if use_triton(impl, q.device, window):
        return goat_triton(q, k, v, freqs, lam_sym, lam_asym, u, qs, ks, tau, causal,
                           None if packed is None else packed.seg)
    return goat_fused(q, k, v, freqs, lam_sym, lam_asym, u, qs, ks, tau, causal, window, packed)
