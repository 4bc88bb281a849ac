"""The scalar family's fused GPU kernel, backward: the two kernels of FlashAttention-2 for the score of
`triton_kernel` (module docstring: the score in units of C, u, g and the pieces `_score` returns).

`_bwd_kv`, one program per key tile, runs over the query tiles that see it with the tile's scores
key-major, (BLOCK_N keys, BLOCK_M queries) as the Triton tutorial's dk/dv kernel forms them: the
probabilities and the score gradients are then already the left operands of dv += p^T do and
dk += ds^T q (no transpose through shared memory), and the scalar keys' gradient is a sum along
each register row (no reduction across warps). Per score, beyond the products: the score (one
subtraction, a multiply, a multiply-add), the exponent (one multiply-add), ds (two), and dks one
multiply-add on the Gaussian's u = g (ks - qs) kept from the score: d score / d ks = 2 lam (qs - ks)
/ tau = 2 (C / log2 e) u. `_bwd_q`, one program per query tile, accumulates dq and the per-row sums
A = sum ds phi' d, X = sum ds phi' d^2 (and for the Cauchy kernel L = sum ds log2(1 + x)) that give
the gradients of qs, tau and the gain (`triton_kernel._store_row_grads`).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ..common.triton_math import LOG2E, mm, rcp
from ..common.triton_rows import doc_ids, doc_span, seen_end
from .triton_kernel import (
    _dot, _key_tile, _program_rows, _query_scalars, _score, _seen, _store_row_grads, _tile, _unit, _vec, _visible_tiles,
)


@triton.jit
def _kv_tile(dk, dk2, dv, dks, du, k, k2, v, ks, us, Q, QS, TAU, G, DO, LSE, DELTA, row, start_m, offs_n, offs_d,
             offs_d2, offs_dv, Tq, Tk, off, C, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, HAS_DOT: tl.constexpr,
             BIAS: tl.constexpr, KERNEL: tl.constexpr,
             CAUSAL: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, DOCS, drow, dkey,
             DOC: tl.constexpr, FAST: tl.constexpr):
    """One query tile's share of a key tile's dk, dv, dks and du, key-major. MASK: the causal / document
    mask and the end of the queries (those past Tq read lse = +inf: p = 0 there); else every query
    of the tile is there and sees every key."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_ok = offs_m < Tq
    qs = _vec(QS, row, offs_m, m_ok, 0.0, MASK)
    g = _vec(G, row, offs_m, m_ok, 0.0, MASK)
    tau = 0.0
    if KERNEL == 1:
        tau = _vec(TAU, row, offs_m, m_ok, 1.0, MASK)
    lse = _vec(LSE, row, offs_m, m_ok, float("inf"), MASK)
    delta = _vec(DELTA, row, offs_m, m_ok, 0.0, MASK)
    q = _tile(Q, row, offs_m, m_ok, offs_d, D, BLOCK_D, HAS_DOT, MASK, Q.dtype.element_ty)
    q2 = 0.0
    if BLOCK_D2 > 0:
        q2 = _tile(Q, row, offs_m, m_ok, offs_d2, D, BLOCK_D + BLOCK_D2, True, MASK, Q.dtype.element_ty)
    do = _tile(DO, row, offs_m, m_ok, offs_dv, DV, BLOCK_DV, True, MASK, DO.dtype.element_ty)
    dot = 0.0
    if HAS_DOT:
        dot = _dot(k, q, k2, q2, BLOCK_D2, PREC, UP)  # (BLOCK_N, BLOCK_M)
    s, t, x1, _ = _score(dot, ks[:, None] - qs[None, :], g[None, :], tau[None, :], KERNEL, FAST)
    if BIAS:
        s += us[:, None]
    if KERNEL == 1:  # d score / d ks up to 2 C, formed before the products: one tile live in place of two
        t = t * rcp(x1, FAST) * g[None, :]
    if MASK:
        s = _seen(s, offs_m[None, :], offs_n[:, None], Tk, off, CAUSAL,
                  doc_ids(DOCS, drow, offs_m + off, m_ok, DOC)[None, :], dkey[:, None], DOC)
    p = tl.exp2(s * C - lse[None, :])
    dv += mm(p.to(do.dtype), do, PREC, UP)
    ds = p * (mm(v, tl.trans(do), PREC, UP) - delta[None, :])  # the gradient of the (natural) score
    if HAS_DOT:
        dk += mm(ds.to(q.dtype), q, PREC, UP)
        if BLOCK_D2 > 0:
            dk2 += mm(ds.to(q.dtype), q2, PREC, UP)
    if BIAS:
        du += tl.sum(ds, 1)
    if KERNEL != 2:  # Gaussian t = u = g (ks - qs), times 2 C / log2(e) at the end; Cauchy t = g (ks - qs) / (tau
        dks += tl.sum(ds * t, 1)  # (1 + x)), times 2 C at the end
    return dk, dk2, dv, dks, du


