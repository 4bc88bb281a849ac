"""The spec of a decoding comparison on one pretrained model, read and checked before any work.

    title = "..."                       # and claim, description
    model = "smollm2"                   # 'smollm2', a model folder or a .gguf file
    layer_set = "all"                   # the layers every selector substitutes (presses compress all)
    groups = "kv"                       # candidate sets per token: one per KV head
    lengths = [2048, 4096, 8192]        # context lengths, in tokens
    budgets = [64, 128, 256, 512]       # keys read per decode step per KV head (a press keeps as many)
    [tasks]      tasks, depths, n_examples, seed, digits, corpus, split    (attnlab.data.passkey)
    [perplexity] n_contexts, continuation, corpus, split, seed
    [timing]     prompts, steps, device
    [attnlab]    methods, page, n_sink, ring, hnsw_ef_search                (SelectorConfig)
    [presses]    methods                                                     (attnlab.search.presses.PRESSES)
    [train.<method>]  SearchTrainConfig fields of the projections a method reads ("learned", "sorted")
    [[rules]]    the verdicts, fixed before any run (`verdict.py`)

`settings` is a digest of everything a record depends on (all but the title, claim, description and
rules): records written under other settings are not this spec's and are refused.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from attnlab.experiments.sweep.spec import runs_root
from attnlab.experiments.trial import need, read_spec, table
from attnlab.models.config import ConfigError
from attnlab.search.patch import SelectorConfig
from attnlab.search.presses import PRESSES
from attnlab.search.retrieval import SELECTORS
from attnlab.search.task_plan import TASKS
from attnlab.search.train import SearchTrainConfig

from .verdict import check_rule

KEYS = ("title", "claim", "description", "model", "dtype", "layer_set", "groups", "lengths", "budgets", "tasks",
        "perplexity", "timing", "attnlab", "presses", "train", "rules")
TRAINED = ("learned", "sorted")  # the projections a method reads: learned* -> "learned", sorted -> "sorted"


@dataclass
class Tasks:
    tasks: list = field(default_factory=lambda: list(TASKS))
    depths: list = field(default_factory=lambda: [0.1, 0.5, 0.9])
    n_examples: int = 50
    seed: int = 0
    digits: int = 5
    corpus: str = "stdlib"
    split: str = "test"


@dataclass
class Perplexity:
    n_contexts: int = 8
    continuation: int = 32
    corpus: str = "stdlib-tests"
    split: str = "test"
    seed: int = 0


@dataclass
class Timing:
    prompts: int = 1  # timed prompts per length
    steps: int = 16  # single-token decode steps timed per method and round
    rounds: int = 3  # rounds over the methods, the order rotated each round
    device: str = "cpu"


@dataclass
class Selectors:
    methods: list = field(default_factory=lambda: ["full", "learned", "learned-hnsw", "quest", "streaming", "sorted"])
    page: int = SelectorConfig.page  # SelectorConfig's fields and defaults
    n_sink: int = SelectorConfig.n_sink
    ring: int | None = SelectorConfig.ring
    hnsw_ef_search: int = SelectorConfig.hnsw_ef_search


@dataclass
class Presses:
    methods: list = field(default_factory=lambda: list(PRESSES))


@dataclass
class Spec:
    path: Path
    title: str
    claim: str
    description: str
    model: str
    dtype: str
    layer_set: str
    groups: int | str
    lengths: list[int]
    budgets: list[int]
    tasks: Tasks
    perplexity: Perplexity
    timing: Timing
    attnlab: Selectors
    presses: Presses
    train: dict  # method -> SearchTrainConfig (its `out` under runs/)
    rules: list[dict]

    @property
    def folder(self) -> Path:
        return self.path.parent

    def settings(self) -> str:
        """The digest of what the records depend on."""
        body = {k: getattr(self, k) for k in ("model", "dtype", "layer_set", "groups", "lengths", "budgets")}
        for k in ("tasks", "perplexity", "timing", "attnlab", "presses"):
            body[k] = asdict(getattr(self, k))
        body["train"] = {m: {k: v for k, v in asdict(c).items() if k not in ("out", "device", "resume")}
                         for m, c in self.train.items()}
        return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()[:12]

    def trained_for(self, method: str) -> str | None:
        """The [train] table a method's projections come from (None: it reads none)."""
        return trained_for(method)


