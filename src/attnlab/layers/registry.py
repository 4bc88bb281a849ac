"""The mechanism registry: config name -> the `Attention` subclass that implements it.

A module of its own that imports nothing of attnlab, so that `config` (which validates a layer's
mechanism and options against it) and `attention` can read it while the mechanism modules, which
build on both, fill it: each mechanism module registers its class with `@register` when
`attnlab.layers.mechanisms` imports it (docs/adding-a-mechanism.md).
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


__all__ = ["REGISTRY", "mechanism_class", "register"]
