"""Plain decode caches: a growing KV cache and a recurrent-state holder.

`KVCache` keeps any set of named per-token tensors whose time axis is dim 2 — vectors
(B, H, T, D) and scalars (B, H, T) alike — in buffers that double when full, so appending one
token is amortised O(1) and reading returns views, not copies. `RecurrentState` holds the
fixed-size state of the linear family (cosformer, gla, ssd) between decode steps.
"""

from __future__ import annotations

from typing import Any

import torch

from ..checks import check_finite, check_int

TIME_DIM = 2


class KVCache:
    """Named tensors growing along dim 2; every `append` must bring the same names and shapes.

    ```python
    cache = KVCache(batch_size=2)
    full = cache.append(k=k_t, v=v_t, ks=ks_t)  # k_t (B, G, 1, D), ks_t (B, H, 1)
    full["k"].shape                             # (B, G, len(cache), D)
    ```

    With `window=w` it is the cache of a sliding window (`AttentionConfig.sliding_window`): it
    holds the first `keep` tokens (a sink) and the last w, in buffers of fixed size that never
    grow past keep + 2w + the largest append (the held tokens are moved to the front when the
    buffers fill: amortised O(1) per token, constant memory at any context length).

    Args:
        batch_size: B, the batch every appended tensor must have; an int >= 1.
        initial_capacity: time steps the buffers hold before their first doubling; an int >= 1
            (the first append allocates max(initial_capacity, its steps), doubled as needed).
        window: None (every token is kept), or w: only the last w tokens (and the first `keep`)
            are kept; an int >= 1.
        keep: with a window, the leading tokens kept for good (a sink); an int >= 0 (without a
            window every token is kept anyway).

    Raises:
        ValueError: batch_size or initial_capacity is not a positive int, window not None or an
            int >= 1, keep not an int >= 0 (for a non-int, a NotAnIntError, which is a TypeError too).
    """

    def __init__(self, batch_size: int, initial_capacity: int = 64, *, window: int | None = None, keep: int = 0):
        check_int("batch_size", batch_size)
        check_int("initial_capacity", initial_capacity)
        if window is not None:
            check_int("window", window)
        check_int("keep", keep, 0)
        self.batch_size = batch_size
        self.window, self.keep = window, keep
        self.capacity = initial_capacity if window is None else max(initial_capacity, keep + 2 * window)
        self.length = 0  # tokens in the buffers (with a window: the kept ones, then the recent run)
        self._buf: dict[str, torch.Tensor] = {}

    def __len__(self) -> int:
        if self.window is None:
            return self.length
        return min(self.length, self.keep) + min(max(self.length - self.keep, 0), self.window)

    @property
    def names(self) -> tuple[str, ...]:
        """The names cached so far, in the order of the first append (empty before it)."""
        return tuple(self._buf)

    def _check(self, tensors: dict[str, torch.Tensor]) -> int:
        if not tensors:
            raise ValueError("append needs at least one named tensor")
        steps = None
        for name, x in tensors.items():
            if not isinstance(x, torch.Tensor) or x.dim() < 3:
                got = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
                raise ValueError(f"{name} must be a tensor with time on dim 2 (B, H, T[, D]), got {got}")
            if x.shape[0] != self.batch_size:
                raise ValueError(f"{name} has batch {x.shape[0]}, the cache was made for batch_size={self.batch_size}")
            check_finite(name, x)  # each token's values once, here: a step then trusts the cache (checks.trusted)
            if steps is None:
                steps = x.shape[TIME_DIM]
            elif x.shape[TIME_DIM] != steps:
                raise ValueError(f"{name} brings {x.shape[TIME_DIM]} steps, the other tensors bring {steps}")
        if self._buf:
            if set(tensors) != set(self._buf):
                raise ValueError(f"append must bring the names {sorted(self._buf)}, got {sorted(tensors)}")
            for name, x in tensors.items():
                old = self._buf[name]
                if x.shape[:TIME_DIM] + x.shape[TIME_DIM + 1:] != old.shape[:TIME_DIM] + old.shape[TIME_DIM + 1:]:
                    want = list(old.shape)
                    want[TIME_DIM] = "T"
                    raise ValueError(f"{name} must be shaped {tuple(want)}, got {tuple(x.shape)}")
        return steps

    def _grow(self, need: int) -> None:
        new_cap = self.capacity
        while new_cap < need:
            new_cap *= 2
        for name, old in self._buf.items():
            shape = list(old.shape)
            shape[TIME_DIM] = new_cap
            new = old.new_empty(shape)
            new.narrow(TIME_DIM, 0, self.length).copy_(old.narrow(TIME_DIM, 0, self.length))
            self._buf[name] = new
        self.capacity = new_cap

    def append(self, **tensors: torch.Tensor) -> dict[str, torch.Tensor]:
        """Append `steps` tokens of each named tensor; return views of everything cached so far.

        Args:
            **tensors: the tensors to append, by name, each with the batch on dim 0 and time on
                dim 2: vectors (B, H, steps, D), scalars (B, H, steps). All bring the same
                number of steps; after the first append, the same names and the same shapes but
                for dim 2. They are detached and copied into the buffers (in each buffer's
                dtype, the first append's).

        Returns:
            A dict of views, name -> the tensor cached so far with time length len(self); with a
            window, the kept tokens and the last window - 1 + steps (every key the appended
            tokens' sliding windows reach, the new ones last).

        Raises:
            ValueError: no tensor; a value that is not a tensor of >= 3 dims; NaN or inf in one;
                another batch size; different step counts; names or shapes that differ from the first
                append's. The cache is unchanged.
        """
        steps = self._check(tensors)
        if not self._buf:
            while self.capacity < steps:
                self.capacity *= 2
            for name, x in tensors.items():
                shape = list(x.shape)
                shape[TIME_DIM] = self.capacity
                self._buf[name] = x.new_empty(shape)
        elif self.length + steps > self.capacity:
            if self.window is not None:
                self._compact()
            if self.length + steps > self.capacity:
                self._grow(self.length + steps)
        for name, x in tensors.items():
            self._buf[name].narrow(TIME_DIM, self.length, steps).copy_(x.detach())
        self.length += steps
        if self.window is None:
            return self.view()
        return self._span(self.window - 1 + steps)

    def _compact(self) -> None:
        """Move the last window - 1 recent tokens (what the next queries can still see) to just
        after the kept ones."""
        keep, n = self.keep, min(self.window - 1, max(self.length - self.keep, 0))
        if self.length - keep > n:
            for buf in self._buf.values():
                buf.narrow(TIME_DIM, keep, n).copy_(buf.narrow(TIME_DIM, self.length - n, n).clone())
            self.length = keep + n

    def _span(self, recent: int) -> dict[str, torch.Tensor]:
        """The kept tokens, then the last `recent` (those held): views when nothing is kept."""
        keep = min(self.keep, self.length)
        n = min(recent, self.length - keep)
        out = {}
        for name, buf in self._buf.items():
            last = buf.narrow(TIME_DIM, self.length - n, n)
            out[name] = last if not keep else torch.cat([buf.narrow(TIME_DIM, 0, keep), last], dim=TIME_DIM)
        return out

    def view(self) -> dict[str, torch.Tensor]:
        """Every cached tensor, time length len(self): views (no copy), except that a window that
        keeps leading tokens joins them to the recent ones."""
        if self.window is not None:
            return self._span(self.window)
        return {name: buf.narrow(TIME_DIM, 0, self.length) for name, buf in self._buf.items()}

    def nbytes(self) -> int:
        """Bytes of the cached tokens (not the spare capacity)."""
        return sum(b.element_size() * b.numel() // b.shape[TIME_DIM] * len(self) for b in self._buf.values())


class RecurrentState:
    """The fixed-size state of a linear-family head between decode steps, plus the position.

    `state` is whatever the op returned as its final state (None before the first token);
    `pos` counts the tokens folded into it.

    Args:
        batch_size: B, the batch of the layer's inputs; an int >= 1.

    Raises:
        ValueError: batch_size is not a positive int (for a non-int, a NotAnIntError, which is a
            TypeError too).
    """

    def __init__(self, batch_size: int):
        check_int("batch_size", batch_size)
        self.batch_size = batch_size
        self.state: Any = None
        self.pos = 0

    def update(self, state: Any, steps: int = 1) -> None:
        """Replace the state with the op's final state after `steps` more tokens.

        Args:
            state: the op's final state: a tensor, a tuple or list of them, or a NamedTuple such
                as `attnlab.ops.CosformerState`; its tensors are detached.
            steps: the tokens the op folded in since the last update (added to `pos`).
        """
        self.state = _detach(state)
        self.pos += steps

    def nbytes(self) -> int:
        """Bytes of the tensors the state holds (0 before the first update)."""
        return sum(t.element_size() * t.numel() for t in _tensors(self.state))


def _detach(state: Any) -> Any:
    if isinstance(state, torch.Tensor):
        return state.detach()
    if isinstance(state, tuple) and hasattr(state, "_fields"):  # NamedTuple states (cosformer)
        return type(state)(*(_detach(s) for s in state))
    if isinstance(state, (tuple, list)):
        return type(state)(_detach(s) for s in state)
    return state


def _tensors(state: Any):
    if isinstance(state, torch.Tensor):
        yield state
    elif isinstance(state, (tuple, list)):
        for s in state:
            yield from _tensors(s)
