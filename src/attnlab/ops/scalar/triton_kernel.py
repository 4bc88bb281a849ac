"""The scalar family's fused GPU kernel: scalar and hybrid attention under either kernel, in Triton.

One online-softmax loop over key tiles (the fused-attention pattern: no Tq x Tk matrix is stored,
forward or backward) whose score is

    s_ts = [q_t . k_s / sqrt(d)] + lam_t * phi((qs_t - ks_s)^2 / tau_t)

with phi(x) = -x (Gaussian) or -log(1 + x) (Cauchy) and the bracket present for hybrid heads only.
The dot product runs on the matrix units in the inputs' dtype (bf16 / fp16 operands, float32
accumulation; float32 inputs in full float32, no TF32); the scalar term is formed in float32 from
float32 qs, ks, tau and lam whatever the inputs' dtype, so it carries none of the cancellation of
the augmented SDPA route (`attnlab.ops.scalar`, module docstring) and needs no reference shift.

Backward (two kernels, as FlashAttention-2): one per key tile accumulates dk, dv and dks over the
query tiles that see it; one per query tile accumulates dq, dqs and the per-row gradients of tau
and lam over the key tiles it sees. Probabilities are recomputed from the forward's log-sum-exp.
Grouped keys / values (GQA) are read in place; their gradients are formed per query head and
summed over each group. Causal masking aligns the Tq queries with the last Tq of the Tk keys.

On the CPU the kernels run under Triton's interpreter (TRITON_INTERPRET=1, set before Triton is
imported): that is how the tests compare them with the naive op without a GPU.
"""

from __future__ import annotations

import os

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # the kernels keep scores and log-sum-exps in base 2
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fast_math() -> bool:
    """The kernels' FAST switch, read by the launchers at each launch: the Cauchy kernel's log and
    division in the hardware's approximate forms (`_log2_1p`, `_over_1p`), compiled for a GPU; off
    under the interpreter (TRITON_INTERPRET=1, which cannot run inline PTX) and with
    ATTNLAB_TRITON_FAST_MATH=0 (the accurate forms, as before: benchmarks/kernel_sass.py's baseline)."""
    return not interpreted() and os.environ.get("ATTNLAB_TRITON_FAST_MATH", "1").strip() != "0"


def _interpreter_compat() -> None:
    """Triton 3.6's interpreter turns a scalar into an index by int() of a one-element array, which
    NumPy >= 2.4 refuses; a loop bound read from program_id needs it. Take the element instead."""
    from triton.runtime import interpreter as ti

    if getattr(ti, "_attnlab_index_compat", False):
        return
    patch = ti._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    ti._patch_lang_tensor = patched
    ti._attnlab_index_compat = True



if interpreted():
    _interpreter_compat()


@triton.jit
def _mm(a, b, PREC: tl.constexpr, UP: tl.constexpr):
    """a @ b on the matrix units; UP: in float32 from the (already rounded) 16-bit operands, for the
    interpreter, whose dot misreads bf16 (the products are exact either way, the sums float32)."""
    if UP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def _log2_1p(x, FAST: tl.constexpr):
    """log2(1 + x) for x >= 0 (float32). FAST: the hardware approximation (PTX lg2.approx, one MUFU.LG2:
    error ~2^-22, absolute on [1, 2) and relative above, a few times the float32 rounding of 1 + x
    itself and far below bf16's; flushing subnormals is moot as 1 + x >= 1) in place of libdevice's
    accurate log2f, ~25 instructions per score on sm_90 (benchmarks/kernel_sass.py)."""
    if FAST:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return tl.log2(1.0 + x)


@triton.jit
def _over_1p(a, x, FAST: tl.constexpr):
    """a / (1 + x) for x >= 0 (float32). FAST: a times the hardware reciprocal (PTX rcp.approx.ftz, one
    MUFU.RCP, 1 ulp): two instructions, where Triton's division (div.full.f32, itself approximate) also
    tests and scales both operands for a divisor near either end of the range, ~8; 1 + x >= 1 needs no
    scaling (the reciprocal flushes to 0 past 1 + x = 2^126, where the quotient is below 2^-126 |a|)."""
    if FAST:
        return a * tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + x], dtype=tl.float32,
                                             is_pure=True, pack=1)
    return a / (1.0 + x)


