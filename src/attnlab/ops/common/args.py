"""Argument checks shared by the op families: dot-product queries, keys and values (`check_qkv`) and
the causal flag. Each family's own arguments are checked in its `args` module; the checks every part
of attnlab uses are `attnlab.checks`."""

from __future__ import annotations

from ...checks import check_finite, check_groups, check_lengths, check_like, check_same, check_tensor


def check_qkv(q, k, v, causal: bool = True) -> tuple[int, int, int, int]:
    """Validate finite q (B, H, Tq, D), k (B, Gk, Tk, D), v (B, Gv, Tk, Dv) of one dtype and
    device, Tq <= Tk under causal masking; return (B, H, Tq, D)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, 4)
        check_like(name, x, q, "q")
    B, H, T, D = q.shape
    for name, x in (("k", k), ("v", v)):
        check_same("q", B, name, x.shape[0], "batch size (dim 0)")
    check_same("k", k.shape[2], "v", v.shape[2], "sequence length (dim 2)")
    check_lengths(T, k.shape[2], causal)
    check_same("q", D, "k", k.shape[3], "head dimension (dim 3)")
    check_groups(H, k.shape[1], "k")
    check_groups(H, v.shape[1], "v")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_finite(name, x)
    return B, H, T, D


def check_causal(causal) -> None:
    if not isinstance(causal, bool):
        raise TypeError(f"causal must be a bool, got {type(causal).__name__}")
