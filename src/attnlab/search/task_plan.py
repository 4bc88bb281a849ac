"""What `attnlab search tasks` scores, checked and generated before any weights load: the config
(`TaskConfig`), the examples of every (task, length, depth) and what a resumed run must match
(`plan_tasks`, `TaskPlan`). `tasks` runs the plan."""

from __future__ import annotations

import hashlib
import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

from attnlab.checks import check_choice, check_int, check_int_list, check_name_list
from attnlab.data.synthetic import PASSKEY_QUESTION, passkey

from .capture import load_texts
from .hf_model import (ModelDims, ModelSource, check_layer_spec, hf_encode, load_hf_config, load_tokenizer, model_dims,
                       resolve_device, resolve_dtype, resolve_layers, resolve_source)
from .lm import FrozenLM
from .patch import SelectorConfig
from ..index.ivf import IVFIndex
from ..index.projections import SearchProjections
from .report import FULL, task_combos
from .retrieval import PROJECTED, SELECTORS, check_group_spec, resolve_groups

TASKS = ("passkey", "needle")
TASK_METHODS = (FULL, *SELECTORS)
DEFAULT_LENGTHS = (2048, 4096, 8192)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
DEFAULT_METHODS = (FULL, "learned", "quest", "streaming")
DEFAULT_KS = (64, 256)
PREFILLS = ("selected", "full")


def needs_checkpoint(method: str) -> bool:
    """Whether a method reads trained projections (the learned methods and `sorted`)."""
    return method in PROJECTED


@dataclass
class TaskConfig:
    """Which tasks, lengths, needle depths, methods and budgets K to score, on which model.

    checkpoint: trained search projections (needed by the learned methods only); model: a hub id,
    folder, .gguf file or 'smollm2' (default: the model the checkpoint was trained on). methods:
    'full' (no substitution) and names from retrieval.SELECTORS, each run at every K of `ks` in the
    layers of `layer_set`. groups: candidate sets per token for every method (default: the
    checkpoint's, else 1). corpus/split: the held-out text the needle task uses as haystack.
    prefill: "selected" (every position through the method) or "full" (the haystack exactly, the
    question and answer through the method; module docstring). device: where the model loads and
    the examples run ('auto': CUDA when available, else the CPU; 'cpu'; 'cuda'); dtype: the model's
    weights ('float32' or 'bfloat16'). A rerun on another device resumes the same results; another
    dtype is another configuration.
    """

    checkpoint: str | None = None
    model: str | None = None
    tasks: list[str] = field(default_factory=lambda: list(TASKS))
    lengths: list[int] = field(default_factory=lambda: list(DEFAULT_LENGTHS))
    depths: list[float] = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    n_examples: int = 4
    methods: list[str] = field(default_factory=lambda: list(DEFAULT_METHODS))
    ks: list[int] = field(default_factory=lambda: list(DEFAULT_KS))
    layer_set: str | list[int] = "middle6"
    groups: int | str | None = None
    corpus: str = "stdlib"
    split: str = "test"
    digits: int = 5  # digits of the pass key
    page: int = SelectorConfig.page  # Quest page size (the methods' knobs: SelectorConfig's defaults)
    n_sink: int = SelectorConfig.n_sink  # StreamingLLM and sorted sinks
    ring: int | None = SelectorConfig.ring  # sorted: the recent keys always read (None: K // 4)
    hnsw_ef_search: int = SelectorConfig.hnsw_ef_search
    ivf_nlist: int = SelectorConfig.ivf_nlist
    ivf_nprobe: int = SelectorConfig.ivf_nprobe
    seed: int = 0
    prefill: str = "selected"
    out: str = "runs/search-tasks"
    device: str = "auto"  # where the model loads and the examples run: auto (CUDA when available), cpu, cuda
    dtype: str = "float32"  # the model's weights: float32 or bfloat16

    def __post_init__(self):
        self.tasks = check_name_list("tasks", self.tasks, TASKS)
        self.lengths = check_int_list("lengths", self.lengths)
        if (not isinstance(self.depths, (list, tuple)) or not self.depths or len(set(self.depths)) != len(self.depths)
                or not all(isinstance(d, (int, float)) and not isinstance(d, bool) and 0.0 <= d <= 1.0
                           for d in self.depths)):
            raise ValueError(f"depths must be a non-empty list of distinct numbers in [0, 1], got {self.depths!r}")
        self.depths = [float(d) for d in self.depths]
        check_int("n_examples", self.n_examples)
        self.methods = check_name_list("methods", self.methods, TASK_METHODS)
        self.ks = check_int_list("ks", self.ks)
        check_layer_spec(self.layer_set)
        check_group_spec(self.groups, allow_none=True)
        for name in ("corpus", "split", "out"):
            if not isinstance(getattr(self, name), str) or not getattr(self, name):
                raise ValueError(f"{name} must be a non-empty string, got {getattr(self, name)!r}")
        for name in ("digits", "page", "hnsw_ef_search", "ivf_nlist", "ivf_nprobe"):
            check_int(name, getattr(self, name))
        check_int("n_sink", self.n_sink, 0)
        if self.ring is not None:
            check_int("ring", self.ring, 0)
        check_int("seed", self.seed, 0)
        IVFIndex.check_args(self.ivf_nlist, self.ivf_nprobe, None)
        check_choice("prefill", self.prefill, PREFILLS)
        resolve_device(self.device)
        resolve_dtype(self.dtype)
        if self.checkpoint is not None and (not isinstance(self.checkpoint, str) or not self.checkpoint):
            raise ValueError(f"checkpoint must be None or a path, got {self.checkpoint!r}")
        learned = [m for m in self.methods if needs_checkpoint(m)]
        if learned and not self.checkpoint:
            raise ValueError(f"checkpoint is needed by the methods {learned} (trained search projections)")
        if "sorted" in self.methods and len(learned) > 1:
            raise ValueError(f"methods {learned} read different projections (sorted: a one-dimensional distance "
                             "space; the learned methods: the dot-product one); run them with their own checkpoints")
        if self.checkpoint is None and self.model is None:
            raise ValueError("model must be given when there is no checkpoint to take it from")

    def combos(self) -> list[tuple[str, int | None]]:
        """(method, K) in run order: full attention (K None) first, then each method at each K."""
        return task_combos(self.methods, self.ks)


