"""Attention layers: nn.Modules that own projections and call one op; (B, T, C) in and out.

`Attention(AttentionConfig(...))` returns the layer registered for the config's mechanism
(`attnlab.layers.mechanisms`: softmax with GQA and RoPE, scalar with grouped value attention,
mixed scalar + dot-product, hybrid, principled, cosformer, gla, ssd), with optional τ forms,
sink and output gate; `forward(x, record=True)`
keeps an `AttentionRecord` for `attnlab.regularizers`, and `make_cache` / `step` decode. Each
mechanism's own options are a dataclass beside its code (`ScalarOptions`, `GoatOptions`, ...),
held as `AttentionConfig.options`.
"""

from .attention import Attention
from .layer_cache import LayerCache
from .config import AttentionConfig
from .gate import OutputGate
from .params import GroundValue, HeadParam, Temperature
from .record import AttentionRecord, Projected
from .mechanisms import LINEAR_FAMILY, MECHANISMS, REGISTRY, mechanism_class, register
from .mechanisms.cosformer import CosformerOptions
from .mechanisms.gla import GLAOptions
from .mechanisms.goat import GoatOptions, GoatPriorOptions
from .mechanisms.goat_hybrid import GoatHybridOptions
from .mechanisms.principled import PrincipledOptions
from .mechanisms.scalar_options import HybridOptions, ScalarKeyOptions, ScalarOptions, TemperatureOptions
from .options import MechanismOptions
from .rope import RotaryEmbedding

__all__ = [
    "Attention",
    "AttentionConfig",
    "AttentionRecord",
    "CosformerOptions",
    "GLAOptions",
    "GoatHybridOptions",
    "GoatOptions",
    "GoatPriorOptions",
    "GroundValue",
    "HeadParam",
    "HybridOptions",
    "LayerCache",
    "LINEAR_FAMILY",
    "MECHANISMS",
    "MechanismOptions",
    "OutputGate",
    "PrincipledOptions",
    "REGISTRY",
    "Projected",
    "RotaryEmbedding",
    "ScalarKeyOptions",
    "ScalarOptions",
    "Temperature",
    "TemperatureOptions",
    "mechanism_class",
    "register",
]
