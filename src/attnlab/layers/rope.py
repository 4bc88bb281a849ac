"""Rotary position embedding for vector queries and keys.

Pairs (x_i, x_{i+D/2}) are rotated by angle pos·base^(-2i/D), so q_t·k_s depends on t - s only
through the rotation. Scalar queries/keys get no RoPE: a scalar has no plane to rotate in.
"""

from __future__ import annotations

import torch
from torch import nn


class RotaryEmbedding(nn.Module):
    """Rotates (B, H, T, D) tensors by their absolute positions start_pos .. start_pos+T-1.

    Args:
        head_dim: D, the width of the rotated vectors; even (pairs (x_i, x_{i+D/2}) rotate).
        base: the frequency base (angles pos·base^(-2i/D)).

    Raises:
        ValueError: head_dim is odd.
    """

    def __init__(self, head_dim: int, base: float = 10000.0):
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"head_dim must be even for RoPE, got {head_dim}")
        self.head_dim = head_dim
        self.base = float(base)
        self.register_buffer("inv_freq", self.frequencies(), persistent=False)  # (D/2,)
        self._tables: dict = {}  # (device, dtype) -> cos, sin (n, D/2) for positions 0 .. n-1: eager calls only

    def frequencies(self, device=None) -> torch.Tensor:
        """base^(-2i/D) for i < D/2, float64: the value of the (non-persistent) buffer inv_freq."""
        return self.base ** (-torch.arange(0, self.head_dim, 2, dtype=torch.float64, device=device) / self.head_dim)

    @torch.no_grad()
    def reset_buffers(self) -> None:
        """Recompute inv_freq in place (a loader that builds modules on the meta device, as
        transformers' from_pretrained does, leaves non-persistent buffers unset)."""
        self.inv_freq.copy_(self.frequencies(self.inv_freq.device))
        self._tables.clear()

    def _apply(self, fn, recurse=True):
        self._tables = {}  # a move or cast: tables are rebuilt on the next call
        return super()._apply(fn, recurse)

    def table(self, end: int, device, dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin (n, D/2) in `dtype` for positions 0 .. n-1, n >= end: computed in float64 once
        per device and dtype, grown to the next power of two when a call reaches past them, and reused
        by every later call (eager only; under torch.compile the angles are part of the graph)."""
        key = (torch.device(device) if device is not None else self.inv_freq.device, dtype)
        have = self._tables.get(key)
        if have is None or have[0].shape[0] < end:
            n = max(64, 1 << (max(end, 1) - 1).bit_length())
            cos64, sin64 = self.angles(0, n, key[0])
            have = self._tables[key] = (cos64.to(dtype), sin64.to(dtype))
        return have

    def angles(self, start_pos: int, length: int, device=None) -> tuple[torch.Tensor, torch.Tensor]:
        """cos and sin of the rotation angles, each (length, D/2), in float64."""
        pos = torch.arange(start_pos, start_pos + length, dtype=torch.float64, device=device)
        ang = pos[:, None] * self.inv_freq.to(device)[None, :]  # (T, D/2)
        return ang.cos(), ang.sin()

    def forward(self, x: torch.Tensor, start_pos: int = 0) -> torch.Tensor:
        """Rotate x.

        Args:
            x: queries or keys (B, H, T, D), D = head_dim.
            start_pos: the absolute position of x's token 0.

        Returns:
            The rotated tensor (B, H, T, D), in x's dtype (angles computed in float64).

        Raises:
            ValueError: x is not (B, H, T, head_dim).
        """
        return self.rotate_pair(x, None, start_pos)[0]

    def rotate_pair(self, q: torch.Tensor, k: torch.Tensor | None, start_pos: int | torch.Tensor = 0):
        """q and k (or None) rotated, the angles computed once: each (B, H, T, D) with the same T;
        start_pos: the position of token 0, or every token's position as a (B, T) integer tensor."""
        for name, x in (("x", q), ("k", k)):
            if x is not None and (x.dim() != 4 or x.shape[-1] != self.head_dim or x.shape[2] != q.shape[2]):
                raise ValueError(f"{name} must be (B, H, T, {self.head_dim}), got shape {tuple(x.shape)}")
        if isinstance(start_pos, torch.Tensor):  # per-token positions (B, T), e.g. restarting in each document
            ang = start_pos.to(torch.float64)[:, None, :, None] * self.inv_freq.to(q.device)  # (B, 1, T, D/2)
            cos64, sin64 = ang.cos(), ang.sin()

            def angles_in(dtype):
                return cos64.to(dtype), sin64.to(dtype)
        elif torch.compiler.is_compiling():  # part of the graph (inductor fuses it)
            cos64, sin64 = self.angles(start_pos, q.shape[2], q.device)

            def angles_in(dtype):
                return cos64.to(dtype), sin64.to(dtype)
        else:  # rows start_pos .. start_pos + T - 1 of the cached tables, already in the dtype
            end = start_pos + q.shape[2]

            def angles_in(dtype):
                return tuple(t[start_pos:end] for t in self.table(end, q.device, dtype))

        cos, sin = angles_in(q.dtype)  # (T, D/2), or (B, 1, T, D/2)

        def turn(x):
            c, s = (cos, sin) if x.dtype == q.dtype else angles_in(x.dtype)
            x1, x2 = x.chunk(2, dim=-1)  # (B, H, T, D/2) each
            return torch.cat([x1 * c - x2 * s, x1 * s + x2 * c], dim=-1)

        return turn(q), None if k is None else turn(k)
