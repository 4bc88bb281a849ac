"""A small decoder-only LM with a per-layer choice of attention mechanism (`LM`, `ModelConfig`)."""

from .config import MECHANISMS, ConfigError, ModelConfig
from .blocks import RMSNorm, SwiGLU
from .lm import LM
from .static_decode import StaticDecoder

__all__ = ["LM", "ModelConfig", "ConfigError", "MECHANISMS", "RMSNorm", "SwiGLU", "StaticDecoder"]