def trained_for(method: str) -> str | None:
    """The [train] table a method's projections come from (None: it reads none)."""
    return "sorted" if method == "sorted" else "learned" if method.startswith("learned") else None


def _section(cls, raw, key: str):
    raw = table(raw, f"[{key}]")
    names = {f.name for f in fields(cls)}
    unknown = sorted(set(raw) - names)
    need(not unknown, f"[{key}]: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(sorted(names))}")
    return cls(**raw)


def _ints(raw, key: str) -> list[int]:
    need(isinstance(raw, list) and raw and len(set(raw)) == len(raw)
         and all(isinstance(x, int) and not isinstance(x, bool) and x > 0 for x in raw),
         f"{key} must be a list of distinct positive integers, got {raw!r}")
    return sorted(raw)


def load_spec(path) -> Spec:
    """The spec at `path`, every key checked (ConfigError naming it) before anything runs."""
    head = read_spec(path, KEYS)  # the file, its keys, title, claim and description
    path, raw = head.path, head.raw
    lengths, budgets = _ints(raw.get("lengths"), "lengths"), _ints(raw.get("budgets"), "budgets")
    need(budgets[-1] < lengths[0], f"every budget must be below the shortest length {lengths[0]}, got {budgets}")
    tasks = _section(Tasks, raw.get("tasks", {}), "tasks")
    bad = [t for t in tasks.tasks if t not in TASKS]
    need(tasks.tasks and not bad, f"[tasks] tasks must be a subset of {TASKS}, got {tasks.tasks!r}")
    need(isinstance(tasks.n_examples, int) and tasks.n_examples > 0, "[tasks] n_examples must be a positive int")
    ppl = _section(Perplexity, raw.get("perplexity", {}), "perplexity")
    timing = _section(Timing, raw.get("timing", {}), "timing")
    sel = _section(Selectors, raw.get("attnlab", {}), "attnlab")
    bad = [m for m in sel.methods if m != "full" and m not in SELECTORS]
    need(sel.methods and not bad, f"[attnlab] methods must be 'full' or in {SELECTORS}, got {bad}")
    press = _section(Presses, raw.get("presses", {}), "presses")
    bad = [m for m in press.methods if m not in PRESSES]
    need(not bad, f"[presses] methods must be in {tuple(PRESSES)}, got {bad}")
    train_raw = table(raw.get("train", {}), "[train]")
    train = {}
    for m in sel.methods:
        which = trained_for(m)
        if which is None or which in train:
            continue
        need(which in train_raw, f"method {m!r} reads projections: the spec needs a [train.{which}] table")
        conf = dict(table(train_raw[which], f"[train.{which}]"))
        need("out" not in conf, f"[train.{which}] out is set by the runner (runs/{which} beside the spec, or "
                                "under $ATTNLAB_RUNS as a sweep's run folders)")
        try:
            train[which] = SearchTrainConfig(**{**conf, "model": raw.get("model", "smollm2"),
                                                "out": str(runs_root(path.parent) / which)})
        except (TypeError, ValueError) as e:
            raise ConfigError(f"[train.{which}]: {e}") from None
    if "sorted" in train:
        t = train["sorted"]
        need((t.d_search, t.score, t.rope) == (1, "distance", False),
             "[train.sorted] must set d_search = 1, score = 'distance', rope = false (a one-dimensional distance space)")
    rules = raw.get("rules", [])
    need(isinstance(rules, list) and all(isinstance(r, dict) for r in rules), "rules must be an array of tables")
    names = set(sel.methods) | set(press.methods)
    for i, r in enumerate(rules):
        check_rule(r, names, f"rules[{i}]")
    return Spec(path, head.title, head.claim, head.description, raw.get("model", "smollm2"),
                raw.get("dtype", "float32"), raw.get("layer_set", "all"), raw.get("groups", "kv"), lengths, budgets,
                tasks, ppl, timing, sel, press, train, rules)
