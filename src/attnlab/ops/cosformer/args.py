"""cosFormer's argument checks, all before any work: q, k, v, the options, the state and the position
horizon M (`resolve_horizon`; with packed documents `packed_horizon`)."""

from __future__ import annotations

from ...checks import assert_values, check_impl, check_linear_qkv, check_positive, value_check_mode
from ..common.packed import Packing, packing
from .state import CosformerState, check_cosformer_state


def packed_horizon(max_len, packed: Packing, T: int):
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


def resolve_horizon(max_len, reweight: bool, state: CosformerState | None, offset: int, T: int, default_T: bool):
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


def check_call(q, k, v, causal, normalize: bool, reweight: bool, eps, initial_state, impl: str, chunk_size,
               cu_seqlens, docs):
    """Every check of `cosformer_attention` but the horizon's. Returns (B, H, T, Dk, Dv), F (2 Dk with
    reweighting, Dk without) and the `Packing` (or None)."""
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
        check_cosformer_state(initial_state, B, H, F, Dv, "initial_state", q)
    packed = packing(cu_seqlens, docs, B, T, q)
    if packed is not None and initial_state is not None:
        raise ValueError("initial_state must be None with packed documents (cu_seqlens or docs): every document "
                         "starts from position 0 and zero sums (continue one document by calling on it alone)")
    return (B, H, T, Dk, Dv), F, packed
