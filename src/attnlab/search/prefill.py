"""An exact prefill shared by several selectors: the decode-time protocol of retrieve-then-attend.

A decoder that retrieves at each step usually reads its prompt with full attention first (Quest and
RetrievalAttention are evaluated this way): the prompt's keys go into the KV cache and the search
index, and only the positions after it attend through the selector. `record_prefix` records what a
selector needs from such a prefill (each substituted layer's input and keys), `PrefixRecord.prime`
fills the indexes of a `substitute`d model from it, `prefill` reads a prompt so, and
`prefilled_logits` scores one example's continuation through several selectors after one shared
prefill.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Callable, Iterable

import torch

from .hf_model import model_device
from .hooks import Installed
from .patch import PrefillGraphs, check_layers, new_cache


class PrefixRecord:
    """Records, during one forward with full attention, each chosen layer's input hidden state and
    post-RoPE keys: what `RetrieveThenAttend.prime` needs to continue that sequence through a
    selector, so that several selectors can share one exact prefill (see `record_prefix`), and the
    HNSW graphs built over it, so that they share one graph per layer too (`patch.PrefillGraphs`)."""

    def __init__(self):
        self.hidden: dict[int, torch.Tensor] = {}
        self.keys: dict[int, torch.Tensor] = {}
        self.n_heads: dict[int, int] = {}
        self.graphs = PrefillGraphs()

    def handler(self, layer: int):
        def record(module, hidden, q, k, v, allowed, scaling):
            self.hidden[layer], self.keys[layer], self.n_heads[layer] = hidden.detach(), k.detach(), q.shape[1]
            return None  # attend with the model's own SDPA

        return record

    def prime(self, installed: Installed, share_graphs: bool = True) -> None:
        """Prime every RetrieveThenAttend handler of `installed` with this record (ValueError when a
        handled layer was not recorded). share_graphs: an HNSW index starts from a copy of the graph
        an earlier priming built over the same keys and settings (False: each builds its own; the
        same results, bit for bit)."""
        for module in installed.mods:
            handler = module._attnlab_handler
            if handler.layer not in self.hidden:
                raise ValueError(f"layer {handler.layer} is substituted but its prefill was not recorded "
                                 f"(recorded: {sorted(self.hidden)})")
            handler.prime(self.hidden[handler.layer], self.keys[handler.layer], self.n_heads[handler.layer],
                          self.graphs if share_graphs else None)


def record_prefix(model, layers) -> tuple[Installed, PrefixRecord]:
    """Hooks that record `layers`' inputs and keys while the model attends exactly; use the first as a
    context manager around the prefill, then `record.prime(substitute(...))` before the next forward."""
    check_layers(model, layers)
    record = PrefixRecord()
    return Installed(model, {i: record.handler(i) for i in layers}), record


def _clock(device: torch.device) -> Callable[[], float]:
    """time.time, after the GPU's queued work has finished where there is one (the timings are per forward)."""
    if device.type != "cuda":
        return time.time
    return lambda: (torch.cuda.synchronize(device), time.time())[1]


@dataclass
class Prefill:
    """One exact prefill of ids[:, :split] (`prefill`): the ids on the model's device, the cache that
    holds the prefix, the record that primes a `substitute`d model from it, the clock that timed it
    and its seconds."""

    ids: torch.Tensor
    split: int
    cache: object
    record: PrefixRecord
    clock: Callable[[], float]
    seconds: float


@torch.no_grad()
def prefill(model, layers, ids: torch.Tensor, split: int) -> Prefill:
    """ids[:, :split] read once with full attention into a new cache, `layers`' inputs and keys recorded."""
    from attnlab.hf.modeling import CACHE_NAME

    ids = ids.to(model_device(model))
    clock = _clock(ids.device)
    t0 = clock()
    installed, record = record_prefix(model, layers)
    cache = new_cache(model)
    with installed:
        model(input_ids=ids[:, :split], use_cache=True, logits_to_keep=1, **{CACHE_NAME: cache})
    return Prefill(ids, split, cache, record, clock, clock() - t0)


@torch.no_grad()
def prefilled_logits(model, layers, input_ids: torch.Tensor, split: int, keep: int,
                     contexts: Iterable[tuple[object, Callable]], share_graphs: bool = True) -> tuple[dict, float]:
    """input_ids (1, T): positions before `split` read once with full attention, then for each
    (name, make_context) of `contexts` the positions from `split` on read inside make_context() (a
    `substitute`d model, primed from the prefill, or None / a null context for full attention), the
    cache cut back to the prefill after each. Returns ({name: (logits of the last `keep` positions
    (1, keep, V), seconds)}, the prefill's seconds). input_ids go to the model's device, where the
    logits are. share_graphs: as for `PrefixRecord.prime`."""
    from attnlab.hf.modeling import CACHE_NAME

    T = input_ids.shape[1]
    if not 0 < split < T or not 0 < keep <= T - split:
        raise ValueError(f"split must be in 1..{T - 1} and keep in 1..T - split, got split={split}, keep={keep}")
    pre = prefill(model, layers, input_ids, split)
    out = {}
    for name, make in contexts:
        t1 = pre.clock()
        with make() as sub:
            if sub is not None:
                pre.record.prime(sub, share_graphs)
            logits = model(input_ids=pre.ids[:, split:], use_cache=True, logits_to_keep=keep,
                           **{CACHE_NAME: pre.cache}).logits
        pre.cache.crop(split - T)  # back to the prefill
        out[name] = (logits, pre.clock() - t1)
    return out, pre.seconds
