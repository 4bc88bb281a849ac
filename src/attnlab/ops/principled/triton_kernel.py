"""Principled attention's fused GPU kernel, in Triton (the math: docs/mechanisms.md#principled-attention).

The tiled algorithm of `attnlab.ops.principled.tiled` (module docstring) as one online loop over key
tiles per query tile, no Tq x Tk matrix stored forward or backward. In base 2 and relative to the
threshold, the logit of query t and key s is

    y_ts = log2(e) [c_t (q_t . k_s / sqrt(d) - gamma_t) - softplus(beta_t) softplus(-qg_t . kg_s)]

and each query tile keeps the running max M of max(0, y), the sum of 2^(y - M) v and 2^(y - M),
and the grounded mass sum max(0, 2^-M - 2^(y - M)); z = sumexp + grounded mass, w0 = grounded / z.
The products q.k and qg.kg run on the matrix units in the inputs' dtype (float32 accumulation);
c, softplus(beta), gamma and every sum are float32.

Backward (two kernels, as FlashAttention-2): one per key tile accumulates dk, dv and dkg over the
query tiles that see it; one per query tile accumulates sum_s ds k_s, sum_s ds, the gate query's
gradient and softplus(beta)'s. With w = 2^(y - lse) and Delta = do.o_keys - dw0 (1 - w0), the
logit gradient is ds = w (do.v - dw0 - Delta (1 + sign y) / 2). Grouped keys, gate keys and values
are read in place; their gradients are formed per query head and summed over each group.

On the CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1): the tests compare them
with the naive op there.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl

from ..common.triton_math import LN2, LOG2E, fast_math, interpreted, lg2, mm, rcp
from ..common.triton_rows import bases, doc_ids, doc_span, document_spans, load_rows, seen_end

__all__ = ["document_log_counts", "triton_principled"]

NEG_LOG2E: tl.constexpr = tl.constexpr(-1.4426950408889634)


@triton.jit
def _gate(ng, FAST: tl.constexpr):
    """softplus(ng) and sigmoid(ng) (its derivative) of the negated gate score ng = -g, from one
    exponential e = 2^(-|ng| log2 e) <= 1: softplus = max(ng, 0) + ln 2 log2(1 + e) and sigmoid = (1 or
    e) / (1 + e), overflow-free. FAST: the log and the reciprocal in the hardware's forms (one MUFU.LG2,
    one MUFU.RCP; `attnlab.ops.common.triton_math`'s `lg2`, `rcp`) where libdevice's logf and a
    division cost ~40 instructions per score."""
    e = tl.exp2(-tl.abs(ng) * LOG2E)
    x1 = 1.0 + e
    sp = tl.maximum(ng, 0.0) + LN2 * lg2(x1, FAST)
    sig = tl.where(ng >= 0.0, 1.0, e) * rcp(x1, FAST)
    return sp, sig


@triton.jit
def _logits(q, k, qg, kg, cs, thr, nspb, offs_m, offs_n, Tk, off, CAUSAL: tl.constexpr, PREC: tl.constexpr,
            UP: tl.constexpr, dq, dk, DOC: tl.constexpr, FAST: tl.constexpr):
    """(BLOCK_M, BLOCK_N) logits y in base 2 relative to the threshold (-inf where hidden), sigmoid(-g)
    (softplus(-g)'s derivative, for the backward) and softplus(-g), g the gate score."""
    y = mm(q, tl.trans(k), PREC, UP) * (cs * LOG2E)[:, None]
    sp, sig = _gate(-mm(qg, tl.trans(kg), PREC, UP), FAST)
    y = y + thr[:, None] + nspb[:, None] * sp
    seen = offs_n[None, :] < Tk
    if CAUSAL:
        seen = seen & (offs_n[None, :] <= offs_m[:, None] + off)
    if DOC:  # packed documents: a query sees the keys of its own document only
        seen = seen & (dq[:, None] == dk[None, :])
    return tl.where(seen, y, float("-inf")), sig, sp


@triton.jit
def _row_scalars(C, SPB, GAM, row, offs_m, m_ok, sm_scale):
    """A query tile's c / sqrt(d), threshold term -log2(e) c gamma, -log2(e) softplus(beta) and softplus(beta)."""
    c = tl.load(C + row + offs_m, mask=m_ok, other=0.0)
    spb = tl.load(SPB + row + offs_m, mask=m_ok, other=0.0)
    gam = tl.load(GAM + row + offs_m, mask=m_ok, other=0.0)
    return c * sm_scale, c * gam * NEG_LOG2E, spb * NEG_LOG2E, spb


@triton.jit
def _program(bh, H, GK, GG, GV, Tq, Tk):
    """Element offsets of program (batch x head) bh's rows: queries (and per-row scalars), per-head
    keys, its key, gate-key and value groups, and its batch row of document ids."""
    row, krow, kbase, vbase = bases(bh, H, GK, GV, Tq, Tk)
    _, _, gbase, _ = bases(bh, H, GG, GV, Tq, Tk)
    return row, krow, kbase, gbase, vbase, (bh // H).to(tl.int64) * Tk


@triton.jit
def _key_tile(K, KG, V, DOCS, kbase, gbase, vbase, drow, offs_n, n_ok, offs_d, offs_g, offs_v, D: tl.constexpr,
              DG: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DG: tl.constexpr,
              BLOCK_DV: tl.constexpr, DOC: tl.constexpr):
    """A key tile's keys, gate keys, values and document ids (zeros past Tk)."""
    k = load_rows(K, kbase, offs_n, n_ok, offs_d, D, True, BLOCK_D, K.dtype.element_ty)
    kg = load_rows(KG, gbase, offs_n, n_ok, offs_g, DG, True, BLOCK_DG, KG.dtype.element_ty)
    v = load_rows(V, vbase, offs_n, n_ok, offs_v, DV, True, BLOCK_DV, V.dtype.element_ty)
    return k, kg, v, doc_ids(DOCS, drow, offs_n, n_ok, DOC)


@triton.jit
def _query_tile(Q, QG, C, SPB, GAM, DOCS, row, drow, off, offs_m, m_ok, offs_d, offs_g, sm_scale, D: tl.constexpr,
                DG: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DG: tl.constexpr, DOC: tl.constexpr):
    """A query tile's queries, gate queries, per-row scalars (`_row_scalars`) and document ids."""
    q = load_rows(Q, row, offs_m, m_ok, offs_d, D, True, BLOCK_D, Q.dtype.element_ty)
    qg = load_rows(QG, row, offs_m, m_ok, offs_g, DG, True, BLOCK_DG, QG.dtype.element_ty)
    cs, thr, nspb, spb = _row_scalars(C, SPB, GAM, row, offs_m, m_ok, sm_scale)
    return q, qg, cs, thr, nspb, spb, doc_ids(DOCS, drow, offs_m + off, m_ok, DOC)


@triton.jit
def _fwd(Q, K, QG, KG, V, C, SPB, GAM, OK, W0, LSE, DOCS, START, END, Tq, Tk, H, GK, GG, GV, sm_scale,
         D: tl.constexpr, DG: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DG: tl.constexpr,
         BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
         PREC: tl.constexpr, UP: tl.constexpr, DOC: tl.constexpr, FAST: tl.constexpr = False,
         SPLIT: tl.constexpr = False):
    """SPLIT (16-bit v): the weights enter the product with v in two 16-bit parts, p = hi + lo, so that
    the float32 key readout carries p to ~2^-16 rather than the 2^-9 of one bf16 rounding: the
    backward's Delta = do . o_keys must equal sum_s w_s do . v_s, whose sum over keys the gradient of
    gamma (and alpha's, through c) is, up to a small remainder; a 16-bit p alone puts its rounding into
    that remainder (2.9e-2 relative error on gamma's gradient, tests/test_principled_triton.py). FAST:
    the gate's log and reciprocal in the hardware's forms (`_gate`)."""
    sm_scale = tl.cast(sm_scale, tl.float32)  # a Python float reaches a kernel as fp64 under Inductor
    m0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    off = Tk - Tq
    row, krow, kbase, gbase, vbase, drow = _program(bh, H, GK, GG, GV, Tq, Tk)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d, offs_g, offs_v = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DG), tl.arange(0, BLOCK_DV)
    m_ok = offs_m < Tq
    q, qg, cs, thr, nspb, _spb, dq = _query_tile(Q, QG, C, SPB, GAM, DOCS, row, drow, off, offs_m, m_ok, offs_d, offs_g,
                                              sm_scale, D, DG, BLOCK_D, BLOCK_DG, DOC)
    lo, hi = doc_span(START, END, drow, m0 + off, tl.minimum(m0 + BLOCK_M, Tq) - 1 + off, 0,
                       seen_end(m0, Tk, off, BLOCK_M, CAUSAL), BLOCK_N, DOC)
    m_i = tl.zeros((BLOCK_M,), tl.float32)  # running max of max(0, y): starts at the threshold
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    ex = tl.zeros((BLOCK_M,), tl.float32)  # grounded mass, relative to 2^M
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < Tk
        k, kg, v, dk = _key_tile(K, KG, V, DOCS, kbase, gbase, vbase, drow, offs_n, n_ok, offs_d, offs_g, offs_v, D, DG,
                                 DV, BLOCK_D, BLOCK_DG, BLOCK_DV, DOC)
        y, _sig, _sp = _logits(q, k, qg, kg, cs, thr, nspb, offs_m, offs_n, Tk, off, CAUSAL, PREC, UP, dq, dk, DOC,
                               FAST)
        m_new = tl.maximum(m_i, tl.max(y, 1))
        r = tl.exp2(m_i - m_new)
        p = tl.exp2(y - m_new[:, None])  # 0 where hidden
        ground = tl.where(y == float("-inf"), 0.0, tl.maximum(tl.exp2(-m_new)[:, None] - p, 0.0))
        p_hi = p.to(V.dtype.element_ty)
        acc = acc * r[:, None] + mm(p_hi, v, PREC, UP)
        if SPLIT:
            acc += mm((p - p_hi.to(tl.float32)).to(V.dtype.element_ty), v, PREC, UP)
        l_i = l_i * r + tl.sum(p, 1)
        ex = ex * r + tl.sum(ground, 1)
        m_i = m_new
    z = l_i + ex
    z = tl.where(z > 0.0, z, 1.0)  # rows past Tq
    tl.store(OK + (row + offs_m[:, None]) * DV + offs_v[None, :], acc / z[:, None],
             mask=m_ok[:, None] & (offs_v[None, :] < DV))
    tl.store(W0 + row + offs_m, ex / z, mask=m_ok)
    tl.store(LSE + row + offs_m, m_i + tl.log2(z), mask=m_ok)


@triton.jit
def _dlogits(y, do, v, lse, e, hd, PREC: tl.constexpr, UP: tl.constexpr):
    """The weights w = 2^(y - lse) and the logit gradient ds = w (do.v - e - hd sign(y)), e = dw0 + Delta / 2,
    hd = Delta / 2."""
    w = tl.exp2(y - lse[:, None])
    side = tl.where(y > 0.0, 1.0, tl.where(y < 0.0, -1.0, 0.0))
    dov = mm(do, tl.trans(v), PREC, UP)
    return w, w * (dov - e[:, None] - hd[:, None] * side)


@triton.jit
def _grad_rows(DO, LSE, E, HD, row, offs_m, m_ok, offs_v, DV: tl.constexpr, BLOCK_DV: tl.constexpr):
    do = load_rows(DO, row, offs_m, m_ok, offs_v, DV, True, BLOCK_DV, DO.dtype.element_ty)
    lse = tl.load(LSE + row + offs_m, mask=m_ok, other=float("inf"))  # w = 0 past Tq
    e = tl.load(E + row + offs_m, mask=m_ok, other=0.0)
    hd = tl.load(HD + row + offs_m, mask=m_ok, other=0.0)
    return do, lse, e, hd


@triton.jit
def _bwd_kv(Q, K, QG, KG, V, C, SPB, GAM, DO, LSE, E, HD, DOCS, START, END, DK, DKG, DV_, Tq, Tk, H, GK, GG, GV,
            sm_scale, D: tl.constexpr, DG: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DG: tl.constexpr,
            BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
            PREC: tl.constexpr, UP: tl.constexpr, DOC: tl.constexpr, FAST: tl.constexpr = False):
    sm_scale = tl.cast(sm_scale, tl.float32)  # a Python float reaches a kernel as fp64 under Inductor
    n0 = tl.program_id(0) * BLOCK_N
    bh = tl.program_id(1)
    off = Tk - Tq
    row, krow, kbase, gbase, vbase, drow = _program(bh, H, GK, GG, GV, Tq, Tk)
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d, offs_g, offs_v = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DG), tl.arange(0, BLOCK_DV)
    n_ok = offs_n < Tk
    k, kg, v, dk_ids = _key_tile(K, KG, V, DOCS, kbase, gbase, vbase, drow, offs_n, n_ok, offs_d, offs_g, offs_v, D, DG,
                                 DV, BLOCK_D, BLOCK_DG, BLOCK_DV, DOC)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dkg = tl.zeros((BLOCK_N, BLOCK_DG), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
    start = 0
    if CAUSAL:
        start = tl.maximum(n0 - off, 0)  # the first query that sees this key tile
    start, end = doc_span(START, END, drow, n0, tl.minimum(n0 + BLOCK_N, Tk) - 1, start + off, Tq + off, 1, DOC)
    for start_m in range(tl.maximum(start - off, 0) // BLOCK_M * BLOCK_M, end - off, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < Tq
        q, qg, cs, thr, nspb, spb, dq_ids = _query_tile(Q, QG, C, SPB, GAM, DOCS, row, drow, off, offs_m, m_ok, offs_d,
                                                        offs_g, sm_scale, D, DG, BLOCK_D, BLOCK_DG, DOC)
        do, lse, e, hd = _grad_rows(DO, LSE, E, HD, row, offs_m, m_ok, offs_v, DV, BLOCK_DV)
        y, sig, _ = _logits(q, k, qg, kg, cs, thr, nspb, offs_m, offs_n, Tk, off, CAUSAL, PREC, UP, dq_ids, dk_ids, DOC,
                            FAST)
        w, ds = _dlogits(y, do, v, lse, e, hd, PREC, UP)
        dv += mm(tl.trans(w).to(DO.dtype.element_ty), do, PREC, UP)
        dk += mm(tl.trans(ds * cs[:, None]).to(Q.dtype.element_ty), q, PREC, UP)
        gate = ds * sig * spb[:, None]  # dL/dg
        dkg += mm(tl.trans(gate).to(QG.dtype.element_ty), qg, PREC, UP)
    out = (krow + offs_n[:, None])  # per query head: the host sums each group
    tl.store(DK + out * D + offs_d[None, :], dk, mask=n_ok[:, None] & (offs_d[None, :] < D))
    tl.store(DKG + out * DG + offs_g[None, :], dkg, mask=n_ok[:, None] & (offs_g[None, :] < DG))
    tl.store(DV_ + out * DV + offs_v[None, :], dv, mask=n_ok[:, None] & (offs_v[None, :] < DV))


@triton.jit
def _bwd_q(Q, K, QG, KG, V, C, SPB, GAM, DO, LSE, E, HD, DOCS, START, END, DQK, DSUM, DQG, DSPB, DLOG, Tq, Tk, H,
           GK, GG, GV, sm_scale,
           D: tl.constexpr, DG: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DG: tl.constexpr,
           BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, CAUSAL: tl.constexpr,
           PREC: tl.constexpr, UP: tl.constexpr, DOC: tl.constexpr, FAST: tl.constexpr = False):
    sm_scale = tl.cast(sm_scale, tl.float32)  # a Python float reaches a kernel as fp64 under Inductor
    m0 = tl.program_id(0) * BLOCK_M
    bh = tl.program_id(1)
    off = Tk - Tq
    row, krow, kbase, gbase, vbase, drow = _program(bh, H, GK, GG, GV, Tq, Tk)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d, offs_g, offs_v = tl.arange(0, BLOCK_D), tl.arange(0, BLOCK_DG), tl.arange(0, BLOCK_DV)
    m_ok = offs_m < Tq
    q, qg, cs, thr, nspb, spb, dq_ids = _query_tile(Q, QG, C, SPB, GAM, DOCS, row, drow, off, offs_m, m_ok, offs_d,
                                                    offs_g, sm_scale, D, DG, BLOCK_D, BLOCK_DG, DOC)
    do, lse, e, hd = _grad_rows(DO, LSE, E, HD, row, offs_m, m_ok, offs_v, DV, BLOCK_DV)
    dqk = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    dqg = tl.zeros((BLOCK_M, BLOCK_DG), tl.float32)
    dsum = tl.zeros((BLOCK_M,), tl.float32)
    dspb = tl.zeros((BLOCK_M,), tl.float32)
    dlog = tl.zeros((BLOCK_M,), tl.float32)  # sum_s ds y: c's gradient in float32 (the host's note)
    lo, hi = doc_span(START, END, drow, m0 + off, tl.minimum(m0 + BLOCK_M, Tq) - 1 + off, 0,
                       seen_end(m0, Tk, off, BLOCK_M, CAUSAL), BLOCK_N, DOC)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < Tk
        k, kg, v, dk_ids = _key_tile(K, KG, V, DOCS, kbase, gbase, vbase, drow, offs_n, n_ok, offs_d, offs_g, offs_v, D,
                                     DG, DV, BLOCK_D, BLOCK_DG, BLOCK_DV, DOC)
        y, sig, sp = _logits(q, k, qg, kg, cs, thr, nspb, offs_m, offs_n, Tk, off, CAUSAL, PREC, UP, dq_ids, dk_ids,
                             DOC, FAST)
        _w, ds = _dlogits(y, do, v, lse, e, hd, PREC, UP)
        dqk += mm(ds.to(K.dtype.element_ty), k, PREC, UP)
        dsum += tl.sum(ds, 1)
        dspb -= tl.sum(ds * sp, 1)
        dlog += tl.sum(ds * tl.maximum(y, -3.0e38), 1)  # (0 where hidden: ds = 0 and y = -inf there)
        dqg += mm((ds * sig).to(KG.dtype.element_ty), kg, PREC, UP)
    tl.store(DQK + (row + offs_m[:, None]) * D + offs_d[None, :], dqk, mask=m_ok[:, None] & (offs_d[None, :] < D))
    tl.store(DQG + (row + offs_m[:, None]) * DG + offs_g[None, :], dqg * spb[:, None],
             mask=m_ok[:, None] & (offs_g[None, :] < DG))
    tl.store(DSUM + row + offs_m, dsum, mask=m_ok)
    tl.store(DSPB + row + offs_m, dspb, mask=m_ok)
    tl.store(DLOG + row + offs_m, dlog, mask=m_ok)


def _pow2(n: int) -> int:
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def _launch(kernel, grid, tensors, Tq, Tk, H, groups, sm_scale, dims, causal, dtype, blocks, docs, **extra):
    D, DG, DV = dims
    BLOCK_M, BLOCK_N, warps, stages = blocks
    up = interpreted() and dtype in (torch.bfloat16, torch.float16)
    kernel[grid](*tensors, Tq, Tk, H, *groups, sm_scale, D, DG, DV, _pow2(D), _pow2(DG), _pow2(DV), BLOCK_M, BLOCK_N,
                 causal, "ieee", up, docs, FAST=fast_math(), num_warps=warps, num_stages=stages, **extra)


def _blocks(device: torch.device, dims, kind: str = "fwd") -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) of kernel kind "fwd", "bwd_kv" or "bwd_q": small under
    the interpreter (NumPy work per program); on a GPU 64 x 64 tiles on 4 warps (the scalar kernel's
    tuned choice; 32-row tiles past width 64), and 32-query tiles for the key-major dk/dv kernel, whose
    three accumulators (dk, dkg, dv) leave no registers for 64 x 64 tiles of scores (measured:
    benchmarks/kernel_sass.py, spills at 64 x 64)."""
    if device.type != "cuda":
        return 32, 32, 4, 1
    if kind == "bwd_kv":
        return 32, 64, 4, 2
    return (64, 64, 4, 2) if max(dims) <= 64 else (32, 64, 4, 2)


class _Principled(torch.autograd.Function):
    """q (B, H, Tq, D), k (B, G, Tk, D), qg (B, H, Tq, Dg), kg (B, Gg, Tk, Dg), v (B, Gv, Tk, Dv) in
    one dtype; c, softplus(beta), gamma (B, H, Tq) float32. Returns the key readout (B, H, Tq, Dv) and
    w0 (B, H, Tq), float32."""

    @staticmethod
    def forward(ctx, q, k, qg, kg, v, c, spb, gamma, causal: bool, docs):
        q, k, qg, kg, v = (x.contiguous() for x in (q, k, qg, kg, v))
        c, spb, gamma = (x.float().contiguous() for x in (c, spb, gamma))
        B, H, Tq, D = q.shape
        Tk, DG, DV = k.shape[2], qg.shape[3], v.shape[3]
        groups = (k.shape[1], kg.shape[1], v.shape[1])
        blocks = _blocks(q.device, (D, DG, DV))
        ok = torch.empty(B, H, Tq, DV, device=q.device, dtype=torch.float32)
        w0 = torch.empty(B, H, Tq, device=q.device, dtype=torch.float32)
        lse = torch.empty_like(w0)
        grid = (triton.cdiv(Tq, blocks[0]), B * H)
        spans = document_spans(docs) if docs is not None else (w0,) * 3
        _launch(_fwd, grid, (q, k, qg, kg, v, c, spb, gamma, ok, w0, lse, *spans), Tq, Tk, H, groups, 1 / math.sqrt(D),
                (D, DG, DV), causal, q.dtype, blocks, docs is not None,
                SPLIT=v.dtype in (torch.bfloat16, torch.float16))
        ctx.save_for_backward(q, k, qg, kg, v, c, spb, gamma, ok, w0, lse, *spans)
        ctx.docs = docs is not None
        ctx.causal = causal
        return ok, w0

    @staticmethod
    def backward(ctx, d_ok, d_w0):
        q, k, qg, kg, v, c, spb, gamma, ok, w0, lse, *spans = ctx.saved_tensors
        B, H, Tq, D = q.shape
        Tk, DG, DV = k.shape[2], qg.shape[3], v.shape[3]
        groups = (k.shape[1], kg.shape[1], v.shape[1])
        blocks = _blocks(q.device, (D, DG, DV))
        kv_blocks = _blocks(q.device, (D, DG, DV), "bwd_kv")
        d_ok = torch.zeros_like(ok) if d_ok is None else d_ok.float()
        d_w0 = torch.zeros_like(w0) if d_w0 is None else d_w0.float()
        delta = (d_ok * ok).sum(-1) - d_w0 * (1 - w0)  # (B, H, Tq)
        e, hd = (d_w0 + 0.5 * delta).contiguous(), (0.5 * delta).contiguous()
        do = d_ok.to(v.dtype).contiguous()
        sm_scale = 1 / math.sqrt(D)
        f32 = dict(device=q.device, dtype=torch.float32)
        dk, dkg, dv = torch.empty(B, H, Tk, D, **f32), torch.empty(B, H, Tk, DG, **f32), torch.empty(B, H, Tk, DV, **f32)
        args = (q, k, qg, kg, v, c, spb, gamma, do, lse, e, hd, *spans)
        _launch(_bwd_kv, (triton.cdiv(Tk, kv_blocks[1]), B * H), (*args, dk, dkg, dv), Tq, Tk, H, groups, sm_scale,
                (D, DG, DV), ctx.causal, q.dtype, kv_blocks, ctx.docs)
        dqk, dqg = torch.empty(B, H, Tq, D, **f32), torch.empty(B, H, Tq, DG, **f32)
        dsum, dspb, dlog = (torch.empty(B, H, Tq, **f32) for _ in range(3))
        _launch(_bwd_q, (triton.cdiv(Tq, blocks[0]), B * H), (*args, dqk, dsum, dqg, dspb, dlog), Tq, Tk, H, groups,
                sm_scale, (D, DG, DV), ctx.causal, q.dtype, blocks, ctx.docs)
        dq = dqk * (c * sm_scale)[..., None]
        # c's gradient sum_s ds (s - gamma) from float32 row sums: with the natural logit l = c (s - gamma) - b
        # = y ln 2 and b = softplus(beta) sp, it is (sum_s ds l + softplus(beta) sum_s ds sp) / c. (q . dqk
        # would carry each ds rounded to 16 bits for the product: ~1e-2 on alpha's gradient in bf16.)
        dc = (math.log(2.0) * dlog - spb * dspb) / c
        dgamma = -c * dsum

        def grouped(x, G):  # per query head -> per group
            return x if G == H else x.view(B, G, H // G, *x.shape[2:]).sum(2)

        return (dq.to(q.dtype), grouped(dk, groups[0]).to(k.dtype), dqg.to(qg.dtype), grouped(dkg, groups[1]).to(kg.dtype),
                grouped(dv, groups[2]).to(v.dtype), dc, dspb, dgamma, None, None)


def document_log_counts(docs: torch.Tensor, Tq: int, causal: bool, dtype) -> torch.Tensor:
    """log K per query under packed documents, (B, 1, Tq): the keys of its own document it sees (up to
    itself under causal masking, the whole document otherwise)."""
    _, start, end = document_spans(docs)
    Tk = docs.shape[1]
    pos = torch.arange(Tk - Tq, Tk, device=docs.device)
    count = (pos + 1 - start[:, Tk - Tq:]) if causal else (end - start)[:, Tk - Tq:]
    return count.to(dtype).log()[:, None]


def triton_principled(q, k, qg, kg, v, c, spb, gamma, causal: bool, docs: torch.Tensor | None = None):
    """The fused kernel on validated inputs: q (B, H, Tq, D), k (B, G, Tk, D), qg (B, H, Tq, Dg),
    kg (B, Gg, Tk, Dg), v (B, Gv, Tk, Dv) in one dtype (each group count dividing H); c (the margin
    factor 1 + softplus(alpha) log K), softplus(beta) and gamma as (B, H, Tq). Returns the key readout
    sum_s w_s v_s (B, H, Tq, Dv) and the ground weight w0 (B, H, Tq), both float32, differentiable in
    every input. docs (B, Tk): document ids of the keys (query t is key t + Tk - Tq) for packed
    documents: a query sees only its own document's keys (K in c must then count those), and tiles of
    other documents are skipped."""
    return _Principled.apply(q, k, qg, kg, v, c, spb, gamma, causal, docs)
