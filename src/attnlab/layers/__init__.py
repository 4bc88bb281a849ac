"""Attention layers: nn.Modules that own projections and call one op; (B, T, C) in and out.

`Attention(AttentionConfig(...))` returns the layer registered for the config's mechanism
(`attnlab.layers.mechanisms`: softmax with GQA and RoPE, scalar with grouped value attention,
mixed scalar + dot-product, hybrid, principled, cosformer, gla, ssd), with optional τ forms,
sink and output gate; `forward(x, record=True)`
keeps an `AttentionRecord` for `attnlab.regularizers`, and `make_cache` / `step` decode.
"""

from .attention import Attention
from .layer_cache import LayerCache
from .config import AttentionConfig
from .gate import OutputGate
from .params import GroundValue, HeadParam, Temperature
from .record import AttentionRecord, Projected
from .mechanisms import LINEAR_FAMILY, MECHANISMS, REGISTRY, mechanism_class, register
from .rope import RotaryEmbedding

__all__ = [
    "Attention",
    "AttentionConfig",
    "AttentionRecord",
    "GroundValue",
    "HeadParam",
    "LayerCache",
    "LINEAR_FAMILY",
    "MECHANISMS",
    "OutputGate",
    "REGISTRY",
    "Projected",
    "RotaryEmbedding",
    "Temperature",
    "mechanism_class",
    "register",
]
