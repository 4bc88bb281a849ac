"""A layer's per-token entries in static buffers: `KeyStore`.

A `KeyStore` holds one layer's per-token entries (keys, values, and whatever else its score reads)
in buffers made once, with the position each slot holds. Without a sliding window it has max_len
slots, slot t holding position t; with a sliding window of w < max_len keys it is a ring of w slots
(position t in slot t mod w), so a step reads w keys whatever the context. A step writes its token
first, then reads every slot under the mask of the positions it may see; a prompt chunk through a
ring reads the ring and the chunk's own entries together, then keeps the chunk's last w.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["KeyStore"]


class KeyStore(nn.Module):
    """One layer's entries in static buffers (module docstring).

    Args:
        entries: name -> (groups, width, dtype) of each per-token entry; buffers (B, groups, S, width).
        batch_size, max_len: B and the positions decoded.
        window: the layer's sliding window (each query reads its last `window` keys), or None.
        device: where the buffers live.
    """

    def __init__(self, entries: dict, batch_size: int, max_len: int, window: int | None, device):
        super().__init__()
        self.window = window
        self.ring = window is not None and window < max_len
        S = window if self.ring else max_len
        self.names = tuple(entries)
        for name, (groups, width, dtype) in entries.items():
            self.register_buffer(name, torch.zeros(batch_size, groups, S, width, dtype=dtype, device=device),
                                 persistent=False)
        # the position each slot holds; -1: empty (a ring's slots fill as it goes)
        self.register_buffer("kpos", torch.full((S,), -1, device=device) if self.ring
                             else torch.arange(S, device=device), persistent=False)

    def reset(self) -> None:
        if self.ring:
            self.kpos.fill_(-1)

    def write(self, new: dict, positions: torch.Tensor) -> None:
        """Entries new[name] (B, groups, T, width) at `positions` (T,); through a ring, T <= its size."""
        slots = positions % self.kpos.shape[0] if self.ring else positions
        for name in self.names:
            buf = getattr(self, name)
            buf.index_copy_(2, slots, new[name].to(buf.dtype))
        if self.ring:
            self.kpos.index_copy_(0, slots, positions)

    def read(self, new: dict, positions: torch.Tensor, n: int):
        """The tokens' entries new at `positions` written, and what they read: (entries by name
        (B, groups, m, width), their positions (m,), the mask ok (T, m)). n: the slots to read
        without a ring (the buffer's length in a step, a prompt chunk's end before)."""
        T = positions.shape[0]
        if self.ring and T > 1:  # a prompt chunk: the ring and the chunk's own entries, then keep the last
            got = {name: torch.cat([getattr(self, name), new[name].to(getattr(self, name).dtype)], 2)
                   for name in self.names}
            kpos = torch.cat([self.kpos, positions])
            self.keep(new, positions)
        else:
            self.write(new, positions)
            n = self.kpos.shape[0] if self.ring else n
            got, kpos = {name: getattr(self, name)[:, :, :n] for name in self.names}, self.kpos[:n]
        ok = (kpos[None, :] <= positions[:, None]) & (kpos[None, :] >= 0)
        if self.window is not None:
            ok = ok & (kpos[None, :] > positions[:, None] - self.window)
        return got, kpos, ok

    def keep(self, new: dict, positions: torch.Tensor) -> None:
        """Entries new[name] (B, groups, T, width) of tokens at `positions` (T,), written without a
        read: as many of the last ones as the buffers hold (a ring: its last w)."""
        T = positions.shape[0]
        m = min(T, self.kpos.shape[0])
        self.write({name: new[name][:, :, T - m :] for name in self.names}, positions[T - m :])
