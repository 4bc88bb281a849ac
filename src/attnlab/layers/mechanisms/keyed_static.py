"""The static decode state of a layer read through a key store (softmax, GOAT, goat_hybrid,
principled): `KeyedState`, a `cache.static.KeyStore` of the layer's per-token entries (a ring of w
slots under a sliding window of w keys), read by the layer's own readout.

A mechanism decoded this way returns `KeyedState(self, opts)` from `static_state(opts)` and says
what it stores and how it reads it:

- `static_entries(dtype)`: name -> (groups, width, dtype) of each per-token entry (`kv_entries`: its
  keys and values, to which GOAT adds its key-only term u, goat_hybrid its scalar keys, principled
  its gate keys);
- `static_values(p, positions)`: those entries of the tokens p at `positions` (T,);
- `static_readout(p, e, kpos, positions, ok, chunk)`: the readout (B, H, T, Dv) of the tokens p over
  the entries e read, held at positions kpos (m,), where ok (T, m); its score written for explicit
  key positions beside the layer's own op; chunk: a step over the whole buffer may be split in
  chunks of that many keys (`cache.static.split_attention`), or None.
"""

from __future__ import annotations

import torch

from ...cache.static import KeyStore, StaticState

__all__ = ["KeyedState", "kv_entries"]


def kv_entries(layer, dtype) -> dict:
    """A layer's keys and values as `KeyStore` entries: (groups, width, dtype) by name."""
    return {"k": (layer.n_kv, layer.qk_dim, dtype), "v": (layer.n_kv, layer.config.head_dim, dtype)}


class KeyedState(StaticState):
    """A layer's static state in a `KeyStore` of its `static_entries` (module docstring).
    opts: a `cache.static.StaticOptions`; its chunk splits a step over the whole buffer (no ring)."""

    def __init__(self, layer, opts):
        super().__init__(layer)
        self.chunk = opts.chunk
        self.store = KeyStore(layer.static_entries(opts.dtype), opts.batch_size, opts.max_len,
                              layer.config.sliding_window, opts.device)

    def reset(self) -> None:
        self.store.reset()

    def attend(self, p, positions: torch.Tensor, n: int, h: torch.Tensor) -> torch.Tensor:
        a = self.layer
        e, kpos, ok = self.store.read(a.static_values(p, positions), positions, n)
        return a.static_readout(p, e, kpos, positions, ok, None if self.store.ring else self.chunk)

    def fill(self, p, T: int) -> torch.Tensor:
        """A whole prompt of T tokens from position 0: its entries kept (a ring: the last w), the
        layer's own op for its readout."""
        positions = torch.arange(T, device=p.q.device)
        self.store.keep(self.layer.static_values(p, positions), positions)
        return self.layer.attend(p)[0]
