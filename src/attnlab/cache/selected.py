"""Decoding scalar and hybrid layers through a learned key selector.

Search projections trained on a model (`attnlab.eval.selector_training.train_selector_projections`)
map each layer's input to unit search vectors, one search space per scalar/hybrid head. A layer
decoded through a `DecodeSelector` keeps every key in a plain cache and, per step, adds the new
token's search key to a growing index (exact maximum inner product, FAISS HNSW or FAISS IVF), searches it
with the token's search query, and attends over the K keys found (and the sink) with the layer's
own op. Token by token, this reads the keys `attnlab.eval.selectors.select_keys(model, "learned",
K, projections=...)` reads in a full-sequence forward (tested with the exact index).

    sel = DecodeSelector(projections, K=64)                # or index="hnsw" / "ivf"
    out = model.generate(prompt, 100, selector=sel)

`DecodeSelector(None, K, index="quest", page=16)` needs no projections: each layer keeps per-page
ranges of its own keys (scalar and per channel), updated as tokens arrive, and reads the keys of
the pages whose bound on the logits is highest, as `select_keys(model, "quest", K, page=...)` does
in a full-sequence forward (tested equal).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..checks import check_choice, check_int
from ..ops.common.heads import expand_heads
from .kv import KVCache

INDEXES = ("exact", "hnsw", "ivf", "quest")
KEY_DTYPES = {"float32": torch.float32, "float16": torch.float16}


@dataclass(frozen=True)
class DecodeSelector:
    """How scalar/hybrid layers pick their keys when decoding (`LM.make_caches(selector=...)`).

    Args:
        projections: an `attnlab.search.SearchProjections` with one search space per scalar/hybrid
            head for every such layer of the model; None with index="quest".
        K: keys each head reads per step (besides the sink).
        index: "exact" (every search key scored, O(n) per step), "hnsw" (FAISS HNSW graphs, one
            per batch row and head; needs faiss-cpu), "ivf" (FAISS IVF-flat: a step scores the
            keys of `ivf_nprobe` of `ivf_nlist` lists, `attnlab.index.ivf.IVFIndex`) or "quest" (pages of
            the layer's own keys ranked by a bound on their logits, no projections).
        page: Quest's page size (index="quest").
        hnsw_m, hnsw_ef_construction, hnsw_ef_search, pin: the HNSW graph's links per node, build
            and search beam widths, and the first keys scored exactly beside the graph or the lists
            (`HNSWIndex`; the options' spelling: `attnlab.index.options`).
        ivf_nlist, ivf_nprobe, ivf_train_at: index="ivf": lists per sequence, lists a step scores, and
            the keys held when the lists' centroids are learned (None: 16 * ivf_nlist; exact until then).
        key_dtype: index="exact" or "hnsw": "float16" stores the search keys in half precision
            (half the vector bytes a step reads; HNSW through FAISS's fp16 scalar quantizer).
    """

    projections: object
    K: int
    index: str = "exact"
    hnsw_m: int = 32
    hnsw_ef_construction: int = 64
    hnsw_ef_search: int = 128
    pin: int = 4
    page: int = 16
    ivf_nlist: int = 256
    ivf_nprobe: int = 16
    ivf_train_at: int | None = None
    key_dtype: str = "float32"

    def __post_init__(self):
        check_int("K", self.K)
        check_int("page", self.page)
        check_choice("index", self.index, INDEXES)
        if (self.projections is None) != (self.index == "quest"):
            raise ValueError(f"index={self.index!r}: " + ("Quest reads the layers' own keys, give projections=None"
                             if self.index == "quest" else "needs search projections (train_selector_projections)"))
        for name in ("hnsw_m", "hnsw_ef_construction", "hnsw_ef_search"):
            check_int(name, getattr(self, name))
        check_int("pin", self.pin, low=0)
        check_choice("key_dtype", self.key_dtype, tuple(KEY_DTYPES))
        if self.key_dtype != "float32" and self.index not in ("exact", "hnsw"):
            raise ValueError(f"key_dtype={self.key_dtype!r} applies to index='exact' or 'hnsw', not {self.index!r}")
        if self.index == "ivf":
            from ..index.ivf import IVFIndex

            IVFIndex.check_args(self.ivf_nlist, self.ivf_nprobe, self.ivf_train_at, prefix="ivf_")

    def check(self, layers) -> None:
        """The projections fit these (block index, layer) pairs (ValueError/TypeError naming them)."""
        from ..index.projections import check_projections

        if self.index != "quest":
            check_projections(self.projections, layers)

    def attach(self, layer, cache, i: int) -> None:
        """Make `cache` (an exact decode cache of block i's layer) decode through this selector."""
        cache.scalar = KVCache(cache.batch_size)
        if layer.config.sink:
            cache.scalar.append(**layer.sink_entry(cache.batch_size))
        cache.selector = QuestKeys(self, i) if self.index == "quest" else KeySelector(self, i)


class KeySelector:
    """One layer's selection state: the search vectors of positions observed but not yet decoded,
    and the index of the decoded tokens' search keys."""

    def __init__(self, spec: DecodeSelector, layer: int):
        from ..index.ivf import IVFIndex
        from ..index.retrieval import ExactIndex, HNSWIndex

        self.spec, self.layer = spec, layer
        d = spec.projections.d_search
        self.index = (ExactIndex(KEY_DTYPES[spec.key_dtype]) if spec.index == "exact"
                      else IVFIndex(d, spec.ivf_nlist, spec.ivf_nprobe, spec.ivf_train_at, spec.pin)
                      if spec.index == "ivf"
                      else HNSWIndex(d, spec.hnsw_m, spec.hnsw_ef_construction, spec.hnsw_ef_search, spec.pin,
                                     KEY_DTYPES[spec.key_dtype]))
        self._pending: list[tuple[torch.Tensor, torch.Tensor]] = []

    @torch.no_grad()
    def observe(self, hidden: torch.Tensor, pos: int) -> None:
        """The layer's input (B, T, C) at positions pos..pos+T-1, before the layer decodes them."""
        sq, sk = self.spec.projections(self.layer, hidden, start=pos)  # (B, H, T, d)
        self._pending.extend((sq[:, :, t:t + 1], sk[:, :, t:t + 1]) for t in range(hidden.shape[1]))

    @torch.no_grad()
    def select(self, p=None, q=None, k=None, layer=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the next observed token's search key, search with its query: positions (B, H, k)
        among the n tokens decoded so far (this one included), k = min(K, n), and their validity.
        (p, q, k, layer: the step's projections and its layer, read by `QuestKeys` only.)"""
        if not self._pending:
            raise RuntimeError(f"layer {self.layer}: a step came before its input was observed; decode through "
                               f"LM.step / LM.prefill, which feed the selector")
        sq, sk = self._pending.pop(0)
        self.index.add(sk)
        n = self.index.ntotal
        allowed = torch.ones(1, 1, 1, n, dtype=torch.bool, device=sq.device)
        idx, valid = self.index.search(sq, allowed, min(self.spec.K, n))  # (B, H, 1, k)
        return idx[:, :, 0], valid[:, :, 0]


def selected_step(layer, p, cache, vals: torch.Tensor, q, k) -> torch.Tensor:
    """Readout (B, H_s, 1, D) of one token through `cache.selector`: the token's keys appended to the
    plain cache (the sink first), then the layer's op over the sink and the selected keys."""
    if p.qs.shape[-1] != 1:
        raise RuntimeError("a selector cache decodes one token at a time")
    full = cache.scalar.append(**{"ks": p.ks, layer.value_key: vals, **({"k": k} if k is not None else {})})
    idx, valid = cache.selector.select(p, q, k, layer)  # (B, H, k)
    H, pre = layer.n_scalar, 1 if layer.config.sink else 0
    pick = torch.cat([idx.new_zeros(*idx.shape[:2], pre), idx + pre], -1)  # the sink, then the selection
    ok = torch.cat([valid.new_ones(*valid.shape[:2], pre), valid], -1)

    def gather(x):  # (B, G, n[, D]) -> (B, H, 1 + k[, D]) per head
        x = expand_heads(x, H) if x.dim() == 4 else x
        return x.gather(2, pick[..., None].expand(-1, -1, -1, x.shape[-1])) if x.dim() == 4 else x.gather(2, pick)

    ks, vv = gather(full["ks"]), gather(full[layer.value_key])
    kk = gather(full["k"]) if k is not None else None
    if bool(ok.all()):
        return layer.scalar_op(p.qs, ks, vv, p.tau, q, kk, layer.config.impl)
    # fewer keys than slots (a graph search that found fewer, Quest's partial pages): the op's scores
    # over the slots with the empty ones masked out, whatever the kernel and the sign of the gain
    from ..ops.scalar import hybrid_scores, scalar_scores

    tau = p.tau.view(1, H, 1) if p.tau.dim() == 1 else p.tau[..., :1]
    lam = getattr(layer, "scalar_scale", None)
    lam = None if lam is None else lam.view(1, H, 1)
    logits = (scalar_scores(p.qs, ks, tau, layer.config.kernel, lam) if kk is None
              else hybrid_scores(q, kk, p.qs, ks, tau, layer.config.kernel, lam))  # (B, H, 1, m)
    logits = logits.masked_fill(~ok[:, :, None], float("-inf"))
    return (torch.softmax(logits, -1) @ vv.to(logits.dtype)).to(vv.dtype)


def selected_prefill(layer, p, cache):
    """Readout (B, H, T, D) of a whole prompt through an exact-index learned selector in one pass, or
    None when `cache` must take it token by token (a selector already holding keys, another index,
    half-precision search keys, Quest). The layer's own op reads, per query, the K causal keys its
    search query scores highest (`index.keep.learned_keep`, what stepping the index selects);
    then the plain cache and the index take every prompt key, as T steps would leave them."""
    sel = cache.selector
    T = p.qs.shape[-1]
    if (not isinstance(sel, KeySelector) or sel.index.ntotal or sel.spec.index != "exact"
            or sel.spec.key_dtype != "float32" or len(sel._pending) != T):
        return None
    from ..index.keep import learned_keep
    from ..ops.common.precision import upcast
    from .sink import token_values

    sq = torch.cat([q for q, _ in sel._pending], 2)  # (B, H, T, d), the positions the layer decodes
    sk = torch.cat([k for _, k in sel._pending], 2)

    @torch.no_grad()
    def select(qs, ks, tau, q, k, n_prefix):  # the search vectors with zero rows at the sink's position
        pad = (0, 0, n_prefix, 0)
        search = tuple(torch.nn.functional.pad(x.to(upcast(qs.dtype)), pad) for x in (sq, sk))
        return learned_keep(*search, sel.spec.K, n_prefix)

    saved = layer.__dict__.get("decode_select")
    layer.decode_select = select
    try:
        o, _ = layer.attend(p)  # scalar heads through the selection (and a mixed layer's dot heads)
    finally:
        if saved is None:
            layer.__dict__.pop("decode_select", None)
        else:
            layer.decode_select = saved
    vals = layer.scalar_values(p)
    _, k = layer.score_vectors(p)
    cache.scalar.append(**{"ks": p.ks, layer.value_key: vals if layer.sink_weight is None else token_values(vals),
                           **({"k": k} if k is not None else {})})
    sel.index.add(sk)
    sel._pending.clear()
    if cache.kv is not None:  # the dot-product heads of a mixed layer
        cache.kv.append(k=p.k, v=p.v)
    return o


class QuestKeys:
    """One layer's Quest state while decoding: per page of `page` tokens the range of its scalar keys
    and, for hybrid heads, of its vector keys per channel, extended by each new token."""

    def __init__(self, spec: DecodeSelector, layer: int):
        self.spec, self.layer, self.n = spec, layer, 0
        self.lo = self.hi = self.k_lo = self.k_hi = None  # (B, H, P), (B, H, P, D)

    def observe(self, hidden: torch.Tensor, pos: int) -> None:
        pass  # Quest reads the layer's own keys, given to `select`

    @staticmethod
    def _extend(lo, hi, x, new_page: bool):
        if lo is None or new_page:
            return (x, x) if lo is None else (torch.cat([lo, x], 2), torch.cat([hi, x], 2))
        return torch.cat([lo[:, :, :-1], torch.minimum(lo[:, :, -1:], x)], 2), \
            torch.cat([hi[:, :, :-1], torch.maximum(hi[:, :, -1:], x)], 2)

    @torch.no_grad()
    def select(self, p, q=None, k=None, layer=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the step's keys to their page, bound every page's logits for its query (the bound of
        `eval.selectors.quest_page_bounds`, under `layer`'s kernel and gain), and return the keys of
        the best pages: positions (B, H, m) among the n tokens so far and their validity, at most K
        of them."""
        from ..index.pages import _dot_bound, _lam_rows, _quest_keep, scalar_range_bound, scalar_term
        from ..ops.common.precision import upcast

        cdt = upcast(p.qs.dtype)
        H, new_page = p.qs.shape[1], self.n % self.spec.page == 0
        self.lo, self.hi = self._extend(self.lo, self.hi, p.ks.to(cdt), new_page)
        if q is not None:
            kk = expand_heads(k, H).to(cdt)
            self.k_lo, self.k_hi = self._extend(self.k_lo, self.k_hi, kk, new_page)
        self.n += 1
        tau = torch.as_tensor(p.tau, dtype=cdt, device=p.qs.device)
        tau = tau.view(1, -1, 1) if tau.dim() == 1 else tau.reshape(-1, H, 1) if tau.dim() else tau.view(1, 1, 1)
        qs = p.qs.to(cdt)  # (B, H, 1)
        kernel, lam = scalar_term(layer) if layer is not None else ("gaussian", None)
        bound = scalar_range_bound(qs, self.lo, self.hi, tau, kernel, _lam_rows(lam, qs))  # (B, H, P)
        if q is not None:  # full pages by matmul, the query's own (last) page by a sum, as the forward does
            qq, D = q.to(cdt), q.shape[-1]
            dots = (qq.clamp(min=0) @ self.k_hi.transpose(-1, -2) + qq.clamp(max=0) @ self.k_lo.transpose(-1, -2))
            own = _dot_bound(qq, self.k_hi[:, :, -1:], self.k_lo[:, :, -1:]).sum(-1)  # (B, H, 1)
            bound = bound + torch.cat([dots[:, :, 0, :-1], own], -1) / math.sqrt(D)
        keep = _quest_keep(bound[:, :, None], self.n - 1, self.n, self.spec.K, self.spec.page, 0)[:, :, 0]  # (B, H, n)
        m = min(self.spec.K, self.n)
        valid, idx = keep.to(torch.int8).topk(m, dim=-1, sorted=False)  # the kept positions first
        return idx, valid.bool()

