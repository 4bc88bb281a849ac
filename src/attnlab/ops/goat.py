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
q / sqrt(d) and k (and to the scalar columns of `scalar._augment` for the hybrid term), the whole
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
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..checks import TRITON_IMPLS, check_finite, check_impl, check_tensor, check_window
from ..masks import visible_keys
from ._packed import packing
from ._sdpa import check_causal, check_qkv, expand_heads, fused_attention, upcast, without_autocast
from .scalar.attention import _use_triton
from .scalar.fused import _augment
from .scalar.naive import scalar_logits
from .scalar.args import _check_scalars, _tau


def _check_prior(freqs, lam_sym, lam_asym, u, B: int, G: int, Tk: int, like: torch.Tensor) -> None:
    for name, x, ndim in (("freqs", freqs, 1), ("lam_sym", lam_sym, 2), ("lam_asym", lam_asym, 2), ("u", u, 3)):
        check_tensor(name, x, ndim)
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
        if x.device != like.device:
            raise ValueError(f"{name} must be on the device of q ({like.device}), got {x.device}")
    R = freqs.shape[0]
    for name, x in (("lam_sym", lam_sym), ("lam_asym", lam_asym)):
        if tuple(x.shape) != (G, R):
            raise ValueError(f"{name} must have shape (G, R) = {(G, R)} (key groups, frequencies), got {tuple(x.shape)}")
    if u.shape[0] not in (1, B) or tuple(u.shape[1:]) != (G, Tk):
        raise ValueError(f"u must have shape (B or 1, G, Tk) = ({B}, {G}, {Tk}), got {tuple(u.shape)}")
    for name, x in (("freqs", freqs), ("lam_sym", lam_sym), ("lam_asym", lam_asym), ("u", u)):
        check_finite(name, x)