_DEFAULTS = {f.name: f.default for f in fields(TaskConfig) if f.default is not MISSING}


class _Tokenizer:
    """The `encode(str) -> list[int]` interface attnlab.data.passkey needs, over FrozenLM.encode.
    Long texts (the needle haystack) are encoded once and remembered."""

    def __init__(self, encode: Callable[[str], list[int]]):
        self._encode, self._memo = encode, {}

    def encode(self, text: str) -> list[int]:
        if len(text) < 4096:
            return list(self._encode(text))
        if text not in self._memo:
            self._memo[text] = list(self._encode(text))
        return self._memo[text]


@dataclass
class TaskPlan:
    """Everything checked and generated before any weights load: the model's shapes, the resolved
    layers and groups, the projections, and the (inputs, labels) of every (task, length, depth)."""

    name: str
    dims: ModelDims
    layers: list[int]
    groups: int
    projections: SearchProjections | None
    source: ModelSource | None  # None when a loaded FrozenLM was given
    header: dict  # what a resumed run must match (config without `out`, model, checkpoint digest)
    examples: dict = field(default_factory=dict)  # (task, length, depth) -> (inputs, labels) (N, length)
    question: int = 0  # tokens of the question that precedes each answer
    previous: list = field(default_factory=list)  # rows already in cfg.out


def _digest(path: str) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _rows_in(out: Path, header: dict) -> list:
    """The finished rows of an earlier run into `out`; refuses a folder holding another configuration."""
    path = out / "results.json"
    if not path.exists():
        return []
    try:
        old = json.loads(path.read_text())
        rows = old["rows"]
    except (ValueError, KeyError, TypeError) as e:
        raise ValueError(f"out={str(out)!r} holds a results.json that cannot be read ({e}); "
                         "remove it or choose another out") from None
    theirs = {k: old.get(k) for k in header}
    if isinstance(theirs.get("config"), dict):  # results written before a field existed ran with its default
        theirs["config"] = {**{k: v for k, v in _DEFAULTS.items() if k in header["config"]}, **theirs["config"]}
    if theirs != header:
        keys = sorted(set(header.get("config", {})) | set(theirs.get("config") or {}))
        diff = [k for k in keys if (theirs.get("config") or {}).get(k) != header["config"].get(k)]
        diff += [k for k in header if k != "config" and theirs.get(k) != header[k]]
        raise ValueError(f"out={str(out)!r} holds results of a different configuration (differs in: "
                         f"{', '.join(diff)}); choose another out to keep both, or remove it")
    return rows


