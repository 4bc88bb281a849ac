"""`LayerCache`: one attention layer's decode state, made by `Attention.make_cache`."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..cache.kv import KVCache, RecurrentState


@dataclass
class LayerCache:
    """Decode state of one layer, made by `Attention.make_cache` (whose arguments set the options).

    Args:
        batch_size: B, the batch of every step.
        pos: tokens seen (the next token's position).
        kv: plain cache of the vector heads (k, v, and what else a mechanism keeps per key).
        scalar: the scalar heads' cache (KVCache, ExactScalarCache or SortedScalarCache).
        state: the recurrent state of the linear family.
        window: the sorted cache's window k; None for exact decoding.
        budget: with window, the entries per head the sorted cache keeps after each step.
        compress: with window, the key span merged after each step (density compression).
        max_len: the cosformer horizon M.
        ring: the last local_window tokens of a window-trained scalar/hybrid layer.
        exact: decode every key even where the layer was trained through a window.
        selector: the scalar/hybrid heads' learned key selector (`attnlab.cache.selected`), or None.
    """

    batch_size: int
    pos: int = 0
    kv: KVCache | None = None
    scalar: Any = None
    state: RecurrentState | None = None
    window: int | None = None
    budget: int | None = None
    compress: float | None = None
    max_len: int | None = None
    ring: Any = None
    exact: bool = False
    selector: Any = None
