"""The scalar family's fused GPU kernel: scalar and hybrid attention under either kernel, in Triton.

One online-softmax loop over key tiles (the fused-attention pattern: no Tq x Tk matrix is stored,
forward or backward) whose score is

    s_ts = [q_t . k_s / sqrt(d)] + lam_t * phi((qs_t - ks_s)^2 / tau_t)

with phi(x) = -x (Gaussian) or -log(1 + x) (Cauchy) and the bracket present for hybrid heads only.
In the key-tile loops the score is kept in units of C = log2(e) / sqrt(d) (log2(e) without the
product), the product's own scale, so that beyond the product it costs a subtraction, a multiply and
a multiply-add per score (Gaussian: s'_ts = u (qs_t - ks_s) + q_t . k_s with u = g_t (qs_t - ks_s),
g_t = -lam_t log2(e) / (tau_t C) formed once per query row on the host; Cauchy: s' = g_t log2(1 + x)
+ q . k, g_t = -lam_t / C; a key-only term u_s arrives in units of C too), and the exponent C s' - C m
one multiply-add more; the row max m and the log-sum-exp carry the factor, so every exp2 of the
backward takes C s' - lse directly. qs - ks itself is formed per score, in float32: expanding the
square would cancel for far-off scalars (tests/test_scalar_triton.py).
The dot product runs on the matrix units in the inputs' dtype (bf16 / fp16 operands, float32
accumulation; float32 inputs in full float32, no TF32); the scalar term is formed in float32 from
float32 qs, ks, tau and lam whatever the inputs' dtype, so it carries none of the cancellation of
the augmented SDPA route (`attnlab.ops.scalar`, module docstring) and needs no reference shift.

Backward (`triton_backward`, two kernels as FlashAttention-2): one per key tile accumulates dk, dv
and dks over the query tiles that see it, its scores key-major; one per query tile accumulates dq,
dqs and the per-row gradients of tau and lam over the key tiles it sees. Probabilities are
recomputed from the forward's log-sum-exp. Grouped keys / values (GQA) are read in place; their
gradients are formed per query head and summed over each group. Causal masking aligns the Tq
queries with the last Tq of the Tk keys.

On the CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
imported): that is how the tests compare them with the naive op without a GPU.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common.triton_math import LN2, LOG2E, fast_math, lg2, mm  # noqa: F401 - fast_math: benchmarks/kernel_sass.py reads it here
from ..common.triton_rows import bases, doc_ids, doc_span, load_rows, seen_end


@triton.jit
def _unit(sm_scale, HAS_DOT: tl.constexpr):
    """C, the scores' unit (module docstring): the product's scale in base 2, log2(e) without a product."""
    if HAS_DOT:  # (a Python float reaches a kernel as fp64 under Inductor: both returns fp32)
        return tl.cast(sm_scale, tl.float32) * LOG2E
    return LOG2E


@triton.jit
def _vec(X, base, offs, ok, other, EDGE: tl.constexpr):
    """X[base + offs] (float32 per row or key), `other` where not ok; EDGE False: every one is there."""
    if EDGE:
        return tl.load(X + base + offs, mask=ok, other=other)
    return tl.load(X + base + offs)


@triton.jit
def _tile(X, base, offs, ok, offs_d, D: tl.constexpr, END: tl.constexpr, LOAD: tl.constexpr, EDGE: tl.constexpr,
          dtype: tl.constexpr):
    """(len(offs), len(offs_d)) entries [base + offs, offs_d] of a row-major (.., D) tensor, zeros where
    absent: the columns offs_d (ending before END) are masked only when D < END; EDGE False: every row
    is there. Zeros without LOAD."""
    if not LOAD:
        return tl.zeros((offs.shape[0], offs_d.shape[0]), dtype=dtype)
    ptr = X + (base + offs[:, None]) * D + offs_d[None, :]
    if EDGE:
        if D < END:
            return tl.load(ptr, mask=ok[:, None] & (offs_d[None, :] < D), other=0.0)
        return tl.load(ptr, mask=ok[:, None], other=0.0)
    if D < END:
        return tl.load(ptr, mask=offs_d[None, :] < D, other=0.0)
    return tl.load(ptr)


@triton.jit
def _key_tile(K, V, KS, U, kbase, vbase, krow, offs_n, n_ok, offs_d, offs_d2, offs_dv, D: tl.constexpr,
              DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr,
              HAS_DOT: tl.constexpr, BIAS: tl.constexpr, EDGE: tl.constexpr):
    """A key tile's scalar keys, key-only terms (0 without them), key vectors (columns [0, BLOCK_D) and,
    split, [BLOCK_D, BLOCK_D + BLOCK_D2)) and values (zeros past Tk)."""
    ks = _vec(KS, krow, offs_n, n_ok, 0.0, EDGE)
    us = 0.0
    if BIAS:
        us = _vec(U, krow, offs_n, n_ok, 0.0, EDGE)
    k = _tile(K, kbase, offs_n, n_ok, offs_d, D, BLOCK_D, HAS_DOT, EDGE, K.dtype.element_ty)
    k2 = 0.0
    if BLOCK_D2 > 0:
        k2 = _tile(K, kbase, offs_n, n_ok, offs_d2, D, BLOCK_D + BLOCK_D2, True, EDGE, K.dtype.element_ty)
    v = _tile(V, vbase, offs_n, n_ok, offs_dv, DV, BLOCK_DV, True, EDGE, V.dtype.element_ty)
    return ks, us, k, k2, v


@triton.jit
def _dot(a, b, a2, b2, BLOCK_D2: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """a @ b^T over the product's columns: one block, or two when split (BLOCK_D2 > 0: D = 80 as 64 + 16
    rather than padded to 128)."""
    out = mm(a, tl.trans(b), PREC, UP)
    if BLOCK_D2 > 0:
        out += mm(a2, tl.trans(b2), PREC, UP)
    return out


@triton.jit
def _cols2(BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr):
    """The second block's columns when the product is split (else 16 unused ones)."""
    return BLOCK_D + tl.arange(0, BLOCK_D2 if BLOCK_D2 > 0 else 16)


