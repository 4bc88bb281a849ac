"""Long-context retrieval tasks for retrieve-then-attend: passkey and needle-in-a-haystack.

Both tasks hide "The pass key is K" at a chosen depth of a long haystack and end with the question
"What is the pass key? The pass key is" (see `attnlab.data.passkey`). `passkey` fills the haystack
with one fixed sentence repeated; `needle` fills it with held-out corpus text, so the needle does not
stand out as the only non-repeating span. The frozen model reads each example once (teacher forcing):
an example counts as solved when the argmax at every answer position is the answer token.

Every cell (task, length, depth, method, K) scores the same examples: the keys are drawn from
`seed` alone, so cells differ only in where the needle sits and how much haystack surrounds it.
Full attention runs first; a method can only be judged on the cells full attention solves.
Results are rewritten atomically after every cell, and a rerun with the same configuration skips
the cells already there.

`prefill` sets what the selector reads: "selected" (every query of the example, haystack included,
attends through the method) or "full" (the haystack is read once with full attention into the KV
cache, and only the question and answer positions attend through the method: the protocol of a
decoder that prefills exactly and retrieves at each step, as Quest and RetrievalAttention are
evaluated). Under "full" one exact prefill per example serves every method: its selectors are
primed from it (`prefill.record_prefix`).

The examples are generated on the CPU; each goes to the model's device (`device`, weights in
`dtype`) as it is read, and the answers are scored there.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import time
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

import torch
from tqdm.auto import tqdm

from attnlab.checks import check_choice, check_int, check_int_list, check_name_list
from attnlab import interrupt
from attnlab.data.cache import atomic_write_text
from attnlab.lock import FolderLock, check_free
from attnlab.data.synthetic import IGNORE, PASSKEY_QUESTION, passkey

from .capture import load_texts
from .hf_model import (ModelDims, ModelSource, check_layer_spec, hf_encode, load_hf_config, load_model,
                       load_tokenizer, model_device, model_dims, resolve_device, resolve_dtype, resolve_layers,
                       resolve_source)
from .lm import FrozenLM
from ..index.ivf import IVFIndex
from .patch import SelectorConfig, substitute
from .prefill import prefilled_logits
from ..index.projections import SearchProjections
from .report import FULL, task_combos, task_key, tasks_markdown
from .retrieval import METHODS, check_group_spec, resolve_groups

TASKS = ("passkey", "needle")
TASK_METHODS = (FULL, *METHODS)
DEFAULT_LENGTHS = (2048, 4096, 8192)
DEFAULT_DEPTHS = (0.1, 0.5, 0.9)
DEFAULT_METHODS = (FULL, "learned", "quest", "streaming")
DEFAULT_KS = (64, 256)
PREFILLS = ("selected", "full")


def _needs_checkpoint(method: str) -> bool:
    return method.startswith("learned")


@dataclass
class TaskConfig:
    """Which tasks, lengths, needle depths, methods and budgets K to score, on which model.

    checkpoint: trained search projections (needed by the learned methods only); model: a hub id,
    folder, .gguf file or 'smollm2' (default: the model the checkpoint was trained on). methods:
    'full' (no substitution) and names from retrieval.METHODS, each run at every K of `ks` in the
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
    page: int = 16  # Quest page size
    n_sink: int = 4  # StreamingLLM sinks
    hnsw_ef_search: int = 512
    ivf_nlist: int = 256
    ivf_nprobe: int = 16
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
        check_int("seed", self.seed, 0)
        IVFIndex.check_args(self.ivf_nlist, self.ivf_nprobe, None)
        check_choice("prefill", self.prefill, PREFILLS)
        resolve_device(self.device)
        resolve_dtype(self.dtype)
        if self.checkpoint is not None and (not isinstance(self.checkpoint, str) or not self.checkpoint):
            raise ValueError(f"checkpoint must be None or a path, got {self.checkpoint!r}")
        learned = [m for m in self.methods if _needs_checkpoint(m)]
        if learned and not self.checkpoint:
            raise ValueError(f"checkpoint is needed by the methods {learned} (trained search projections)")
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
    learned = [m for m in cfg.methods if _needs_checkpoint(m)]
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


