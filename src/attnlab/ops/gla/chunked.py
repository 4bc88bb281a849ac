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
decay underflows instead of overflowing to inf. Exponents are clamped just above the log of the
smallest normal float (`exp_floor`): a factor below ~3e-38 (float32) becomes that number rather
than a subnormal or 0, which the CPU's eager exp computes on a scalar path instead of a vectorized one.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

SUB_CHUNK = 16  # per-channel decay: sub-chunk length c (largest divisor of C up to this) of the exact (c, c, Dk) blocks


def _sub_chunk_size(C: int) -> int:
    """Largest divisor of C that is at most SUB_CHUNK."""
    return max(d for d in range(1, min(C, SUB_CHUNK) + 1) if C % d == 0)


def exp_floor(dtype: torch.dtype) -> float:
    """The lowest exponent eager `torch.exp` on a CPU computes on its vectorized path for `dtype`:
    one above the log of the smallest normal float (at and below it the result is subnormal or 0,
    computed on a scalar path). exp(floor) is ~3e-38 in float32."""
    return math.log(torch.finfo(dtype).tiny) + 1.0


def _decay_exp(x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """exp of a non-positive exponent, clamped to stay normal; exactly 0 where keep is False."""
    x = x.clamp(min=exp_floor(x.dtype))
    if keep is not None:
        x = x.masked_fill(~keep, float("-inf"))
    return torch.exp(x)


def _causal_mask(C: int, device) -> torch.Tensor:
    return torch.ones(C, C, dtype=torch.bool, device=device).tril()  # (C, C), s <= t


def _intra_scalar(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor | None,
                  ls: torch.Tensor | None = None) -> torch.Tensor:
    """Within-chunk outputs for no decay (b None) or a scalar decay b (B, H, N, C):
    the segment-sum form A[t, s] = (q_t . k_s) exp(b_t - b_s) for s <= t (and, with packed documents,
    ls (B, 1, N, C) each step's document inside its chunk, s in t's document)."""
    C = q.shape[-2]
    mask = _causal_mask(C, q.device)
    if ls is not None:
        mask = mask & (ls[..., :, None] == ls[..., None, :])  # (B, 1, N, C, C)
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
    diff = (b[..., :, None, :] - b[..., None, :, :]).clamp_(min=exp_floor(b.dtype))
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


def _intra_vector(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor,
                  ls: torch.Tensor | None = None) -> torch.Tensor:
    """Within-chunk outputs for a per-channel decay, b (B, H, N, C, Dk):
    A[t, s] = sum_d q_td k_sd exp(b_td - b_sd) for s <= t (and s in t's document, with packed
    documents: ls (B, 1, N, C) each step's document inside its chunk; A is zeroed across them).

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
    if ls is not None:
        lsd = ls.view(*ls.shape[:3], m, c)
        A_diag = A_diag.masked_fill(lsd[..., :, None] != lsd[..., None, :], 0.0)
    o = (A_diag @ vs).reshape(B, H, N, C, Dv)
    if m == 1:
        return o

    b_ref = F.pad(bs[..., :-1, -1, :], (0, 0, 1, 0))  # (B, H, N, m, Dk): b_r, and 0 before sub-chunk 0
    q_off = qs * _decay_exp(bs - b_ref[..., None, :])  # (B, H, N, m, c, Dk)
    pos = torch.arange(C, device=q.device)
    before = pos[None, :] < (pos[:m] * c)[:, None]  # (m, C): s precedes sub-chunk i
    k_off = k[..., None, :, :] * _decay_exp(b_ref[..., :, None, :] - b[..., None, :, :], before[..., None])  # (B, H, N, m, C, Dk)
    A_off = (q_off @ k_off.transpose(-1, -2)).reshape(B, H, N, C, C)  # zero where s >= start of t's sub-chunk
    if ls is not None:
        A_off = A_off.masked_fill(ls[..., :, None] != ls[..., None, :], 0.0)
    return o + A_off @ v


def chunked_linear_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    log_decay: torch.Tensor | None,
    state: torch.Tensor,
    chunk_size: int,
    starts: torch.Tensor | None = None,
    cu: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Chunked form of the recurrence above.

    q, k: (B, H, T, Dk), q already scaled; v: (B, H, T, Dv); log_decay: None (no decay),
    (B, H, T) (scalar per head and step) or (B, H, T, Dk) (per channel), all <= 0;
    state: (B, H, Dk, Dv), the state before step 0.
    Returns o (B, H, T, Dv) and the state after step T-1 (B, H, Dk, Dv).

    Packed documents (`_packed_chunks`): starts (B, T) bool marks each document's first step, where
    the state restarts from zero. Given cu (N + 1,) document offsets (B = 1), the second result is
    every document's final state (N, H, Dk, Dv) instead of the row's.
    """
    if starts is not None:
        return _packed_chunks(q, k, v, log_decay, state, chunk_size, starts, cu)
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


def _packed_chunks(q, k, v, log_decay, state, chunk_size, starts, cu):
    """`chunked_linear_attention` over packed documents, the state reset to zero at every step that
    starts[b, t] marks. With ls the document index of each step inside its chunk (0: the document
    that entered the chunk), the chunked form changes in three places, each a mask, so shapes and
    work stay those of one long sequence (no host sync):

    - inside a chunk, A[t, s] is kept only for s in t's document;
    - the state entering a chunk is read only by steps whose document entered with it (ls = 0);
    - the state leaving a chunk is the decayed entry state plus the chunk's contribution when no
      document starts in the chunk, else the contribution of the chunk's last document alone.
    """
    B, H, T, Dk = q.shape
    Dv = v.shape[-1]
    C = min(chunk_size, T)
    N = -(-T // C)
    pad = N * C - T
    if pad:  # padded steps continue the last document, adding and decaying nothing
        q, k, v = (F.pad(x, (0, 0, 0, pad)) for x in (q, k, v))
        starts = F.pad(starts, (0, pad))
        if log_decay is not None:
            log_decay = F.pad(log_decay, (0, pad) if log_decay.dim() == 3 else (0, 0, 0, pad))
    qc, kc = q.view(B, H, N, C, Dk), k.view(B, H, N, C, Dk)
    vc = v.view(B, H, N, C, Dv)
    ls = starts.view(B, 1, N, C).long().cumsum(-1)  # (B, 1, N, C): document index inside the chunk
    entered = (ls == 0)[..., None]  # (B, 1, N, C, 1): t's document began before its chunk
    in_last = (ls == ls[..., -1:])[..., None]  # s belongs to the chunk's last document
    carried = (ls[..., -1] == 0)[..., None, None]  # (B, 1, N, 1, 1): no document starts in the chunk

    if log_decay is None:
        b = None
        o = _intra_scalar(qc, kc, vc, None, ls)
        u = (kc * in_last).transpose(-1, -2) @ vc  # (B, H, N, Dk, Dv)
        chunk_decay = carried.to(q.dtype).expand(B, H, N, 1, 1)
    else:
        if log_decay.dim() == 3:
            b = log_decay.view(B, H, N, C).cumsum(-1)  # (B, H, N, C)
            o = _intra_scalar(qc, kc, vc, b, ls)
            b = b[..., None]  # (B, H, N, C, 1)
        else:
            b = log_decay.view(B, H, N, C, Dk).cumsum(-2)  # (B, H, N, C, Dk)
            o = _intra_vector(qc, kc, vc, b, ls)
        g = b[..., -1:, :]  # (B, H, N, 1, Dk|1)
        u = (kc * _decay_exp(g - b) * in_last).transpose(-1, -2) @ vc  # (B, H, N, Dk, Dv)
        chunk_decay = _decay_exp(g).transpose(-1, -2) * carried  # (B, H, N, Dk|1, 1)
    entries = []
    for a_n, u_n in zip(chunk_decay.unbind(2), u.unbind(2)):
        entries.append(state)
        state = a_n * state + u_n
    entry = torch.stack(entries, dim=2)  # (B, H, N, Dk, Dv)
    q_in = qc * entered if b is None else qc * _decay_exp(b) * entered
    o = (o + q_in @ entry).reshape(B, H, N * C, Dv)[:, :, :T]
    if cu is None:
        return o, state
    return o, _document_finals(kc, vc, b, entry, cu, C)


def _document_finals(kc, vc, b, entry, cu, C: int) -> torch.Tensor:
    """Each document's state after its last step, (N_docs, H, Dk, Dv), from the chunked form's pieces
    (B = 1): kc (1, H, N, C, Dk), vc (1, H, N, C, Dv), b the within-chunk cumulative log-decays
    (1, H, N, C, Dk|1) or None, entry the state entering each chunk (1, H, N, Dk, Dv). Document i
    ends at e in chunk n: its state is the entry state decayed to e (when the document entered the
    chunk) plus the decayed contributions of its steps in chunk n up to e. Memory N_docs x C x Dk
    per head, the order of the states returned; an empty document's state is zero."""
    first, stop = cu[:-1], cu[1:]
    nonempty = stop > first  # (Nd,)
    e = (stop - 1).clamp_min(0)
    n, j = e // C, e % C
    steps = n[:, None] * C + torch.arange(C, device=cu.device)  # (Nd, C): the absolute step of each slot
    keep = ((steps <= e[:, None]) & (steps >= first[:, None]) & nonempty[:, None])[..., None]  # (Nd, C, 1)
    kg, vg = kc[:, :, n], vc[:, :, n]  # (1, H, Nd, C, Dk), (1, H, Nd, C, Dv)
    entered = (first < n * C) & nonempty  # (Nd,)
    if b is None:
        from_entry = entry[:, :, n] * entered[:, None, None]
        own = (kg * keep).transpose(-1, -2) @ vg
    else:
        bg = b[:, :, n]  # (1, H, Nd, C, Dk|1)
        b_end = bg[:, :, torch.arange(n.shape[0], device=cu.device), j]  # (1, H, Nd, Dk|1)
        own = (kg * _decay_exp(b_end[..., None, :] - bg, keep)).transpose(-1, -2) @ vg  # (1, H, Nd, Dk, Dv)
        from_entry = _decay_exp(b_end)[..., None] * entry[:, :, n] * entered[:, None, None]
    return (from_entry + own)[0].transpose(0, 1)  # (Nd, H, Dk, Dv)
