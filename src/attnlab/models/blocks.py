"""The parts of `LM`'s residual stack: RMSNorm, the SwiGLU MLP and the pre-norm block around an attnlab
`Attention` layer."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from attnlab.layers import Attention
from attnlab.ops.common.precision import upcast

from .config import ModelConfig


class RMSNorm(nn.Module):
    """x / rms(x) * weight; half-precision inputs are normalised in float32."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (..., dim) -> the same shape and dtype, normalised over the last dimension."""
        xf = x.to(upcast(x.dtype))
        y = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * self.weight.to(y.dtype)).type_as(x)


class SwiGLU(nn.Module):
    """W2 (silu(W1 x) * W3 x): the gated MLP of LLaMA-style blocks."""

    def __init__(self, d_model: int, hidden: int):
        super().__init__()
        self.w1 = nn.Linear(d_model, hidden, bias=False)
        self.w3 = nn.Linear(d_model, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d_model, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, d_model) -> (B, T, d_model)."""
        return self.w2(F.silu(self.w1(x)) * self.w3(x))  # (B, T, C) -> (B, T, hidden) -> (B, T, C)


class Block(nn.Module):
    """Pre-norm residual block: attention, then MLP."""

    def __init__(self, cfg: ModelConfig, attn_cfg):
        super().__init__()
        self.norm1 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(attn_cfg)
        self.norm2 = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.mlp = SwiGLU(cfg.d_model, cfg.ffn_hidden)

    def forward(self, x: torch.Tensor, record: bool = False, docs: torch.Tensor | None = None,
                key_rule=None) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), record=record, docs=docs, key_rule=key_rule)  # (B, T, C)
        return x + self.mlp(self.norm2(x))

    def step(self, x_t: torch.Tensor, cache) -> torch.Tensor:
        return self.prefill(x_t, cache, step=True)  # (B, 1, C)

    def prefill(self, x: torch.Tensor, cache, step: bool = False) -> torch.Tensor:
        h = self.norm1(x)
        if getattr(cache, "selector", None) is not None:  # a learned key selector reads the layer's input
            cache.selector.observe(h, cache.pos)
        x = x + (self.attn.step(h, cache) if step else self.attn.prefill(h, cache))  # (B, T, C)
        return x + self.mlp(self.norm2(x))
