"""Decoding a batch whose prompts have different lengths (left padding) through attnlab's caches.

A left-padded batch is decoded as if every prompt were alone:

    row 0:  pad pad  a  b  c | x ...        positions 0 1 2 for a b c, then 3, 4, ...
    row 1:   d   e   f  g  h | y ...        positions 0 1 2 3 4, then 5, 6, ...

Rows that have seen the same number of real tokens sit at the same positions, so they share one
set of per-layer caches (a *group*) and run batched; rows of different lengths are different
groups. A pad token never reaches a model: it enters no key set, recurrent state or sorted cache,
and RoPE, GOAT and cosFormer positions (and learned position embeddings) count from each row's
first real token. Outputs are exact, not masked approximations: a group computes what its rows
would alone. The price is one forward per distinct prompt length at the prefill and one attention
call per group per step; a batch of equal lengths (no padding) is one group, the plain batched
path. `LM.generate(..., attention_mask=)` and the Hugging Face wrapper (`attnlab.hf`) decode
through this class.

Also here: `DecodeOptions` (from `attnlab.cache.options`, where the caches check the same values),
the options of a decode, checked when made and against a model by `DecodeOptions.check`, which
`LM.make_caches`, `LM.generate`, `DecodeState`, `attnlab.hf` and `attnlab eval` use; and
`padding_mask`, the padding rule of every attention_mask (left padding to decode, left or right for
a forward without a cache, never a pad between real tokens); and `decode_window`, which switches a
model's full-sequence forward to what its windowed decode reads (`attnlab.eval.window` measures
losses with it), through `using_key_rules`: the `KeyRule` each layer's forward is handed within a
block, looked up by `LM.forward` (`key_rule_of`) and passed down as an argument.
"""

from __future__ import annotations

import contextlib
import threading
from dataclasses import dataclass
from typing import Iterator

import torch

from attnlab.cache.options import (DecodeOptionError, DecodeOptions, KeyRule, selectable_layers,  # noqa: F401
                                   sorted_cache_layers)

# The key rules of this thread's open `using_key_rules` blocks, innermost last, each a tuple of (layer,
# KeyRule or None) pairs: `_OPEN.rules`, a list per thread, so that two threads' blocks never reach each
# other's forwards. A thread-local attribute rather than a ContextVar: torch.compile traces LM.forward's
# read of it (and guards on it), where ContextVar.get breaks the graph.
_OPEN = threading.local()


def padding_mask(mask: torch.Tensor, *, right: bool = False, started: torch.Tensor | None = None) -> torch.Tensor:
    """The one padding rule of attnlab's models: an attention_mask (B, T) of 0 (pad) and 1 (real
    token), of any dtype, as a bool tensor on its device.

    A row's pads come before its real tokens (left padding), never between them. right=True (a
    forward without a cache, whose causal attention never reads a later pad) also takes pads after
    a row's real tokens (right padding); decoding with caches does not, since every fed token enters
    a state. started (B,) bool: rows holding real tokens from earlier columns (a pad is then after
    them). ValueError naming the first row that breaks the rule."""
    if mask.dtype != torch.bool:
        if not bool(((mask == 0) | (mask == 1)).all()):
            raise ValueError("attention_mask must hold 0 (pad) and 1 (real token) only")
        mask = mask.bool()
    m = mask if started is None else torch.cat([started.to(mask.device)[:, None], mask], 1)
    hole = (m[:, 1:] & ~m[:, :-1]).sum(1) + m[:, :1].sum(1) > 1  # more than one run of real tokens
    bad = hole if right else (m[:, :-1] & ~m[:, 1:]).any(1)  # ... or a real token, then a pad
    if bool(bad.any()):
        row = int(bad.nonzero()[0])
        if bool(hole[row]):
            raise ValueError(f"attention_mask row {row} has a pad (0) between real tokens (1); pad on the left "
                             f"(tokenizer.padding_side='left')")
        raise ValueError(f"attention_mask row {row} has a pad (0) after a real token (1); decoding with a cache takes "
                         f"left padding only (zeros, then ones): pad prompts on the left (tokenizer.padding_side='left')")
    return mask


@dataclass
class Group:
    """Rows `rows` (indices into the batch) sharing per-layer caches: they hold the same count of
    real tokens (caches[0].pos)."""

    rows: torch.Tensor
    caches: list


