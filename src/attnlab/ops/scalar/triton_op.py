"""The Triton kernel's host side: its autograd Function, tile sizes, and `triton_scalar_attention`,
which `attention` (scalar and hybrid heads) and `attnlab.ops.goat` call. The kernels and the math
are in `triton_kernel` (forward) and `triton_backward`."""

from __future__ import annotations

import math

import torch

from ..common.triton_math import fast_math, interpreted
from ..common.triton_rows import document_spans
from .triton_backward import _bwd_kv, _bwd_q
from .triton_kernel import _fwd

__all__ = ["triton_scalar_attention"]

LOG2E = 1.4426950408889634
GAUSSIAN, CAUCHY, NONE = 0, 1, 2  # the scalar term's kernel; NONE: no scalar term (GOAT's prior alone)


# Scalar heads run the dot-product kernel on zero vectors of width 16: the scores then arrive in the matrix
# units' register layout that the p @ v product reads, where the product-free kernel must convert its tile's
# layout first (benchmarks/gpu.py times both).
SCALAR_DOT = True
BLOCKS: dict = {}  # overrides of `_blocks`' choice by kernel ("fwd", "bwd", "bwd_kv"): benchmarks/gpu.py's tuning


def _blocks(device: torch.device, D: int, DV: int) -> dict:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages) per kernel ("fwd"; "bwd": the dq kernel's; "bwd_kv": the
    dk/dv kernel's, BLOCK_M queries by BLOCK_N keys): small under the interpreter (each program is NumPy
    work). On a GPU the forward and the dq kernel take 64 x 64 tiles on 4 warps, the tiling
    benchmarks/gpu.py's tuning chose (benchmarks/results/gpu.json). The key-major dk/dv kernel takes 32
    queries by 64 keys: with 64 queries each thread holds 16 per-query columns (qs, g, lse, delta; the
    Cauchy kernel's tau) beside its tiles, and sm_90a code needs 255 registers and spills (the Cauchy
    kernel always, the Gaussian and GOAT ones where the sequence length is no multiple of 16;
    benchmarks/kernel_sass.py). A "bwd" override (benchmarks/gpu.py's tuning) sets both backward kernels."""
    if device.type != "cuda":
        return dict(fwd=(32, 32, 4, 1), bwd=(32, 32, 4, 1), bwd_kv=(32, 32, 4, 1))
    wide = max(*_split(D), _pow2(DV)) > 64  # a block past 64 columns (D = 80 is two blocks, 64 + 16)
    cfg = dict(fwd=(64, 64, 4, 3), bwd=(64, 64, 4, 2) if not wide else (32, 64, 4, 2), bwd_kv=(32, 64, 4, 2))
    if "bwd" in BLOCKS:
        cfg["bwd_kv"] = BLOCKS["bwd"]
    cfg.update(BLOCKS)
    return cfg


def _pow2(n: int) -> int:
    return max(16, 1 << (max(n, 1) - 1).bit_length())


def _split(D: int) -> tuple[int, int]:
    """(BLOCK_D, BLOCK_D2): the product's D columns as one power-of-two block, or as two (the largest
    power of two below D, then the rest padded) when that is narrower: D = 80 (GOAT's 64-wide head and
    its 16 prior columns) as 64 + 16, not 128; BLOCK_D2 = 0 for one block."""
    whole = _pow2(D)
    if D <= 16 or D == whole:
        return whole, 0
    first = whole // 2
    rest = _pow2(D - first)
    return (first, rest) if first + rest < whole else (whole, 0)


class _ScalarFamily(torch.autograd.Function):
    """Inputs as `triton_scalar_attention` documents them, q / k already scaled when sm_scale is given."""

    @staticmethod
    def forward(ctx, q, k, v, qs, ks, tau, lam, u, kernel: int, causal: bool, sm_scale, docs=None):
        B, H, Tq = tau.shape
        Tk = v.shape[2]
        has_dot = q is not None
        if not has_dot and SCALAR_DOT:  # scalar heads through the dot-product kernel with zero vectors
            q, k = v.new_zeros(B, H, Tq, 16), v.new_zeros(B, H, Tk, 16)
        D = q.shape[-1] if q is not None else 16
        DV = v.shape[-1]
        GK = k.shape[1] if k is not None else H
        GV = v.shape[1]
        none = v.new_zeros(1)
        qq = q.contiguous() if q is not None else none
        kk = k.contiguous() if k is not None else none
        vv = v.contiguous()
        f32 = torch.zeros(1, device=v.device)
        qs32 = qs.float().contiguous() if qs is not None else f32.expand(B, H, Tq).contiguous()
        ks32 = ks.float().contiguous() if ks is not None else f32
        if sm_scale is None:  # (scalar heads: any scale of their zero product; 1 keeps the scores' unit log2 e)
            sm_scale = 1.0 / math.sqrt(D) if has_dot else 1.0
        unit = (sm_scale if q is not None else 1.0) * LOG2E  # C: the kernels' scores are in units of it
        uu = (u.double() * (LOG2E / unit)).float().contiguous() if u is not None else f32
        tau32, lam32 = (1.0 / tau.float()).contiguous(), lam.float().contiguous()  # the kernels take 1 / tau
        g = -lam32.double() * (tau32.double() * (LOG2E / unit) if kernel == GAUSSIAN else 1.0 / unit)
        g32 = g.float().contiguous()  # the scalar term's factor per query (triton_kernel's module docstring)
        out = torch.empty(B, H, Tq, DV, dtype=torch.float32, device=v.device)  # float32: the backward's delta
        lse = torch.empty(B, H, Tq, dtype=torch.float32, device=v.device)
        BM, BN, warps, stages = _blocks(v.device, D, DV)["fwd"]
        BD, BD2 = _split(D)
        consts = dict(D=D, DV=DV, BLOCK_D=BD, BLOCK_D2=BD2, BLOCK_DV=_pow2(DV), HAS_DOT=q is not None,
                      BIAS=u is not None, KERNEL=kernel, CAUSAL=causal,
                      PREC="ieee" if v.dtype == torch.float32 else "tf32",
                      UP=interpreted() and v.dtype == torch.bfloat16, DOC=docs is not None,
                      FAST=fast_math())  # the Cauchy log / division in hardware approximations (not interpreted)
        segs, start, end = document_spans(docs) if docs is not None else (f32, f32, f32)
        _fwd[(-(-Tq // BM), B * H)](qq, kk, vv, qs32, ks32, uu, tau32, g32, out, lse, segs, start, end, Tq, Tk, H, GK,
                                   GV, sm_scale, BLOCK_M=BM, BLOCK_N=BN, num_warps=warps, num_stages=stages, **consts)
        ctx.save_for_backward(qq, kk, vv, qs32, ks32, uu, tau32, g32, lam32, out, lse, segs, start, end)
        ctx.meta = (has_dot, qs is not None, u is not None, u.shape if u is not None else None, consts, sm_scale,
                    GK, GV)
        return out.to(v.dtype)

    @staticmethod
    def backward(ctx, dout):
        qq, kk, vv, qs32, ks32, uu, tau32, g32, lam32, out, lse, segs, start, end = ctx.saved_tensors
        has_dot, has_scalar, has_bias, _, consts, sm_scale, GK, GV = ctx.meta
        B, H, Tq = tau32.shape
        Tk = vv.shape[2]
        dout = dout.contiguous()
        delta = (dout.float() * out).sum(-1).contiguous()  # (B, H, Tq): sum_s p_ts dp_ts, from the float32 output
        BD, BDV = consts["BLOCK_D"] + consts["BLOCK_D2"], consts["BLOCK_DV"]
        dev = vv.device
        empty = lambda *shape: torch.empty(*shape, dtype=torch.float32, device=dev)  # noqa: E731
        dk, dv, dks, du = empty(B, H, Tk, BD), empty(B, H, Tk, BDV), empty(B, H, Tk), empty(B, H, Tk)
        dq, dqs, dtau, dlam = empty(B, H, Tq, BD), empty(B, H, Tq), empty(B, H, Tq), empty(B, H, Tq)
        tiles = _blocks(dev, consts["D"], consts["DV"])
        args = (qq, kk, vv, qs32, ks32, uu, tau32, g32, lam32, dout, lse, delta, segs, start, end)
        BM, BN, warps, stages = tiles["bwd_kv"]
        _bwd_kv[(-(-Tk // BN), B * H)](*args, dk, dv, dks, du, Tq, Tk, H, GK, GV, sm_scale, BLOCK_M=BM, BLOCK_N=BN,
                                      num_warps=warps, num_stages=stages, **consts)
        BM, BN, warps, stages = tiles["bwd"]
        _bwd_q[(-(-Tq // BM), B * H)](*args, dq, dqs, dtau, dlam, Tq, Tk, H, GK, GV, sm_scale, BLOCK_M=BM,
                                     BLOCK_N=BN, num_warps=warps, num_stages=stages, **consts)
        D, DV = consts["D"], consts["DV"]
        dv = dv[..., :DV].view(B, GV, H // GV, Tk, DV).sum(2).to(vv.dtype)
        if has_dot:
            dq = dq[..., :D].to(qq.dtype)
            dk = dk[..., :D].view(B, GK, H // GK, Tk, D).sum(2).to(kk.dtype)
        else:
            dq = dk = None
        if not has_scalar:
            dqs = dks = dtau = dlam = None
        return dq, dk, dv, dqs, dks, dtau, dlam, du if has_bias else None, None, None, None, None


def triton_scalar_attention(q, k, v, qs, ks, tau_b, lam_b, kernel: str | None, causal: bool, *,
                            sm_scale: float | None = None, u=None, docs: torch.Tensor | None = None) -> torch.Tensor:
    """softmax_s([q_t . k_s * sm_scale] + lam_t phi((qs_t - ks_s)^2 / tau_t) [+ u_s]) v_s through the kernels
    above, for checked inputs: q (B, H, Tq, D) and k (B, G, Tk, D), or both None (scalar heads); v (B, G',
    Tk, Dv); qs (B, H, Tq) and ks (B, H, Tk), or both None with kernel None (no scalar term: GOAT); tau_b and
    lam_b tensors broadcastable to (B, H, Tq) (lam_b None for 1); sm_scale 1 / sqrt(D) when None; u a
    key-only term broadcastable to (B, H, Tk), added in float32; docs (B, Tk) document ids of the keys
    (query t is key t + Tk - Tq) for packed documents: a query sees only the keys of its own document,
    and tiles of other documents are skipped. Gradients reach every tensor. Returns (B, H, Tq, Dv) in
    v's dtype."""
    B, H, Tq = (qs.shape if qs is not None else q.shape[:3])
    if Tq == 0:
        return v.new_zeros(B, H, 0, v.shape[-1])
    dev = v.device
    tau = (torch.ones((), device=dev) if tau_b is None else tau_b.float()).expand(B, H, Tq)
    lam = (torch.ones((), device=dev) if lam_b is None else lam_b.float()).expand(B, H, Tq)
    if sm_scale is not None and not sm_scale > 0:  # the kernels keep scores in units of it (triton_kernel)
        raise ValueError(f"sm_scale must be > 0, got {sm_scale}")
    code = NONE if kernel is None else GAUSSIAN if kernel == "gaussian" else CAUCHY
    uu = None if u is None else u.float().expand(B, H, v.shape[2])
    return _ScalarFamily.apply(q, k, v, None if qs is None else qs.float(), None if ks is None else ks.float(),
                               tau, lam, uu, code, causal, sm_scale, docs)
