"""Decode-time state: the plain KV cache and recurrent states, the sorted scalar cache with its
eviction policies, and window-error accounting."""

from .kv import KVCache, RecurrentState
from .sorted import SortedScalarCache, bytes_per_token
from .window_error import erfc_bound, window_error

__all__ = ["KVCache", "RecurrentState", "SortedScalarCache", "bytes_per_token", "erfc_bound", "window_error"]
