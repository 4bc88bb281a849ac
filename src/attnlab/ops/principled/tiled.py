"""Principled attention's tiled fast path in PyTorch (the autograd Function the public op falls back
to where the compiled CPU kernel cannot be built, and runs on devices without one).

The fast path is FlashAttention-style online accumulation with one extra accumulator for the
grounded mass (docs/mechanisms.md#principled-attention, "Fast path"). Everything is kept relative
to the threshold: y = a - gamma = c (s - gamma) - b with c = 1 + softplus(alpha) log K, so the
ground term max(gamma, a) becomes max(0, y) and its exponential is 2^-M for the running max M.
Per query block, a loop over key blocks keeps

    M       running max of max(0, y)             (base-2 units)
    acc     sum_j 2^(y_j - M) [v_j, 1]           values and the plain sumexp
    excess  sum_j max(0, 2^-M - 2^(y_j - M))     the grounded mass, accumulated non-negative

so z = sumexp + excess, w0 = excess / z (never negative), o = values / z + w0 v0.
Scale factors (c / sqrt(d), log2 e, the threshold) are folded into the query side of the
score matmul: [q c log2e / sqrt(d), -c gamma log2e] . [k, 1] = log2e c (s - gamma).

The backward recomputes each block's scores from the saved log-normaliser. With
dP_j = do.v_j - dw0 and Delta = sum_j w_j dP_j = do.o_keys - dw0 (1 - w0), the logit gradient is
ds_j = w_j (dP_j - Delta tau_j), where tau_j = 1 if a_j > gamma, 1/2 on a tie (torch.maximum
splits the gradient of a tie evenly), 0 below; tau = (1 + sign(y)) / 2 covers all three cases.
Shifting gamma and every a_j together leaves w unchanged, which gives the threshold's gradient
through max(gamma, a) as -sum_j ds_j; with da/dgamma = 1 - c the total is dgamma = -c sum_j ds_j.

On the CPU (float32, float64) the same algorithm runs as one compiled kernel, forward and backward
(`cpu`, csrc/principled.cpp), which reads grouped k, kg, v in place; the autograd Function here is the
fallback when the kernel cannot be built, and the path on other devices.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable

from ..common.heads import broadcast_heads

LOG2E = 1.4426950408889634
BLOCK_K = 256
TILE_SCORES = 1 << 21  # default query block: about this many scores per tile over all heads (8 MiB fp32)


def _block_sizes(n_heads: int, block_q: int | None, block_k: int | None) -> tuple[int, int]:
    """Default tiles: 256 keys, and as many queries as fit TILE_SCORES (a multiple of 16, at least 16).
    Few large tiles keep the number of ops low; the budget bounds their memory for any batch."""
    block_k = BLOCK_K if block_k is None else block_k
    if block_q is None:
        block_q = max(16, TILE_SCORES // (n_heads * block_k) // 16 * 16)
    return block_q, block_k


def _tiles(q0: int, q1: int, Tk: int, offset: int, causal: bool, block_k: int):
    """Key blocks [k0, k1) that queries q0..q1-1 see, each with r0, the first query that sees
    it (rows before r0 are skipped), and n_mask, how many rows from r0 on need a causal mask."""
    k_end = min(Tk, q1 + offset) if causal else Tk
    for k0 in range(0, k_end, block_k):
        k1 = min(k0 + block_k, Tk)
        if not causal:
            yield k0, k1, q0, 0
            continue
        r0 = max(q0, k0 - offset)  # query r sees key j iff j <= r + offset
        yield k0, k1, r0, max(0, min(q1, k1 - 1 - offset) - r0)


class _BandMasks:
    """Causal masks for the rows of a tile that straddle the diagonal, built once per shape and shift."""

    def __init__(self, block_k: int, device):
        steps = torch.arange(block_k, device=device)
        self.diff = steps[None, :] - steps[:, None]  # key index - query index
        self.cache = {}

    def __call__(self, n_rows: int, n_keys: int, shift: int) -> torch.Tensor:
        """(n_rows, n_keys) bool, True where key k0 + j is hidden from query r0 + i (shift = r0 + offset - k0)."""
        key = (n_rows, n_keys, shift)
        if key not in self.cache:
            self.cache[key] = self.diff[:n_rows, :n_keys] > shift
        return self.cache[key]


def _mm_into(acc, a, b):
    """acc += a @ b for batched matrices; acc may be a row slice of a larger buffer."""
    if acc.is_contiguous():
        return acc.baddbmm_(a, b)
    return acc.add_(torch.bmm(a, b))  # baddbmm_ into a strided view would run one GEMM per batch


def _mm_acc(acc, a, b):
    """acc + a @ b, starting a fresh buffer when acc is None."""
    return torch.bmm(a, b) if acc is None else _mm_into(acc, a, b)


def _no_autocast(fn):
    """Run fn with autocast off: the kernel gets its operands in the work dtype and its matmuls
    must stay there (autocast would turn some of them bf16 and mix dtypes in baddbmm)."""
    def wrapped(ctx, *args):
        with torch.autocast("cpu", enabled=False), torch.autocast("cuda", enabled=False):
            return fn(ctx, *args)
    return wrapped


class _PrincipledTiled(torch.autograd.Function):
    """Tiled principled attention on flattened heads: q (N, Tq, D), k (N, Tk, D), qg (N, Tq, Dg),
    kg (N, Tk, Dg), v (N, Tk, Dv), per-query c, softplus(beta), gamma (N, Tq).
    Returns the key readout sum_j w_j v_j (N, Tq, Dv) and the ground weight w0 (N, Tq)."""

    @staticmethod
    def _operands(q, k, qg, v, c, spb, gamma):
        """Matmul operands with the per-query scalars folded in (recomputed in backward, O(T))."""
        N, Tq, D = q.shape
        ones_k = q.new_ones(N, k.shape[1], 1)
        qa = torch.cat([q * (c * (LOG2E / math.sqrt(D)))[..., None], (-LOG2E * c * gamma)[..., None]], -1)
        ka = torch.cat([k, ones_k], -1)  # (N, Tk, D + 1): qa . ka = log2e c (s - gamma)
        va = torch.cat([v, ones_k], -1)  # (N, Tk, Dv + 1): p . va = [sum p v, sum p]
        nspb2 = (-LOG2E * spb)[..., None]  # (N, Tq, 1)
        return qa, ka, va, -qg, nspb2

    @staticmethod
    @_no_autocast
    def forward(ctx, q, k, qg, kg, v, c, spb, gamma, causal, block_q, block_k):
        N, Tq, D = q.shape
        Tk, Dv = k.shape[1], v.shape[2]
        offset = Tk - Tq
        qa, ka, va, qgn, nspb2 = _PrincipledTiled._operands(q, k, qg, v, c, spb, gamma)
        band = _BandMasks(block_k, q.device)

        ok = q.new_empty(N, Tq, Dv)
        w0 = q.new_empty(N, Tq)
        lse2 = q.new_empty(N, Tq)
        for q0 in range(0, Tq, block_q):
            q1 = min(q0 + block_q, Tq)
            nq = q1 - q0
            m = q.new_zeros(N, nq, 1)  # running max of max(0, y), base 2
            acc = q.new_zeros(N, nq, Dv + 1)
            excess = q.new_zeros(N, nq, 1)
            for k0, k1, r0, n_mask in _tiles(q0, q1, Tk, offset, causal, block_k):
                rows, loc = slice(r0, q1), slice(r0 - q0, nq)
                sp = F.softplus(torch.bmm(qgn[:, rows], kg[:, k0:k1].transpose(1, 2)))  # (N, nr, nk)
                y = torch.bmm(qa[:, rows], ka[:, k0:k1].transpose(1, 2)).addcmul_(sp, nspb2[:, rows])
                del sp
                if n_mask:
                    hidden = band(n_mask, k1 - k0, r0 + offset - k0)
                    y[:, :n_mask].masked_fill_(hidden, float("-inf"))
                m_old = m[:, loc]
                m_new = torch.maximum(m_old, y.amax(-1, keepdim=True))
                rescale = torch.exp2(m_old - m_new)
                acc[:, loc].mul_(rescale)
                excess[:, loc].mul_(rescale)
                m[:, loc].copy_(m_new)
                p = y.sub_(m_new).exp2_()  # 2^(y - M)
                _mm_into(acc[:, loc], p, va[:, k0:k1])
                short = p.sub_(torch.exp2(-m_new)).clamp_max_(0)  # -max(0, 2^(0 - M) - p)
                if n_mask:
                    short[:, :n_mask].masked_fill_(hidden, 0.0)
                excess[:, loc].sub_(short.sum(-1, keepdim=True))
            z = acc[..., Dv:] + excess  # (N, nq, 1)
            ok[:, q0:q1] = acc[..., :Dv] / z
            w0[:, q0:q1] = (excess / z).squeeze(-1)
            lse2[:, q0:q1] = (m + torch.log2(z)).squeeze(-1)

        ctx.save_for_backward(q, k, qg, kg, v, c, spb, gamma, ok, w0, lse2)
        ctx.causal, ctx.block_q, ctx.block_k = causal, block_q, block_k
        return ok, w0

    @staticmethod
    @once_differentiable
    @_no_autocast
    def backward(ctx, d_ok, d_w0):
        q, k, qg, kg, v, c, spb, gamma, ok, w0, lse2 = ctx.saved_tensors
        causal, block_q, block_k = ctx.causal, ctx.block_q, ctx.block_k
        N, Tq, D = q.shape
        Tk = k.shape[1]
        offset = Tk - Tq
        need_gate = any(ctx.needs_input_grad[i] for i in (2, 3, 6))
        qa, ka, va, qgn, nspb2 = _PrincipledTiled._operands(q, k, qg, v, c, spb, gamma)
        band = _BandMasks(block_k, q.device)

        delta = (d_ok * ok).sum(-1) - d_w0 * (1 - w0)  # (N, Tq)
        # [do, -(dw0 + Delta/2)] . [v, 1] = dP - Delta/2; the sign term adds -Delta/2 sign(y).
        doa = torch.cat([d_ok, -(d_w0 + 0.5 * delta)[..., None]], -1)  # (N, Tq, Dv + 1)
        half_delta = (-0.5 * delta)[..., None]  # (N, Tq, 1)
        qs = qa[..., :D]
        qgs = qg * spb[..., None]  # (N, Tq, Dg)

        # Keys' gradients accumulate per key block, queries' per query block, in contiguous
        # buffers; they are joined at the end.
        n_kb = -(-Tk // block_k)
        dk_parts, dv_parts, dkg_parts = [None] * n_kb, [None] * n_kb, [None] * n_kb
        dqa_rows, dqg_rows, dspb_rows = [], [], []
        for q0 in range(0, Tq, block_q):
            q1 = min(q0 + block_q, Tq)
            nq = q1 - q0
            dqa_q = q.new_zeros(N, nq, D + 1)  # [sum_j ds k_j, sum_j ds]
            dqg_q = q.new_zeros(N, nq, qg.shape[2]) if need_gate else None
            dspb_q = q.new_zeros(N, nq)
            for k0, k1, r0, n_mask in _tiles(q0, q1, Tk, offset, causal, block_k):
                rows, loc, kb = slice(r0, q1), slice(r0 - q0, nq), k0 // block_k
                ng = torch.bmm(qgn[:, rows], kg[:, k0:k1].transpose(1, 2))  # -g, (N, nr, nk)
                sp = F.softplus(ng)
                y = torch.bmm(qa[:, rows], ka[:, k0:k1].transpose(1, 2)).addcmul_(sp, nspb2[:, rows])
                if n_mask:
                    y[:, :n_mask].masked_fill_(band(n_mask, k1 - k0, r0 + offset - k0), float("-inf"))
                side = torch.sign(y)  # +1 above the threshold, 0 on a tie, -1 below or hidden
                w = y.sub_(lse2[:, rows, None]).exp2_()  # (N, nr, nk)
                ds = torch.bmm(doa[:, rows], va[:, k0:k1].transpose(1, 2))
                ds.addcmul_(side, half_delta[:, rows]).mul_(w)  # dL/da
                del side
                dv_parts[kb] = _mm_acc(dv_parts[kb], w.transpose(1, 2), d_ok[:, rows])
                _mm_into(dqa_q[:, loc], ds, ka[:, k0:k1])
                dk_parts[kb] = _mm_acc(dk_parts[kb], ds.transpose(1, 2), qs[:, rows])
                if need_gate:
                    dspb_q[:, loc].sub_(torch.linalg.vecdot(ds, sp))
                    gate = ds.mul_(torch.sigmoid_(ng))  # dL/da * sigmoid(-g)
                    _mm_into(dqg_q[:, loc], gate, kg[:, k0:k1])
                    dkg_parts[kb] = _mm_acc(dkg_parts[kb], gate.transpose(1, 2), qgs[:, rows])
            dqa_rows.append(dqa_q)
            dqg_rows.append(dqg_q)
            dspb_rows.append(dspb_q)

        dqa = torch.cat(dqa_rows, 1)
        dk, dv = torch.cat(dk_parts, 1), torch.cat(dv_parts, 1)
        if need_gate:
            dqg, dkg, dspb = torch.cat(dqg_rows, 1), torch.cat(dkg_parts, 1), torch.cat(dspb_rows, 1)
        else:
            dqg, dkg, dspb = torch.zeros_like(qg), torch.zeros_like(kg), torch.zeros_like(spb)
        scale = c / math.sqrt(D)  # (N, Tq)
        ds_k, ds_sum = dqa[..., :D], dqa[..., D]
        dq = ds_k * scale[..., None]
        dk = dk * (1 / LOG2E)
        dc = (q * ds_k).sum(-1) / math.sqrt(D) - gamma * ds_sum
        dgamma = -c * ds_sum
        dqg = dqg * spb[..., None]
        return dq, dk, dqg, dkg, dv, dc, dspb, dgamma, None, None, None


def principled_tiled(q, k, qg, kg, v, c, spb, gamma, causal: bool, block_q: int | None, block_k: int | None):
    """`_PrincipledTiled` on checked inputs of one dtype: q (B, H, Tq, D), k (B, G, Tk, D), qg (B, H, Tq,
    Dg), kg (B, Gg, Tk, Dg), v (B, Gv, Tk, Dv), per-query c, softplus(beta), gamma (B, H, Tq). Returns
    (key readout (B, H, Tq, Dv), w0 (B, H, Tq))."""
    B, H, Tq, _ = q.shape
    Dv = v.shape[3]
    k, kg, v = broadcast_heads(k, H), broadcast_heads(kg, H), broadcast_heads(v, H)
    flat = [x.reshape(B * H, x.shape[2], x.shape[3]) for x in (q, k, qg, kg, v)]
    rows = [x.reshape(B * H, Tq) for x in (c, spb, gamma)]
    ok, w0 = _PrincipledTiled.apply(*flat, *rows, causal, *_block_sizes(B * H, block_q, block_k))
    return ok.view(B, H, Tq, Dv), w0.view(B, H, Tq)
