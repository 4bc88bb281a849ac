"""Attention layers: nn.Modules that own projections and call one op; (B, T, C) in and out.

`Attention(AttentionConfig(...))` covers every mechanism of attnlab (softmax with GQA and
RoPE, scalar with grouped value attention, mixed scalar + dot-product, hybrid, principled,
cosformer, gla, ssd), with optional τ forms, sink and output gate; `forward(x, record=True)`
keeps an `AttentionRecord` for `attnlab.regularizers`, and `make_cache` / `step` decode.
"""

from .attention import Attention
from .config import MECHANISMS, AttentionConfig
from .gate import OutputGate
from .params import GroundValue, HeadParam, Temperature
from .record import AttentionRecord, Projected
from .rope import RotaryEmbedding
from .stepping import LayerCache

__all__ = [
    "Attention",
    "AttentionConfig",
    "AttentionRecord",
    "GroundValue",
    "HeadParam",
    "LayerCache",
    "MECHANISMS",
    "OutputGate",
    "Projected",
    "RotaryEmbedding",
    "Temperature",
]
