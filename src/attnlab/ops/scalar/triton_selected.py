"""Training through the window on the GPU: scalar and hybrid attention over each query's selected
keys only, in Triton.

`windowed_attention`'s selected-keys path picks, for each query t, m key indices idx[t] (the sink,
the last w keys, then the k nearest older keys in scalar space: `window.window_indices`) and takes

    o_t = sum_j softmax_j(s_t,idx[t,j]) v_idx[t,j],   s_ts = [q_t . k_s / sqrt(d)] + lam_t phi((qs_t - ks_s)^2 / tau_t)

(the score of `triton_kernel`, phi(x) = -x or -log(1 + x)). The PyTorch route forms each query chunk's
scores against every key it could see and masks all but the selected: O(T^2) work and memory traffic
for a softmax over m keys. Here a program holds BLOCK_M queries, gathers their selected keys and
values BLOCK_J columns at a time ((BLOCK_M, BLOCK_J, D) tiles read straight from k and v by index)
and runs the online softmax over them: O(T m D) work, O(T) memory besides the indices, no T x T
tile anywhere. The dot products of gathered rows are elementwise products summed in float32 (each
query has its own keys, so there is no shared tile for the matrix units).

Backward, in two kernels and with no atomics: one program per query tile recomputes the probabilities
from the forward's log-sum-exp and accumulates dq and the per-row sums that give dqs, tau's and the
gain's gradients; one program per tile of keys reads the (query, key) pairs that select its keys (the
selection inverted on the device by one sort of the pairs by key, `_invert`) and sums each pair's
share of dk, dv and dks into its key through a one-hot product, writing every key's gradient once into
per-query-head float32 buffers; the host sums GQA groups. Indices of -1 are unused columns.

The selection itself stays in `window.window_indices`, with no gradient and exactly the key set the
sorted cache decodes with (ties: newest first): below `window.TREE_FROM` positions a chunked top-k over
the scalar distances, from there the merge-sort tree of `tree.tree_select` (batched searchsorted and
one top-k over O(k log T) candidates per query, no T x T pass and no host sync).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import triton
import triton.language as tl

from ..common.triton_math import LOG2E, fast_math, log2_1p, over_1p
from ..common.triton_rows import bases
from .triton_kernel import _grad_rows, _query_rows, _store_row_grads
from .triton_op import CAUCHY, GAUSSIAN, _pow2

__all__ = ["triton_selected_attention"]


@triton.jit
def _gather(X, base, ix, valid, offs_d, D: tl.constexpr):
    """(BLOCK_M, BLOCK_J, BLOCK_D) rows base + ix of a row-major (.., D) tensor, in float32 (0 where not valid)."""
    ptr = X + (base + ix.to(tl.int64))[:, :, None] * D + offs_d[None, None, :]
    return tl.load(ptr, mask=valid[:, :, None] & (offs_d[None, None, :] < D), other=0.0).to(tl.float32)


@triton.jit
def _sel_scores(q, K, KS, qs, tau, lam, kbase, krow, ix, valid, offs_d, sm_scale, D: tl.constexpr,
                HAS_DOT: tl.constexpr, KERNEL: tl.constexpr, FAST: tl.constexpr):
    """Scores in base 2 of a query tile against its gathered keys (-inf where not valid), the gathered
    key vectors (HAS_DOT) and the pieces the backward needs: d = qs - ks, x = d^2 / tau, l1 = log2(1 + x)
    (FAST: in the hardware's approximate log, `attnlab.ops.common.triton_math.log2_1p`)."""
    ks = tl.load(KS + krow + ix, mask=valid, other=0.0)
    d = qs[:, None] - ks
    x = d * d * tau[:, None]  # tau holds 1 / tau_t
    if KERNEL == 0:
        l1 = x
        s = -(lam * LOG2E)[:, None] * x
    else:
        l1 = log2_1p(x, FAST)
        s = -lam[:, None] * l1
    k = 0.0
    if HAS_DOT:
        k = _gather(K, kbase, ix, valid, offs_d, D)
        s += tl.sum(q.to(tl.float32)[:, None, :] * k, 2) * (sm_scale * LOG2E)
    s = tl.where(valid, s, float("-inf"))
    return s, k, d, x, l1


@triton.jit
def _sel_program(Q, QS, TAU, LAM, T, H, GK, GV, D: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                 BLOCK_M: tl.constexpr, HAS_DOT: tl.constexpr):
    """The program's query tile: its row offsets (`bases`), query positions and the query rows."""
    row, krow, kbase, vbase = bases(tl.program_id(1), H, GK, GV, T, T)
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_ok = offs_m < T
    qs, tau, lam, q = _query_rows(Q, QS, TAU, LAM, row, offs_m, m_ok, offs_d, D, HAS_DOT, BLOCK_D)
    return row, krow, kbase, vbase, offs_m, offs_d, tl.arange(0, BLOCK_DV), m_ok, qs, tau, lam, q


@triton.jit
def _sel_columns(IDX, K, KS, q, qs, tau, lam, row, kbase, krow, offs_m, m_ok, j0, M, offs_d, sm_scale,
                 D: tl.constexpr, BLOCK_J: tl.constexpr, HAS_DOT: tl.constexpr, KERNEL: tl.constexpr,
                 FAST: tl.constexpr):
    """Columns j0 .. j0 + BLOCK_J of the query tile's selected keys: their indices (0 where unused), which
    are used, and `_sel_scores` of them."""
    offs_j = j0 + tl.arange(0, BLOCK_J)
    ix = tl.load(IDX + (row + offs_m[:, None]) * M + offs_j[None, :], mask=m_ok[:, None] & (offs_j[None, :] < M),
                 other=-1)
    valid = ix >= 0
    ix = tl.where(valid, ix, 0)
    s, k, d, x, l1 = _sel_scores(q, K, KS, qs, tau, lam, kbase, krow, ix, valid, offs_d, sm_scale, D, HAS_DOT, KERNEL,
                                 FAST)
    return ix, valid, s, k, d, x, l1


@triton.jit
def _sel_fwd(Q, K, V, QS, KS, TAU, LAM, IDX, O, LSE, T, M, H, GK, GV, sm_scale, D: tl.constexpr, DV: tl.constexpr,
             BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr,
             HAS_DOT: tl.constexpr, KERNEL: tl.constexpr, FAST: tl.constexpr):
    sm_scale = tl.cast(sm_scale, tl.float32)  # a Python float reaches a kernel as fp64 under Inductor
    row, krow, kbase, vbase, offs_m, offs_d, offs_dv, m_ok, qs, tau, lam, q = _sel_program(
        Q, QS, TAU, LAM, T, H, GK, GV, D, BLOCK_D, BLOCK_DV, BLOCK_M, HAS_DOT)
    m_i = tl.full((BLOCK_M,), float("-inf"), tl.float32)
    l_i = tl.zeros((BLOCK_M,), tl.float32)
    acc = tl.zeros((BLOCK_M, BLOCK_DV), tl.float32)
    for j0 in range(0, M, BLOCK_J):
        ix, valid, s, k, d, x, l1 = _sel_columns(IDX, K, KS, q, qs, tau, lam, row, kbase, krow, offs_m, m_ok, j0, M,
                                                 offs_d, sm_scale, D, BLOCK_J, HAS_DOT, KERNEL, FAST)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        p = tl.exp2(s - m_safe[:, None])
        alpha = tl.exp2(m_i - m_safe)
        v = _gather(V, vbase, ix, valid, offs_dv, DV)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v, 1)
        l_i = l_i * alpha + tl.sum(p, 1)
        m_i = m_new
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    tl.store(O + (row + offs_m[:, None]) * DV + offs_dv[None, :], acc / l_safe[:, None],
             mask=m_ok[:, None] & (offs_dv[None, :] < DV))
    tl.store(LSE + row + offs_m, m_i + tl.log2(l_safe), mask=m_ok)