def _phases(freqs: torch.Tensor, start: int, n: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of w_r t for t = start .. start + n - 1: (n, R) each, computed in float64."""
    t = torch.arange(start, start + n, device=freqs.device, dtype=torch.float64)
    ph = t[:, None] * freqs.to(torch.float64)[None, :]  # (n, R)
    return ph.cos().to(dtype), ph.sin().to(dtype)


def goat_prior(freqs, lam_sym, lam_asym, u, Tq: int, causal: bool = True, window: int | None = None) -> torch.Tensor:
    """The log-prior log pi as a (B|1, G, Tq, Tk) tensor, -inf where key j is hidden from query i.

    Materialises Tq x Tk: the naive path and analysis. It does not check its arguments;
    `goat_attention` checks the same ones before calling it.

    Args:
        freqs: the prior's frequencies w_r (R,).
        lam_sym: the symmetric (cosine) spectral weights a (G, R), one row per key group.
        lam_asym: the antisymmetric (sine) spectral weights b (G, R).
        u: the key-only term (B or 1, G, Tk); its last dimension sets Tk.
        Tq: the number of queries, the last Tq of the Tk positions.
        causal: -inf where key j comes after query i.
        window: with causal, -inf too where key j is not among query i's last `window` keys.

    Returns:
        (B or 1, G, Tq, Tk), in u's dtype (float32 for 16-bit u).
    """
    Tk = u.shape[-1]
    dt = upcast(u.dtype)
    kpos = torch.arange(Tk, device=u.device)
    prior = spectral_prior(freqs, lam_sym, lam_asym, kpos[Tk - Tq :], kpos, dt)[None] + u.to(dt)[:, :, None, :]
    if causal:
        prior = prior.masked_fill(~visible_keys(Tq, Tk, True, u.device, window), float("-inf"))
    return prior


def spectral_prior(freqs, lam_sym, lam_asym, qpos: torch.Tensor, kpos: torch.Tensor, dtype) -> torch.Tensor:
    """The prior's spectral part sum_r [a_r cos w_r (i - j) + b_r sin w_r (i - j)] for queries at
    positions qpos (Tq,) and keys at kpos (Tk,) (integer tensors): (G, Tq, Tk) in dtype, the phases
    in float64. `goat_prior` calls it; a static decoder passes the positions its buffers hold."""
    rel = (qpos[:, None] - kpos[None, :]).to(torch.float64)
    ph = rel[..., None] * freqs.to(torch.float64)  # (Tq, Tk, R)
    return (torch.einsum("ijr,gr->gij", ph.cos().to(dtype), lam_sym.to(dtype))
            + torch.einsum("ijr,gr->gij", ph.sin().to(dtype), lam_asym.to(dtype)))


@without_autocast
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
            kernel with the prior's columns in the product and u added in float32 (`_goat_triton`).
        window: a causal sliding window: each query reads only its last ``window`` keys (itself
            included); None (default) for every earlier key. u still holds every key position's
            term (a decode cache passes the held keys' terms).
        cu_seqlens: packed documents (`attnlab.ops._packed`: offsets of the documents packed in a
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
            cu_seqlens or docs that do not describe packed documents (`attnlab.ops._packed`), or both.
    """
    check_impl(impl, TRITON_IMPLS)
    check_causal(causal)
    check_window(window, causal)
    B, H, Tq, D = check_qkv(q, k, v, causal)
    G, Tk = k.shape[1], k.shape[2]
    _check_prior(freqs, lam_sym, lam_asym, u, B, G, Tk, q)
    packed = packing(cu_seqlens, docs, B, Tk, q)
    scalar = qs is not None or ks is not None or tau is not None
    if scalar:
        if qs is None or ks is None or tau is None:
            raise ValueError("qs, ks and tau go together: give all three for the hybrid term, or none")
        _check_scalars(qs, ks, q, "q", causal)
        if tuple(qs.shape) != (B, H, Tq) or ks.shape[2] != Tk:
            raise ValueError(
                f"qs must have shape (B, H, Tq) = {(B, H, Tq)} and ks (B, H, Tk) = {(B, H, Tk)}, "
                f"got {tuple(qs.shape)} and {tuple(ks.shape)}"
            )
    cdt = upcast(q.dtype)
    if impl == "naive":
        scores = q.to(cdt) @ expand_heads(k, H).to(cdt).transpose(-1, -2) / math.sqrt(D)  # (B, H, Tq, Tk)
        scores = scores + expand_heads(goat_prior(freqs, lam_sym, lam_asym, u, Tq, causal, window), H)
        if scalar:
            scores = scores + scalar_logits(qs, ks, tau, causal, window=window)
        if packed is not None:
            scores = scores.masked_fill(~packed.same(Tq), float("-inf"))
        w = torch.softmax(scores, dim=-1)
        return (w @ expand_heads(v, H).to(w.dtype)).to(v.dtype)  # (B, H, Tq, Dv)

    if _use_triton(impl, q.device, window):
        return _goat_triton(q, k, v, freqs, lam_sym, lam_asym, u, qs, ks, tau, causal,
                            None if packed is None else packed.seg)
    cos_q, sin_q = _phases(freqs, Tk - Tq, Tq, cdt)  # (Tq, R)
    cos_k, sin_k = _phases(freqs, 0, Tk, cdt)  # (Tk, R)
    a = expand_heads(lam_sym.to(cdt)[None, :, None, :], H)  # (1, H, 1, R)
    b = expand_heads(lam_asym.to(cdt)[None, :, None, :], H)
    qa = torch.cat([
        q.to(cdt) * (1.0 / math.sqrt(D)),
        (a * cos_q + b * sin_q).expand(B, H, Tq, -1),
        (a * sin_q - b * cos_q).expand(B, H, Tq, -1),
        q.new_ones(B, H, Tq, 1, dtype=cdt),
    ], dim=-1)  # (B, H, Tq, D + 2R + 1)
    ka = torch.cat([
        k.to(cdt),
        torch.cat([cos_k, sin_k], dim=-1).expand(B, G, Tk, -1),
        u.to(cdt).expand(B, G, Tk)[..., None],
    ], dim=-1)  # (B, G, Tk, D + 2R + 1)
    if scalar:
        inv_tau = 1.0 / _tau(tau, B, H, Tq, cdt, q.device)
        sq, sk = _augment(qs, ks, inv_tau, cdt, causal)  # (B, H, Tq, 2), (B, H, Tk, 2)
        qa = torch.cat([qa, sq], dim=-1)
        ka = torch.cat([expand_heads(ka, H), sk], dim=-1)  # the scalar keys are per head
    if packed is not None:  # one masked call: each query's own document, causal and windowed as asked
        keep = packed.same(Tq)
        if causal:
            keep = keep & visible_keys(Tq, Tk, True, q.device, window)
        return F.scaled_dot_product_attention(qa, expand_heads(ka, H), expand_heads(v.to(cdt), H), attn_mask=keep,
                                              scale=1.0).to(v.dtype)
    return fused_attention(qa, ka, v.to(cdt), causal=causal, window=window).to(v.dtype)


def _goat_triton(q, k, v, freqs, lam_sym, lam_asym, u, qs, ks, tau, causal: bool, docs=None) -> torch.Tensor:
    """GOAT through the scalar family's Triton kernel (`scalar.triton_op`): the spectral prior as 2R columns appended to q / sqrt(d) and k in
    the inputs' dtype (its terms are of the size of its weights, so 16-bit columns cost it only their
    rounding), the key-only term u as a float32 bias per key, the hybrid term (if any) in float32."""
    from .scalar.triton_op import triton_scalar_attention

    B, H, Tq, D = q.shape
    G, Tk = k.shape[1], k.shape[2]
    cos_q, sin_q = _phases(freqs, Tk - Tq, Tq, torch.float32)  # (Tq, R)
    cos_k, sin_k = _phases(freqs, 0, Tk, torch.float32)  # (Tk, R)
    a = expand_heads(lam_sym.float()[None, :, None, :], H)  # (1, H, 1, R)
    b = expand_heads(lam_asym.float()[None, :, None, :], H)
    prior_q = torch.cat([a * cos_q + b * sin_q, a * sin_q - b * cos_q], dim=-1)  # (1, H, Tq, 2R)
    qa = torch.cat([q * (1.0 / math.sqrt(D)), prior_q.to(q.dtype).expand(B, H, Tq, -1)], dim=-1)
    ka = torch.cat([k, torch.cat([cos_k, sin_k], dim=-1).to(k.dtype).expand(B, G, Tk, -1)], dim=-1)
    tau_b = None if qs is None else _tau(tau, B, H, Tq, torch.float32, q.device)
    return triton_scalar_attention(qa, ka, v, qs, ks, tau_b, None, None if qs is None else "gaussian", causal,
                                   sm_scale=1.0, u=expand_heads(u.float(), H), docs=docs)


__all__ = ["goat_attention", "goat_prior"]