@triton.jit
def _score(dot, dd, g, tau, KERNEL: tl.constexpr, FAST: tl.constexpr):
    """A tile's scores in units of C from its product `dot` (0.0 without one), dd = qs - ks (or its
    negation) and the query's g and 1 / tau broadcast against it, with what the backward reuses:
    Gaussian u = g dd (the score is u dd + dot); Cauchy t = dd / tau, x1 = 1 + t dd and l1 =
    log2(x1) (the score is g l1 + dot); nothing without a scalar term (KERNEL 2)."""
    if KERNEL == 0:
        u = g * dd
        return u * dd + dot, u, u, u
    if KERNEL == 1:
        t = tau * dd
        x1 = t * dd + 1.0
        l1 = lg2(x1, FAST)
        return g * l1 + dot, t, x1, l1
    return dot, dot, dot, dot


@triton.jit
def _seen(s, pos_q, pos_k, Tk, off, CAUSAL: tl.constexpr, doc_q, doc_k, DOC: tl.constexpr):
    """s, -inf where query pos_q does not see key pos_k (both broadcast to the tile, either way round)."""
    ok = pos_k < Tk
    if CAUSAL:
        ok = ok & (pos_k <= pos_q + off)
    if DOC:  # packed documents: a query sees the keys of its own document only
        ok = ok & (doc_q == doc_k)
    return tl.where(ok, s, float("-inf"))


@triton.jit
def _visible_tiles(m0, Tk, off, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr):
    """The end of the key tiles [0, full) that every query row from m0 on sees whole (no mask needed)."""
    full = Tk // BLOCK_N * BLOCK_N
    if CAUSAL:
        diag = (m0 + off + 1) // BLOCK_N * BLOCK_N  # key tiles wholly at or before row m0's position
        if diag < full:
            full = diag
    return full


