"""Decode state with static shapes, the pieces the mechanisms' static states are made of
(`attnlab.models.StaticDecoder` decodes through them; docs/guide/decoding.md):

- `state`: the options a layer's state is made with (`StaticOptions`) and the interface the decoder
  calls (`StaticState`);
- `store`: a layer's per-token entries in static buffers, a ring for a sliding window (`KeyStore`);
- `split`: split-K attention for a step over a long buffer (`split_attention`, its naive reference,
  the chunk `split_chunk` chooses);
- `window`: a window's choice of keys through sorted int64 codes (`merge_codes`, `extend_codes`,
  `window_keys`) and a budget's (`nearest_alive`, `budget_keep`); `window_kernel`, its step as one
  Triton kernel.
"""

from .split import CHUNK, SPLIT_MIN, padded, split_attention, split_attention_naive, split_chunk
from .state import WINDOW_IMPLS, StaticOptions, StaticState
from .store import KeyStore
from .window import (LAST, POS_MAX, budget_keep, extend_codes, extend_scratch_size, float_order, merge_codes,
                     nearest_alive, window_keys)

__all__ = ["CHUNK", "LAST", "POS_MAX", "SPLIT_MIN", "WINDOW_IMPLS", "KeyStore", "StaticOptions", "StaticState",
           "budget_keep", "extend_codes", "extend_scratch_size", "float_order", "merge_codes", "nearest_alive",
           "padded", "split_attention", "split_attention_naive", "split_chunk", "window_keys"]