def plan_tasks(cfg: TaskConfig, lm: FrozenLM | None = None) -> TaskPlan:
    """Validate `cfg` against the model config, checkpoint and `cfg.out`, then generate every
    example. Reads the model config and tokenizer only (never the weights), writes nothing."""
    if not isinstance(cfg, TaskConfig):
        raise TypeError(f"cfg must be a TaskConfig, got {type(cfg).__name__}")
    proj, meta = None, {}
    if cfg.checkpoint:
        try:
            proj, meta, _ = SearchProjections.load(cfg.checkpoint)
        except Exception as e:  # missing file, not safetensors, no projection metadata
            raise ValueError(f"checkpoint={cfg.checkpoint!r} cannot be read as search projections: {e}") from None
    learned = [m for m in cfg.methods if needs_checkpoint(m)]
    source = None
    if lm is not None:
        name, config, dims = lm.name, lm.model.config, lm.dims
    else:
        name = cfg.model or meta.get("meta", {}).get("model")
        if not name:
            raise ValueError(f"model is not given and the checkpoint {cfg.checkpoint!r} records none")
        source = resolve_source(name)
        config = load_hf_config(source)
        dims = model_dims(config)

    max_pos = getattr(config, "max_position_embeddings", None)
    if isinstance(max_pos, int) and max(cfg.lengths) > max_pos:
        raise ValueError(f"lengths: {max(cfg.lengths)} exceeds the model's max_position_embeddings={max_pos}")
    try:
        layers = resolve_layers(cfg.layer_set, dims.n_layers)
    except ValueError as e:
        raise ValueError(f"layer_set={cfg.layer_set!r}: {e}") from None
    want = cfg.groups if cfg.groups is not None else (proj.groups if proj is not None else 1)
    groups = resolve_groups(want, dims)
    if proj is not None and learned:
        if groups != proj.groups:
            raise ValueError(f"groups={cfg.groups!r} gives {groups} candidate sets, but the checkpoint's projections "
                             f"have groups={proj.groups}; the learned methods need the checkpoint's")
        missing = sorted(set(layers) - set(proj.layers))
        if missing:
            raise ValueError(f"layer_set={cfg.layer_set!r} needs projections for layers {missing}, but the checkpoint "
                             f"{cfg.checkpoint!r} has {proj.layers}")
        if proj.d_model != dims.d_model:
            raise ValueError(f"checkpoint {cfg.checkpoint!r} has d_model={proj.d_model}, the model {dims.d_model}")
        if "sorted" in cfg.methods and (proj.score, proj.d_search) != ("distance", 1):
            raise ValueError(f"checkpoint {cfg.checkpoint!r} holds projections with d_search={proj.d_search} and "
                             f"score={proj.score!r}; the sorted method needs d_search=1 and score='distance'")

    conf = asdict(cfg)
    conf.pop("out")
    conf.pop("device")  # where the cells run does not change what they score
    header = json.loads(json.dumps({"config": conf, "model": name,
                                    "checkpoint_sha256": _digest(cfg.checkpoint) if cfg.checkpoint else None}))
    previous = _rows_in(Path(cfg.out), header)

    tok = _Tokenizer(lm.encode if lm is not None else hf_encode(load_tokenizer(source)))
    plan = TaskPlan(name, dims, layers, groups, proj if learned else None, source, header, previous=previous,
                    question=len(tok.encode(PASSKEY_QUESTION)))
    for task in cfg.tasks:
        filler = None
        if task == "needle":
            filler = "\n\n".join(load_texts(cfg.corpus, cfg.split))
            n_tok = len(tok.encode(filler)) if filler.strip() else 0
            if n_tok < max(cfg.lengths):
                raise ValueError(f"corpus={cfg.corpus!r} split={cfg.split!r} gives {n_tok} tokens of haystack, "
                                 f"fewer than the longest of lengths ({max(cfg.lengths)}); the needle task would "
                                 "repeat it")
        for length in cfg.lengths:
            for depth in cfg.depths:
                try:
                    plan.examples[task, length, depth] = passkey(tok, length, depth, cfg.n_examples, seed=cfg.seed,
                                                                 digits=cfg.digits, filler=filler)
                except ValueError as e:
                    raise ValueError(f"lengths: {e}") from None
    return plan
