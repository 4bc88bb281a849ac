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

import math
import os

import torch
import triton
import triton.language as tl

__all__ = ["available", "triton_scalar_attention"]

GAUSSIAN, CAUCHY = 0, 1


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def available(device: torch.device) -> str | None:
    """None when the Triton kernels can run on `device`, else why not (for the error message)."""
    if device.type == "cuda" or (device.type == "cpu" and interpreted()):
        return None
    return f"Triton runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1), got device {device}"


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
def _scores(q, k, qs, ks, tau, lam, offs_m, offs_n, Tq, Tk, off, sm_scale,
            HAS_DOT: tl.constexpr, KERNEL: tl.constexpr, CAUSAL: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    """(BLOCK_M, BLOCK_N) scores, -inf where hidden, and the pieces the backward needs."""
    d = qs[:, None] - ks[None, :]
    x = d * d * tau[:, None]  # tau holds 1 / tau_t: a product per entry, not a division
    if KERNEL == 0:
        term = -x
    else:
        term = -tl.log(1.0 + x)
    s = lam[:, None] * term
    if HAS_DOT:
        s += _mm(q, tl.trans(k), PREC, UP) * sm_scale
    ok = (offs_m[:, None] < Tq) & (offs_n[None, :] < Tk)
    if CAUSAL:
        ok = ok & (offs_n[None, :] <= offs_m[:, None] + off)
    s = tl.where(ok, s, float("-inf"))
    return s, ok, d, x, term

@triton.jit
def _fwd(Q, K, V, QS, KS, TAU, LAM, O, LSE, Tq, Tk, H, GK, GV, sm_scale,
         D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
         BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DOT: tl.constexpr, KERNEL: tl.constexpr,
         CAUSAL: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    off = Tk - Tq
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row = bh.to(tl.int64) * Tq
    krow = bh.to(tl.int64) * Tk
    kbase = (b * GK + h // (H // GK)).to(tl.int64) * Tk
    vbase = (b * GV + h // (H // GV)).to(tl.int64) * Tk
    m_ok = offs_m < Tq
    qs = tl.load(QS + row + offs_m, mask=m_ok, other=0.0)
    tau = tl.load(TAU + row + offs_m, mask=m_ok, other=1.0)
    lam = tl.load(LAM + row + offs_m, mask=m_ok, other=0.0)
    q = tl.zeros((BLOCK_M, BLOCK_D), dtype=Q.dtype.element_ty)
    if HAS_DOT:
        q = tl.load(Q + (row + offs_m[:, None]) * D + offs_d[None, :],
                    mask=m_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    hi = Tk
    if CAUSAL:
        hi = (pid_m + 1) * BLOCK_M + off  # rows past Tq see no more keys than this
        if hi > Tk:
            hi = Tk
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < Tk
        ks = tl.load(KS + krow + offs_n, mask=n_ok, other=0.0)
        k = tl.zeros((BLOCK_N, BLOCK_D), dtype=K.dtype.element_ty)
        if HAS_DOT:
            k = tl.load(K + (kbase + offs_n[:, None]) * D + offs_d[None, :],
                        mask=n_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        s, ok, d, x, term = _scores(q, k, qs, ks, tau, lam, offs_m, offs_n, Tq, Tk, off, sm_scale,
                                    HAS_DOT, KERNEL, CAUSAL, PREC, UP)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp(s - m_safe[:, None])
        alpha = tl.exp(m_i - m_safe)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = tl.load(V + (vbase + offs_n[:, None]) * DV + offs_dv[None, :],
                    mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        acc = acc * alpha[:, None] + _mm(p.to(v.dtype), v, PREC, UP)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    out = acc / l_safe[:, None]
    tl.store(O + (row + offs_m[:, None]) * DV + offs_dv[None, :], out.to(O.dtype.element_ty),
             mask=m_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(LSE + row + offs_m, m_i + tl.log(l_safe), mask=m_ok)

@triton.jit
def _grad_term(ds, d, x, tau, lam, KERNEL: tl.constexpr):
    """ds * d(score)/d(qs): the scalar term's share of the score gradient, per entry."""
    if KERNEL == 0:
        g = -2.0 * d * tau[:, None]
    else:
        g = -2.0 * d * tau[:, None] / (1.0 + x)
    return ds * lam[:, None] * g

@triton.jit
def _bwd_kv(Q, K, V, QS, KS, TAU, LAM, DO, LSE, DELTA, DK, DV_, DKS, Tq, Tk, H, GK, GV, sm_scale,
            D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DOT: tl.constexpr, KERNEL: tl.constexpr,
            CAUSAL: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    pid_n = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    off = Tk - Tq
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row = bh.to(tl.int64) * Tq
    krow = bh.to(tl.int64) * Tk
    kbase = (b * GK + h // (H // GK)).to(tl.int64) * Tk
    vbase = (b * GV + h // (H // GV)).to(tl.int64) * Tk
    n_ok = offs_n < Tk
    ks = tl.load(KS + krow + offs_n, mask=n_ok, other=0.0)
    k = tl.zeros((BLOCK_N, BLOCK_D), dtype=K.dtype.element_ty)
    if HAS_DOT:
        k = tl.load(K + (kbase + offs_n[:, None]) * D + offs_d[None, :],
                    mask=n_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    v = tl.load(V + (vbase + offs_n[:, None]) * DV + offs_dv[None, :],
                mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
    dks = tl.zeros((BLOCK_N,), tl.float32)
    lo = 0
    if CAUSAL:
        lo = pid_n * BLOCK_N - off  # the first query that sees this tile's first key
        if lo < 0:
            lo = 0
        lo = lo // BLOCK_M * BLOCK_M
    for start_m in range(lo, Tq, BLOCK_M):
        offs_m = start_m + tl.arange(0, BLOCK_M)
        m_ok = offs_m < Tq
        qs = tl.load(QS + row + offs_m, mask=m_ok, other=0.0)
        tau = tl.load(TAU + row + offs_m, mask=m_ok, other=1.0)
        lam = tl.load(LAM + row + offs_m, mask=m_ok, other=0.0)
        lse = tl.load(LSE + row + offs_m, mask=m_ok, other=0.0)
        delta = tl.load(DELTA + row + offs_m, mask=m_ok, other=0.0)
        q = tl.zeros((BLOCK_M, BLOCK_D), dtype=Q.dtype.element_ty)
        if HAS_DOT:
            q = tl.load(Q + (row + offs_m[:, None]) * D + offs_d[None, :],
                        mask=m_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        do = tl.load(DO + (row + offs_m[:, None]) * DV + offs_dv[None, :],
                     mask=m_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        s, ok, d, x, term = _scores(q, k, qs, ks, tau, lam, offs_m, offs_n, Tq, Tk, off, sm_scale,
                                    HAS_DOT, KERNEL, CAUSAL, PREC, UP)
        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
        dv += _mm(tl.trans(p.to(do.dtype)), do, PREC, UP)
        dp = _mm(do, tl.trans(v), PREC, UP)
        ds = p * (dp - delta[:, None])
        if HAS_DOT:
            dk += _mm(tl.trans(ds.to(q.dtype)), q, PREC, UP)
        dks -= tl.sum(_grad_term(ds, d, x, tau, lam, KERNEL), 0)
    tl.store(DK + (krow + offs_n[:, None]) * BLOCK_D + offs_d[None, :], dk * sm_scale,
             mask=n_ok[:, None])
    tl.store(DV_ + (krow + offs_n[:, None]) * BLOCK_DV + offs_dv[None, :], dv, mask=n_ok[:, None])
    tl.store(DKS + krow + offs_n, dks, mask=n_ok)

@triton.jit
def _bwd_q(Q, K, V, QS, KS, TAU, LAM, DO, LSE, DELTA, DQ, DQS, DTAU, DLAM, Tq, Tk, H, GK, GV, sm_scale,
           D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
           BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HAS_DOT: tl.constexpr, KERNEL: tl.constexpr,
           CAUSAL: tl.constexpr, PREC: tl.constexpr, UP: tl.constexpr):
    pid_m = tl.program_id(0)
    bh = tl.program_id(1)
    b = bh // H
    h = bh % H
    off = Tk - Tq
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    row = bh.to(tl.int64) * Tq
    krow = bh.to(tl.int64) * Tk
    kbase = (b * GK + h // (H // GK)).to(tl.int64) * Tk
    vbase = (b * GV + h // (H // GV)).to(tl.int64) * Tk
    m_ok = offs_m < Tq
    qs = tl.load(QS + row + offs_m, mask=m_ok, other=0.0)
    tau = tl.load(TAU + row + offs_m, mask=m_ok, other=1.0)
    lam = tl.load(LAM + row + offs_m, mask=m_ok, other=0.0)
    lse = tl.load(LSE + row + offs_m, mask=m_ok, other=0.0)
    delta = tl.load(DELTA + row + offs_m, mask=m_ok, other=0.0)
    q = tl.zeros((BLOCK_M, BLOCK_D), dtype=Q.dtype.element_ty)
    if HAS_DOT:
        q = tl.load(Q + (row + offs_m[:, None]) * D + offs_d[None, :],
                    mask=m_ok[:, None] & (offs_d[None, :] < D), other=0.0)
    do = tl.load(DO + (row + offs_m[:, None]) * DV + offs_dv[None, :],
                 mask=m_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    dqs = tl.zeros((BLOCK_M,), tl.float32)
    dtau = tl.zeros((BLOCK_M,), tl.float32)
    dlam = tl.zeros((BLOCK_M,), tl.float32)
    hi = Tk
    if CAUSAL:
        hi = (pid_m + 1) * BLOCK_M + off  # rows past Tq see no more keys than this
        if hi > Tk:
            hi = Tk
    for start_n in range(0, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_ok = offs_n < Tk
        ks = tl.load(KS + krow + offs_n, mask=n_ok, other=0.0)
        k = tl.zeros((BLOCK_N, BLOCK_D), dtype=K.dtype.element_ty)
        if HAS_DOT:
            k = tl.load(K + (kbase + offs_n[:, None]) * D + offs_d[None, :],
                        mask=n_ok[:, None] & (offs_d[None, :] < D), other=0.0)
        v = tl.load(V + (vbase + offs_n[:, None]) * DV + offs_dv[None, :],
                    mask=n_ok[:, None] & (offs_dv[None, :] < DV), other=0.0)
        s, ok, d, x, term = _scores(q, k, qs, ks, tau, lam, offs_m, offs_n, Tq, Tk, off, sm_scale,
                                    HAS_DOT, KERNEL, CAUSAL, PREC, UP)
        p = tl.where(ok, tl.exp(s - lse[:, None]), 0.0)
        dp = _mm(do, tl.trans(v), PREC, UP)
        ds = p * (dp - delta[:, None])
        if HAS_DOT:
            dq += _mm(ds.to(k.dtype), k, PREC, UP)
        dqs += tl.sum(_grad_term(ds, d, x, tau, lam, KERNEL), 1)
        dlam += tl.sum(tl.where(ok, ds * term, 0.0), 1)
        if KERNEL == 0:
            dt = x
        else:
            dt = x / (1.0 + x)
        dtau += tl.sum(tl.where(ok, ds * dt, 0.0), 1)
    tl.store(DQ + (row + offs_m[:, None]) * BLOCK_D + offs_d[None, :], dq * sm_scale, mask=m_ok[:, None])
    tl.store(DQS + row + offs_m, dqs, mask=m_ok)
    tl.store(DTAU + row + offs_m, dtau * lam * tau, mask=m_ok)
    tl.store(DLAM + row + offs_m, dlam, mask=m_ok)


BLOCKS: dict = {}  # overrides of `_blocks`' choice by kernel ("fwd" / "bwd"): benchmarks/gpu.py's tuning


def _blocks(device: torch.device, D: int, DV: int) -> dict:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel: small under the interpreter (each program
    is NumPy work); on a GPU the forward's FlashAttention-2 tiles, and 64 x 64 tiles on 8 warps for
    the backward, which holds several fp32 score-sized tiles at once (benchmarks/gpu.py times others)."""
    if device.type != "cuda":
        return dict(fwd=(32, 32, 4, 1), bwd=(32, 32, 4, 1))
    wide = max(D, DV) > 64
    cfg = dict(fwd=(64, 64, 4, 3) if wide else (128, 64, 8, 3), bwd=(64, 64, 8, 2) if not wide else (32, 64, 8, 2))
    cfg.update(BLOCKS)
    return cfg


def _pow2(n: int) -> int:
    return max(16, 1 << (max(n, 1) - 1).bit_length())


class _ScalarFamily(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, qs, ks, tau, lam, kernel: int, causal: bool):
        B, H, Tq = qs.shape
        Tk = ks.shape[2]
        has_dot = q is not None
        D = q.shape[-1] if has_dot else 16
        DV = v.shape[-1]
        GK = k.shape[1] if has_dot else H
        GV = v.shape[1]
        qq = q.contiguous() if has_dot else v.new_zeros(1)
        kk = k.contiguous() if has_dot else v.new_zeros(1)
        vv = v.contiguous()
        qs32, ks32 = qs.float().contiguous(), ks.float().contiguous()
        tau32, lam32 = (1.0 / tau.float()).contiguous(), lam.float().contiguous()  # the kernels take 1 / tau
        out = torch.empty(B, H, Tq, DV, dtype=torch.float32, device=v.device)  # float32: the backward's delta
        lse = torch.empty(B, H, Tq, dtype=torch.float32, device=v.device)
        cfg = _blocks(v.device, D, DV)
        BM, BN, warps, stages = cfg["fwd"]
        prec = "ieee" if v.dtype == torch.float32 else "tf32"
        consts = dict(D=D, DV=DV, BLOCK_D=_pow2(D), BLOCK_DV=_pow2(DV), HAS_DOT=has_dot, KERNEL=kernel,
                      CAUSAL=causal, PREC=prec, UP=interpreted() and v.dtype == torch.bfloat16)
        sm_scale = 1.0 / math.sqrt(D) if has_dot else 0.0
        _fwd[(-(-Tq // BM), B * H)](qq, kk, vv, qs32, ks32, tau32, lam32, out, lse, Tq, Tk, H, GK, GV, sm_scale,
                                   BLOCK_M=BM, BLOCK_N=BN, num_warps=warps, num_stages=stages, **consts)
        ctx.save_for_backward(qq, kk, vv, qs32, ks32, tau32, lam32, out, lse)
        ctx.meta = (has_dot, kernel, causal, consts, sm_scale, GK, GV)
        return out.to(v.dtype)

    @staticmethod
    def backward(ctx, dout):
        qq, kk, vv, qs32, ks32, tau32, lam32, out, lse = ctx.saved_tensors
        has_dot, kernel, causal, consts, sm_scale, GK, GV = ctx.meta
        B, H, Tq = qs32.shape
        Tk = ks32.shape[2]
        dout = dout.contiguous()
        delta = (dout.float() * out).sum(-1).contiguous()  # (B, H, Tq): sum_s p_ts dp_ts, from the float32 output
        BD, BDV = consts["BLOCK_D"], consts["BLOCK_DV"]
        dev = vv.device
        dk = torch.empty(B, H, Tk, BD, dtype=torch.float32, device=dev)
        dv = torch.empty(B, H, Tk, BDV, dtype=torch.float32, device=dev)
        dks = torch.empty(B, H, Tk, dtype=torch.float32, device=dev)
        dq = torch.empty(B, H, Tq, BD, dtype=torch.float32, device=dev)
        dqs, dtau, dlam = (torch.empty(B, H, Tq, dtype=torch.float32, device=dev) for _ in range(3))
        cfg = _blocks(dev, consts["D"], consts["DV"])
        BM, BN, warps, stages = cfg["bwd"]
        args = (qq, kk, vv, qs32, ks32, tau32, lam32, dout, lse, delta)
        _bwd_kv[(-(-Tk // BN), B * H)](*args, dk, dv, dks, Tq, Tk, H, GK, GV, sm_scale, BLOCK_M=BM, BLOCK_N=BN,
                                      num_warps=warps, num_stages=stages, **consts)
        _bwd_q[(-(-Tq // BM), B * H)](*args, dq, dqs, dtau, dlam, Tq, Tk, H, GK, GV, sm_scale, BLOCK_M=BM,
                                     BLOCK_N=BN, num_warps=warps, num_stages=stages, **consts)
        D, DV = consts["D"], consts["DV"]
        dv = dv[..., :DV].view(B, GV, H // GV, Tk, DV).sum(2).to(vv.dtype)
        if has_dot:
            dq = dq[..., :D].to(qq.dtype)
            dk = dk[..., :D].view(B, GK, H // GK, Tk, D).sum(2).to(kk.dtype)
        else:
            dq = dk = None
        return dq, dk, dv, dqs, dks, dtau, dlam, None, None


def triton_scalar_attention(q, k, v, qs, ks, tau_b, lam_b, kernel: str, causal: bool) -> torch.Tensor:
    """softmax_s([q_t . k_s / sqrt(d)] + lam_t phi((qs_t - ks_s)^2 / tau_t)) v_s through the kernels above,
    for checked inputs: q (B, H, Tq, D) and k (B, G, Tk, D), or both None (scalar heads); v (B, G', Tk, Dv);
    qs (B, H, Tq), ks (B, H, Tk); tau_b and lam_b tensors broadcastable to (B, H, Tq) (lam_b None for 1).
    Gradients reach every tensor. Returns (B, H, Tq, Dv) in v's dtype."""
    B, H, Tq = qs.shape
    if Tq == 0:
        return v.new_zeros(B, H, 0, v.shape[-1])
    tau = tau_b.float().expand(B, H, Tq)
    lam = (torch.ones((), device=qs.device) if lam_b is None else lam_b.float()).expand(B, H, Tq)
    code = GAUSSIAN if kernel == "gaussian" else CAUCHY
    return _ScalarFamily.apply(q, k, v, qs.float(), ks.float(), tau, lam, code, causal)
