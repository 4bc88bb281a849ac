"""Key selectors compared on one attnlab model: which K keys each scalar/hybrid head reads.

`select_keys(model, method, K)` switches the full-sequence forward of a model's scalar and hybrid
layers (those `decode_window` switches) to attention over the keys a selector keeps, per head
and per query, plus the always-kept prefix entries (the learned sink), through the `keep_fn` of
`attnlab.ops.windowed_attention`. The methods:

- "window": the K keys nearest to the query in scalar space; equal to `decode_window(model, K)`.
- "oracle": the K keys with the highest logits (so the highest attention weights). No selector
  that reads K keys keeps more of the attention's mass.
- "quest": Quest's page selection. The keys (the prefix aside) are cut into pages of `page`
  consecutive positions; each head ranks the pages a query sees by an upper bound on the page's
  logits (the newest first among equal bounds) and reads the best ceil(K / page) of them,
  truncated to K keys (best page first, in position order inside a page). The bound
  (`quest_page_bounds`) adds Quest's bound on the dot term, scale * sum_c max(q_c min_c,
  q_c max_c) over the page's per-channel key range, and the exact maximum of the scalar term
  -(qs - ks)^2 / tau over ks in the page's range [lo, hi]: 0 when qs lies inside, else
  -(distance to the nearer end)^2 / tau. The page a query sits in is bounded over the keys it
  sees so far, as a decoder that fills pages as it goes would.
- "learned": search projections trained on this model (`attnlab.eval.selector_training.train_selector_projections`): the
  layer's input h is mapped by `attnlab.search.SearchProjections` to unit search vectors, one
  search space per head, and each query reads the K causal keys with the highest q^s . k^s.

Every method leaves a query that sees at most K keys with all of them (exact attention). With a
`SelectionTally` the context also counts, over queries that see more than K keys besides the
prefix, Mass@K (the exact attention's weight on the keys read, the prefix included) and Recall@K
(the share of the oracle's K keys read).
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass, field
from typing import Iterator

import torch

from ..checks import check_choice, check_int, check_tensor
from ..ops import range_distance, window_mask
from ..ops._sdpa import expand_heads, upcast
from ..ops.scalar import check_kernel, kernel_term

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


def candidate_keys(a: int, b: int, n_prefix: int, device=None) -> torch.Tensor:
    """(b - a, b) bool: the keys query rows a..b-1 may select, the causal keys past the prefix."""
    pos_q = torch.arange(a, b, device=device)[:, None]
    pos_k = torch.arange(b, device=device)[None, :]
    return (pos_k <= pos_q) & (pos_k >= n_prefix)


def top_keys(scores: torch.Tensor, candidate: torch.Tensor, K: int) -> torch.Tensor:
    """Bool mask of the K candidates with the highest scores per row (all when fewer): scores
    (..., Tq, Tk), candidate broadcastable to them."""
    candidate = candidate.expand(scores.shape)
    keep = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    n = min(K, scores.shape[-1])
    if n:
        best = scores.masked_fill(~candidate, float("-inf")).topk(n, dim=-1).indices
        keep.scatter_(-1, best, True)
    return keep & candidate


def _with_prefix(keep: torch.Tensor, n_prefix: int) -> torch.Tensor:
    if n_prefix:
        keep[..., :n_prefix] = True
    return keep


def _tau_rows(tau, a: int, b: int, like: torch.Tensor) -> torch.Tensor:
    """tau as a float, (H,) or (B, H, T) -> a tensor broadcastable to (B, H, b - a)."""
    t = torch.as_tensor(tau, dtype=like.dtype, device=like.device)
    if t.dim() == 0:
        return t.view(1, 1, 1)
    if t.dim() == 1:
        return t.view(1, -1, 1)
    return t[..., a:b]


def _running_page_stats(x: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Running max and min of keys x (B, H, N[, D]) from the start of each key's page to the key:
    entry j holds the range of keys page_start(j)..j. Same shape as x."""
    N = x.shape[2]
    P = math.ceil(N / page)
    pad = P * page - N
    tail = x.shape[3:]
    shape = (*x.shape[:2], P, page, *tail)
    fill = (0, 0) * len(tail) + (0, pad)
    hi = torch.nn.functional.pad(x, fill, value=float("-inf")).view(shape).cummax(3).values
    lo = torch.nn.functional.pad(x, fill, value=float("inf")).view(shape).cummin(3).values
    back = (*x.shape[:2], P * page, *tail)
    return hi.reshape(back)[:, :, :N], lo.reshape(back)[:, :, :N]


