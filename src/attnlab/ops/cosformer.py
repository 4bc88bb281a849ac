"""cosFormer: linear attention with a ReLU feature map and cos position reweighting.

The score of query i on key j is

    s(i, j) = relu(q_i) . relu(k_j) * cos(pi (i - j) / (2 M)),

and cos(a - b) = cos a cos b + sin a sin b splits it into two linear-attention streams:
with theta_i = pi i / (2 M), the features are phi(x_i) = [relu(x_i) cos theta_i, relu(x_i) sin theta_i]
(F = 2 Dk channels) and s(i, j) = phi(q_i) . phi(k_j). The output is

    o_i = sum_j s(i, j) v_j / (sum_j s(i, j) + eps)      (normalize=True, the cosFormer normaliser)
    o_i = sum_j s(i, j) v_j                               (normalize=False)

over j <= i (causal) or all j (causal=False: global sums, as in the bidirectional cosFormer).
With reweight=False the features are relu(x) alone (F = Dk): plain ReLU linear attention.

M is the position horizon ``max_len``. The reweighting stays in [0, 1] only while every
position is below M, so positions offset .. offset+T-1 must be < M. Without an initial state
and without max_len, M = T (the whole sequence, the original cosFormer choice). For decoding
past the prompt pass a fixed max_len >= the total length; it is stored in the state so that
later calls and ``cosformer_step`` keep the same M.

``impl="naive"`` loops over positions and updates the state literally; ``impl="fast"``
(``"auto"``) is the chunked form of ``_chunked.py`` (causal) or global sums (non-causal),
memory linear in T. 16-bit inputs are computed in float32; the state stays float32.

Packed documents (``cu_seqlens`` or ``docs``, `attnlab.ops._packed`): each document is a sequence of
its own, its positions counted from its first token, its sums (state and normaliser) starting from
zero, and its horizon M = max_len, or its own length when max_len is None (as a call on that document
alone takes it), so the output equals running each document alone. The causal fast path is the
chunked form with the state reset at every document start; the non-causal one is a forward and a
backward causal pass over the reversed row, less the diagonal counted twice: O(T) memory, no host sync.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from ..checks import (
    assert_values, check_impl, check_positive, check_linear_qkv, check_state, empty_result,
    value_check_mode,
)
from ._chunked import chunked_linear_attention
from ._packed import Packing, document_states, packing
from ._sdpa import upcast


class CosformerState(NamedTuple):
    """State of cosformer_attention after ``offset`` positions.

    F = 2 Dk with reweighting (cos channels then sin channels), Dk without. kv and k_sum are in the
    compute dtype (float32 for 16-bit inputs).

    Attributes:
        kv: (B, H, F, Dv), the sum of phi(k_j) v_j^T.
        k_sum: (B, H, F), the sum of phi(k_j) (the normaliser).
        offset: the position of the next token.
        max_len: the horizon M; None without reweighting.
    """

    kv: torch.Tensor
    k_sum: torch.Tensor
    offset: int
    max_len: int | None



def _features(x: torch.Tensor, offset, max_len: int | None) -> torch.Tensor:
    """(B, H, T, Dk) -> (B, H, T, F): relu(x), times [cos theta, sin theta] when max_len is set.
    offset: the first token's position, an int or a 0-d integer tensor (a static decoder's)."""
    x = torch.relu(x)
    if max_len is None:
        return x
    pos = torch.arange(x.shape[-2], dtype=torch.float64, device=x.device) + offset
    theta = (pos * (math.pi / (2 * max_len)))[:, None]  # (T, 1)
    return torch.cat([x * torch.cos(theta).to(x.dtype), x * torch.sin(theta).to(x.dtype)], dim=-1)  # (B, H, T, 2Dk)


def _packed_features(x: torch.Tensor, pos: torch.Tensor, horizon) -> torch.Tensor:
    """`_features` of packed documents: x (B, H, T, Dk), pos (B, T) each token's position in its
    document, horizon M an int or per token (B, T) (its document's length)."""
    x = torch.relu(x)
    M = horizon.double() if isinstance(horizon, torch.Tensor) else float(horizon)
    theta = (pos.double() * (math.pi / 2) / M)[:, None, :, None]  # (B, 1, T, 1)
    return torch.cat([x * torch.cos(theta).to(x.dtype), x * torch.sin(theta).to(x.dtype)], dim=-1)


def _packed_horizon(max_len, packed: Packing, T: int):
    """M for packed documents: max_len (checked to cover every document: eagerly, or as an assert in a
    compiled graph or on the device), or each document's own length (max_len None)."""
    if max_len is None:
        return packed.length
    if isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1:
        raise ValueError(f"max_len must be a positive int or None, got {max_len!r}")
    if max_len < T:  # a document as long as the row would need T
        mode = value_check_mode(packed.length)
        longest = packed.length.max() if packed.length.numel() else packed.length.new_zeros(())
        if mode == "eager" and int(longest) > max_len:
            raise ValueError(f"max_len={max_len} is too small: a packed document has {int(longest)} positions "
                             f"(the cos reweighting turns negative past the horizon)")
        if mode == "assert":
            assert_values(longest <= max_len, f"max_len={max_len} must cover every packed document's length "
                                              f"(checked in a compiled graph or on the device)")
    return max_len


def _resolve_horizon(max_len, reweight: bool, state: CosformerState | None, offset: int, T: int, default_T: bool):
    """The horizon M in use, checked against the state and the positions it must cover."""
    if not reweight:
        return None
    if max_len is not None and (isinstance(max_len, bool) or not isinstance(max_len, int) or max_len < 1):
        raise ValueError(f"max_len must be a positive int or None, got {max_len!r}")
    if state is not None:
        if state.max_len is None:
            raise ValueError("initial_state was built without reweighting (max_len None) but reweight=True")
        if max_len is not None and max_len != state.max_len:
            raise ValueError(f"max_len={max_len} disagrees with the state's horizon max_len={state.max_len}")
        max_len = state.max_len
    if max_len is None:
        if not default_T or offset + T == 0:
            raise ValueError(
                "max_len must be given (the fixed position horizon M) when stepping, or calling with T = 0, "
                "from no state"
            )
        max_len = offset + T
    if offset + T > max_len:
        raise ValueError(
            f"max_len={max_len} is too small: positions {offset}..{offset + T - 1} need max_len >= {offset + T} "
            f"(the cos reweighting turns negative past the horizon)"
        )
    return max_len


def _check_state(state, B: int, H: int, F: int, Dv: int, name: str, like: torch.Tensor) -> None:
    """A CosformerState of these sizes (F = 2 Dk with reweighting, Dk without), finite, in the compute dtype."""
    if not isinstance(state, CosformerState):
        raise TypeError(f"{name} must be a CosformerState or None, got {type(state).__name__}")
    dt = upcast(like.dtype)
    check_state(f"{name}.kv", state.kv, (B, H, F, Dv), dt, like)
    check_state(f"{name}.k_sum", state.k_sum, (B, H, F), dt, like)
    if isinstance(state.offset, bool) or not isinstance(state.offset, int) or state.offset < 0:
        raise ValueError(f"{name}.offset must be a non-negative int, got {state.offset!r}")


def _readout(num: torch.Tensor, den: torch.Tensor, normalize: bool, eps: float) -> torch.Tensor:
    return num / (den + eps)[..., None] if normalize else num


def _naive(qf, kf, v, kv, k_sum, causal, normalize, eps):
    """The state update and readout position by position. qf, kf (B, H, T, F), v (B, H, T, Dv)."""
    outs = []
    if causal:
        for q_t, k_t, v_t in zip(qf.unbind(2), kf.unbind(2), v.unbind(2)):
            kv = kv + k_t[..., :, None] * v_t[..., None, :]  # (B, H, F, Dv)
            k_sum = k_sum + k_t
            outs.append(_readout((q_t[..., None, :] @ kv).squeeze(-2), (q_t * k_sum).sum(-1), normalize, eps))
        return torch.stack(outs, dim=2), kv, k_sum
    for k_t, v_t in zip(kf.unbind(2), v.unbind(2)):
        kv = kv + k_t[..., :, None] * v_t[..., None, :]
        k_sum = k_sum + k_t
    for q_t in qf.unbind(2):
        outs.append(_readout((q_t[..., None, :] @ kv).squeeze(-2), (q_t * k_sum).sum(-1), normalize, eps))
    return torch.stack(outs, dim=2), kv, k_sum


def _naive_packed(qf, kf, v, kv, k_sum, causal, normalize, eps, packed: Packing):
    """The reference over packed documents: the causal state update with kv and k_sum restarting at
    each document's first position, or (non-causal) the (T, T) scores masked to same-document pairs.
    The state returned: each document's sums with cu_seqlens, else each row's last document's."""
    if causal:
        outs, kvs, sums = [], [], []
        for t, (q_t, k_t, v_t) in enumerate(zip(qf.unbind(2), kf.unbind(2), v.unbind(2))):
            fresh = packed.starts[:, t, None, None]  # (B, 1, 1)
            kv = torch.where(fresh[..., None], torch.zeros_like(kv), kv) + k_t[..., :, None] * v_t[..., None, :]
            k_sum = torch.where(fresh, torch.zeros_like(k_sum), k_sum) + k_t
            outs.append(_readout((q_t[..., None, :] @ kv).squeeze(-2), (q_t * k_sum).sum(-1), normalize, eps))
            kvs.append(kv)
            sums.append(k_sum)
        if packed.cu is not None:
            kv = document_states(torch.stack(kvs, 2), packed.cu)
            k_sum = document_states(torch.stack(sums, 2), packed.cu)
        return torch.stack(outs, dim=2), kv, k_sum
    same = packed.same().to(qf.dtype)  # (B, 1, T, T)
    scores = (qf @ kf.transpose(-1, -2)) * same  # (B, H, T, T)
    o = _readout(scores @ v, scores.sum(-1), normalize, eps)
    if packed.cu is not None:  # every document of the one row: (N, T) which positions it holds
        t = torch.arange(qf.shape[2], device=qf.device)
        w = ((packed.cu[:-1, None] <= t) & (t < packed.cu[1:, None])).to(qf.dtype)
        return o, torch.einsum("nt,htf,htd->nhfd", w, kf[0], v[0]), torch.einsum("nt,htf->nhf", w, kf[0])
    w = (packed.seg == packed.seg[:, -1:]).to(qf.dtype)  # (B, T): each row's last document
    return o, torch.einsum("bt,bhtf,bhtd->bhfd", w, kf, v), torch.einsum("bt,bhtf->bhf", w, kf)


def _fast(qf, kf, v, kv, k_sum, causal, normalize, eps, chunk_size, packed: Packing | None = None):
    """Chunked (causal) or global-sum (non-causal) form; the normaliser rides along as an extra value column of ones.
    Packed documents: the chunked form with the state reset at each document's start; non-causal, a
    causal pass plus one over the reversed row (each document's later keys) less the diagonal."""
    Dv = v.shape[-1]
    v1 = torch.cat([v, torch.ones_like(v[..., :1])], dim=-1)  # (B, H, T, Dv + 1)
    state = torch.cat([kv, k_sum[..., None]], dim=-1)  # (B, H, F, Dv + 1)
    if packed is not None:
        o1, final = chunked_linear_attention(qf, kf, v1, None, state, chunk_size, packed.starts, packed.cu)
        if not causal:  # each document's later keys: the causal form over the reversed row
            back, _ = chunked_linear_attention(qf.flip(2), kf.flip(2), v1.flip(2), None, state, chunk_size,
                                               packed.ends.flip(1))
            o1 = o1 + back.flip(2) - (qf * kf).sum(-1, keepdim=True) * v1  # the diagonal was counted twice
        state = final
    elif causal:
        o1, state = chunked_linear_attention(qf, kf, v1, None, state, chunk_size)  # (B, H, T, Dv + 1)
    else:
        state = state + kf.transpose(-1, -2) @ v1
        o1 = qf @ state
    return _readout(o1[..., :Dv], o1[..., Dv], normalize, eps), state[..., :Dv], state[..., Dv]


def cosformer_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    max_len: int | None = None,
    normalize: bool = True,
    reweight: bool = True,
    eps: float = 1e-6,
    initial_state: CosformerState | None = None,
    impl: str = "auto",
    chunk_size: int = 64,
    cu_seqlens=None,
    docs: torch.Tensor | None = None,
) -> tuple[torch.Tensor, CosformerState]:
    """cosFormer attention (see the module docstring for the formula).

    Args:
        q: queries (B, H, T, Dk), before the ReLU feature map.
        k: keys (B, H, T, Dk), before the ReLU feature map.
        v: values (B, H, T, Dv).
        causal: position i reads keys j <= i (a chunked scan); False reads every key (global
            sums, the bidirectional cosFormer).
        max_len: the position horizon M, an int >= offset + T; None for the state's, else
            offset + T. Ignored without reweighting.
        normalize: divide by the cosFormer normaliser (+ eps).
        reweight: apply the cos reweighting (False: plain ReLU linear attention).
        eps: added to the normaliser, > 0 (read only with normalize).
        initial_state: a CosformerState from an earlier call, whose positions this call
            continues from its offset; None starts at position 0 with a zero state.
        impl: ``"naive"`` loops over positions; ``"fast"`` and ``"auto"`` run the chunked form
            (causal) or global sums (non-causal).
        chunk_size: positions per chunk of the chunked form, an int >= 1.
        cu_seqlens: packed documents, flash-linear-attention's convention (`attnlab.ops._packed`): an
            int32/int64 tensor (or list) of N + 1 offsets [0, ..., T] into one packed row (B = 1).
            Each document's positions, sums and horizon restart (module docstring), equal to running
            it alone; the state returned holds each document's sums, kv (N, H, F, Dv) and k_sum
            (N, H, F), with offset the (N,) int64 tensor of document lengths and max_len the horizon
            (None when each document took its own length).
        docs: packed documents as (B, T) integer ids, a document being a run of equal ids in its row
            (any batch size): as cu_seqlens, with the state of each row's last document (kv
            (B, H, F, Dv), offset its (B,) lengths). Give at most one of the two; neither comes with
            an initial_state.

    Returns:
        o (B, H, T, Dv) in q's dtype, and the CosformerState after the last position.

    Raises:
        TypeError: q, k or v is not a tensor, not floating or not of q's dtype; causal is not a
            bool; initial_state is not a CosformerState (or its tensors not in the compute dtype).
        ValueError: shapes that do not fit (q and k one shape, v's (B, H, T), the state's sizes),
            another device, NaN or inf in any input or in the state, eps <= 0, a chunk_size or
            max_len that is not a positive int, a max_len that disagrees with the state's or is
            below offset + T, a state without horizon under reweighting, or an unknown impl;
            packed documents given badly (cu_seqlens not int offsets from 0 to T, non-decreasing, or
            with B != 1; docs of another shape or device; both), with an initial_state, or longer
            than max_len.
    """
    check_impl(impl)
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    B, H, T, Dk, _ = check_linear_qkv(q, k, v)
    if normalize:
        check_positive("eps", eps)
    Dv, F = v.shape[-1], (2 * Dk if reweight else Dk)
    if initial_state is not None:
        _check_state(initial_state, B, H, F, Dv, "initial_state", q)
    packed = packing(cu_seqlens, docs, B, T, q)
    if packed is not None:
        if initial_state is not None:
            raise ValueError("initial_state must be None with packed documents (cu_seqlens or docs): every document "
                             "starts from position 0 and zero sums (continue one document by calling on it alone)")
        return _packed_call(q, k, v, causal, max_len, normalize, reweight, eps, impl, chunk_size, packed)
    offset = 0 if initial_state is None else initial_state.offset
    M = _resolve_horizon(max_len, reweight, initial_state, offset, T, default_T=True)

    out_dtype, dt = q.dtype, upcast(q.dtype)
    qf = _features(q.to(dt), offset, M)  # (B, H, T, F)
    kf = _features(k.to(dt), offset, M)
    v = v.to(dt)
    if initial_state is None:
        kv, k_sum = q.new_zeros(B, H, F, Dv, dtype=dt), q.new_zeros(B, H, F, dtype=dt)
    else:
        kv, k_sum = initial_state.kv, initial_state.k_sum
    if T == 0:
        return empty_result((B, H, 0, Dv), q, k, v).to(out_dtype), CosformerState(kv, k_sum, offset, M)
    if impl == "naive":
        o, kv, k_sum = _naive(qf, kf, v, kv, k_sum, causal, normalize, eps)
    else:
        o, kv, k_sum = _fast(qf, kf, v, kv, k_sum, causal, normalize, eps, chunk_size)
    return o.to(out_dtype), CosformerState(kv, k_sum, offset + T, M)


