"""Which keys each query sees, as the ops build it: causal masking with the queries the last Tq of Tk
positions, an optional sliding window and a sink (`visible_keys`), and how many (`key_counts`)."""

from __future__ import annotations

import torch

__all__ = ["key_counts", "visible_keys"]


def visible_keys(Tq: int, Tk: int, causal: bool, device, window: int | None = None, n_prefix: int = 0) -> torch.Tensor:
    """(Tq, Tk) bool: which keys each query sees. Queries are the last Tq of the Tk positions, so
    under causal masking query t sees keys 0 .. t + Tk - Tq (Tq == Tk is ordinary causal masking;
    one query against n cached keys sees them all). With a sliding `window` w (causal only) query
    t sees only the last w of those, itself included, and the first `n_prefix` keys (a sink)
    always."""
    if not causal:
        return torch.ones(Tq, Tk, dtype=torch.bool, device=device)
    rows = torch.arange(Tq, device=device)[:, None] + (Tk - Tq)  # each query's position
    cols = torch.arange(Tk, device=device)[None, :]
    seen = cols <= rows
    if window is not None:
        seen &= (cols > rows - window) | (cols < n_prefix)
    return seen


def key_counts(Tq: int, Tk: int, causal: bool, device, dtype, window: int | None = None) -> torch.Tensor:
    """(Tq,) number of keys each query sees: t + 1 + Tk - Tq under causal masking (at most `window`
    with a sliding window), Tk otherwise."""
    if not causal:
        return torch.full((Tq,), float(Tk), device=device, dtype=dtype)
    n = torch.arange(Tk - Tq + 1, Tk + 1, device=device, dtype=dtype)
    return n if window is None else n.clamp_max(window)