class _PageRanges:
    """Per-page key ranges of one layer call, for Quest bounds: ks (B, H, N) and k (B, H, N, D) of
    the N keys past the prefix, as running ranges inside each page (see `_running_page_stats`)."""

    def __init__(self, ks: torch.Tensor, k: torch.Tensor | None, page: int):
        self.page = page
        self.N = ks.shape[-1]
        self.ks_hi, self.ks_lo = _running_page_stats(ks, page)  # (B, H, N)
        self.k_hi = self.k_lo = None
        if k is not None:
            self.k_hi, self.k_lo = _running_page_stats(k, page)  # (B, H, N, D)
        last = torch.arange(page - 1, self.N + page - 1, page, device=ks.device).clamp(max=max(self.N - 1, 0))  # each page's last key
        self.last = last[: math.ceil(self.N / page)]


def _dot_bound(q: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The terms max(q_c lo_c, q_c hi_c) = q+_c hi_c + q-_c lo_c of Quest's bound, for q (..., D)
    against key ranges (..., D); their sum over c bounds q . k for every k in the range."""
    return q.clamp(min=0) * hi + q.clamp(max=0) * lo


def scalar_range_bound(qs: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, tau, kernel: str = "gaussian",
                       lam=None) -> torch.Tensor:
    """The largest scalar term lam * kernel((qs - ks)^2 / tau) over keys ks in [lo, hi] (all
    broadcast together): at the nearest point of the range when lam >= 0 (or None, i.e. 1), at its
    farthest end when lam < 0 (a hybrid's learned gain may have either sign)."""
    near = kernel_term(range_distance(qs, lo, hi).square() / tau, kernel)
    if lam is None:
        return near
    far = kernel_term(torch.maximum((qs - lo).abs(), (qs - hi).abs()).square() / tau, kernel)
    return torch.where(lam >= 0, lam * near, lam * far)


def scalar_term(layer) -> tuple[str, torch.Tensor | None]:
    """(kernel, per-head gain on the scalar term or None) of a scalar/hybrid layer, detached."""
    lam = getattr(layer, "scalar_scale", None)
    return layer.config.kernel, None if lam is None else lam.detach()


def _lam_rows(lam, like: torch.Tensor):
    """A per-head gain (H,) shaped to broadcast against (B, H, Tq[, P]) (None stays None)."""
    if lam is None:
        return None
    lam = torch.as_tensor(lam, dtype=like.dtype, device=like.device)
    return lam.reshape(1, -1, 1) if lam.dim() == 1 else lam


def quest_page_bounds(qs: torch.Tensor, ks: torch.Tensor, tau, q: torch.Tensor | None = None,
                      k: torch.Tensor | None = None, *, page: int = 16, n_prefix: int = 0,
                      rows: tuple[int, int] | None = None, _ranges: _PageRanges | None = None,
                      kernel: str = "gaussian", lam=None) -> torch.Tensor:
    """Upper bounds on the logits of each page of keys, for the queries in `rows` = (a, b) (op
    positions; default all): (B, H, b - a, P), P = ceil((Tk - n_prefix) / page), -inf for pages
    the query cannot see. qs (B, H, Tq), ks (B, H, Tk), tau a float, (H,) or (B, H, Tq);
    q (B, H, Tq, D), k (B, G, Tk, D) for the hybrid score (scale 1/sqrt(D)); the queries are the
    op's positions 0..Tq-1 with Tq = Tk (a whole sequence), key positions past the prefix in pages.

    Page j of a query at op position t covers keys n_prefix + j*page .. and is bounded over the
    keys of it that t sees: for the page holding t itself, those up to t. kernel ("gaussian" or
    "cauchy") and lam (the hybrid's per-head gain on the scalar term, (H,), any sign) are the
    layer's: the bound is over its actual logits."""
    check_kernel(kernel)
    check_int("page", page)
    check_int("n_prefix", n_prefix, 0)
    check_tensor("qs", qs, 3)
    if not isinstance(ks, torch.Tensor) or ks.shape != qs.shape:
        raise ValueError(f"ks must have the shape of qs {tuple(qs.shape)} (a whole sequence), "
                         f"got {tuple(ks.shape) if isinstance(ks, torch.Tensor) else type(ks).__name__}")
    if (q is None) != (k is None):
        raise ValueError("q and k must be given together (hybrid score) or both be None (scalar)")
    T = qs.shape[-1]
    a, b = (0, T) if rows is None else rows
    if not 0 <= a <= b <= T:
        raise ValueError(f"rows must be (a, b) with 0 <= a <= b <= {T}, got {rows!r}")
    cdt = upcast(qs.dtype)
    if _ranges is None:
        kk = None if k is None else expand_heads(k, qs.shape[1])[:, :, n_prefix:].to(cdt)
        _ranges = _PageRanges(ks[..., n_prefix:].to(cdt), kk, page)
    R = _ranges
    P = math.ceil(R.N / page)
    if P == 0:  # no keys past the prefix
        return qs.new_full((*qs.shape[:2], b - a, 0), float("-inf"), dtype=cdt)
    r = torch.arange(a, b, device=qs.device) - n_prefix  # each query's index among the N keys
    own = r.clamp(min=0) // page  # the page each query sits in
    tq = _tau_rows(tau, a, b, qs.to(cdt))  # (1|B, 1|H, Tq)
    qsr = qs[..., a:b].to(cdt)
    # full pages: the range of the whole page (the running range at its last key)
    lam = _lam_rows(lam, qsr)
    bound = scalar_range_bound(qsr[..., None], R.ks_lo[..., R.last][..., None, :], R.ks_hi[..., R.last][..., None, :],
                               tq[..., None], kernel, None if lam is None else lam[..., None])  # (B, H, Tq, P)
    # the page a query sits in: the range of its keys up to the query
    rc = r.clamp(min=0, max=max(R.N - 1, 0))
    part = scalar_range_bound(qsr, R.ks_lo[..., rc], R.ks_hi[..., rc], tq, kernel, lam)  # (B, H, Tq)
    if q is not None:
        D = q.shape[-1]
        qr = q[:, :, a:b].to(cdt)
        hi, lo = R.k_hi[:, :, R.last], R.k_lo[:, :, R.last]  # (B, H, P, D)
        bound = bound + (qr.clamp(min=0) @ hi.transpose(-1, -2) + qr.clamp(max=0) @ lo.transpose(-1, -2)) / math.sqrt(D)
        part = part + _dot_bound(qr, R.k_hi[:, :, rc], R.k_lo[:, :, rc]).sum(-1) / math.sqrt(D)
    bound = bound.scatter(-1, own.view(1, 1, -1, 1).expand(*bound.shape[:3], 1), part[..., None])
    seen = (torch.arange(P, device=qs.device)[None, :] <= own[:, None]) & (r[:, None] >= 0)  # (Tq, P)
    return bound.masked_fill(~seen, float("-inf"))


def _quest_keep(bounds: torch.Tensor, a: int, b: int, K: int, page: int, n_prefix: int) -> torch.Tensor:
    """The keys of the best ceil(K / page) pages by bound (the newest first among equal bounds), at
    most K (best page first, then by position), for query rows a..b-1: (B, H, b - a, b) bool,
    prefix excluded."""
    B, H, Tq, P = bounds.shape
    keep = torch.zeros(B, H, Tq, b + 1, dtype=torch.bool, device=bounds.device)  # last column: a drain
    n_sel = min(math.ceil(K / page), P)
    if n_sel:
        # best first; at equal bounds (a query inside several pages' scalar ranges) the newest page first
        order = bounds.flip(-1).sort(dim=-1, descending=True, stable=True)
        val, top = order.values[..., :n_sel], P - 1 - order.indices[..., :n_sel]
        tok = n_prefix + top[..., None] * page + torch.arange(page, device=bounds.device)  # (B, H, Tq, n_sel, page)
        pos_q = torch.arange(a, b, device=bounds.device).view(1, 1, -1, 1, 1)
        ok = (val > float("-inf"))[..., None] & (tok <= pos_q)
        ok, tok = ok.flatten(-2), tok.flatten(-2)
        ok &= ok.cumsum(-1) <= K
        keep.scatter_(-1, torch.where(ok, tok, b), True)
    return keep[..., :b]


# --------------------------------------------------------------------------- the selectors


def _keep_fn(method: str, K: int, page: int, qs, ks, tau, q, k, n_prefix: int, search=None,
             kernel: str = "gaussian", lam=None):
    """keep_fn(a, b, logits) of `method` for one call of a layer's op (see `windowed_attention`)."""
    if method == "window":
        return lambda a, b, logits: window_mask(qs[..., a:b], ks[..., :b], K, n_prefix=n_prefix)
    if method == "oracle":
        return lambda a, b, logits: _with_prefix(top_keys(logits, candidate_keys(a, b, n_prefix, logits.device), K), n_prefix)
    if method == "quest":
        cdt = upcast(qs.dtype)
        kk = None if k is None else expand_heads(k, qs.shape[1])[:, :, n_prefix:].to(cdt)
        ranges = _PageRanges(ks[..., n_prefix:].to(cdt), kk, page)

        def quest(a, b, logits):
            bounds = quest_page_bounds(qs, ks, tau, q, k, page=page, n_prefix=n_prefix, rows=(a, b), _ranges=ranges,
                                       kernel=kernel, lam=lam)
            return _with_prefix(_quest_keep(bounds, a, b, K, page, n_prefix), n_prefix)

        return quest
    sq, sk = search  # (B, H, T_op, d): zero rows at the prefix positions

    def learned(a, b, logits):
        scores = sq[:, :, a:b] @ sk[:, :, :b].transpose(-1, -2)  # (B, H, Tq, b)
        return _with_prefix(top_keys(scores, candidate_keys(a, b, n_prefix, scores.device), K), n_prefix)

    return learned


def selectable_layers(model) -> list[tuple[int, object]]:
    """(block index, layer) of each attention layer of `model` that decodes through the sorted
    scalar cache (scalar and hybrid; as `attnlab.eval.window.windowed_layers`)."""
    blocks = getattr(model, "blocks", None)
    if blocks is None:
        raise TypeError(f"model must be an attnlab LM (with .blocks), got {type(model).__name__}")
    return [(i, blk.attn) for i, blk in enumerate(blocks)
            if getattr(blk.attn, "sorted_decode", False) and blk.attn.n_scalar]


def _check_projections(projections, layers) -> None:
    from ..search.projections import SearchProjections

    if not isinstance(projections, SearchProjections):
        raise TypeError(f"projections must be a SearchProjections (see train_selector_projections), "
                        f"got {type(projections).__name__}")
    for i, layer in layers:
        if str(i) not in projections.wq:
            raise ValueError(f"projections hold layers {projections.layers}; the model's scalar/hybrid layer {i} has none")
        if projections.groups != layer.n_scalar:
            raise ValueError(f"projections have groups={projections.groups} search spaces per token; layer {i} "
                             f"needs one per scalar/hybrid head ({layer.n_scalar})")
        if projections.d_model != layer.config.d_model:
            raise ValueError(f"projections map d_model={projections.d_model}; layer {i} has d_model={layer.config.d_model}")


@contextlib.contextmanager
def select_keys(model, method: str, K: int, *, projections=None, page: int = 16,
                tally: SelectionTally | None = None) -> Iterator[None]:
    """Within the block, each scalar/hybrid head of `model` reads, per query, only the K keys
    that `method` selects (see the module docstring) plus the prefix entries (the sink).

    projections: a SearchProjections with one search space per head for every such layer
    (method "learned" only); page: Quest's page size; tally: a SelectionTally that accumulates
    Mass@K and Recall@K of every forward in the block. The layers are restored on exit."""
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
        if layer.decode_select is not None or layer.decode_window is not None or layer.decode_budget is not None:
            raise ValueError(f"model: layer {i} already has a key rule (decode_window={layer.decode_window!r}, "
                             f"decode_budget={layer.decode_budget!r}, decode_select set: {layer.decode_select is not None}); "
                             f"leave that block first")
    if method == "learned":
        _check_projections(projections, layers)

    inputs: dict[int, torch.Tensor] = {}
    hooks = []

    def selector(i: int, layer):
        @torch.no_grad()  # keys are chosen, not differentiated
        def select(qs, ks, tau, q, k, n_prefix):
            search = _search_vectors(projections, i, inputs.pop(i, None), qs, n_prefix) if method == "learned" else None
            fn = _keep_fn(method, K, page, qs, ks, tau, q, k, n_prefix, search, *scalar_term(layer))
            if tally is None:
                return torch.no_grad()(fn)

            @torch.no_grad()
            def counted(a, b, logits):
                if method == "oracle":  # its keys are the tally's reference: select once
                    best = top_keys(logits, candidate_keys(a, b, n_prefix, logits.device), K)
                    keep = _with_prefix(best.clone(), n_prefix)
                else:
                    best, keep = None, fn(a, b, logits)
                tally.observe(i, a, b, logits, keep, K, n_prefix, best)
                return keep

            return counted

        return select

    try:
        for i, layer in layers:
            layer.decode_select = selector(i, layer)
            if method == "learned":
                hooks.append(layer.register_forward_pre_hook(
                    lambda mod, args, i=i: inputs.__setitem__(i, args[0].detach())))
        yield
    finally:
        for h in hooks:
            h.remove()
        for _, layer in layers:
            layer.__dict__.pop("decode_select", None)  # back to the class default (None)
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