@triton.jit
def _scores(q, k, qs, ks, us, tau, lam, offs_m, offs_n, Tk, off, sm_scale, HAS_DOT: tl.constexpr,
            BIAS: tl.constexpr, KERNEL: tl.constexpr, CAUSAL: tl.constexpr, MASK: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr,
            dq=0, dk=0, DOC: tl.constexpr = False, FAST: tl.constexpr = False):
    """(BLOCK_M, BLOCK_N) scores in base 2 (the score times log2(e), so exp2 takes them; -inf where
    hidden, if MASK: tiles wholly visible skip the mask) and the pieces the backward needs: d = qs - ks,
    x = d^2 / tau and l1 = log2(1 + x) (Cauchy; x again for the Gaussian; KERNEL 2 has no scalar term).
    FAST: the log in the hardware's approximate form (`_log2_1p`)."""
    if KERNEL == 2:  # no scalar term (GOAT): the product alone
        d = 0.0
        x = 0.0
        l1 = 0.0
        s = _mm(q, tl.trans(k), PREC, UP) * (sm_scale * LOG2E)
    else:
        d = qs[:, None] - ks[None, :]
        x = d * d * tau[:, None]  # tau holds 1 / tau_t: a product per entry, not a division
        if KERNEL == 0:
            l1 = x
            s = -(lam * LOG2E)[:, None] * x  # -lam x log2(e)
        else:
            l1 = _log2_1p(x, FAST)
            s = -lam[:, None] * l1  # -lam ln(1 + x) log2(e)
        if HAS_DOT:
            s += _mm(q, tl.trans(k), PREC, UP) * (sm_scale * LOG2E)
    if BIAS:  # a key-only term u_s, in float32
        s += (us * LOG2E)[None, :]
    if MASK:
        ok = offs_n[None, :] < Tk
        if CAUSAL:
            ok = ok & (offs_n[None, :] <= offs_m[:, None] + off)
        if DOC:  # packed documents: a query sees the keys of its own document only
            ok = ok & (dq[:, None] == dk[None, :])
        s = tl.where(ok, s, float("-inf"))
    return s, d, x, l1


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
def _load_rows(X, base, offs, n_ok, offs_d, D: tl.constexpr, LOAD: tl.constexpr, BLOCK_D: tl.constexpr,
               dtype: tl.constexpr):
    """(len(offs), BLOCK_D) rows base + offs of a row-major (.., D) tensor, zeros where absent."""
    if LOAD:
        return tl.load(X + (base + offs[:, None]) * D + offs_d[None, :], mask=n_ok[:, None] & (offs_d[None, :] < D),
                       other=0.0)
    return tl.zeros((offs.shape[0], BLOCK_D), dtype=dtype)


