"""The mechanisms, one module each (scalar and hybrid share one), holding everything layer-side about it (parameters, projection,
full-sequence attend through its op, decode cache and step, what it records); importing this package
registers every one (`attnlab.layers.registry`). Adding a mechanism adds a module and one import
line below (docs/adding-a-mechanism.md).
"""

from __future__ import annotations

from ..registry import REGISTRY, mechanism_class, register

# The registration lines: importing a module registers its mechanism(s).
from . import softmax, scalar, principled, cosformer, gla, ssd, goat, goat_hybrid  # noqa: E402,F401

MECHANISMS: tuple[str, ...] = tuple(REGISTRY)
LINEAR_FAMILY: tuple[str, ...] = tuple(name for name, cls in REGISTRY.items() if cls.recurrent)

__all__ = ["LINEAR_FAMILY", "MECHANISMS", "REGISTRY", "mechanism_class", "register"]
