"""What a layer's static decode state is: the options it is made with (`StaticOptions`) and the
interface `attnlab.models.StaticDecoder` calls (`StaticState`).

A mechanism decodes with static shapes when its layer class has a method `static_state(opts)`
returning a `StaticState` (docs/adding-a-mechanism.md): the decoder makes one per layer and loops
over them, naming no mechanism. The decode modes (a window, a budget, a selector, split steps) reach
the state as these options, never as attributes set on the layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["WINDOW_IMPLS", "StaticOptions", "StaticState"]

WINDOW_IMPLS = ("auto", "triton", "torch")  # `window.window_keys`' impl


@dataclass(frozen=True)
class StaticOptions:
    """How one layer's static state is made (the `StaticDecoder`'s arguments, checked there).

    batch_size: rows decoded together. max_len: the positions the buffers hold, rounded up to whole
    chunks when `chunk` is set. device, dtype: the model's (buffers of keys and values in dtype).
    layer: the layer's block index (a selector's projections are per layer). chunk: an exact step
    over the whole buffer is split in chunks of that many keys (`split.split_attention`), or None.
    exact: a layer trained through a window reads every key. window: scalar heads read their
    `window` nearest keys (None: a window-trained layer's own k, every key otherwise). budget: with
    a window, at most `budget` older keys per head stay. tail: older keys scored directly between
    two merges of a window's sorted codes. selector: an exact-index `DecodeSelector`, or None.
    window_impl: how a window step chooses its keys (`window.window_keys`' impl).
    """

    batch_size: int
    max_len: int
    device: torch.device
    dtype: torch.dtype
    layer: int
    chunk: int | None = None
    exact: bool = False
    window: int | None = None
    budget: int | None = None
    tail: int = 256
    selector: object = None
    window_impl: str = "auto"

    def __post_init__(self):
        if self.window_impl not in WINDOW_IMPLS:
            raise ValueError(f"window_impl must be one of {', '.join(map(repr, WINDOW_IMPLS))}, got {self.window_impl!r}")


class StaticState(nn.Module):
    """One layer's decode state in buffers made once (subclassed per mechanism or family).

    `attend(p, positions, n, h)` writes the tokens' entries (a step's one token, or a prompt chunk)
    at `positions` (T,) and returns the layer's readout (B, H, T, Dv) of its projections p (an
    `attnlab.layers.record.Projected`; h (B, T, C) the layer's input, for what reads it besides the
    projections), reading the first n slots (a step: all of them; a chunk: up to its end).
    `fill(p, T)` takes a whole prompt from position 0 through the layer's own op. `reset()` comes
    before every prompt, `merge(t, force, scratch)` between steps (the step at position t next).

    Class facts the decoder reads: `whole_prompt` (a prompt goes through `fill`, the model's whole
    forward, never in chunks), `stack_qkv_off` (the decoder keeps no stacked q/k/v weights for this
    layer), `scratch_size` (int64 elements of the merge scratch the layers share) and `merged` (the
    host copy of the position its sorted codes are merged up to).
    """

    whole_prompt = False
    stack_qkv_off = False
    scratch_size = 0
    merged = 0

    def __init__(self, layer):
        super().__init__()
        object.__setattr__(self, "layer", layer)  # not a submodule: the decoder's model holds it

    def reset(self) -> None:
        """Before a prompt: forget what the last one left (a ring's slots, a recurrent state)."""

    def attend(self, p, positions: torch.Tensor, n: int, h: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define attend()")

    def fill(self, p, T: int) -> torch.Tensor:
        raise NotImplementedError(f"{type(self).__name__} must define fill()")

    def merge(self, t: int, force: bool = False, scratch: torch.Tensor | None = None) -> None:
        """Between steps, before the step at position t: bring sorted codes up to date (only a
        windowed state keeps any); force: every key sorted again, after a prompt."""