@triton.jit
def _bases(bh, H, GK, GV, Tq, Tk):
    """Element offsets of program (batch x head) bh's rows: its queries (and per-row scalars), its
    scalar keys, and the rows of its key and value groups (GQA: head h reads group h // (H / G))."""
    b = bh // H
    h = bh % H
    row = bh.to(tl.int64) * Tq
    krow = bh.to(tl.int64) * Tk
    kbase = (b * GK + h // (H // GK)).to(tl.int64) * Tk
    vbase = (b * GV + h // (H // GV)).to(tl.int64) * Tk
    return row, krow, kbase, vbase


@triton.jit
def _query_rows(Q, QS, TAU, LAM, row, offs_m, m_ok, offs_d, D: tl.constexpr, HAS_DOT: tl.constexpr,
                BLOCK_D: tl.constexpr):
    """A query tile's qs, 1 / tau, gain and vectors (zeros past Tq)."""
    qs = tl.load(QS + row + offs_m, mask=m_ok, other=0.0)
    tau = tl.load(TAU + row + offs_m, mask=m_ok, other=1.0)
    lam = tl.load(LAM + row + offs_m, mask=m_ok, other=0.0)
    q = _load_rows(Q, row, offs_m, m_ok, offs_d, D, HAS_DOT, BLOCK_D, Q.dtype.element_ty)
    return qs, tau, lam, q


@triton.jit
def _load_bias(U, krow, offs_n, n_ok, BIAS: tl.constexpr):
    """A key tile's key-only terms u (float32), or 0 without them."""
    u = 0.0
    if BIAS:
        u = tl.load(U + krow + offs_n, mask=n_ok, other=0.0)
    return u


@triton.jit
def _key_rows(K, V, KS, U, kbase, vbase, krow, offs_n, n_ok, offs_d, offs_dv, D: tl.constexpr, DV: tl.constexpr,
              HAS_DOT: tl.constexpr, BIAS: tl.constexpr, BLOCK_D: tl.constexpr):
    """A key tile's scalar keys, key-only terms, key vectors and values (zeros past Tk)."""
    ks = tl.load(KS + krow + offs_n, mask=n_ok, other=0.0)
    us = _load_bias(U, krow, offs_n, n_ok, BIAS)
    k = _load_rows(K, kbase, offs_n, n_ok, offs_d, D, HAS_DOT, BLOCK_D, K.dtype.element_ty)
    v = tl.load(V + (vbase + offs_n[:, None]) * DV + offs_dv[None, :], mask=n_ok[:, None] & (offs_dv[None, :] < DV),
                other=0.0)
    return ks, us, k, v


@triton.jit
def _grad_rows(LSE, DELTA, DO, row, offs_m, m_ok, offs_dv, DV: tl.constexpr):
    """A query tile's log-sum-exp (+inf past Tq, so p = 0 there), delta and output gradient."""
    lse = tl.load(LSE + row + offs_m, mask=m_ok, other=float("inf"))
    delta = tl.load(DELTA + row + offs_m, mask=m_ok, other=0.0)
    do = tl.load(DO + (row + offs_m[:, None]) * DV + offs_dv[None, :], mask=m_ok[:, None] & (offs_dv[None, :] < DV),
                 other=0.0)
    return lse, delta, do


@triton.jit
def _seen_end(m0, Tk, off, BLOCK_M: tl.constexpr, CAUSAL: tl.constexpr):
    """One past the last key the query tile from m0 sees (its rows past Tq see no more)."""
    hi = Tk
    if CAUSAL:
        hi = m0 + BLOCK_M + off
        if hi > Tk:
            hi = Tk
    return hi


@triton.jit
def _doc_ids(DOCS, drow, offs, ok, DOC: tl.constexpr):
    """Document (segment) ids of positions offs of batch row drow (-1 past the end), or 0 without documents."""
    ids = 0
    if DOC:
        ids = tl.load(DOCS + drow + offs, mask=ok, other=-1)
    return ids


@triton.jit
def _doc_span(START, END, drow, first, last, lo, hi, BLOCK: tl.constexpr, DOC: tl.constexpr):
    """[lo, hi) narrowed to the documents of positions first..last (START / END: each position's
    document's first position and one past its last), lo rounded down to a tile of BLOCK."""
    if DOC:
        lo = tl.maximum(lo, tl.load(START + drow + first) // BLOCK * BLOCK)
        hi = tl.minimum(hi, tl.load(END + drow + last))
    return lo, hi


@triton.jit
def _fwd_tile(acc, m_i, l_i, q, qs, tau, lam, K, V, KS, U, kbase, vbase, krow, start_n, offs_m, offs_d, offs_dv,
              Tk, off, sm_scale, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
              HAS_DOT: tl.constexpr, BIAS: tl.constexpr, KERNEL: tl.constexpr, CAUSAL: tl.constexpr, MASK: tl.constexpr,
              PREC: tl.constexpr, UP: tl.constexpr, DOCS, drow, dq, DOC: tl.constexpr, FAST: tl.constexpr):
    """One key tile of the online softmax: the running max m_i, sum l_i and output acc, updated."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < Tk
    ks, us, k, v = _key_rows(K, V, KS, U, kbase, vbase, krow, offs_n, n_ok, offs_d, offs_dv, D, DV, HAS_DOT, BIAS,
                             BLOCK_D)
    dk = _doc_ids(DOCS, drow, offs_n, n_ok, DOC)
    s, d, x, l1 = _scores(q, k, qs, ks, us, tau, lam, offs_m, offs_n, Tk, off, sm_scale, HAS_DOT, BIAS, KERNEL, CAUSAL,
                          MASK, PREC, UP, dq, dk, DOC, FAST)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(s - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, PREC, UP)
    return acc, m_new, l_i * alpha + tl.sum(p, 1)


@triton.jit
def _fwd(Q, K, V, QS, KS, U, TAU, LAM, O, LSE, DOCS, START, END, Tq, Tk, H, GK, GV, sm_scale,
         D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DOT: tl.constexpr, BIAS: tl.constexpr, KERNEL: tl.constexpr,
         CAUSAL: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, DOC: tl.constexpr, FAST: tl.constexpr):
    m0 = tl.program_id(0) * BLOCK_M
    off = Tk - Tq
    row, krow, kbase, vbase = _bases(tl.program_id(1), H, GK, GV, Tq, Tk)
    drow = (tl.program_id(1) // H).to(tl.int64) * Tk  # the batch row's document ids (by key position)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < Tq
    qs, tau, lam, q = _query_rows(Q, QS, TAU, LAM, row, offs_m, m_ok, offs_d, D, HAS_DOT, BLOCK_D)
    dq = _doc_ids(DOCS, drow, offs_m + off, m_ok, DOC)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    lo = 0
    full = _visible_tiles(m0, Tk, off, BLOCK_N, CAUSAL)
    hi = _seen_end(m0, Tk, off, BLOCK_M, CAUSAL)
    if DOC:  # only the key tiles of the tile's documents, every one masked
        lo, hi = _doc_span(START, END, drow, m0 + off, tl.minimum(m0 + BLOCK_M, Tq) - 1 + off, lo, hi, BLOCK_N, DOC)
        full = lo
    for start_n in range(lo, full, BLOCK_N):  # whole tiles: no mask
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, qs, tau, lam, K, V, KS, U, kbase, vbase, krow, start_n, offs_m,
                                  offs_d, offs_dv, Tk, off, sm_scale, D, DV, BLOCK_D, BLOCK_N, HAS_DOT, BIAS, KERNEL,
                                  CAUSAL, False, PREC, UP, DOCS, drow, dq, DOC, FAST)
    for start_n in range(full, hi, BLOCK_N):  # the diagonal and the ragged end
        acc, m_i, l_i = _fwd_tile(acc, m_i, l_i, q, qs, tau, lam, K, V, KS, U, kbase, vbase, krow, start_n, offs_m,
                                  offs_d, offs_dv, Tk, off, sm_scale, D, DV, BLOCK_D, BLOCK_N, HAS_DOT, BIAS, KERNEL,
                                  CAUSAL, True, PREC, UP, DOCS, drow, dq, DOC, FAST)
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(O + (row + offs_m[:, None]) * DV + offs_dv[None, :], out.to(O.dtype.element_ty),
             mask=m_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(LSE + row + offs_m, m_i + tl.log2(l_safe), mask=m_ok)  # base 2, as the scores


@triton.jit
def _kv_tile(dk, dv, dks, du, k, v, ks, us, Q, QS, TAU, LAM, DO, LSE, DELTA, row, start_m, offs_n, offs_d, offs_dv, Tq, Tk,
             off, sm_scale, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_M: tl.constexpr,
             HAS_DOT: tl.constexpr, BIAS: tl.constexpr, KERNEL: tl.constexpr, CAUSAL: tl.constexpr, MASK: tl.constexpr,
             PREC: tl.constexpr, UP: tl.constexpr, DOCS, drow, dkey, DOC: tl.constexpr, FAST: tl.constexpr):
    """One query tile's share of a key tile's dk, dv, dks and du. Rows past Tq read lse = +inf: p = 0."""
    offs_m = start_m + tl.arange(0, BLOCK_M)
    m_ok = offs_m < Tq
    qs, tau, lam, q = _query_rows(Q, QS, TAU, LAM, row, offs_m, m_ok, offs_d, D, HAS_DOT, BLOCK_D)
    lse, delta, do = _grad_rows(LSE, DELTA, DO, row, offs_m, m_ok, offs_dv, DV)
    dqd = _doc_ids(DOCS, drow, offs_m + off, m_ok, DOC)
    s, d, x, l1 = _scores(q, k, qs, ks, us, tau, lam, offs_m, offs_n, Tk, off, sm_scale, HAS_DOT, BIAS, KERNEL, CAUSAL,
                          MASK, PREC, UP, dqd, dkey, DOC, FAST)
    if KERNEL == 1:
        d = _over_1p(d, x, FAST)  # d phi'(x) with phi' = 1 / (1 + x), before the products: one tile live, not two
    p = tl.exp2(s - lse[:, None])
    dv += _mm(tl.trans(p.to(do.dtype)), do, PREC, UP)
    ds = p * (_mm(do, tl.trans(v), PREC, UP) - delta[:, None])  # the gradient of the (natural) score
    if HAS_DOT:
        dk += _mm(tl.trans(ds.to(q.dtype)), q, PREC, UP)
    if BIAS:
        du += tl.sum(ds, 0)
    if KERNEL != 2:
        dks += tl.sum(ds * d * (2.0 * lam * tau)[:, None], 0)  # d score / d ks = 2 lam phi'(x) (qs - ks) / tau
    return dk, dv, dks, du


@triton.jit
def _bwd_kv(Q, K, V, QS, KS, U, TAU, LAM, DO, LSE, DELTA, DOCS, START, END, DK, DV_, DKS, DU, Tq, Tk, H, GK, GV,
            sm_scale, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DOT: tl.constexpr, BIAS: tl.constexpr, KERNEL: tl.constexpr,
            CAUSAL: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, DOC: tl.constexpr, FAST: tl.constexpr):
    n0 = tl.program_id(0) * BLOCK_N
    off = Tk - Tq
    row, krow, kbase, vbase = _bases(tl.program_id(1), H, GK, GV, Tq, Tk)
    drow = (tl.program_id(1) // H).to(tl.int64) * Tk
    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    n_ok = offs_n < Tk
    ks, us, k, v = _key_rows(K, V, KS, U, kbase, vbase, krow, offs_n, n_ok, offs_d, offs_dv, D, DV, HAS_DOT, BIAS,
                             BLOCK_D)
    dkey = _doc_ids(DOCS, drow, offs_n, n_ok, DOC)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
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
        lo, end = _doc_span(START, END, drow, n0, tl.minimum(n0 + BLOCK_N, Tk) - 1, lo + off, end + off, 1, DOC)
        lo = tl.maximum(lo - off, 0) // BLOCK_M * BLOCK_M
        end = end - off
        full = end
    for start_m in range(lo, full, BLOCK_M):  # the diagonal
        dk, dv, dks, du = _kv_tile(dk, dv, dks, du, k, v, ks, us, Q, QS, TAU, LAM, DO, LSE, DELTA, row, start_m, offs_n, offs_d,
                               offs_dv, Tq, Tk, off, sm_scale, D, DV, BLOCK_D, BLOCK_M, HAS_DOT, BIAS, KERNEL, CAUSAL,
                               True, PREC, UP, DOCS, drow, dkey, DOC, FAST)
    for start_m in range(full, end, BLOCK_M):  # whole tiles (non-causal: every tile; padded keys are not stored)
        dk, dv, dks, du = _kv_tile(dk, dv, dks, du, k, v, ks, us, Q, QS, TAU, LAM, DO, LSE, DELTA, row, start_m, offs_n, offs_d,
                               offs_dv, Tq, Tk, off, sm_scale, D, DV, BLOCK_D, BLOCK_M, HAS_DOT, BIAS, KERNEL, CAUSAL,
                               False, PREC, UP, DOCS, drow, dkey, DOC, FAST)
    tl.store(DK + (krow + offs_n[:, None]) * BLOCK_D + offs_d[None, :], dk * sm_scale, mask=n_ok[:, None])
    tl.store(DV_ + (krow + offs_n[:, None]) * BLOCK_DV + offs_dv[None, :], dv, mask=n_ok[:, None])
    tl.store(DKS + krow + offs_n, dks, mask=n_ok)
    if BIAS:
        tl.store(DU + krow + offs_n, du, mask=n_ok)


@triton.jit
def _q_tile(dq, da, dx, dl, q, qs, tau, lam, do, lse, delta, K, V, KS, U, kbase, vbase, krow, start_n, offs_m,
            offs_d, offs_dv, Tk, off, sm_scale, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr,
            BLOCK_N: tl.constexpr, HAS_DOT: tl.constexpr, BIAS: tl.constexpr, KERNEL: tl.constexpr, CAUSAL: tl.constexpr,
            MASK: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, DOCS, drow, dqd, DOC: tl.constexpr,
            FAST: tl.constexpr):
    """One key tile's share of a query tile's dq and of the per-row sums A = sum ds phi' d, X = sum ds
    phi' x and L = sum ds l1 (phi' = 1 for the Gaussian, 1 / (1 + x) for the Cauchy kernel) that give
    the gradients of qs, tau and the gain."""
    offs_n = start_n + tl.arange(0, BLOCK_N)
    n_ok = offs_n < Tk
    ks, us, k, v = _key_rows(K, V, KS, U, kbase, vbase, krow, offs_n, n_ok, offs_d, offs_dv, D, DV, HAS_DOT, BIAS,
                             BLOCK_D)
    dkey = _doc_ids(DOCS, drow, offs_n, n_ok, DOC)
    s, d, x, l1 = _scores(q, k, qs, ks, us, tau, lam, offs_m, offs_n, Tk, off, sm_scale, HAS_DOT, BIAS, KERNEL, CAUSAL,
                          MASK, PREC, UP, dqd, dkey, DOC, FAST)
    p = tl.exp2(s - lse[:, None])
    ds = p * (_mm(do, tl.trans(v), PREC, UP) - delta[:, None])  # 0 wherever a key is hidden
    if HAS_DOT:
        dq += _mm(ds.to(k.dtype), k, PREC, UP)
    if KERNEL == 1:
        dl += tl.sum(ds * l1, 1)
        ds = _over_1p(ds, x, FAST)
    if KERNEL != 2:
        da += tl.sum(ds * d, 1)
        dx += tl.sum(ds * x, 1)
    return dq, da, dx, dl


@triton.jit
def _bwd_q(Q, K, V, QS, KS, U, TAU, LAM, DO, LSE, DELTA, DOCS, START, END, DQ, DQS, DTAU, DLAM, Tq, Tk, H, GK, GV,
           sm_scale, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DOT: tl.constexpr, BIAS: tl.constexpr, KERNEL: tl.constexpr,
           CAUSAL: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr, DOC: tl.constexpr, FAST: tl.constexpr):
    m0 = tl.program_id(0) * BLOCK_M
    off = Tk - Tq
    row, krow, kbase, vbase = _bases(tl.program_id(1), H, GK, GV, Tq, Tk)
    drow = (tl.program_id(1) // H).to(tl.int64) * Tk
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    m_ok = offs_m < Tq
    qs, tau, lam, q = _query_rows(Q, QS, TAU, LAM, row, offs_m, m_ok, offs_d, D, HAS_DOT, BLOCK_D)
    lse, delta, do = _grad_rows(LSE, DELTA, DO, row, offs_m, m_ok, offs_dv, DV)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    da = tl.zeros((BLOCK_M,), tl.float32)
    dx = tl.zeros((BLOCK_M,), tl.float32)
    dl = tl.zeros((BLOCK_M,), tl.float32)
    dqd = _doc_ids(DOCS, drow, offs_m + off, m_ok, DOC)
    lo = 0
    full = _visible_tiles(m0, Tk, off, BLOCK_N, CAUSAL)
    hi = _seen_end(m0, Tk, off, BLOCK_M, CAUSAL)
    if DOC:
        lo, hi = _doc_span(START, END, drow, m0 + off, tl.minimum(m0 + BLOCK_M, Tq) - 1 + off, lo, hi, BLOCK_N, DOC)
        full = lo
    for start_n in range(lo, full, BLOCK_N):
        dq, da, dx, dl = _q_tile(dq, da, dx, dl, q, qs, tau, lam, do, lse, delta, K, V, KS, U, kbase, vbase,
                                 krow, start_n, offs_m, offs_d, offs_dv, Tk, off, sm_scale, D, DV, BLOCK_D,
                                 BLOCK_N, HAS_DOT, BIAS, KERNEL, CAUSAL, False, PREC, UP, DOCS, drow, dqd, DOC, FAST)
    for start_n in range(full, hi, BLOCK_N):
        dq, da, dx, dl = _q_tile(dq, da, dx, dl, q, qs, tau, lam, do, lse, delta, K, V, KS, U, kbase, vbase,
                                 krow, start_n, offs_m, offs_d, offs_dv, Tk, off, sm_scale, D, DV, BLOCK_D,
                                 BLOCK_N, HAS_DOT, BIAS, KERNEL, CAUSAL, True, PREC, UP, DOCS, drow, dqd, DOC, FAST)
    tl.store(DQ + (row + offs_m[:, None]) * BLOCK_D + offs_d[None, :], dq * sm_scale, mask=m_ok[:, None])
    _store_row_grads(DQS, DTAU, DLAM, row, offs_m, m_ok, lam, tau, da, dx, dl, KERNEL)


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
