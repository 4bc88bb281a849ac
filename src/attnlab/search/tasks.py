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

What runs is planned first, without the weights (`task_plan`). The examples are generated on the
CPU; each goes to the model's device (`device`, weights in
`dtype`) as it is read, and the answers are scored there.
"""

from __future__ import annotations

import contextlib
import json
import time
from pathlib import Path

import torch
from tqdm.auto import tqdm

from attnlab import interrupt
from attnlab.data.cache import atomic_write_text
from attnlab.lock import FolderLock, check_free
from attnlab.data.synthetic import IGNORE

from .hf_model import load_model, model_device, resolve_device, resolve_dtype
from .lm import FrozenLM
from .patch import SelectorConfig, selector_knobs, substitute
from .prefill import prefilled_logits
from .report import FULL, task_key, tasks_markdown
from .task_plan import (DEFAULT_DEPTHS, DEFAULT_KS, DEFAULT_LENGTHS, DEFAULT_METHODS, PREFILLS,  # noqa: F401
                        TASK_METHODS, TASKS, TaskConfig, TaskPlan, needs_checkpoint, plan_tasks)


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
    sel = SelectorConfig(method, K, plan.groups, **selector_knobs(cfg))
    return substitute(model, plan.layers, sel, plan.projections if needs_checkpoint(method) else None)


def write_results(results: dict, cfg: TaskConfig, out: Path) -> None:
    """results.json and results.md, each through a temporary file and an atomic rename."""
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", json.dumps(results, indent=2))
    atomic_write_text(out / "results.md", tasks_markdown(results))