@triton.jit
def _program_rows(H, GK, GV, Tq, Tk, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr):
    """Program (batch x head) program_id(1)'s row offsets (`bases`), its batch row of document ids (by
    key position) and the column offsets of its tiles: head, second head part, values."""
    row, krow, kbase, vbase = bases(tl.program_id(1), H, GK, GV, Tq, Tk)
    drow = (tl.program_id(1) // H).to(tl.int64) * Tk
    return (row, krow, kbase, vbase, drow, tl.arange(0, BLOCK_D), _cols2(BLOCK_D, BLOCK_D2),
            tl.arange(0, BLOCK_DV))


@triton.jit
def _query_scalars(QS, TAU, G, row, offs_m, m_ok):
    """A query tile's scalar queries, temperatures and gains (0, 1, 0 past Tq)."""
    qs = tl.load(QS + row + offs_m, mask=m_ok, other=0.0)
    tau = tl.load(TAU + row + offs_m, mask=m_ok, other=1.0)
    g = tl.load(G + row + offs_m, mask=m_ok, other=0.0)
    return qs, tau, g


@triton.jit
def _query_rows(Q, QS, TAU, LAM, row, offs_m, m_ok, offs_d, D: tl.constexpr, HAS_DOT: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """A query tile's qs, 1 / tau, gain and vectors (zeros past Tq)."""
    qs = tl.load(QS + row + offs_m, mask=m_ok, other=0.0)
    tau = tl.load(TAU + row + offs_m, mask=m_ok, other=1.0)
    lam = tl.load(LAM + row + offs_m, mask=m_ok, other=0.0)
    q = load_rows(Q, row, offs_m, m_ok, offs_d, D, HAS_DOT, BLOCK_D, Q.dtype.element_ty)
    return qs, tau, lam, q


@triton.jit
def _grad_rows(LSE, DELTA, DO, row, offs_m, m_ok, offs_dv, DV: tl.constexpr):
    """A query tile's log-sum-exp (+inf past Tq, so p = 0 there), delta and output gradient."""
    lse = tl.load(LSE + row + offs_m, mask=m_ok, other=float("inf"))
    delta = tl.load(DELTA + row + offs_m, mask=m_ok, other=0.0)
    do = tl.load(DO + (row + offs_m[:, None]) * DV + offs_dv[None, :], mask=m_ok[:, None] & (offs_dv[None, :] < DV),
                 other=0.0)
    return lse, delta, do



@triton.jit
def _fwd_tile(acc, m_i, l_i, q, q2, qs, tau, g, K, V, KS, U, kbase, vbase, krow, start_n, offs_m, offs_d, offs_d2,
              offs_dv, Tk, off, C, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_D2: tl.constexpr,
              BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DOT: tl.constexpr, BIAS: tl.constexpr,
              KERNEL: tl.constexpr, CAUSAL: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr,
              DOCS, drow, dq, DOC: tl.constexpr, FAST: tl.constexpr):
    """One key tile of the online softmax: the running max m_i (units of C), sum l_i and output acc,
    updated. MASK: the causal / document mask and the end of the keys (else a whole tile, every key
    seen by every row)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < Tk
    ks, us, k, k2, v = _key_tile(K, V, KS, U, kbase, vbase, krow, offs_n, n_ok, offs_d, offs_d2, offs_dv, D, DV,
                                 BLOCK_D, BLOCK_D2, BLOCK_DV, HAS_DOT, BIAS, MASK)
    dot = 0.0
    if HAS_DOT:
        dot = _dot(q, k, q2, k2, BLOCK_D2, PREC, UP)
    s, _, _, _ = _score(dot, qs[:, None] - ks[None, :], g[:, None], tau[:, None], KERNEL, FAST)
    if BIAS:  # a key-only term u_s (in units of C), in float32
        s += us[None, :]
    if MASK:
        s = _seen(s, offs_m[:, None], offs_n[None, :], Tk, off, CAUSAL, dq[:, None],
                  doc_ids(DOCS, drow, offs_n, n_ok, DOC)[None, :], DOC)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    mc = tl.where(m_new == float("-inf"), 0.0, m_new * C)
    p = tl.exp2(s * C - mc[:, None])
    alpha = tl.exp2(m_i * C - mc)
    acc = acc * alpha[:, None] + mm(p.to(v.dtype), v, PREC, UP)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _fwd(Q, K, V, QS, KS, U, TAU, G, O, LSE, DOCS, START, END, Tq, Tk, H, GK, GV, sm_scale,
         D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DOT: tl.constexpr, BIAS: tl.constexpr, KERNEL: tl.constexpr,
         CAUSAL: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, DOC: tl.constexpr, FAST: tl.constexpr,
         BLOCK_D2: tl.constexpr = 0):
    m0 = tl.program_id(0) * BLOCK_M
    off = Tk - Tq
    row, krow, kbase, vbase, drow, offs_d, offs_d2, offs_dv = _program_rows(H, GK, GV, Tq, Tk, BLOCK_D, BLOCK_D2,
                                                                            BLOCK_DV)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < Tq
    qs, tau, g = _query_scalars(QS, TAU, G, row, offs_m, m_ok)
    q = _tile(Q, row, offs_m, m_ok, offs_d, D, BLOCK_D, HAS_DOT, True, Q.dtype.element_ty)
    q2 = 0.0
    if BLOCK_D2 > 0:
        q2 = _tile(Q, row, offs_m, m_ok, offs_d2, D, BLOCK_D + BLOCK_D2, True, True, Q.dtype.element_ty)
    C = _unit(sm_scale, HAS_DOT)
    dq = doc_ids(DOCS, drow, offs_m + off, m_ok, DOC)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    lo = 0
    full = _visible_tiles(m0, Tk, off, BLOCK_N, CAUSAL)
    hi = seen_end(m0, Tk, off, BLOCK_M, CAUSAL)
    if DOC:  # only the key tiles of the tile's documents, every one masked
        lo, hi = doc_span(START, END, drow, m0 + off, tl.minimum(m0 + BLOCK_M, Tq) - 1 + off, lo, hi, BLOCK_N, DOC)
        full = lo
    for start_n in range(lo, full, BLOCK_N):  # whole tiles: no mask
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, q2, qs, tau, g, K, V, KS, U, kbase, vbase, krow, start_n, offs_m,
                                  offs_d, offs_d2, offs_dv, Tk, off, C, D, DV, BLOCK_D, BLOCK_D2, BLOCK_DV, BLOCK_N,
                                  HAS_DOT, BIAS, KERNEL, CAUSAL, False, PREC, UP, DOCS, drow, dq, DOC, FAST)
    for start_n in range(full, hi, BLOCK_N):  # the diagonal and the ragged end
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, q2, qs, tau, g, K, V, KS, U, kbase, vbase, krow, start_n, offs_m,
                                  offs_d, offs_d2, offs_dv, Tk, off, C, D, DV, BLOCK_D, BLOCK_D2, BLOCK_DV, BLOCK_N,
                                  HAS_DOT, BIAS, KERNEL, CAUSAL, True, PREC, UP, DOCS, drow, dq, DOC, FAST)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(O + (row + offs_m[:, None]) * DV + offs_dv[None, :], out.to(O.dtype.element_ty),
             mask=m_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(LSE + row + offs_m, m_i * C + tl.log2(l_safe), mask=m_ok)  # base 2, as the exponents


@triton.jit
def _store_row_grads(DQS, DTAU, DLAM, row, offs_m, m_ok, lam, tau, da, dx, dl, KERNEL: tl.constexpr):
    """The gradients of qs, tau and the gain per query row from the sums A = sum ds phi' d, X = sum ds
    phi' x and L = sum ds l1: score = -lam phi(x), so d/d qs = -2 lam phi' d / tau, d/d tau = lam phi' x
    / tau and d/d lam = -phi(x) (tau holds 1 / tau)."""
    tl.store(DQS + row + offs_m, -2.0 * lam * tau * da, mask=m_ok)
    tl.store(DTAU + row + offs_m, lam * tau * dx, mask=m_ok)
    if KERNEL == 0:
        tl.store(DLAM + row + offs_m, -dx, mask=m_ok)
    else:
        tl.store(DLAM + row + offs_m, -LN2 * dl, mask=m_ok)
