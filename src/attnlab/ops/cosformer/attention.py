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

``impl="naive"`` loops over positions and updates the state literally (`naive`); ``impl="fast"``
(``"auto"``) is the chunked form of `attnlab.ops.gla.chunked` (causal) or global sums (non-causal),
memory linear in T (`chunked`). 16-bit inputs are computed in float32; the state stays float32.
`cosformer_attention` checks its arguments (`args`), builds the features (`features`) and chooses.

Packed documents (``cu_seqlens`` or ``docs``, `attnlab.ops.common.packed`): each document is a sequence of
its own, its positions counted from its first token, its sums (state and normaliser) starting from
zero, and its horizon M = max_len, or its own length when max_len is None (as a call on that document
alone takes it), so the output equals running each document alone. The causal fast path is the
chunked form with the state reset at every document start; the non-causal one is a forward and a
backward causal pass over the reversed row, less the diagonal counted twice: O(T) memory, no host sync.
"""

from __future__ import annotations

import torch

from ...checks import empty_result
from ..common.packed import Packing
from ..common.precision import upcast
from .args import check_call, packed_horizon, resolve_horizon
from .chunked import cosformer_chunked
from .features import features, packed_features
from .naive import cosformer_naive, cosformer_naive_packed
from .state import CosformerState


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
        cu_seqlens: packed documents, flash-linear-attention's convention (`attnlab.ops.common.packed`): an
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
    (B, H, T, Dk, Dv), F, packed = check_call(q, k, v, causal, normalize, reweight, eps, initial_state, impl,
                                              chunk_size, cu_seqlens, docs)
    if packed is not None:
        return _packed_call(q, k, v, causal, max_len, normalize, reweight, eps, impl, chunk_size, packed)
    offset = 0 if initial_state is None else initial_state.offset
    M = resolve_horizon(max_len, reweight, initial_state, offset, T, default_T=True)

    out_dtype, dt = q.dtype, upcast(q.dtype)
    qf = features(q.to(dt), offset, M)  # (B, H, T, F)
    kf = features(k.to(dt), offset, M)
    v = v.to(dt)
    if initial_state is None:
        kv, k_sum = q.new_zeros(B, H, F, Dv, dtype=dt), q.new_zeros(B, H, F, dtype=dt)
    else:
        kv, k_sum = initial_state.kv, initial_state.k_sum
    if T == 0:
        return empty_result((B, H, 0, Dv), q, k, v).to(out_dtype), CosformerState(kv, k_sum, offset, M)
    if impl == "naive":
        o, kv, k_sum = cosformer_naive(qf, kf, v, kv, k_sum, causal, normalize, eps)
    else:
        o, kv, k_sum = cosformer_chunked(qf, kf, v, kv, k_sum, causal, normalize, eps, chunk_size)
    return o.to(out_dtype), CosformerState(kv, k_sum, offset + T, M)


def _packed_call(q, k, v, causal, max_len, normalize, reweight, eps, impl, chunk_size, packed: Packing):
    B, H, T, Dk = q.shape
    Dv, F = v.shape[-1], (2 * Dk if reweight else Dk)
    M = packed_horizon(max_len, packed, T) if reweight else None
    out_dtype, dt = q.dtype, upcast(q.dtype)
    if reweight:
        qf, kf = packed_features(q.to(dt), packed.pos, M), packed_features(k.to(dt), packed.pos, M)
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
        o, kv, k_sum = cosformer_naive_packed(qf, kf, v, kv, k_sum, causal, normalize, eps, packed)
    else:
        o, kv, k_sum = cosformer_chunked(qf, kf, v, kv, k_sum, causal, normalize, eps, chunk_size, packed)
    return o.to(out_dtype), CosformerState(kv, k_sum, lengths, horizon)
