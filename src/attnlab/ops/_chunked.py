"""Chunked parallel form shared by the linear-attention family (gla, ssd, cosformer).

All three run the recurrence

    S_t = diag(exp(log_decay_t)) S_{t-1} + k_t v_t^T,    o_t = q_t^T S_t

with a per-channel decay (gla), one decay per head and step (ssd) or no decay (cosformer).
Time is cut into chunks of C steps. An output is the readout of the state entering its
chunk plus a causal, decay-weighted attention over the at most C steps of its own chunk, so
only the N = ceil(T / C) chunk-entry states are carried from chunk to chunk: memory is
linear in T and no T x T matrix is ever built.

Every decay factor is exp of a non-positive difference of within-chunk cumulative
log-decays b (b_t - b_s with s <= t), never a ratio of cumulative products, so strong
decay underflows instead of overflowing to inf. Exponents are clamped at the log of the
smallest normal float: a factor below ~1e-38 (float32) becomes that number rather than a
subnormal, which CPUs compute several times slower.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

SUB_CHUNK = 16  # per-channel decay: sub-chunk length c (largest divisor of C up to this) of the exact (c, c, Dk) blocks


def _sub_chunk_size(C: int) -> int:
    """Largest divisor of C that is at most SUB_CHUNK."""
    return max(d for d in range(1, min(C, SUB_CHUNK) + 1) if C % d == 0)


def _log_tiny(dtype: torch.dtype) -> float:
    return math.log(torch.finfo(dtype).tiny)


def _decay_exp(x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """exp of a non-positive exponent, clamped to stay normal; exactly 0 where keep is False."""
    x = x.clamp(min=_log_tiny(x.dtype))
    if keep is not None:
        x = x.masked_fill(~keep, float("-inf"))
    return torch.exp(x)


def _causal_mask(C: int, device) -> torch.Tensor:
    return torch.ones(C, C, dtype=torch.bool, device=device).tril()  # (C, C), s <= t


def _intra_scalar(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor | None) -> torch.Tensor:
    """Within-chunk outputs for no decay (b None) or a scalar decay b (B, H, N, C):
    the segment-sum form A[t, s] = (q_t . k_s) exp(b_t - b_s) for s <= t."""
    C = q.shape[-2]
    mask = _causal_mask(C, q.device)
    A = q @ k.transpose(-1, -2)  # (B, H, N, C, C)
    if b is None:
        A = A.masked_fill(~mask, 0.0)
    else:
        A = A * _decay_exp(b[..., :, None] - b[..., None, :], mask)  # (B, H, N, C, C) segment sums
    return A @ v  # (B, H, N, C, Dv)


def _diag_decay(b: torch.Tensor) -> torch.Tensor:
    """b (..., c, Dk) -> (..., c, c, Dk): exp(b_t - b_s) for s <= t, exactly 0 for s > t."""
    c = b.shape[-2]
    tri = _causal_mask(c, b.device)[..., None]  # (c, c, 1)
    diff = (b[..., :, None, :] - b[..., None, :, :]).clamp_(min=_log_tiny(b.dtype))
    return diff.masked_fill_(~tri, float("-inf")).exp_()


class _DiagBlocks(torch.autograd.Function):
    """A[t, s] = sum_d q_td k_sd exp(b_td - b_sd) (s <= t) inside each sub-chunk.

    The (c, c, Dk) decay tensor is the largest intermediate of the per-channel chunked form,
    so it is rebuilt in backward instead of being stored. With P_tsd = dA_ts q_td k_sd E_tsd:
    dq = sum_s dA E k, dk = sum_t dA E q, and db = sum_s P - sum_t P = q dq - k dk.
    """

    @staticmethod
    def forward(ctx, q, k, b):
        ctx.save_for_backward(q, k, b)
        E = _diag_decay(b).mul_(q[..., :, None, :])  # (..., c, c, Dk)
        return E.mul_(k[..., None, :, :]).sum(-1)

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dA):
        q, k, b = ctx.saved_tensors
        W = _diag_decay(b).mul_(dA[..., None])  # (..., c, c, Dk)
        dq = (W * k[..., None, :, :]).sum(-2)  # (..., c, Dk)
        dk = W.mul_(q[..., :, None, :]).sum(-3)
        return dq, dk, q * dq - k * dk


def _intra_vector(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Within-chunk outputs for a per-channel decay, b (B, H, N, C, Dk):
    A[t, s] = sum_d q_td k_sd exp(b_td - b_sd) for s <= t.

    The chunk is split into m sub-chunks of c steps. Diagonal (c x c) blocks use the exact
    (c, c, Dk) decay tensor. An off-diagonal block (t in sub-chunk i, s before it) factors
    through r, the last step before sub-chunk i: exp(b_t - b_s) = exp(b_t - b_r) exp(b_r - b_s),
    both exponents <= 0, so it is a plain matrix product of rescaled queries and keys.
    """
    B, H, N, C, Dk = q.shape
    Dv = v.shape[-1]
    c = _sub_chunk_size(C)
    m = C // c
    qs, ks, bs = (x.view(B, H, N, m, c, Dk) for x in (q, k, b))
    vs = v.view(B, H, N, m, c, Dv)

    A_diag = _DiagBlocks.apply(qs, ks, bs)  # (B, H, N, m, c, c)
    o = (A_diag @ vs).reshape(B, H, N, C, Dv)
    if m == 1:
        return o

    b_ref = F.pad(bs[..., :-1, -1, :], (0, 0, 1, 0))  # (B, H, N, m, Dk): b_r, and 0 before sub-chunk 0
    q_off = qs * _decay_exp(bs - b_ref[..., None, :])  # (B, H, N, m, c, Dk)
    pos = torch.arange(C, device=q.device)
    before = pos[None, :] < (pos[:m] * c)[:, None]  # (m, C): s precedes sub-chunk i
    k_off = k[..., None, :, :] * _decay_exp(b_ref[..., :, None, :] - b[..., None, :, :], before[..., None])  # (B, H, N, m, C, Dk)
    A_off = (q_off @ k_off.transpose(-1, -2)).reshape(B, H, N, C, C)  # zero where s >= start of t's sub-chunk
    return o + A_off @ v


