"""The mechanism registry: config name -> the `Attention` subclass that implements it.

Each mechanism is one module here holding everything layer-side about it (parameters,
projection, full-sequence attend through its op, decode cache and step, what it records);
`register` adds it under its `mechanism` name. Adding a mechanism adds a module and one
import line below (docs/adding-a-mechanism.md).
"""

from __future__ import annotations

REGISTRY: dict[str, type] = {}


def register(cls: type) -> type:
    """Class decorator: make `cls` the layer of `AttentionConfig(mechanism=cls.mechanism)`."""
    name = cls.mechanism
    if not name or name in REGISTRY:
        raise ValueError(f"a mechanism needs a new, non-empty name; got {name!r} (registered: {tuple(REGISTRY)})")
    REGISTRY[name] = cls
    return cls


def mechanism_class(name: str) -> type:
    """The registered `Attention` subclass for `name` (ValueError naming the known ones)."""
    try:
        return REGISTRY[name]
    except KeyError:
        raise ValueError(f"mechanism must be one of {tuple(REGISTRY)}, got {name!r}") from None


# The registration lines: importing a module registers its mechanism(s).
from . import softmax, scalar, hybrid, principled, cosformer, gla, ssd, goat, goat_hybrid  # noqa: E402,F401

MECHANISMS: tuple[str, ...] = tuple(REGISTRY)
LINEAR_FAMILY: tuple[str, ...] = tuple(name for name, cls in REGISTRY.items() if cls.recurrent)

__all__ = ["LINEAR_FAMILY", "MECHANISMS", "REGISTRY", "mechanism_class", "register"]
