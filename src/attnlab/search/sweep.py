"""Evaluation sweep: methods x K x layer sets on held-out packed contexts.

For every configuration the substituted model's perplexity is compared with full attention on the
same contexts, and Recall@K / Mass@K are measured against each substituted layer's own teacher
(the head-averaged softmax of its native q.k in that forward). Results are written after every
configuration, so an interrupted sweep keeps what it finished. The contexts stay on the CPU and go
to the model's device one at a time; the projections move there too.
"""

from __future__ import annotations

import hashlib
import contextlib
import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm.auto import tqdm

from attnlab.checks import check_int
from attnlab.data.cache import atomic_write_text
from attnlab import interrupt
from attnlab.lock import FolderLock, check_free

from .capture import forward_packed, on_device
from .hf_model import model_device, resolve_device, resolve_dtype
from .lm import FrozenLM, prepare
from .metrics import Tally, rel_gap
from .patch import SelectorConfig, selector_knobs, substitute
from ..index.projections import SearchProjections
from .report import write_results
from ..index.ivf import IVFIndex
from .retrieval import METHODS, check_group_spec, resolve_groups

DEFAULT_KS = (16, 32, 64, 128, 256)
DEFAULT_LAYER_SETS = ("middle6", "all", "reserved-edge")


@dataclass
class EvalConfig:
    """What `run_eval` (`attnlab search eval`) measures; each field is a command-line option.

    checkpoint: trained projections (needed by the learned methods); model: default the checkpoint's.
    Every method of `methods` runs in every layer set of `layer_sets` at every K of `ks`, on
    n_contexts held-out contexts of `context` tokens from corpus/split (drawn with `seed`); groups:
    candidate sets per token (default the checkpoint's, else 1). page, n_sink, hnsw_m,
    hnsw_ef_search, ivf_nlist, ivf_nprobe: the methods' knobs (`SelectorConfig`); wide_layers / wide_factor: a layer set
    whose layers retrieve wide_factor × K keys. Results go to `out`. device: where the frozen model
    loads and the evaluation runs ('auto': CUDA when available, else the CPU; 'cpu'; 'cuda'; the
    FAISS indexes of the -hnsw / -ivf methods stay on the CPU); dtype: the frozen model's weights
    ('float32' or 'bfloat16'). Raises ValueError for methods not in METHODS, an empty layer_sets, a
    learned method without checkpoint, neither checkpoint nor model, or a device or dtype it cannot
    use ('cuda' without a CUDA device).
    """

    checkpoint: str | None = None  # trained projections; needed by the learned methods
    model: str | None = None  # default: the model the checkpoint was trained on
    layer_sets: list = field(default_factory=lambda: list(DEFAULT_LAYER_SETS))
    ks: list = field(default_factory=lambda: list(DEFAULT_KS))
    groups: int | str | None = None  # candidate sets per token for every method; default: the checkpoint's (or 1)
    methods: list = field(default_factory=lambda: list(METHODS))
    corpus: str = "stdlib"
    split: str = "test"
    context: int = 2048
    n_contexts: int = 4
    seed: int = 0
    page: int = SelectorConfig.page  # the methods' knobs, SelectorConfig's defaults
    n_sink: int = SelectorConfig.n_sink
    hnsw_m: int = SelectorConfig.hnsw_m
    hnsw_ef_search: int = SelectorConfig.hnsw_ef_search
    ivf_nlist: int = SelectorConfig.ivf_nlist
    ivf_nprobe: int = SelectorConfig.ivf_nprobe
    wide_layers: str | None = None  # a layer set whose substituted layers search wide_factor x K keys
    wide_factor: int = 1
    out: str = "runs/search-eval"
    device: str = "auto"  # where the frozen model loads and the evaluation runs: auto (CUDA when available), cpu, cuda
    dtype: str = "float32"  # the frozen model's weights: float32 or bfloat16

    def __post_init__(self):
        self.ks = [check_int("K", k) for k in self.ks]
        check_int("wide_factor", self.wide_factor)
        if self.wide_factor > 1 and not self.wide_layers:
            raise ValueError(f"wide_factor={self.wide_factor} needs wide_layers (which layers search wider)")
        check_group_spec(self.groups, allow_none=True)
        IVFIndex.check_args(self.ivf_nlist, self.ivf_nprobe, None)
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise ValueError(f"methods must be a non-empty subset of {METHODS}, got {self.methods!r}")
        if not self.layer_sets:
            raise ValueError("layer_sets must name at least one layer set")
        if any(m.startswith("learned") for m in self.methods) and not self.checkpoint:
            raise ValueError("the learned methods need --checkpoint (trained search projections)")
        if self.checkpoint is None and self.model is None:
            raise ValueError("model must be given when there is no checkpoint to take it from")
        resolve_device(self.device)
        resolve_dtype(self.dtype)


def _full_key(lm: FrozenLM, packed) -> str:
    """What full attention's numbers depend on: the model's weights and name, and the exact tokens."""
    h = hashlib.sha256(json.dumps({"name": lm.name, "dims": asdict(lm.dims)}, sort_keys=True).encode())
    with torch.no_grad():
        h.update(repr([float(p.double().sum()) for p in lm.model.parameters()]).encode())
    for t in (packed.input_ids, packed.segments):
        h.update(t.contiguous().numpy().tobytes())
    return h.hexdigest()[:24]