@triton.jit
def _bwd_kv(Q, K, V, QS, KS, U, TAU, G, LAM, DO, LSE, DELTA, DOCS, START, END, DK, DV_, DKS, DU, Tq, Tk, H, GK, GV,
            sm_scale, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DOT: tl.constexpr, BIAS: tl.constexpr, KERNEL: tl.constexpr,
            CAUSAL: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, DOC: tl.constexpr, FAST: tl.constexpr,
            BLOCK_D2: tl.constexpr = 0):
    sm_scale = tl.cast(sm_scale, tl.float32)  # a Python float reaches a kernel as fp64 under Inductor
    n0 = tl.program_id(0) * BLOCK_N
    off = Tk - Tq
    row, krow, kbase, vbase, drow, offs_d, offs_d2, offs_dv = _program_rows(H, GK, GV, Tq, Tk, BLOCK_D, BLOCK_D2,
                                                                            BLOCK_DV)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < Tk
    ks, us, k, k2, v = _key_tile(K, V, KS, U, kbase, vbase, krow, offs_n, n_ok, offs_d, offs_d2, offs_dv, D, DV,
                                 BLOCK_D, BLOCK_D2, BLOCK_DV, HAS_DOT, BIAS, True)
    C = _unit(sm_scale, HAS_DOT)
    dkey = doc_ids(DOCS, drow, offs_n, n_ok, DOC)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dk2 = 0.0
    if BLOCK_D2 > 0:
        dk2 = tl.zeros((BLOCK_N, BLOCK_D2), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
    dks = tl.zeros((BLOCK_N,), tl.float32)
    du = tl.zeros((BLOCK_N,), tl.float32)
    lo = 0
    full = 0  # query tiles from `full` on see this key tile whole (keys past Tk are never stored)
    if CAUSAL:
        lo = n0 - off  # the first query that sees this tile's first key
        if lo < 0:
            lo = 0
        lo = lo // BLOCK_M * BLOCK_M
        full = n0 + BLOCK_N - 1 - off  # the first query that sees the tile's last key
        if full < 0:
            full = 0
        full = (full + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        if full > Tq:
            full = Tq
    end = Tq
    if DOC:  # only the query tiles of this key tile's documents, every one masked
        lo, end = doc_span(START, END, drow, n0, tl.minimum(n0 + BLOCK_N, Tk) - 1, lo + off, end + off, 1, DOC)
        lo = tl.maximum(lo - off, 0) // BLOCK_M * BLOCK_M
        end = end - off
        full = end
    whole = tl.maximum(full, Tq // BLOCK_M * BLOCK_M)  # [full, whole): whole tiles of queries, no mask
    if DOC:  # every query tile of the span is masked: the queries past it read other documents
        whole = full
    for start_m in range(lo, full, BLOCK_M):  # the diagonal
        dk, dk2, dv, dks, du = _kv_tile(dk, dk2, dv, dks, du, k, k2, v, ks, us, Q, QS, TAU, G, DO, LSE, DELTA, row,
                                        start_m, offs_n, offs_d, offs_d2, offs_dv, Tq, Tk, off, C, D, DV, BLOCK_D,
                                        BLOCK_D2, BLOCK_DV, BLOCK_M, HAS_DOT, BIAS, KERNEL, CAUSAL, True, PREC, UP,
                                        DOCS, drow, dkey, DOC, FAST)
    for start_m in range(full, whole, BLOCK_M):  # (non-causal: every tile; padded keys are not stored)
        dk, dk2, dv, dks, du = _kv_tile(dk, dk2, dv, dks, du, k, k2, v, ks, us, Q, QS, TAU, G, DO, LSE, DELTA, row,
                                        start_m, offs_n, offs_d, offs_d2, offs_dv, Tq, Tk, off, C, D, DV, BLOCK_D,
                                        BLOCK_D2, BLOCK_DV, BLOCK_M, HAS_DOT, BIAS, KERNEL, CAUSAL, False, PREC, UP,
                                        DOCS, drow, dkey, DOC, FAST)
    for start_m in range(whole, end, BLOCK_M):  # the ragged end of the queries
        dk, dk2, dv, dks, du = _kv_tile(dk, dk2, dv, dks, du, k, k2, v, ks, us, Q, QS, TAU, G, DO, LSE, DELTA, row,
                                        start_m, offs_n, offs_d, offs_d2, offs_dv, Tq, Tk, off, C, D, DV, BLOCK_D,
                                        BLOCK_D2, BLOCK_DV, BLOCK_M, HAS_DOT, BIAS, KERNEL, CAUSAL, True, PREC, UP,
                                        DOCS, drow, dkey, DOC, FAST)
    tl.store(DK + (krow + offs_n[:, None]) * (BLOCK_D + BLOCK_D2) + offs_d[None, :], dk * sm_scale, mask=n_ok[:, None])
    if BLOCK_D2 > 0:
        tl.store(DK + (krow + offs_n[:, None]) * (BLOCK_D + BLOCK_D2) + offs_d2[None, :], dk2 * sm_scale,
                 mask=n_ok[:, None])
    tl.store(DV_ + (krow + offs_n[:, None]) * BLOCK_DV + offs_dv[None, :], dv, mask=n_ok[:, None])
    if KERNEL == 0:
        dks = dks * (2.0 * C / LOG2E)
    else:
        dks = dks * (2.0 * C)
    tl.store(DKS + krow + offs_n, dks, mask=n_ok)
    if BIAS:
        tl.store(DU + krow + offs_n, du, mask=n_ok)


@triton.jit
def _q_tile(dq, dq2, da, dx, dl, q, q2, qs, tau, g, do, lse, delta, K, V, KS, U, kbase, vbase, krow, start_n,
            offs_m, offs_d, offs_d2, offs_dv, Tk, off, C, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_D2: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DOT: tl.constexpr,
            BIAS: tl.constexpr,
            KERNEL: tl.constexpr, CAUSAL: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr,
            DOCS, drow, dqd, DOC: tl.constexpr, FAST: tl.constexpr):
    """One key tile's share of a query tile's dq and of the per-row sums A = sum ds phi' d, X = sum ds
    phi' d^2 and L = sum ds l1 (phi' = 1 for the Gaussian, 1 / (1 + x) for the Cauchy kernel)."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < Tk
    ks, us, k, k2, v = _key_tile(K, V, KS, U, kbase, vbase, krow, offs_n, n_ok, offs_d, offs_d2, offs_dv, D, DV,
                                 BLOCK_D, BLOCK_D2, BLOCK_DV, HAS_DOT, BIAS, MASK)
    dot = 0.0
    if HAS_DOT:
        dot = _dot(q, k, q2, k2, BLOCK_D2, PREC, UP)
    d = qs[:, None] - ks[None, :]
    s, _, x1, l1 = _score(dot, d, g[:, None], tau[:, None], KERNEL, FAST)
    if BIAS:
        s += us[None, :]
    if MASK:
        s = _seen(s, offs_m[:, None], offs_n[None, :], Tk, off, CAUSAL, dqd[:, None],
                  doc_ids(DOCS, drow, offs_n, n_ok, DOC)[None, :], DOC)
    p = tl.exp2(s * C - lse[:, None])
    ds = p * (mm(do, tl.trans(v), PREC, UP) - delta[:, None])  # 0 wherever a key is hidden
    if HAS_DOT:
        dq += mm(ds.to(k.dtype), k, PREC, UP)
        if BLOCK_D2 > 0:
            dq2 += mm(ds.to(k.dtype), k2, PREC, UP)
    if KERNEL == 1:
        dl += tl.sum(ds * l1, 1)
        ds = ds * rcp(x1, FAST)
    if KERNEL != 2:
        w = ds * d
        da += tl.sum(w, 1)
        dx += tl.sum(w * d, 1)
    return dq, dq2, da, dx, dl


@triton.jit
def _bwd_q(Q, K, V, QS, KS, U, TAU, G, LAM, DO, LSE, DELTA, DOCS, START, END, DQ, DQS, DTAU, DLAM, Tq, Tk, H, GK, GV,
           sm_scale, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DOT: tl.constexpr, BIAS: tl.constexpr, KERNEL: tl.constexpr,
           CAUSAL: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, DOC: tl.constexpr, FAST: tl.constexpr,
           BLOCK_D2: tl.constexpr = 0):
    sm_scale = tl.cast(sm_scale, tl.float32)  # a Python float reaches a kernel as fp64 under Inductor
    m0 = tl.program_id(0) * BLOCK_M
    off = Tk - Tq
    row, krow, kbase, vbase, drow, offs_d, offs_d2, offs_dv = _program_rows(H, GK, GV, Tq, Tk, BLOCK_D, BLOCK_D2,
                                                                            BLOCK_DV)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    m_ok = offs_m < Tq
    qs, tau, g = _query_scalars(QS, TAU, G, row, offs_m, m_ok)
    lam = tl.load(LAM + row + offs_m, mask=m_ok, other=0.0)
    lse = tl.load(LSE + row + offs_m, mask=m_ok, other=float("inf"))  # p = 0 past Tq
    delta = tl.load(DELTA + row + offs_m, mask=m_ok, other=0.0)
    q = _tile(Q, row, offs_m, m_ok, offs_d, D, BLOCK_D, HAS_DOT, True, Q.dtype.element_ty)
    q2 = 0.0
    dq2 = 0.0
    if BLOCK_D2 > 0:
        q2 = _tile(Q, row, offs_m, m_ok, offs_d2, D, BLOCK_D + BLOCK_D2, True, True, Q.dtype.element_ty)
        dq2 = tl.zeros((BLOCK_M, BLOCK_D2), tl.float32)
    do = _tile(DO, row, offs_m, m_ok, offs_dv, DV, BLOCK_DV, True, True, DO.dtype.element_ty)
    C = _unit(sm_scale, HAS_DOT)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    da = tl.zeros((BLOCK_M,), tl.float32)
    dx = tl.zeros((BLOCK_M,), tl.float32)
    dl = tl.zeros((BLOCK_M,), tl.float32)
    dqd = doc_ids(DOCS, drow, offs_m + off, m_ok, DOC)
    lo = 0
    full = _visible_tiles(m0, Tk, off, BLOCK_N, CAUSAL)
    hi = seen_end(m0, Tk, off, BLOCK_M, CAUSAL)
    if DOC:
        lo, hi = doc_span(START, END, drow, m0 + off, tl.minimum(m0 + BLOCK_M, Tq) - 1 + off, lo, hi, BLOCK_N, DOC)
        full = lo
    for start_n in range(lo, full, BLOCK_N):
        dq, dq2, da, dx, dl = _q_tile(dq, dq2, da, dx, dl, q, q2, qs, tau, g, do, lse, delta, K, V, KS, U, kbase,
                                      vbase, krow, start_n, offs_m, offs_d, offs_d2, offs_dv, Tk, off, C, D, DV,
                                      BLOCK_D, BLOCK_D2, BLOCK_DV, BLOCK_N, HAS_DOT, BIAS, KERNEL, CAUSAL, False,
                                      PREC, UP, DOCS, drow, dqd, DOC, FAST)
    for start_n in range(full, hi, BLOCK_N):
        dq, dq2, da, dx, dl = _q_tile(dq, dq2, da, dx, dl, q, q2, qs, tau, g, do, lse, delta, K, V, KS, U, kbase,
                                      vbase, krow, start_n, offs_m, offs_d, offs_d2, offs_dv, Tk, off, C, D, DV,
                                      BLOCK_D, BLOCK_D2, BLOCK_DV, BLOCK_N, HAS_DOT, BIAS, KERNEL, CAUSAL, True,
                                      PREC, UP, DOCS, drow, dqd, DOC, FAST)
    tl.store(DQ + (row + offs_m[:, None]) * (BLOCK_D + BLOCK_D2) + offs_d[None, :], dq * sm_scale, mask=m_ok[:, None])
    if BLOCK_D2 > 0:
        tl.store(DQ + (row + offs_m[:, None]) * (BLOCK_D + BLOCK_D2) + offs_d2[None, :], dq2 * sm_scale,
                 mask=m_ok[:, None])
    _store_row_grads(DQS, DTAU, DLAM, row, offs_m, m_ok, lam, tau, da, dx * tau, dl, KERNEL)