@triton.jit
def _sel_bwd(Q, K, V, QS, KS, TAU, LAM, IDX, DO, LSE, DELTA, DQ, DQS, DTAU, DLAM, T, M, H, GK, GV,
             sm_scale, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
             BLOCK_M: tl.constexpr, BLOCK_J: tl.constexpr, HAS_DOT: tl.constexpr, KERNEL: tl.constexpr,
             FAST: tl.constexpr):
    """The query side of the backward: dq and the per-row sums that give dqs, dtau and the gain's gradient."""
    sm_scale = tl.cast(sm_scale, tl.float32)  # a Python float reaches a kernel as fp64 under Inductor
    row, krow, kbase, vbase, offs_m, offs_d, offs_dv, m_ok, qs, tau, lam, q = _sel_program(
        Q, QS, TAU, LAM, T, H, GK, GV, D, BLOCK_D, BLOCK_DV, BLOCK_M, HAS_DOT)
    lse, delta, do = _grad_rows(LSE, DELTA, DO, row, offs_m, m_ok, offs_dv, DV)
    do = do.to(tl.float32)
    dq = tl.zeros((BLOCK_M, BLOCK_D), tl.float32)
    da = tl.zeros((BLOCK_M,), tl.float32)
    dx = tl.zeros((BLOCK_M,), tl.float32)
    dl = tl.zeros((BLOCK_M,), tl.float32)
    for j0 in range(0, M, BLOCK_J):
        ix, valid, s, k, d, x, l1 = _sel_columns(IDX, K, KS, q, qs, tau, lam, row, kbase, krow, offs_m, m_ok, j0, M,
                                                 offs_d, sm_scale, D, BLOCK_J, HAS_DOT, KERNEL, FAST)
        p = tl.exp2(s - lse[:, None])  # 0 where not valid
        v = _gather(V, vbase, ix, valid, offs_dv, DV)
        ds = p * (tl.sum(do[:, None, :] * v, 2) - delta[:, None])
        if HAS_DOT:
            dq += tl.sum(ds[:, :, None] * k, 1)
        if KERNEL == 1:
            dl += tl.sum(ds * l1, 1)
            ds = over_1p(ds, x, FAST)
        da += tl.sum(ds * d, 1)
        dx += tl.sum(ds * x, 1)
    tl.store(DQ + (row + offs_m[:, None]) * BLOCK_D + offs_d[None, :], dq * sm_scale, mask=m_ok[:, None])
    _store_row_grads(DQS, DTAU, DLAM, row, offs_m, m_ok, lam, tau, da, dx, dl, KERNEL)