@torch.no_grad()
def answer_logits(model, input_ids: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One teacher-forced forward of `input_ids` (B, T); returns the logits (B, n, V) and labels
    (B, n) of the last n positions, from the first labelled one on. Only those n positions go
    through the output head (`logits_to_keep`), which keeps an 8K-token forward from holding a
    (T, vocab) logit matrix. input_ids go to the model's device; the labels stay where they are."""
    marked = (labels != IGNORE).any(0).nonzero()
    if marked.numel() == 0:
        raise ValueError("labels mark no answer position")
    first = int(marked[0, 0])
    keep = input_ids.shape[1] - first
    logits = model(input_ids=input_ids.to(model_device(model)), use_cache=False,
                   logits_to_keep=keep).logits  # (B, n, V)
    return logits, labels[:, first:]


def score(logits: torch.Tensor, labels: torch.Tensor) -> tuple[int, int, int]:
    """(examples with every answer token right, answer tokens right, answer tokens) of logits
    (B, n, V) against labels (B, n) (IGNORE where nothing is asked), on the logits' device."""
    labels = labels.to(logits.device)
    asked = labels != IGNORE
    hit = (logits.argmax(-1) == labels) & asked
    solved = (hit | ~asked).all(-1) & asked.any(-1)
    return int(solved.sum()), int(hit.sum()), int(asked.sum())


def run_tasks(cfg: TaskConfig, lm: FrozenLM | None = None, progress: bool = True, plan: TaskPlan | None = None) -> dict:
    """Score every (task, length, depth, method, K) cell on cfg.n_examples examples, one forward per
    example at batch 1; write results.json and results.md under cfg.out after each cell.

    Everything that can be checked without the weights is checked first (`plan_tasks`); the weights
    load only when some cell is still to run, on cfg.device in cfg.dtype (a given `lm` stays where it
    is). `plan`: what plan_tasks(cfg, lm) returned, when the
    caller has already planned (the CLI does, to report bad input as a usage error). Returns the
    results dict (config, model, layers, groups, device, rows of {task, length, depth, method, K,
    accuracy, token_accuracy, n, ...})."""
    plan = plan_tasks(cfg, lm) if plan is None else plan
    out = Path(cfg.out)
    rows = list(plan.previous)
    done = {task_key(r) for r in rows}
    todo = [(m, K, t, L, d) for m, K in cfg.combos() for t in cfg.tasks for L in cfg.lengths for d in cfg.depths
            if (t, L, d, m, K) not in done]
    results = {**plan.header, "out": str(out), "layers": plan.layers, "groups": plan.groups, "rows": rows}
    if not todo:
        results["complete"] = True
        return results
    check_free(out)
    model = lm.model if lm is not None else load_model(plan.source, resolve_dtype(cfg.dtype),
                                                        resolve_device(cfg.device))
    if plan.projections is not None:
        plan.projections.to(model_device(model))  # loaded on the CPU; the learned selectors run beside the model
    results["device"] = str(model_device(model))
    with FolderLock(out), interrupt.graceful():
        return _run_cells(cfg, plan, model, todo, results, rows, progress)


def _run_cells(cfg: TaskConfig, plan: TaskPlan, model, todo: list, results: dict, rows: list, progress: bool) -> dict:
    out = Path(cfg.out)
    if cfg.prefill == "full":
        todo_cells = list(dict.fromkeys((t, L, d) for *_, t, L, d in todo))  # run order, each once
        bar = tqdm(total=sum(L for _, L, _ in todo_cells) * cfg.n_examples, desc="search tasks", unit="tok",
                   unit_scale=True, disable=not progress)
        _run_prefilled(cfg, plan, model, todo, todo_cells, results, rows, bar)
        bar.close()
        results["complete"] = True
        write_results(results, cfg, out)
        return results
    bar = tqdm(total=sum(L for *_, L, _ in todo) * cfg.n_examples, desc="search tasks", unit="tok", unit_scale=True,
               disable=not progress)
    t0 = time.time()
    for method, K in cfg.combos():
        cells = [(t, L, d) for m, k, t, L, d in todo if (m, k) == (method, K)]
        if not cells:
            continue
        for task, length, depth in cells:
            inputs, labels = plan.examples[task, length, depth]
            solved = hit = asked = 0
            t1 = time.time()
            with _attention(model, method, K, plan, cfg):
                for i in range(inputs.shape[0]):  # batch 1: memory stays that of one sequence
                    s, h, a = score(*answer_logits(model, inputs[i:i + 1], labels[i:i + 1]))
                    solved, hit, asked = solved + s, hit + h, asked + a
                    bar.update(length)
            rows.append({"task": task, "length": length, "depth": depth, "method": method, "K": K,
                         "accuracy": solved / inputs.shape[0], "token_accuracy": hit / asked, "n": inputs.shape[0],
                         "answer_tokens": asked, "seconds": round(time.time() - t1, 3)})
            results["elapsed_s"] = round(time.time() - t0, 3)
            write_results(results, cfg, out)
            interrupt.check(lambda: f"{out} stopped after {len(rows)} cells, written to results.json; the rerun "
                                    f"scores the rest")
    bar.close()
    results["complete"] = True
    write_results(results, cfg, out)
    return results


def _run_prefilled(cfg: TaskConfig, plan: TaskPlan, model, todo: list, todo_cells: list, results: dict, rows: list,
                   bar) -> None:
    """prefill="full": per example one exact prefill of everything before the question; each method
    still to run on the cell reads the question and answer through its selector (`prefill.prefilled_logits`)."""
    out, t0, todo = Path(cfg.out), time.time(), set(todo)
    for task, length, depth in todo_cells:
        combos = [(m, K) for m, K in cfg.combos() if (m, K, task, length, depth) in todo]
        inputs, labels = plan.examples[task, length, depth]
        counts = {c: [0, 0, 0, 0.0] for c in combos}  # solved, hit, asked, seconds
        prefill_s = 0.0
        for i in range(inputs.shape[0]):  # batch 1: memory stays that of one sequence
            y = labels[i:i + 1]
            first = int((y[0] != IGNORE).nonzero()[0, 0])  # the last question token: it predicts the answer
            got, secs = prefilled_logits(model, plan.layers, inputs[i:i + 1], first + 1 - plan.question, length - first,
                                         [(c, lambda c=c: _attention(model, *c, plan, cfg)) for c in combos])
            prefill_s += secs
            for combo, (logits, t) in got.items():
                c, (s, h, a) = counts[combo], score(logits, y[:, first:])
                c[0], c[1], c[2], c[3] = c[0] + s, c[1] + h, c[2] + a, c[3] + t
            bar.update(length)
        for (method, K), (solved, hit, asked, secs) in counts.items():
            rows.append({"task": task, "length": length, "depth": depth, "method": method, "K": K,
                         "accuracy": solved / inputs.shape[0], "token_accuracy": hit / asked, "n": inputs.shape[0],
                         "answer_tokens": asked, "seconds": round(secs, 3), "prefill_seconds": round(prefill_s, 3)})
        results["elapsed_s"] = round(time.time() - t0, 3)
        write_results(results, cfg, out)
        interrupt.check(lambda: f"{out} stopped after {len(rows)} cells, written to results.json; the rerun "
                                f"scores the rest")


def _attention(model, method: str, K: int | None, plan: TaskPlan, cfg: TaskConfig):
    """The context a cell runs in: nothing for full attention, else the substitution of plan.layers."""
    if method == FULL:
        return contextlib.nullcontext()
    sel = SelectorConfig(method, K, plan.groups, cfg.page, cfg.n_sink, hnsw_ef_search=cfg.hnsw_ef_search,
                         ivf_nlist=cfg.ivf_nlist, ivf_nprobe=cfg.ivf_nprobe)
    return substitute(model, plan.layers, sel, plan.projections if _needs_checkpoint(method) else None)


def write_results(results: dict, cfg: TaskConfig, out: Path) -> None:
    """results.json and results.md, each through a temporary file and an atomic rename."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", json.dumps(results, indent=2))
    atomic_write_text(out / "results.md", tasks_markdown(results))