def _packed_call(q, k, v, causal, max_len, normalize, reweight, eps, impl, chunk_size, packed: Packing):
    B, H, T, Dk = q.shape
    Dv, F = v.shape[-1], (2 * Dk if reweight else Dk)
    M = _packed_horizon(max_len, packed, T) if reweight else None
    out_dtype, dt = q.dtype, upcast(q.dtype)
    if reweight:
        qf, kf = _packed_features(q.to(dt), packed.pos, M), _packed_features(k.to(dt), packed.pos, M)
    else:
        qf, kf = torch.relu(q.to(dt)), torch.relu(k.to(dt))
    v = v.to(dt)
    kv, k_sum = q.new_zeros(B, H, F, Dv, dtype=dt), q.new_zeros(B, H, F, dtype=dt)
    if packed.cu is not None:
        lengths = packed.cu[1:] - packed.cu[:-1]  # (N,)
    else:
        lengths = packed.length[:, -1] if T else packed.length.new_zeros(B)  # (B,): each row's last document
    horizon = max_len if reweight and isinstance(M, int) else None
    if T == 0:
        n = lengths.shape[0]
        kv, k_sum = q.new_zeros(n, H, F, Dv, dtype=dt), q.new_zeros(n, H, F, dtype=dt)
        return empty_result((B, H, 0, Dv), q, k, v).to(out_dtype), CosformerState(kv, k_sum, lengths, horizon)
    if impl == "naive":
        o, kv, k_sum = _naive_packed(qf, kf, v, kv, k_sum, causal, normalize, eps, packed)
    else:
        o, kv, k_sum = _fast(qf, kf, v, kv, k_sum, causal, normalize, eps, chunk_size, packed)
    return o.to(out_dtype), CosformerState(kv, k_sum, lengths, horizon)