@triton.jit
def _rows_at(X, base, ix, ok, offs, D: tl.constexpr):
    """(len(ix), len(offs)) rows base + ix of a row-major (.., D) tensor, in float32 (0 where not ok)."""
    return tl.load(X + (base + ix.to(tl.int64))[:, None] * D + offs[None, :], mask=ok[:, None] & (offs[None, :] < D),
                   other=0.0).to(tl.float32)


@triton.jit
def _sel_bwd_keys(Q, K, V, QS, KS, TAU, LAM, PAIR_Q, PAIR_K, START, DO, LSE, DELTA, DK, DV_, DKS, T, M, H, GK, GV,
                  sm_scale, D: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  BLOCK_N: tl.constexpr, BLOCK_P: tl.constexpr, HAS_DOT: tl.constexpr, KERNEL: tl.constexpr,
                  FAST: tl.constexpr):
    """The key side of the backward, one program per BLOCK_N keys of a head: the (query, key) pairs that
    select those keys (the selection inverted: PAIR_Q / PAIR_K sorted by key, START[s] the first pair of
    key s) are read BLOCK_P at a time, each pair's share of dk, dv and dks computed from its query's
    row, and the shares summed into the block's keys as a product with the pairs' one-hot key matrix:
    every key's gradient is written once, with no atomics."""
    sm_scale = tl.cast(sm_scale, tl.float32)  # a Python float reaches a kernel as fp64 under Inductor
    bh = tl.program_id(1)
    row, krow, kbase, vbase = bases(bh, H, GK, GV, T, T)
    n0 = tl.program_id(0) * BLOCK_N
    offs_n = n0 + tl.arange(0, BLOCK_N)
    n_ok = offs_n < T
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    srow = bh.to(tl.int64) * (T + 1)
    p_lo = tl.load(START + srow + n0)
    p_hi = tl.load(START + srow + tl.minimum(n0 + BLOCK_N, T))
    prow = bh.to(tl.int64) * T * M
    dk = tl.zeros((BLOCK_N, BLOCK_D), tl.float32)
    dv = tl.zeros((BLOCK_N, BLOCK_DV), tl.float32)
    dks = tl.zeros((BLOCK_N,), tl.float32)
    for p0 in range(p_lo, p_hi, BLOCK_P):
        offs_p = p0 + tl.arange(0, BLOCK_P)
        ok = offs_p < p_hi
        t = tl.load(PAIR_Q + prow + offs_p, mask=ok, other=0)
        s_key = tl.load(PAIR_K + prow + offs_p, mask=ok, other=0)
        qs = tl.load(QS + row + t, mask=ok, other=0.0)
        tau = tl.load(TAU + row + t, mask=ok, other=1.0)
        lam = tl.load(LAM + row + t, mask=ok, other=0.0)
        lse = tl.load(LSE + row + t, mask=ok, other=float("inf"))
        delta = tl.load(DELTA + row + t, mask=ok, other=0.0)
        do = _rows_at(DO, row, t, ok, offs_dv, DV)
        v = _rows_at(V, vbase, s_key, ok, offs_dv, DV)
        d = qs - tl.load(KS + krow + s_key, mask=ok, other=0.0)
        x = d * d * tau  # tau holds 1 / tau_t
        if KERNEL == 0:
            sc = -(lam * LOG2E) * x
        else:
            sc = -lam * log2_1p(x, FAST)
        if HAS_DOT:
            q = _rows_at(Q, row, t, ok, offs_d, D)
            kv = _rows_at(K, kbase, s_key, ok, offs_d, D)
            sc += tl.sum(q * kv, 1) * (sm_scale * LOG2E)
        p = tl.where(ok, tl.exp2(sc - lse), 0.0)
        ds = p * (tl.sum(do * v, 1) - delta)
        onehot = ((s_key - n0)[None, :] == tl.arange(0, BLOCK_N)[:, None]) & ok[None, :]  # (BLOCK_N, BLOCK_P)
        oh = onehot.to(tl.float32)
        dv += tl.dot(oh, p[:, None] * do, input_precision="ieee")
        if HAS_DOT:
            dk += tl.dot(oh, (ds * sm_scale)[:, None] * q, input_precision="ieee")
        if KERNEL == 1:
            ds = over_1p(ds, x, FAST)
        dks += tl.sum(oh * (ds * d * 2.0 * lam * tau)[None, :], 1)
    at = krow + offs_n
    tl.store(DV_ + at[:, None] * BLOCK_DV + offs_dv[None, :], dv, mask=n_ok[:, None])
    tl.store(DK + at[:, None] * BLOCK_D + offs_d[None, :], dk, mask=n_ok[:, None])
    tl.store(DKS + at, dks, mask=n_ok)