def full_baseline(lm: FrozenLM, packed, cache_dir=None, bar=None) -> dict:
    """Full attention's perplexity on the packed contexts; with `cache_dir`, read from or written to
    a file named by `_full_key`, so the runs of a trial that share contexts compute it once."""
    path = Path(cache_dir) / f"full-{_full_key(lm, packed)}.json" if cache_dir is not None else None
    if path is not None and path.is_file():
        if bar is not None:
            bar.update(len(packed))
        return json.loads(path.read_text())
    full = Tally()
    device = model_device(lm.model)
    for i in range(len(packed)):
        b = on_device(packed.batch(i), device)
        full.add_nll(forward_packed(lm.model, b), b.input_ids, b.segments)
        if bar is not None:
            bar.update()
    summary = full.summary()
    if path is not None:
        atomic_write_text(path, json.dumps(summary) + "\n")
    return summary


def run_eval(cfg: EvalConfig, lm: FrozenLM | None = None, progress: bool = True, full_cache=None) -> dict:
    """Run the evaluation; returns the results dict (also written as results.json, results.md and
    gap_vs_k.png under cfg.out): full attention's perplexity, and per (layer set, method, K) the
    perplexity, its relative gap in %, Recall@K, Mass@K and the filler rate. lm: an already loaded
    `FrozenLM` (default: load the model on cfg.device in cfg.dtype; a given one stays where it is and
    the evaluation follows it).
    full_cache: a folder where full attention's perplexity is kept per (model, contexts).
    cfg.out is locked while it is written (FolderBusy if another process writes it); SIGINT/SIGTERM
    stop it after the current (method, K), with the rows so far written."""
    check_free(cfg.out)
    with contextlib.ExitStack() as stack:
        return _run_eval(cfg, lm, progress, full_cache, stack)


def _run_eval(cfg: EvalConfig, lm: FrozenLM | None, progress: bool, full_cache, stack: contextlib.ExitStack) -> dict:
    proj, meta = None, {}
    if cfg.checkpoint:
        proj, meta, _ = SearchProjections.load(cfg.checkpoint)
    model_spec = cfg.model or meta.get("meta", {}).get("model")
    learned = [m for m in cfg.methods if m.startswith("learned")]

    resolved = {}

    def check(sets, dims):
        want = cfg.groups if cfg.groups is not None else (proj.groups if proj is not None else 1)
        resolved["groups"] = resolve_groups(want, dims)
        if proj is None or not learned:
            return
        if resolved["groups"] != proj.groups:
            raise ValueError(f"groups={cfg.groups!r} but the checkpoint's projections have groups={proj.groups}; "
                             "the learned methods use the checkpoint's")
        for spec, layers in zip(cfg.layer_sets, sets):
            missing = sorted(set(layers) - set(proj.layers))
            if missing:
                raise ValueError(f"layer set {spec!r} needs projections for layers {missing}, but the checkpoint "
                                 f"has {proj.layers}; train with --layers all or drop that set")

    specs = list(cfg.layer_sets) + ([cfg.wide_layers] if cfg.wide_layers else [])
    lm, sets, packed = prepare(model_spec, specs, cfg.corpus, cfg.split, cfg.context, cfg.n_contexts,
                               cfg.seed, lm=lm, check=check, device=resolve_device(cfg.device),
                               dtype=resolve_dtype(cfg.dtype))
    device = model_device(lm.model)
    wide = set(sets.pop()) if cfg.wide_layers else set()
    if proj is not None and proj.d_model != lm.dims.d_model:
        raise ValueError(f"checkpoint d_model={proj.d_model} does not match the model's {lm.dims.d_model}")
    if proj is not None:
        proj.to(device)  # loaded on the CPU; the learned selectors run beside the model
    out = Path(cfg.out)
    stack.enter_context(FolderLock(out))
    stack.enter_context(interrupt.graceful())
    n_cfg = len(sets) * len(cfg.methods) * len(cfg.ks)
    bar = tqdm(total=len(packed) * (1 + n_cfg), desc="search eval", disable=not progress)
    results = {"config": asdict(cfg), "groups": resolved["groups"], "model": lm.name, "dims": asdict(lm.dims),
               "device": str(device), "layer_sets": {}, "rows": []}
    t0 = time.time()
    with torch.no_grad():
        results["full"] = full_baseline(lm, packed, full_cache, bar)
        for spec, layers in zip(cfg.layer_sets, sets):
            results["layer_sets"][spec] = layers
            for method in cfg.methods:
                for K in cfg.ks:
                    sel = SelectorConfig(method, K, resolved["groups"], **selector_knobs(cfg))
                    tally = Tally()
                    t1 = time.time()
                    layer_k = {l: K * cfg.wide_factor for l in layers if l in wide}
                    for i in range(len(packed)):
                        b = on_device(packed.batch(i), device)
                        with substitute(lm.model, layers, sel, proj, tally, layer_k):
                            tally.add_nll(forward_packed(lm.model, b), b.input_ids, b.segments)
                        bar.update()
                    s = tally.summary()
                    results["rows"].append({"layer_set": spec, "n_layers": len(layers), "method": method, "K": K,
                                            "wide_layers": sorted(layer_k), "wide_K": K * cfg.wide_factor,
                                            **s, "rel_gap": rel_gap(s["ppl"], results["full"]["ppl"]),
                                            "seconds": time.time() - t1})
                    results["elapsed_s"] = time.time() - t0
                    write_results(results, out, png=False)  # partial results survive an interruption
                    interrupt.check(lambda: f"{out} stopped after {len(results['rows'])} of {n_cfg}"
                                  f" evaluations, written to results.json; the rerun evaluates them all")
    bar.close()
    results["elapsed_s"] = time.time() - t0
    write_results(results, out)
    return results
