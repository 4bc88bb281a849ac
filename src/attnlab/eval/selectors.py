"""Key selectors compared on one attnlab model: which K keys each scalar/hybrid head reads.

`select_keys(model, method, K)` switches the full-sequence forward of a model's scalar and hybrid
layers (those `decode_window` switches) to attention over the keys a selector keeps, per head
and per query, plus the always-kept prefix entries (the learned sink), through the `keep_fn` of
`attnlab.ops.windowed_attention`: each layer's forward is handed a `KeyRule` whose select makes it.
The methods:

- "window": the K keys nearest to the query in scalar space; equal to `decode_window(model, K)`.
- "oracle": the K keys with the highest logits (so the highest attention weights). No selector
  that reads K keys keeps more of the attention's mass.
- "quest": Quest's page selection. The keys (the prefix aside) are cut into pages of `page`
  consecutive positions; each head ranks the pages a query sees by an upper bound on the page's
  logits (the newest first among equal bounds) and reads the best ceil(K / page) of them,
  truncated to K keys (best page first, in position order inside a page). The bound
  (`quest_page_bounds`) adds Quest's bound on the dot term, scale * sum_c max(q_c min_c,
  q_c max_c) over the page's per-channel key range, and the exact maximum of the layer's scalar
  term (Gaussian -(qs - ks)^2 / tau or Cauchy -log(1 + (qs - ks)^2 / tau), times the hybrid's
  gain) over ks in the page's range [lo, hi]: at the nearer end, or at qs inside the range (the
  farther end for a negative gain). The page a query sits in is bounded over the keys it sees so
  far, as a decoder that fills pages as it goes would (`attnlab.index.pages`).
- "learned": search projections trained on this model (`attnlab.eval.selector_training.train_selector_projections`): the
  layer's input h is mapped by `attnlab.search.SearchProjections` to unit search vectors, one
  search space per head, and each query reads the K causal keys with the highest q^s . k^s.

The window and learned rules come with their keys as indices too (`attnlab.index.keep.IndexedKeep`), so
the layers read them through the O(T x K) selected-keys path of `windowed_attention` instead of
masking T x T scores (the same keys, so outputs equal to float rounding; the window's two routes
may keep different keys of two whose distances tie only after float32 rounding). With a tally every
rule masks the dense scores, which the tally reads.

Every method leaves a query that sees at most K keys with all of them (exact attention). With a
`SelectionTally` the context also counts, over queries that see more than K keys besides the
prefix, Mass@K (the exact attention's weight on the keys read, the prefix included) and Recall@K
(the share of the oracle's K keys read).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..checks import check_choice, check_int
from ..ops import window_indices, window_mask
from ..ops.common.heads import expand_heads
from ..ops.common.precision import upcast
from ..index.pages import _PageRanges, _quest_keep, quest_page_bounds, scalar_term
from ..index.keep import (IndexedKeep, candidate_keys, learned_indices, learned_keep, top_keys,  # noqa: F401
                          with_prefix)
from ..index.projections import check_projections
from ..models.decode import KeyRule, key_rule_of, using_key_rules
from ..models.lm import selectable_layers

METHODS = ("window", "oracle", "quest", "learned")

__all__ = [
    "METHODS", "SelectionTally", "candidate_keys", "quest_page_bounds", "select_keys", "selectable_layers",
    "top_keys",
]


# --------------------------------------------------------------------------- tally


@dataclass
class SelectionTally:
    """Running sums of Mass@K and Recall@K per layer index, over (query, head) pairs of queries
    that see more than K keys besides the prefix; `select_keys(..., tally=...)` fills it."""

    layers: dict = field(default_factory=dict)

    def add(self, layer: int, n: int, mass: float, recall: float) -> None:
        """Add n (query, head) pairs of `layer` with their summed Mass@K and Recall@K."""
        cur = self.layers.setdefault(int(layer), {"n": 0, "mass": 0.0, "recall": 0.0})
        cur["n"] += int(n)
        cur["mass"] += float(mass)
        cur["recall"] += float(recall)

    def _mean(self, key: str, rows) -> float:
        n = sum(r["n"] for r in rows)
        return sum(r[key] for r in rows) / n if n else float("nan")

    @property
    def n(self) -> int:
        return sum(r["n"] for r in self.layers.values())

    @property
    def mass(self) -> float:
        """Mean Mass@K over every counted (query, head) pair of every layer (nan if none)."""
        return self._mean("mass", self.layers.values())

    @property
    def recall(self) -> float:
        """Mean Recall@K over every counted (query, head) pair of every layer (nan if none)."""
        return self._mean("recall", self.layers.values())

    def summary(self) -> dict:
        """{"n", "mass", "recall", "per_layer": {layer: {"n", "mass", "recall"}}}: the means so far."""
        return {"n": self.n, "mass": self.mass, "recall": self.recall,
                "per_layer": {str(i): {"n": r["n"], "mass": self._mean("mass", [r]), "recall": self._mean("recall", [r])}
                              for i, r in sorted(self.layers.items())}}

    def observe(self, layer: int, a: int, b: int, logits: torch.Tensor, keep: torch.Tensor, K: int, n_prefix: int,
                best: torch.Tensor | None = None) -> None:
        """Count one chunk of query rows a..b-1 (op positions, prefix included): logits (B, H, b - a, b)
        of the exact attention (-inf where hidden) and the keys kept. best: the oracle's K keys
        (`top_keys` of the logits over the candidates) when already at hand."""
        seen = torch.arange(a, b, device=logits.device) + 1 - n_prefix  # non-prefix keys each query sees
        hard = seen > K
        if not bool(hard.any()):
            return
        w = torch.softmax(logits.float(), dim=-1)  # (B, H, Tq, Tk): the exact attention
        mass = (w * keep).sum(-1)[..., hard]  # (B, H, n_hard)
        if best is None:
            best = top_keys(logits, candidate_keys(a, b, n_prefix, logits.device), K)
        hits = (keep & best).sum(-1)[..., hard]  # (B, H, n_hard): of the oracle's K keys
        self.add(layer, mass.numel(), mass.double().sum().item(), hits.sum().item() / K)


# --------------------------------------------------------------------------- selection rules


# --------------------------------------------------------------------------- the selectors


def _keep_fn(method: str, K: int, page: int, qs, ks, tau, q, k, n_prefix: int, search=None,
             kernel: str = "gaussian", lam=None):
    """keep_fn(a, b, logits) of `method` for one call of a layer's op (see `windowed_attention`)."""
    if method == "window":  # the selected-keys path reads it as the window rule's indices
        return IndexedKeep(lambda a, b, logits: window_mask(qs[..., a:b], ks[..., :b], K, n_prefix=n_prefix),
                           lambda: window_indices(qs, ks, K, n_prefix=n_prefix))
    if method == "oracle":
        return lambda a, b, logits: with_prefix(top_keys(logits, candidate_keys(a, b, n_prefix, logits.device), K), n_prefix)
    if method == "quest":
        cdt = upcast(qs.dtype)
        kk = None if k is None else expand_heads(k, qs.shape[1])[:, :, n_prefix:].to(cdt)
        ranges = _PageRanges(ks[..., n_prefix:].to(cdt), kk, page)

        def quest(a, b, logits):
            bounds = quest_page_bounds(qs, ks, tau, q, k, page=page, n_prefix=n_prefix, rows=(a, b), _ranges=ranges,
                                       kernel=kernel, lam=lam)
            return with_prefix(_quest_keep(bounds, a, b, K, page, n_prefix), n_prefix)

        return quest
    sq, sk = search  # (B, H, T_op, d): zero rows at the prefix positions
    return IndexedKeep(learned_keep(sq, sk, K, n_prefix), lambda: learned_indices(sq, sk, K, n_prefix))


