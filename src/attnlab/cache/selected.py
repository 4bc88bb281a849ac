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

Here are the selectors' state and functions of tensors; the layer decodes through them
(`attnlab.layers.mechanisms.scalar_decode`: `attach_selector`, `selected_step`, `selected_prefill`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ..checks import check_choice, check_int
from ..ops.common.heads import expand_heads

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

    def layer_state(self, i: int):
        """The selection state of block i's layer while it decodes: `QuestKeys` or `KeySelector`."""
        return QuestKeys(self, i) if self.index == "quest" else KeySelector(self, i)


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
    def select(self, p=None, q=None, k=None, kernel: str = "gaussian", lam=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the next observed token's search key, search with its query: positions (B, H, k)
        among the n tokens decoded so far (this one included), k = min(K, n), and their validity.
        (p, q, k, kernel, lam: the step's projections and its layer's score, read by `QuestKeys` only.)"""
        if not self._pending:
            raise RuntimeError(f"layer {self.layer}: a step came before its input was observed; decode through "
                               f"LM.step / LM.prefill, which feed the selector")
        sq, sk = self._pending.pop(0)
        self.index.add(sk)
        n = self.index.ntotal
        allowed = torch.ones(1, 1, 1, n, dtype=torch.bool, device=sq.device)
        idx, valid = self.index.search(sq, allowed, min(self.spec.K, n))  # (B, H, 1, k)
        return idx[:, :, 0], valid[:, :, 0]

    def add_prompt(self, sk: torch.Tensor) -> None:
        """A prompt read in one pass (`prompt_search`): its search keys sk (B, H, T, d) into the index."""
        self.index.add(sk)
        self._pending.clear()


def selected_positions(idx: torch.Tensor, valid: torch.Tensor, n_prefix: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The plain cache's positions a step reads, (B, H, n_prefix + k): the sink's first, then the
    selected ones idx (B, H, k) shifted past it; and their validity."""
    pick = torch.cat([idx.new_zeros(*idx.shape[:2], n_prefix), idx + n_prefix], -1)
    ok = torch.cat([valid.new_ones(*valid.shape[:2], n_prefix), valid], -1)
    return pick, ok


def gather_selected(full: dict, value_key: str, pick: torch.Tensor, H: int):
    """The scalar keys (B, H, m), values (B, H, m, D) and vector keys (or None) at positions pick
    (B, H, m) of a plain cache's entries `full` (values and vector keys grouped, (B, G, n, D))."""
    def gather(x):  # (B, G, n[, D]) -> (B, H, m[, D]) per head
        x = expand_heads(x, H) if x.dim() == 4 else x
        return x.gather(2, pick[..., None].expand(-1, -1, -1, x.shape[-1])) if x.dim() == 4 else x.gather(2, pick)

    return gather(full["ks"]), gather(full[value_key]), gather(full["k"]) if "k" in full else None


def masked_readout(qs, ks, v, tau, q, k, ok, kernel: str, lam) -> torch.Tensor:
    """One query's readout (B, H, 1, D) over the slots it reads, the empty ones (ok False: a graph
    search that found fewer keys, Quest's partial pages) masked out: the scalar or hybrid score of
    `ops.scalar.scores` under `kernel` and the gain lam (H,) or None, whatever its sign."""
    from ..ops.scalar import hybrid_scores, scalar_scores

    H = qs.shape[1]
    tau = tau.view(1, H, 1) if tau.dim() == 1 else tau[..., :1]
    lam = None if lam is None else lam.view(1, H, 1)
    logits = (scalar_scores(qs, ks, tau, kernel, lam) if k is None
              else hybrid_scores(q, k, qs, ks, tau, kernel, lam))  # (B, H, 1, m)
    logits = logits.masked_fill(~ok[:, :, None], float("-inf"))
    return (torch.softmax(logits, -1) @ v.to(logits.dtype)).to(v.dtype)


def prompt_search(selector, T: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The search queries and keys (B, H, T, d) that `selector` observed for a prompt of T tokens,
    when one pass can read the prompt: an exact-index `KeySelector` holding no key yet, float32
    search keys. None otherwise (another index, half-precision keys, Quest): token by token."""
    if (not isinstance(selector, KeySelector) or selector.index.ntotal or selector.spec.index != "exact"
            or selector.spec.key_dtype != "float32" or len(selector._pending) != T):
        return None
    return torch.cat([q for q, _ in selector._pending], 2), torch.cat([k for _, k in selector._pending], 2)


def learned_select(sq: torch.Tensor, sk: torch.Tensor, K: int):
    """A `KeyRule` select over a prompt's search vectors sq, sk (B, H, T, d): each query reads the K
    causal keys its search query scores highest (`index.keep.learned_keep`, what stepping an exact
    index selects); the sink's position gets zero search vectors."""
    from ..index.keep import learned_keep
    from ..ops.common.precision import upcast

    @torch.no_grad()
    def select(qs, ks, tau, q, k, n_prefix):
        pad = (0, 0, n_prefix, 0)
        search = tuple(torch.nn.functional.pad(x.to(upcast(qs.dtype)), pad) for x in (sq, sk))
        return learned_keep(*search, K, n_prefix)

    return select


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
    def select(self, p, q=None, k=None, kernel: str = "gaussian", lam=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the step's keys to their page, bound every page's logits for its query (the bound of
        `eval.selectors.quest_page_bounds`, under the layer's kernel and gain lam (H,) or None), and
        return the keys of the best pages: positions (B, H, m) among the n tokens so far and their
        validity, at most K of them."""
        from ..index.pages import _dot_bound, _lam_rows, _quest_keep, scalar_range_bound
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

