"""One item of a decoding comparison through attnlab's selectors: one exact prefill, then every method.

An item is a dict: `kind` ("task", "ppl" or "time"), `id`, `ids` (the token ids, int) and `split`
(the prefill: positions before it are read once with full attention). A task item scores the
argmax at its answer positions (`labels`, the last len(labels) positions' targets: solved when
every one is right); a ppl item sums the negative log-likelihood of `labels`, the tokens after
the prefill, each predicted through the method; a time item decodes `steps` single tokens after
the prefill and times each. Every method reads the same prefill (`prefill.prefilled_logits`:
each selector's index is filled from it, the cache cut back after each method), and every budget
of an HNSW method one graph per layer built over it (`patch.PrefillGraphs`), so an item costs one
prefill, one graph build per HNSW method and layer, plus a few dozen tokens per (method, K).
"""

from __future__ import annotations

import contextlib

import torch

from .patch import SelectorConfig, check_layers, substitute
from .prefill import prefill, prefilled_logits
from .sorted import SortedScalarIndex

FULL = "full"


def combos(methods, budgets) -> list[tuple[str, int | None]]:
    """(method, K) in run order: full attention once (K None), then every method at every budget."""
    first = [(FULL, None)] if FULL in methods else []
    return first + [(m, K) for m in methods if m != FULL for K in budgets]


def combo_name(method: str, K: int | None) -> str:
    return method if K is None else f"{method}@{K}"


def selector_context(model, layers, method: str, K: int | None, groups: int, projections: dict, knobs: dict):
    """The context a (method, K) reads in: nothing for full attention, else the substitution of `layers`
    (projections[method]: the checkpoint it reads; knobs: SelectorConfig's other fields)."""
    if method == FULL:
        return lambda: contextlib.nullcontext()
    cfg = SelectorConfig(method, K, groups, **knobs)
    return lambda: substitute(model, layers, cfg, projections.get(method))


def score_answer(logits: torch.Tensor, labels: torch.Tensor) -> dict:
    """{solved, hit, asked} of logits (n, V) against the answer tokens labels (n,)."""
    hit = logits.argmax(-1) == labels.to(logits.device)
    return {"solved": int(hit.all()), "hit": int(hit.sum()), "asked": int(labels.numel())}


def nll(logits: torch.Tensor, labels: torch.Tensor) -> dict:
    """{nll, tokens}: the summed negative log-likelihood (float64) of labels (n,) under logits (n, V)."""
    lp = torch.log_softmax(logits.double(), -1).gather(-1, labels.to(logits.device)[:, None])
    return {"nll": float(-lp.sum()), "tokens": int(labels.numel())}


@torch.no_grad()
def run_item(model, layers, item: dict, methods, budgets, groups: int, projections: dict, knobs: dict,
             share_graphs: bool = True) -> dict:
    """Every (method, K) on one item -> {"prefill_s", "results": {name: {...}}} (see the module docstring).
    share_graphs=False builds an HNSW method's graphs once per budget (the reference: the same results)."""
    check_layers(model, layers)
    todo = [(combo_name(m, K), selector_context(model, layers, m, K, groups, projections, knobs))
            for m, K in combos(methods, budgets)]
    ids = torch.as_tensor(item["ids"]).long()[None]
    if item["kind"] == "time":
        return timed_steps(model, layers, ids, item["split"], item["steps"], todo, item.get("rounds", 3),
                           share_graphs)
    labels = torch.as_tensor(item["labels"]).long()
    keep = labels.numel()
    got, prefill_s = prefilled_logits(model, layers, ids, item["split"], keep, todo, share_graphs)
    judge = score_answer if item["kind"] == "task" else nll
    return {"prefill_s": round(prefill_s, 4),
            "results": {name: {**judge(logits[0], labels), "s": round(s, 4)} for name, (logits, s) in got.items()}}


def _reads(installed) -> int:
    """Entries the sorted indexes of `installed` have read so far (0 without any)."""
    if installed is None:
        return 0
    return sum(getattr(m._attnlab_handler.index, "reads", 0) for m in installed.mods
               if isinstance(getattr(m._attnlab_handler, "index", None), SortedScalarIndex))


def _hnsw_ndis() -> int:
    try:
        import faiss
    except ImportError:
        return 0
    return int(faiss.cvar.hnsw_stats.ndis)


@torch.no_grad()
def timed_steps(model, layers, ids: torch.Tensor, split: int, steps: int, todo, rounds: int = 3,
                share_graphs: bool = True) -> dict:
    """Prefill ids[:, :split] once with full attention; then, in each of `rounds` rounds, every
    (name, make_context) of `todo` in turn (the order rotated each round) decodes `steps` single tokens
    ids[:, split + s] through it, each timed (ms, on the CPU or after a CUDA sync), with the entries
    its sorted indexes read and FAISS's HNSW distance computations per step; the cache is cut back to
    the prefill after each. Interleaving keeps a slow spell of the machine from landing on one method.
    share_graphs: as for `PrefixRecord.prime` (priming is outside the timed steps)."""
    from attnlab.hf.modeling import CACHE_NAME

    pre = prefill(model, layers, ids, split)
    ids, clock, cache = pre.ids, pre.clock, pre.cache
    results = {name: {"ms": [], "sorted_reads": [], "hnsw_ndis": []} for name, _ in todo}
    for r in range(rounds):
        for name, make in todo[r % len(todo):] + todo[:r % len(todo)]:
            res = results[name]
            with make() as sub:
                if sub is not None:
                    pre.record.prime(sub, share_graphs)
                for s in range(steps):
                    r0, n0, t1 = _reads(sub), _hnsw_ndis(), clock()
                    model(input_ids=ids[:, split + s:split + s + 1], use_cache=True, **{CACHE_NAME: cache})
                    res["ms"].append(round(1000 * (clock() - t1), 3))
                    res["sorted_reads"].append(_reads(sub) - r0)
                    res["hnsw_ndis"].append(_hnsw_ndis() - n0)
            cache.crop(-steps)  # back to the prefill
    return {"prefill_s": round(pre.seconds, 4), "results": results}
