"""The ring of a window-trained layer's last w tokens (model.attention.local_window = w).

Preallocated circular storage: a step writes its token over the oldest slot, so a step costs a
few in-place copies whatever w is (no list of tensors, no stacking). The token a full ring
overwrites is handed to `push`'s `leaving` callback first: the decoder puts it into the sorted
cache. `view()` gives the held tokens in slot order, which is not age order once the ring has
wrapped; the ring's keys enter one softmax beside the sorted cache's, where order is immaterial.
"""

from __future__ import annotations

from typing import Callable

import torch


class Ring:
    """The last `size` tokens: scalar keys (B, H, w), values (B, G, w, D) and, for hybrid heads,
    vector keys (B, H, w, Dk). Storage is allocated at the first push, in that token's dtype and
    device. Inference only: pushed tensors are copied, detached."""

    def __init__(self, size: int):
        if isinstance(size, bool) or not isinstance(size, int) or size < 1:
            raise ValueError(f"size must be an int >= 1, got {size!r}")
        self.size = size
        self.count = 0  # tokens held (<= size)
        self.next = 0  # the slot the next token is written to (the oldest one once full)
        self.ks = self.v = self.k = None

    def __len__(self) -> int:
        return self.count

    def _allocate(self, ks: torch.Tensor, v: torch.Tensor, k: torch.Tensor | None) -> None:
        w = self.size
        self.ks = ks.new_empty(*ks.shape, w)
        self.v = v.new_empty(v.shape[0], v.shape[1], w, v.shape[2])
        self.k = None if k is None else k.new_empty(k.shape[0], k.shape[1], w, k.shape[2])

    def push(self, ks: torch.Tensor, v: torch.Tensor, k: torch.Tensor | None,
             leaving: Callable[[torch.Tensor, torch.Tensor, torch.Tensor | None], None]) -> None:
        """Hold one token: ks (B, H), v (B, G, D), k (B, H, Dk) or None. When the ring is full, the
        oldest token is passed to `leaving(ks, v, k)` (views of its slot, read before it is
        overwritten) first."""
        if self.ks is None:
            self._allocate(ks, v, k)
        s = self.next
        if self.count == self.size:
            leaving(self.ks[..., s], self.v[:, :, s], None if self.k is None else self.k[:, :, s])
        else:
            self.count += 1
        with torch.no_grad():
            self.ks[..., s].copy_(ks)
            self.v[:, :, s].copy_(v)
            if self.k is not None:
                self.k[:, :, s].copy_(k)
        self.next = (s + 1) % self.size

    def view(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """The held tokens (slot order): ks (B, H, n), v (B, G, n, D), k (B, H, n, Dk) or None."""
        n = self.count
        if n == self.size:
            return self.ks, self.v, self.k
        return self.ks[..., :n], self.v[:, :, :n], None if self.k is None else self.k[:, :, :n]

    def fill(self, ks: torch.Tensor, v: torch.Tensor, k: torch.Tensor | None, start: int) -> None:
        """Hold the n <= size tokens at positions start .. start + n - 1 of an empty ring at once, in
        the slots `push` would have put them in: ks (B, H, n), v (B, G, n, D), k (B, H, n, Dk) or None."""
        n = ks.shape[-1]
        if self.count or n > self.size:
            raise ValueError(f"fill takes at most size={self.size} tokens into an empty ring, got {n} "
                             f"into one holding {self.count}")
        if n == 0:
            return
        self._allocate(ks[..., 0], v[:, :, 0], None if k is None else k[:, :, 0])
        slots = (start + torch.arange(n, device=ks.device)) % self.size
        with torch.no_grad():
            self.ks[..., slots] = ks
            self.v[:, :, slots] = v
            if self.k is not None:
                self.k[:, :, slots] = k
        self.count, self.next = n, (start + n) % self.size