def _invert(sel: torch.Tensor):
    """The selection inverted per head, with no host sync: pairs (query, key) of sel (B, H, T, M) (-1:
    unused) sorted by key -> (PAIR_Q, PAIR_K) (B, H, T * M) int32 (unused columns sort last, past T) and
    START (B, H, T + 1) int32, the first pair of each key (START[T]: one past the last used pair)."""
    B, H, T, M = sel.shape
    key = torch.where(sel >= 0, sel, T).view(B, H, T * M)
    pair_k, order = key.sort(dim=-1, stable=True)
    pair_q = torch.div(order, M, rounding_mode="floor")
    bounds = torch.arange(T + 1, device=sel.device, dtype=pair_k.dtype).expand(B, H, T + 1).contiguous()
    start = torch.searchsorted(pair_k.contiguous(), bounds)
    return pair_q.to(torch.int32).contiguous(), pair_k.to(torch.int32).contiguous(), start.to(torch.int32).contiguous()


def _tiles(device: torch.device) -> dict:
    """(BLOCK_M, BLOCK_J, num_warps) per kernel. On a GPU the largest tiles that ptxas compiles for sm_90
    without spilling registers (at D = Dv = 64; read with `ptxas -v` from the PTX Triton builds, no GPU
    needed): the forward 16 queries x 8 columns on 8 warps, the backward 16 x 4 on 8 warps (16 x 16 on
    4 warps spilled 2.8 KB forward and 9.6 KB backward); the key side 16 keys x 16 pairs on 4 warps
    (234 registers; 32 x 32 spilled 524 B, and the one-hot product's work per pair grows with the keys
    per tile). Their speed is measured by benchmarks/gpu.py."""
    if device.type != "cuda":
        return dict(fwd=(16, 8, 1), bwd=(16, 8, 1), keys=(16, 16, 4))
    return dict(fwd=(16, 8, 8), bwd=(16, 4, 8), keys=(16, 16, 4))