@contextlib.contextmanager
def select_keys(model, method: str, K: int, *, projections=None, page: int = 16,
                tally: SelectionTally | None = None) -> Iterator[None]:
    """Within the block, each scalar/hybrid head of `model` reads, per query, only the K keys
    that `method` selects (see the module docstring) plus the prefix entries (the sink).

    projections: a SearchProjections with one search space per head for every such layer
    (method "learned" only); page: Quest's page size; tally: a SelectionTally that accumulates
    Mass@K and Recall@K of every forward in the block. Yields {block index: KeyRule}, the rule to
    hand a layer called alone (`attention_weights(x, rules[i])`)."""
    check_choice("method", method, METHODS)
    check_int("K", K)
    check_int("page", page)
    if method == "learned" and projections is None:
        raise ValueError("projections must be given for method='learned' (train them with train_selector_projections)")
    if method != "learned" and projections is not None:
        raise ValueError(f"projections are read by method='learned' only, got method={method!r}")
    if tally is not None and not isinstance(tally, SelectionTally):
        raise TypeError(f"tally must be a SelectionTally or None, got {type(tally).__name__}")
    layers = selectable_layers(model)
    if not layers:
        names = sorted({str(blk.attn.mechanism) for blk in model.blocks})
        raise ValueError(f"model has no scalar or hybrid layer to select keys for (mechanisms {', '.join(names)})")
    for i, layer in layers:
        held = key_rule_of(layer)
        if held is not None:
            raise ValueError(f"model: layer {i} already has a key rule (window={held.window!r}, budget={held.budget!r}, "
                             f"select set: {held.select is not None}) from an enclosing decode_window/select_keys "
                             f"block; leave that block first to select keys by {method!r}")
    if method == "learned":
        check_projections(projections, layers)

    inputs: dict[int, torch.Tensor] = {}
    hooks = []

    def selector(i: int, layer):
        @torch.no_grad()  # keys are chosen, not differentiated
        def select(qs, ks, tau, q, k, n_prefix):
            search = _search_vectors(projections, i, inputs.pop(i, None), qs, n_prefix) if method == "learned" else None
            fn = _keep_fn(method, K, page, qs, ks, tau, q, k, n_prefix, search, *scalar_term(layer))
            if tally is None:  # an IndexedKeep stays one, so that the op reads its indices
                return fn if callable(getattr(fn, "indices", None)) else torch.no_grad()(fn)

            @torch.no_grad()
            def counted(a, b, logits):
                if method == "oracle":  # its keys are the tally's reference: select once
                    best = top_keys(logits, candidate_keys(a, b, n_prefix, logits.device), K)
                    keep = with_prefix(best.clone(), n_prefix)
                else:
                    best, keep = None, fn(a, b, logits)
                tally.observe(i, a, b, logits, keep, K, n_prefix, best)
                return keep

            return counted

        return select

    rules = {i: KeyRule(select=selector(i, layer)) for i, layer in layers}
    try:
        if method == "learned":
            for i, layer in layers:
                hooks.append(layer.register_forward_pre_hook(
                    lambda mod, args, i=i: inputs.__setitem__(i, args[0].detach())))
        with using_key_rules(model, rules):
            yield rules
    finally:
        for h in hooks:
            h.remove()
        inputs.clear()


@torch.no_grad()
def _search_vectors(projections, i: int, hidden, qs: torch.Tensor, n_prefix: int):
    """Search queries/keys (B, H, T_op, d) of layer i's input, zero at the prefix positions."""
    T = qs.shape[-1] - n_prefix
    if hidden is None or hidden.shape[:2] != (qs.shape[0], T):
        raise RuntimeError(f"method 'learned' reads the input of layer {i} as the layer is called (a forward "
                           f"pre-hook): call the layer or the model, not attention_weights, inside select_keys")
    sq, sk = projections(i, hidden)  # (B, H, T, d)
    pad = (0, 0, n_prefix, 0)
    return (torch.nn.functional.pad(sq.to(upcast(qs.dtype)), pad),
            torch.nn.functional.pad(sk.to(upcast(qs.dtype)), pad))