def chunked_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor | None,
    state: torch.Tensor,
    chunk_size: int,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form of the recurrence above.

    q, k: (B, H, T, Dk), q already scaled; v: (B, H, T, Dv); log_decay: None (no decay),
    (B, H, T) (scalar per head and step) or (B, H, T, Dk) (per channel), all <= 0;
    state: (B, H, Dk, Dv), the state before step 0.
    Returns o (B, H, T, Dv) and the state after step T-1 (B, H, Dk, Dv).
    """
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    C = min(chunk_size, T)
    N = -(-T // C)
    pad = N * C - T
    if pad:  # padded steps have k = 0 (add nothing) and log_decay = 0 (decay nothing)
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        if log_decay is not None:
            log_decay = F.pad(log_decay, (0, pad) if log_decay.dim() == 3 else (0, 0, 0, pad))
    qc, kc = q.view(B, H, N, C, Dk), k.view(B, H, N, C, Dk)
    vc = v.view(B, H, N, C, Dv)

    if log_decay is None:
        o = _intra_scalar(qc, kc, vc, None)
        u = kc.transpose(-1, -2) @ vc  # (B, H, N, Dk, Dv): each chunk's own contribution
        totals = torch.cumsum(u, dim=2)  # (B, H, N, Dk, Dv)
        entry = state[:, :, None] + F.pad(totals[:, :, :-1], (0, 0, 0, 0, 1, 0))  # state entering chunk n
        o = o + qc @ entry
        final = state + totals[:, :, -1]
        return o.reshape(B, H, N * C, Dv)[:, :, :T], final

    if log_decay.dim() == 3:
        b = log_decay.view(B, H, N, C).cumsum(-1)  # (B, H, N, C)
        o = _intra_scalar(qc, kc, vc, b)
        b = b[..., None]  # (B, H, N, C, 1), broadcast over Dk
    else:
        b = log_decay.view(B, H, N, C, Dk).cumsum(-2)  # (B, H, N, C, Dk)
        o = _intra_vector(qc, kc, vc, b)

    g = b[..., -1:, :]  # (B, H, N, 1, Dk|1): log-decay of a whole chunk
    u = (kc * _decay_exp(g - b)).transpose(-1, -2) @ vc  # (B, H, N, Dk, Dv): chunk contribution at its end
    chunk_decay = _decay_exp(g).transpose(-1, -2)  # (B, H, N, Dk|1, 1)
    entries = []
    for a_n, u_n in zip(chunk_decay.unbind(2), u.unbind(2)):
        entries.append(state)
        state = a_n * state + u_n
    entry = torch.stack(entries, dim=2)  # (B, H, N, Dk, Dv)
    o = o + (qc * _decay_exp(b)) @ entry
    return o.reshape(B, H, N * C, Dv)[:, :, :T], state
