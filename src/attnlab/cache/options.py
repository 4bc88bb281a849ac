"""The options of a decode (window, budget, compress, exact, selector), in one place: `DecodeOptions`
checks their values when made (the caches' own checks: `attnlab.layers.Attention.make_cache` makes
one) and against a model with `check`, which needs only the model's blocks and their layers'
attributes (`selectable_layers`, `sorted_cache_layers`). `attnlab.models.decode` re-exports them for
`LM.make_caches`, `LM.generate`, `DecodeState`, `attnlab.hf` and `attnlab eval`.

Also here: `KeyRule`, which keys a scalar/hybrid layer's full-sequence forward reads (what a windowed
decode or a key selector would read), handed to the layer with each call.
"""

from __future__ import annotations

from dataclasses import dataclass

from .selected import DecodeSelector


def selectable_layers(model) -> list[tuple[int, object]]:
    """(block index, layer) of each attention layer of `model` (an LM) that decodes through the sorted
    scalar cache (scalar and hybrid): the layers a `DecodeSelector` reads keys for."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise TypeError(f"model must be an attnlab LM (with .blocks), got {type(model).__name__}")
    return [(i, blk.attn) for i, blk in enumerate(blocks)
            if getattr(blk.attn, "sorted_decode", False) and blk.attn.n_scalar]


def sorted_cache_layers(model) -> list[tuple[int, object]]:
    """(block index, layer) of each layer that `window=k` sends through the sorted scalar cache: the
    selectable layers that do not read a sliding window (as `attnlab.eval.window.windowed_layers`)."""
    return [(i, layer) for i, layer in selectable_layers(model) if getattr(layer.config, "sliding_window", None) is None]


class DecodeOptionError(ValueError):
    """A decode option out of range, or impossible beside another option or with the model. `names`
    are the options it is about, the one to change first (a command line maps them to its flags)."""

    def __init__(self, message: str, *names: str):
        super().__init__(message)
        self.names = names


def _bad_int(value) -> bool:
    return isinstance(value, bool) or not isinstance(value, int) or value < 1


@dataclass(frozen=True)
class KeyRule:
    """Which keys the scalar/hybrid heads of one layer call read (`Attention.forward(x, key_rule=...)`,
    `attention_weights`); None in their place is the layer's own rule (every key, or its `train_window`).

    window: each query reads its `window` nearest keys in scalar space (and the sink, and a
        window-trained layer's last `local_window`), as decoding with `SortedScalarCache(window)` does;
        None: the layer's `train_window`, or every key.
    budget: ... and keys beyond a memory budget of `budget` per head evicted, as
        `SortedScalarCache.evict_to_budget` after every step.
    select: another key selector in place of the window (`attnlab.eval.selectors.select_keys`): a
        callable select(qs, ks, tau, q, k, n_prefix) taking the scalar op's inputs (sink included) and
        returning the keep_fn of `attnlab.ops.windowed_attention`; each head then reads the keys it keeps.

    ValueError for a window or budget that is not an int >= 1, a select that is not callable, or a
    select beside a window or budget (one key rule at a time).
    """

    window: int | None = None
    budget: int | None = None
    select: object = None

    def __post_init__(self):
        for name in ("window", "budget"):
            value = getattr(self, name)
            if value is not None and _bad_int(value):
                raise ValueError(f"KeyRule: {name} must be an int >= 1 or None, got {value!r}")
        if self.select is not None:
            if not callable(self.select):
                raise ValueError(f"KeyRule: select must be callable or None, got {type(self.select).__name__}")
            if self.window is not None or self.budget is not None:
                raise ValueError(f"KeyRule: select and window/budget are both set (window={self.window!r}, "
                                 f"budget={self.budget!r}): choose one key rule")


def check_key_rule(key_rule, layer) -> None:
    """key_rule: None, or a `KeyRule` for `layer`, an attention layer whose scalar heads read keys by
    one (`sorted_decode`: scalar and hybrid). TypeError or ValueError naming key_rule otherwise."""
    if key_rule is None:
        return
    if not isinstance(key_rule, KeyRule):
        raise TypeError(f"key_rule must be an attnlab.cache.options.KeyRule or None, got {type(key_rule).__name__}")
    if not getattr(layer, "sorted_decode", False):
        raise ValueError(f"key_rule: mechanism {layer.mechanism!r} has no scalar heads that read keys by a rule "
                         f"(scalar and hybrid layers do), got {key_rule}")


@dataclass(frozen=True)
class DecodeOptions:
    """How an `LM` decodes: the keyword arguments of `LM.make_caches` and `LM.generate`, and of
    `attnlab.hf`'s `AttnlabCache` and `generate`, checked here once.

    window: scalar/hybrid layers decode from the sorted scalar cache over the `window` nearest keys
        (None: exact caches; a layer trained through a window still decodes through it).
    budget: (with window) each sorted cache keeps at most `budget` keys per head, evicted after each step.
    compress: (with window) each sorted cache merges runs of 4 keys spanning <= compress after each step.
    exact: layers trained through a window (`train_window`) decode over every key; takes no window.
    selector: an `attnlab.cache.selected.DecodeSelector`: scalar/hybrid layers read the K keys its
        search projections find; takes no window, budget or compress.

    Construction checks the values (DecodeOptionError, a ValueError naming the argument; TypeError
    for a selector of another type); `check(model)` checks them against a model.
    """

    window: int | None = None
    budget: int | None = None
    compress: float | None = None
    exact: bool = False
    selector: DecodeSelector | None = None

    def __post_init__(self):
        window, budget, compress = self.window, self.budget, self.compress
        if window is not None and _bad_int(window):
            raise DecodeOptionError(f"window must be an int >= 1 or None, got {window!r}", "window")
        if budget is not None:
            if _bad_int(budget):
                raise DecodeOptionError(f"budget must be an int >= 1 or None, got {budget!r}", "budget")
            if window is None:
                raise DecodeOptionError(f"budget={budget!r} caps the sorted scalar cache: give a window as well",
                                        "budget", "window")
        if compress is not None:
            if isinstance(compress, bool) or not isinstance(compress, (int, float)) or not 0 <= compress < float("inf"):
                raise DecodeOptionError(f"compress must be a finite float >= 0 (the key span merged) or None, "
                                        f"got {compress!r}", "compress")
            if window is None:
                raise DecodeOptionError(f"compress={compress!r} merges keys of the sorted scalar cache: give a window "
                                        f"as well", "compress", "window")
        if not isinstance(self.exact, bool) or (self.exact and window is not None):
            raise DecodeOptionError(f"exact must be a bool, and exact=True takes no window (got exact={self.exact!r}, "
                                    f"window={window!r})", "exact")
        if self.selector is not None:
            if not isinstance(self.selector, DecodeSelector):
                raise TypeError(f"selector must be an attnlab.cache.selected.DecodeSelector, got "
                                f"{type(self.selector).__name__}")
            given = [name for name in ("window", "budget", "compress") if getattr(self, name) is not None]
            if given:
                raise DecodeOptionError(
                    f"give a selector or window/budget/compress, not both: the selector picks the keys "
                    f"(got {', '.join(f'{n}={getattr(self, n)!r}' for n in given)})", "selector", *given)

    def check(self, model) -> list[tuple[int, object]]:
        """Raise DecodeOptionError unless `model` (an LM) can decode with these options: a window
        needs a layer that decodes through the sorted scalar cache, a selector needs scalar/hybrid
        layers and projections that fit them (`DecodeSelector.check`). Returns the (block index,
        layer) pairs the selector decodes (none without a selector)."""
        if self.window is not None and not sorted_cache_layers(model):
            raise DecodeOptionError(
                f"window={self.window} selects the sorted scalar cache, but no layer has scalar heads that decode "
                f"through it (model.attn={model.cfg.layer_attn}): scalar and hybrid layers do, unless they read a "
                f"sliding window (model.attention.sliding_window); give no window", "window")
        if self.selector is None:
            return []
        layers = selectable_layers(model)
        if not layers:
            raise DecodeOptionError(f"selector needs scalar or hybrid layers (model.attn={model.cfg.layer_attn})",
                                    "selector")
        self.selector.check(layers)
        return layers