def _consts(q, v, kernel: int) -> dict:
    D = q.shape[-1] if q is not None else 16
    return dict(D=D, DV=v.shape[-1], BLOCK_D=_pow2(D), BLOCK_DV=_pow2(v.shape[-1]), HAS_DOT=q is not None,
                KERNEL=kernel, FAST=fast_math())  # the Cauchy log / division in hardware approximations (not interpreted)


# The kernels run inside two custom ops: torch.compile sees each as one opaque call (as it sees SDPA), not
# Triton source it must analyse and relaunch (torch 2.11's Inductor failed on these kernels' arguments with
# "NotImplementedError: View" in the windowed model's compile on a GPU).
@torch.library.custom_op("attnlab::selected_fwd", mutates_args=())
def _fwd_op(q: Optional[torch.Tensor], k: Optional[torch.Tensor], v: torch.Tensor, qs: torch.Tensor,
            ks: torch.Tensor, tau_inv: torch.Tensor, lam: torch.Tensor, sel: torch.Tensor, kernel: int,
            sm_scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(out float32 (B, H, T, Dv), lse (B, H, T)) over the selected keys: float32 qs, ks, 1 / tau, lam
    (B, H, T); sel (B, H, T, M) int32, -1 unused."""
    B, H, T = qs.shape
    consts = _consts(q, v, kernel)
    none = v.new_zeros(1)
    GK = k.shape[1] if q is not None else H
    out = torch.empty(B, H, T, consts["DV"], dtype=torch.float32, device=v.device)
    lse = torch.empty(B, H, T, dtype=torch.float32, device=v.device)
    BM, BJ, warps = _tiles(v.device)["fwd"]
    _sel_fwd[(-(-T // BM), B * H)](none if q is None else q.contiguous(), none if k is None else k.contiguous(),
                                  v.contiguous(), qs.contiguous(), ks.contiguous(), tau_inv.contiguous(),
                                  lam.contiguous(), sel.contiguous(), out, lse, T, sel.shape[-1], H, GK, v.shape[1],
                                  sm_scale, BLOCK_M=BM, BLOCK_J=BJ, num_warps=warps, **consts)
    return out, lse


@_fwd_op.register_fake
def _(q, k, v, qs, ks, tau_inv, lam, sel, kernel, sm_scale):
    B, H, T = qs.shape
    return qs.new_empty(B, H, T, v.shape[-1]), qs.new_empty(B, H, T)


@torch.library.custom_op("attnlab::selected_bwd", mutates_args=())
def _bwd_op(q: Optional[torch.Tensor], k: Optional[torch.Tensor], v: torch.Tensor, qs: torch.Tensor,
            ks: torch.Tensor, tau_inv: torch.Tensor, lam: torch.Tensor, sel: torch.Tensor, out: torch.Tensor,
            lse: torch.Tensor, dout: torch.Tensor, kernel: int, sm_scale: float) -> list[torch.Tensor]:
    """[dq, dk (empty without q), dv, dqs, dks, dtau, dlam] of `_Selected.backward` (dtau: of tau itself)."""
    B, H, T = qs.shape
    M = sel.shape[-1]
    consts = _consts(q, v, kernel)
    GK, GV = (k.shape[1] if q is not None else H), v.shape[1]
    none = v.new_zeros(1)
    qq, kk = (none if q is None else q.contiguous()), (none if k is None else k.contiguous())
    vv, dout = v.contiguous(), dout.contiguous()
    delta = (dout.float() * out).sum(-1).contiguous()
    BD, BDV = consts["BLOCK_D"], consts["BLOCK_DV"]
    BM, BJ, warps = _tiles(v.device)["bwd"]
    f32 = dict(dtype=torch.float32, device=v.device)
    dk, dv, dks = torch.empty(B, H, T, BD, **f32), torch.empty(B, H, T, BDV, **f32), torch.empty(B, H, T, **f32)
    dq, dqs, dtau, dlam = (torch.empty(B, H, T, BD, **f32), torch.empty(B, H, T, **f32),
                           torch.empty(B, H, T, **f32), torch.empty(B, H, T, **f32))
    scalars = (qs.contiguous(), ks.contiguous(), tau_inv.contiguous(), lam.contiguous())
    _sel_bwd[(-(-T // BM), B * H)](qq, kk, vv, *scalars, sel, dout, lse, delta, dq, dqs, dtau, dlam,
                                  T, M, H, GK, GV, sm_scale, BLOCK_M=BM, BLOCK_J=BJ, num_warps=warps, **consts)
    pair_q, pair_k, start = _invert(sel)
    BN, BP, warps = _tiles(v.device)["keys"]
    _sel_bwd_keys[(-(-T // BN), B * H)](qq, kk, vv, *scalars, pair_q, pair_k, start, dout, lse, delta, dk, dv, dks,
                                       T, M, H, GK, GV, sm_scale, BLOCK_N=BN, BLOCK_P=BP, num_warps=warps, **consts)
    D, DV = consts["D"], consts["DV"]
    dv = dv[..., :DV].view(B, GV, H // GV, T, DV).sum(2).to(v.dtype)
    if q is None:
        return [none.new_empty(0), none.new_empty(0), dv, dqs, dks, dtau, dlam]
    return [dq[..., :D].to(q.dtype).contiguous(), dk[..., :D].view(B, GK, H // GK, T, D).sum(2).to(k.dtype), dv, dqs,
            dks, dtau, dlam]


@_bwd_op.register_fake
def _(q, k, v, qs, ks, tau_inv, lam, sel, out, lse, dout, kernel, sm_scale):
    B, H, T = qs.shape
    e = v.new_empty(0)
    dq = e if q is None else q.new_empty(q.shape)
    dk = e if k is None else k.new_empty(k.shape)
    return [dq, dk, v.new_empty(v.shape), *(qs.new_empty(B, H, T) for _ in range(4))]


class _Selected(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, qs, ks, tau, lam, sel, kernel: int, sm_scale: float):
        qs32, ks32 = qs.float().contiguous(), ks.float().contiguous()
        tau32, lam32 = (1.0 / tau.float()).contiguous(), lam.float().contiguous()
        out, lse = _fwd_op(q, k, v, qs32, ks32, tau32, lam32, sel, kernel, sm_scale)
        ctx.save_for_backward(q, k, v, qs32, ks32, tau32, lam32, sel, out, lse)
        ctx.meta = (kernel, sm_scale)
        return out.to(v.dtype)

    @staticmethod
    def backward(ctx, dout):
        q, k, v, qs32, ks32, tau32, lam32, sel, out, lse = ctx.saved_tensors
        dq, dk, dv, dqs, dks, dtau, dlam = _bwd_op(q, k, v, qs32, ks32, tau32, lam32, sel, out, lse, dout, *ctx.meta)
        if q is None:
            dq = dk = None
        return dq, dk, dv, dqs, dks, dtau, dlam, None, None, None


def triton_selected_attention(qs, ks, v, tau_b, idx, ok, *, q=None, k=None, lam_b=None, kernel: str = "gaussian",
                              sm_scale: float | None = None) -> torch.Tensor:
    """softmax over each query's selected keys of [q_t . k_s * sm_scale] + lam_t phi((qs_t - ks_s)^2 / tau_t),
    times v, through the kernels above, for checked inputs: qs, ks (B, H, T); v (B, G, T, Dv); q (B, H,
    T, D) and k (B, G', T, D), or both None (scalar heads); tau_b, lam_b tensors broadcastable to (B, H,
    T) (None for 1); idx / ok (B, H, T, m) as `window.window_indices` returns them (a query with no
    selected key gets zeros). sm_scale 1 / sqrt(D) when None. Gradients reach q, k, v, qs, ks, tau and
    lam. Returns (B, H, T, Dv) in v's dtype."""
    B, H, T = qs.shape
    if T == 0 or idx.shape[-1] == 0:
        return v.new_zeros(B, H, T, v.shape[-1])
    dev = v.device
    tau = (torch.ones((), device=dev) if tau_b is None else tau_b.float()).expand(B, H, T)
    lam = (torch.ones((), device=dev) if lam_b is None else lam_b.float()).expand(B, H, T)
    sel = torch.where(ok, idx, -1).to(torch.int32).contiguous()
    if sm_scale is None:
        sm_scale = 1.0 / math.sqrt(q.shape[-1]) if q is not None else 0.0
    code = GAUSSIAN if kernel == "gaussian" else CAUCHY
    return _Selected.apply(q, k, v, qs, ks, tau, lam, sel, code, float(sm_scale))
