"""Retrieve-then-attend inside a Hugging Face model.

In each substituted layer the model computes its native Q, K, V (and RoPE) as usual; a selector
picks K candidate keys per query, and exact attention runs over those candidates only, with the
model's own q, k, v and output projection. In decode mode the learned index grows by the new
tokens' search keys at every step (exact index or FAISS HNSW `add`).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

import torch

from attnlab.checks import check_choice, check_groups, check_int

from .capture import teacher_attention
from .hf_model import attention_modules, model_device
from .hooks import Installed
from .metrics import Tally, retrieval_stats
from ..index.ivf import IVFIndex
from ..index.projections import SearchProjections
from .quest import quest_select
from .retrieval import (PROJECTED, SELECTORS, ExactIndex, HNSWIndex, native_vectors, oracle_select,
                        streaming_select, topk_candidates)
from .sorted import SortedScalarIndex, split_budget
from .sparse import sparse_attention


@dataclass
class SelectorConfig:
    """How candidates are chosen: method and budget K, plus each method's own knobs.

    method: one of `retrieval.SELECTORS`: "learned" / "learned-hnsw" / "learned-ivf" (the trained
    projections, exact top-K, an HNSW graph or an IVF index), "native" / "native-hnsw" (the model's own post-RoPE q and k), "quest"
    (page bounds), "oracle" (top-K of the model's own attention), "streaming" (sinks + the most
    recent keys) or "sorted" (sinks, a ring of the `ring` most recent keys and the nearest others in
    a one-dimensional distance space, read from a sorted array: projections with d_search 1 and
    score "distance"; `sorted.py`). K: keys per query and candidate set; groups: candidate sets per token, each serving
    H / groups query heads (a learned method must match its projections). page: Quest's page size;
    n_sink: StreamingLLM's and the sorted selection's sinks; ring: the sorted selection's recent
    keys (None: K // 4); hnsw_*: the graph's M, efConstruction, efSearch and the block-start
    keys scored exactly beside it (also beside the IVF lists); hnsw_dtype "float16": the graph's
    vectors in half precision (`HNSWIndex(dtype=)`); ivf_*: the IVF index's lists, lists
    probed per query and keys held when the lists are learned (None: 16 per list). Bad values raise
    ValueError naming the field.
    """

    method: str = "learned"
    K: int = 256
    groups: int = 1  # candidate sets per token, each serving H / groups heads (learned: the projections' own)
    page: int = 16  # Quest page size
    n_sink: int = 4  # StreamingLLM and sorted sinks
    ring: int | None = None  # sorted: the most recent keys always read (None: K // 4)
    hnsw_m: int = 32
    hnsw_ef_construction: int = 64
    hnsw_ef_search: int = 512
    hnsw_pin: int = 4  # block-start keys scored exactly beside the graph search
    hnsw_dtype: str = "float32"  # or "float16": the graph's vectors in half precision
    ivf_nlist: int = 256
    ivf_nprobe: int = 16
    ivf_train_at: int | None = None

    def __post_init__(self):
        check_choice("method", self.method, SELECTORS)
        check_int("K", self.K)
        for name in ("groups", "page", "hnsw_m", "hnsw_ef_construction", "hnsw_ef_search"):
            check_int(name, getattr(self, name))
        for name in ("n_sink", "hnsw_pin"):
            check_int(name, getattr(self, name), 0)
        check_choice("hnsw_dtype", self.hnsw_dtype, ("float32", "float16"))
        if self.method == "sorted":
            split_budget(self.K, self.n_sink, self.ring)
        if self.method.endswith("-ivf"):
            IVFIndex.check_args(self.ivf_nlist, self.ivf_nprobe, self.ivf_train_at)


def selector_knobs(cfg) -> dict:
    """The SelectorConfig fields besides method, K and groups that `cfg` (a command's or a spec's
    configuration) spells by their SelectorConfig names (page, n_sink, ring, hnsw_ef_search, ivf_nlist,
    ...), with its values: what it passes to each SelectorConfig it makes (the others keep their defaults)."""
    return {f.name: getattr(cfg, f.name) for f in fields(SelectorConfig)
            if f.name not in ("method", "K", "groups") and hasattr(cfg, f.name)}


class PrefillGraphs:
    """The HNSW graphs built over one prefill's search keys, kept as built, so that every selector
    primed from that prefill (each budget K: K enters only the search) starts from a copy of one graph
    instead of building its own. A graph serves only bit-for-bit the same keys (float32, what
    `HNSWIndex.add` reads) under the same build settings (M, efConstruction, pinned keys, vector
    dtype); each priming gets its own copy, since decode steps add to it. One per `PrefixRecord`, so
    it lives as long as one prefill."""

    def __init__(self):
        self._built: dict[tuple, list[tuple[torch.Tensor, HNSWIndex]]] = {}

    def fill(self, layer: int, index: HNSWIndex, ks: torch.Tensor) -> HNSWIndex:
        """An index holding search keys ks (B, G, T, d) with the settings of `index` (empty): a copy of
        the graph already built over them, else `index` itself once filled (a copy of it kept)."""
        x = ks.detach().float().cpu().contiguous()
        key = (layer, index.M, index.ef_construction, index.pin, index.dtype)
        for keys, graph in self._built.get(key, ()):
            if keys.shape == x.shape and torch.equal(keys.view(torch.int32), x.view(torch.int32)):
                out = graph.copy()
                out.ef_search = index.ef_search  # read only at search time
                return out
        index.add(x)
        self._built.setdefault(key, []).append((x, index.copy()))
        return index


class RetrieveThenAttend:
    """The handler of one substituted layer (see hooks.Installed): selects K keys per query with
    `cfg`'s method and attends over them with the model's own q, k, v (`sparse_attention`).

    layer: the layer index; projections: needed by the learned methods (ValueError when missing, when
    the layer was not trained or when its groups differ from cfg.groups); tally: a `metrics.Tally`
    that also accumulates Recall@K and Mass@K against the full attention (costs the teacher). The
    learned and native methods keep a search index that grows with the sequence.
    """

    def __init__(self, layer: int, cfg: SelectorConfig, projections: SearchProjections | None = None,
                 tally: Tally | None = None):
        if cfg.method in PROJECTED:
            if projections is None:
                raise ValueError(f"method {cfg.method!r} needs trained search projections")
            if layer not in projections.layers:
                raise ValueError(f"no search projection for layer {layer}; trained layers are {projections.layers}")
            if projections.groups != cfg.groups:
                raise ValueError(f"groups={cfg.groups} but the projections were trained with groups={projections.groups}")
            if cfg.method == "sorted" and (projections.score, projections.d_search) != ("distance", 1):
                raise ValueError(f"method 'sorted' reads a one-dimensional distance space: projections with d_search=1 "
                                 f"and score='distance', got d_search={projections.d_search}, score={projections.score!r}")
        self.layer, self.cfg, self.proj, self.tally = layer, cfg, projections, tally
        self.index = None  # learned / native: made at the first forward (the native width comes from q)

    def _index(self, dim: int):
        cfg = self.cfg
        if self.index is None:
            self.index = (HNSWIndex(dim, cfg.hnsw_m, cfg.hnsw_ef_construction, cfg.hnsw_ef_search, cfg.hnsw_pin,
                                    getattr(torch, cfg.hnsw_dtype))
                          if cfg.method.endswith("-hnsw")
                          else IVFIndex(dim, cfg.ivf_nlist, cfg.ivf_nprobe, cfg.ivf_train_at, cfg.hnsw_pin)
                          if cfg.method.endswith("-ivf")
                          else SortedScalarIndex(cfg.n_sink, cfg.ring) if cfg.method == "sorted" else ExactIndex())
        return self.index

    def select(self, hidden, q, k, allowed, scaling, teacher=None):
        """teacher: the group teacher (B, G, Tq, Tk) when the caller already has it (oracle + tally)."""
        cfg = self.cfg
        if cfg.method == "oracle":
            if teacher is not None:
                return topk_candidates(teacher, allowed, cfg.K)  # = oracle_select, without a second teacher
            return oracle_select(q, k, allowed, scaling, cfg.K, cfg.groups)
        if cfg.method == "quest":
            return quest_select(q, k, allowed, scaling, cfg.K, cfg.page, cfg.groups)
        if cfg.method == "streaming":
            return streaming_select(allowed, cfg.K, cfg.n_sink, batch=q.shape[0])
        Tq, Tk = q.shape[2], k.shape[2]
        if cfg.method.startswith("native"):  # the model's own vectors of the Tq new positions
            qs, ks = native_vectors(q, k[:, :, Tk - Tq:], cfg.groups)
        elif cfg.method == "sorted":
            qs, ks = (x[..., 0] for x in self.proj.raw(self.layer, hidden))  # (B, G, Tq) scalars each
        else:
            qs, ks = self.proj(self.layer, hidden, start=Tk - Tq)  # (B, G, Tq, d_search) each, at positions Tk-Tq..
        index = self._index(qs.shape[-1])
        if Tk == Tq:  # a new sequence: start a fresh index
            index.reset()
        if index.ntotal != Tk - Tq:
            raise RuntimeError(
                f"layer {self.layer}: the search index holds {index.ntotal} keys but the KV cache had "
                f"{Tk - Tq}; install the substitution before the first forward of a sequence"
            )
        return index.grow_and_search(qs, ks, allowed, cfg.K)

    @torch.no_grad()
    def prime(self, hidden: torch.Tensor, k: torch.Tensor, n_heads: int, graphs: PrefillGraphs | None = None) -> None:
        """Start a sequence whose first T positions were read with full attention (a decode-time
        protocol: prefill exactly, select from the next forward on): a search index then holds
        those positions' search keys, and the next forward's queries select among them.

        hidden: the layer's input over the T positions (B, T, d_model); k: their post-RoPE keys
        (B, Hkv, T, D); n_heads: the layer's query heads; graphs: the prefill's built HNSW graphs,
        an HNSW index starts from a copy of the one over the same keys (None: always built here).
        Quest, StreamingLLM and the oracle read the KV cache itself and keep no index: nothing to
        do for them."""
        method = self.cfg.method
        if method == "sorted":
            ks = self.proj.raw(self.layer, hidden)[1][..., 0]  # (B, G, T)
        elif method.startswith("learned"):
            _, ks = self.proj(self.layer, hidden, start=0)  # (B, G, T, d_search)
        elif method.startswith("native"):
            _, ks = native_vectors(k.new_zeros(k.shape[0], n_heads, 0, k.shape[3]), k, self.cfg.groups)
        else:
            return
        index = self._index(ks.shape[-1])
        index.reset()
        if graphs is not None and type(index) is HNSWIndex:  # not IVFIndex, a subclass with other blocks
            self.index = graphs.fill(self.layer, index, ks)
            return
        index.add(ks)

    @torch.no_grad()
    def __call__(self, module, hidden, q, k, v, allowed, scaling):
        teacher = None
        if self.tally is not None:
            teacher = teacher_attention(q, k, allowed, scaling, groups=self.cfg.groups)  # (B, G, Tq, Tk)
        idx, valid = self.select(hidden, q, k, allowed, scaling, teacher)  # (B, G or 1, Tq, K)
        out = sparse_attention(q, k, v, idx, valid, scaling)  # (B, H, Tq, D)
        if self.tally is not None:
            self.tally.add_retrieval(self.layer, retrieval_stats(idx, valid, teacher, allowed, self.cfg.K))
        return out.transpose(1, 2)  # (B, Tq, H, D), what transformers' attention functions return


def substitute(model, layers, cfg: SelectorConfig, projections: SearchProjections | None = None,
               tally: Tally | None = None, layer_k: dict[int, int] | None = None) -> Installed:
    """Replace attention in `layers` by retrieve-then-attend; use as a context manager or call
    `.remove()`. `layer_k` gives chosen layers their own budget in place of cfg.K (a wider search for
    weak layers). Validates everything before touching the model.

    model: a transformers Llama/Qwen-family causal LM; layers: layer indices; cfg: the selector;
    projections: trained `SearchProjections` (learned methods); tally: a `metrics.Tally` that
    accumulates retrieval statistics of every forward. Returns the installed handlers (a context
    manager). Raises TypeError when cfg is not a SelectorConfig, ValueError for layers out of range,
    groups that do not divide the heads, projections of another width or layer_k naming a layer not
    substituted. The projections move to the model's device (in place), where the selectors run."""
    if not isinstance(cfg, SelectorConfig):
        raise TypeError(f"cfg must be a SelectorConfig, got {type(cfg).__name__}")
    check_layers(model, layers)
    check_groups(model.config.num_attention_heads, cfg.groups, "groups")
    if projections is not None and projections.d_model != model.config.hidden_size:
        raise ValueError(
            f"projections were trained for d_model={projections.d_model}, the model has {model.config.hidden_size}")
    layer_k = dict(layer_k or {})
    extra = sorted(set(layer_k) - set(layers))
    if extra:
        raise ValueError(f"layer_k names layers {extra} that are not substituted ({list(layers)})")
    for i, k in layer_k.items():
        check_int(f"layer_k[{i}]", k)
    if projections is not None:
        projections.to(model_device(model))
    handlers = {i: RetrieveThenAttend(i, replace(cfg, K=layer_k[i]) if i in layer_k else cfg, projections, tally)
                for i in layers}
    return Installed(model, handlers)


def check_layers(model, layers) -> None:
    """ValueError unless `layers` is a non-empty list of the model's attention layer indices."""
    n = len(attention_modules(model))
    bad = [i for i in layers if not (isinstance(i, int) and 0 <= i < n)]
    if bad or not layers:
        raise ValueError(f"layers must be a non-empty list of layer indices in 0..{n - 1}, got {list(layers)}")


@torch.no_grad()
def generate(model, input_ids: torch.Tensor, max_new_tokens: int, layers=None,
             cfg: SelectorConfig | None = None, projections: SearchProjections | None = None) -> torch.Tensor:
    """Greedy decoding with the KV cache; with `layers` given, those layers retrieve-then-attend and
    their indexes grow by one search key per generated token. Returns (B, T + max_new_tokens).

    input_ids: (B, T) int64; cfg: the selector (default: learned, K = 256, the projections' groups);
    projections: as for `substitute`. Raises ValueError as `substitute` does, and for
    max_new_tokens < 1. input_ids go to the model's device, and so does what is returned."""
    check_int("max_new_tokens", max_new_tokens)
    input_ids = input_ids.to(model_device(model))
    if layers is None:
        return _greedy(model, input_ids, max_new_tokens)
    if cfg is None:
        cfg = SelectorConfig(groups=projections.groups if projections is not None else 1)
    with substitute(model, layers, cfg, projections):
        return _greedy(model, input_ids, max_new_tokens)


def new_cache(model):
    """An empty transformers DynamicCache for `model`."""
    from transformers import DynamicCache

    try:
        return DynamicCache(config=model.config)
    except TypeError:  # older transformers: no config argument
        return DynamicCache()


def _greedy(model, input_ids, max_new_tokens):
    from attnlab.hf.modeling import CACHE_NAME

    cache = new_cache(model)
    out = model(input_ids=input_ids, use_cache=True, **{CACHE_NAME: cache})
    ids = input_ids
    for step in range(max_new_tokens):
        nxt = out.logits[:, -1:].argmax(-1)  # (B, 1)
        ids = torch.cat([ids, nxt], dim=1)
        if step + 1 < max_new_tokens:
            out = model(input_ids=nxt, use_cache=True, **{CACHE_NAME: getattr(out, CACHE_NAME)})
    return ids
