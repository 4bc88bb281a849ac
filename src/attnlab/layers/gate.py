"""Post-readout sigmoid output gate (docs/mechanisms.md#output-gate; Qiu et al. 2025): o ← o ⊙ σ(x W_g), before W_O.

The gate is computed from the layer input x, not from the readout, so it inserts an input-dependent
nonlinearity between the (linear in v) readout and the output projection. "elementwise" gives one
gate per head and channel, "headwise" one per head. W_g is zero-initialised, so every
gate starts at σ(0) = 0.5: the layer's output starts at half its ungated value, a constant factor
the output projection absorbs in the first steps, while the gate's gradient is largest there.

"prenorm" is seed 002's pre-normalisation form for normalised linear attention (cosFormer):
ô = (o ⊙ σ(g)) / (z · σ(g')), the numerator o gated per channel and the normaliser z by a separate
per-head gate g'. Since the readout is o / z, that is the readout times σ(g) / σ(g'), a factor in
(0, ∞) that starts at 1 (both projections zero-initialised).

`scale` c (elementwise, headwise) makes the gate c·σ(x W_g): c = 2 starts it at exactly 1, so a
layer given a gate computes what it computed without one (a retrofit's exact start,
docs/retrofit.md), while W_g's gradient, 2σ'(0) = 0.5 per unit, is as large as ever.
"""

from __future__ import annotations

import torch
from torch import nn


class OutputGate(nn.Module):
    """The post-readout sigmoid gate c·σ(x W_g) of one layer (module docstring), W_g zero-initialised.

    Args:
        mode: "elementwise" (one gate per head and channel), "headwise" (one per head) or
            "prenorm" (cosFormer's numerator gate over a per-head normaliser gate).
        d_model: C, the width of the layer input the gate reads.
        n_heads: H.
        d_v: the width Dv of each head's readout.
        scale: c > 0, finite; 1.0 for "prenorm" (it starts at 1 already).

    Raises:
        ValueError: an unknown mode, or a scale that is not a finite number > 0 (or not 1.0
            with "prenorm").
    """

    def __init__(self, mode: str, d_model: int, n_heads: int, d_v: int, scale: float = 1.0):
        super().__init__()
        if mode not in ("elementwise", "headwise", "prenorm"):
            raise ValueError(f"mode must be 'elementwise', 'headwise' or 'prenorm', got {mode!r}")
        if not (isinstance(scale, (int, float)) and not isinstance(scale, bool) and 0 < scale < float("inf")):
            raise ValueError(f"scale must be a finite number > 0, got {scale!r}")
        if mode == "prenorm" and scale != 1.0:
            raise ValueError(f"scale must be 1.0 for mode 'prenorm' (it starts at 1 already), got {scale!r}")
        self.mode, self.n_heads, self.scale = mode, n_heads, float(scale)
        self.width = {"elementwise": d_v, "headwise": 1, "prenorm": d_v + 1}[mode]  # prenorm: D channels + g'
        self.proj = nn.Linear(d_model, n_heads * self.width, bias=False)
        nn.init.zeros_(self.proj.weight)

    def gated(self, o: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The readout o (B, H, T, Dv) gated, laid out for W_O: (B, T, H·Dv), and the gate values
        (B, H, T, W) as `forward` gives them. The product is written straight in (B, T, H, Dv)
        order (the gate's own layout), so gating costs one pass over the readout instead of a
        multiply and then the transposing copy W_O needs anyway."""
        B, H, T, D = o.shape
        if self.mode == "prenorm":
            g = self(x)
            return (o * g.to(o.dtype)).transpose(1, 2).reshape(B, T, H * D), g
        s = torch.sigmoid(self.proj(x)).view(B, T, H, self.width).to(o.dtype)  # (B, T, H, W)
        y = s * o.transpose(1, 2)  # (B, T, H, Dv), contiguous: s leads, so the output takes its layout
        if self.scale != 1.0:
            y = y * self.scale
        g = s.transpose(1, 2)
        return y.reshape(B, T, H * D), (g if self.scale == 1.0 else g * self.scale)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, C) -> gate values (B, H, T, Dv) elementwise or prenorm, (B, H, T, 1) headwise."""
        B, T, _ = x.shape
        g = torch.sigmoid(self.proj(x)).view(B, T, self.n_heads, self.width).transpose(1, 2)  # (B, H, T, W)
        if self.mode == "prenorm":
            return g[..., :-1] / g[..., -1:]  # sigma(g) / sigma(g'): numerator gate over normaliser gate
        return g if self.scale == 1.0 else g * self.scale