class DecodeState:
    """Per-row decode state of a batch of `batch_size` rows for `model` (an `LM`).

    >>> state = DecodeState(model, batch_size=2, options=DecodeOptions(window=64))
    >>> logits = state.feed(prompt, attention_mask)   # (B, T, V): the prompt, one forward per length
    >>> logits = state.feed(next_tokens)              # (B, 1, V): one step

    `feed(idx, mask)` takes the next T columns of the batch; mask (B, T) marks real tokens (1)
    and pads (0). Only left padding is accepted (`padding_mask`): a row's zeros come before its
    first real token, never after (a 0 after a 1 is a ValueError naming the row). Logits at pad
    positions are zero. options: the `DecodeOptions` of every group's caches (checked against model
    here), None for exact caches.
    """

    def __init__(self, model, batch_size: int, options: DecodeOptions | None = None):
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if options is None:
            options = DecodeOptions()
        elif not isinstance(options, DecodeOptions):
            raise TypeError(f"options must be a DecodeOptions, got {type(options).__name__}")
        options.check(model)
        self.model, self.batch_size, self.options = model, batch_size, options
        self.groups: list[Group] = []
        self.waiting = torch.arange(batch_size)  # rows that have not seen a real token yet
        self.seen = 0  # columns fed so far, pads included

    def lengths(self) -> torch.Tensor:
        """Real tokens each row holds, (B,)."""
        n = torch.zeros(self.batch_size, dtype=torch.long)
        for g in self.groups:
            n[g.rows] = g.caches[0].pos
        return n

    def _check(self, idx: torch.Tensor, mask) -> torch.Tensor | None:
        if not isinstance(idx, torch.Tensor) or idx.dim() != 2 or idx.shape[0] != self.batch_size:
            got = tuple(idx.shape) if isinstance(idx, torch.Tensor) else type(idx).__name__
            raise ValueError(f"idx must be (B={self.batch_size}, T) token ids, got {got}")
        if mask is None:
            return None
        if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != tuple(idx.shape):
            got = tuple(mask.shape) if isinstance(mask, torch.Tensor) else type(mask).__name__
            raise ValueError(f"attention_mask must have the shape of the tokens fed {tuple(idx.shape)}, got {got}")
        started = torch.ones(self.batch_size, dtype=torch.bool)  # rows holding real tokens: no more pads
        started[self.waiting] = False
        return padding_mask(mask.cpu(), started=started)

    def feed(self, idx: torch.Tensor, mask: torch.Tensor | None = None, last: int | None = None) -> torch.Tensor:
        """The next T columns: idx (B, T), mask (B, T) or None (all real) -> logits (B, T, V), or of
        the `last` columns only. Advances every row's caches by its real tokens."""
        mask = self._check(idx, mask)
        T = idx.shape[1]
        L = T if last is None else min(last, T)
        model = self.model
        if mask is None and not self.groups and T:  # no padding: one group of every row
            caches = model.make_caches(self.batch_size, options=self.options)
            self.groups = [Group(self.waiting, caches)]
            self.waiting = self.waiting[:0]
            self.seen += T
            return model.prefill(idx, caches, last=L)
        parts = []  # (rows, logits of their last k columns)
        for g in self.groups:
            whole = len(g.rows) == self.batch_size and bool((g.rows == torch.arange(self.batch_size)).all())
            x = idx if whole else idx[g.rows.to(idx.device)]  # a group holds its own rows, maybe not all
            if T == 1:
                logits = model.step(x, g.caches, pos=g.caches[0].pos)[:, None]  # (b, 1, V)
            else:
                logits = model.prefill(x, g.caches, last=L)
            parts.append((g.rows, logits))
        if len(self.waiting):
            real = torch.full((self.batch_size,), T, dtype=torch.long) if mask is None else mask.sum(1)
            still = []
            for m in real[self.waiting].unique().tolist():
                rows = self.waiting[real[self.waiting] == m]
                if m == 0:
                    still.append(rows)
                    continue
                caches = model.make_caches(len(rows), options=self.options)
                logits = model.prefill(idx[rows.to(idx.device), T - m:], caches, last=min(L, m))
                self.groups.append(Group(rows, caches))
                parts.append((rows, logits))
            self.waiting = torch.cat(still) if still else self.waiting[:0]
        self.seen += T
        if len(parts) == 1 and len(parts[0][0]) == self.batch_size and parts[0][1].shape[1] == L:
            rows, logits = parts[0]
            if bool((rows == torch.arange(self.batch_size)).all()):
                return logits
        head = model.head.weight
        out = head.new_zeros(self.batch_size, L, head.shape[0])
        for rows, logits in parts:
            out[rows.to(out.device), L - logits.shape[1]:] = logits.to(out.dtype)
        return out


def key_rule_of(layer) -> KeyRule | None:
    """The KeyRule that the innermost open `using_key_rules` block naming `layer` gives it, or None."""
    for held in reversed(getattr(_OPEN, "rules", ())):
        for named, rule in held:
            if named is layer:
                return rule
    return None


@contextlib.contextmanager
def using_key_rules(model, rules: dict) -> Iterator[dict]:
    """Within the block, `model`'s forward (an LM's) hands block i's attention layer the KeyRule
    rules[i] (None: no rule, in place of an enclosing block's); other layers keep what an enclosing
    block gives them. Yields rules."""
    held = tuple((model.blocks[i].attn, rule) for i, rule in rules.items())
    if not hasattr(_OPEN, "rules"):
        _OPEN.rules = []
    stack = _OPEN.rules
    stack.append(held)
    try:
        yield rules
    finally:
        del stack[max(j for j, h in enumerate(stack) if h is held)]


@contextlib.contextmanager
def decode_window(model, window: int | None, budget: int | None = None) -> Iterator[dict]:
    """Within the block, `model`'s scalar/hybrid layers attend as SortedScalarCache(window) decodes
    (window None: exactly); with `budget`, as that cache capped at `budget` keys per head by
    `evict_to_budget` after every step. Yields {block index: KeyRule or None} of those layers, the
    rule to hand a layer called alone (`attention_weights(x, rules[i])`). ValueError (`DecodeOptions`'
    checks, as `generate`'s) for a bad window or budget, or a window for a model with no such layer;
    `KeyRule`'s for a window inside a `select_keys` block."""
    DecodeOptions(window=window, budget=budget).check(model)
    rules = {}
    for i, layer in sorted_cache_layers(model):
        held = key_rule_of(layer)
        select = None if held is None else held.select  # an enclosing selector stays
        rules[i] = (None if window is None and budget is None and select is None
                    else KeyRule(window=window, budget=budget, select=select))
    with using_key_rules(model, rules):
        yield rules
