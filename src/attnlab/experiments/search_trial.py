"""`attnlab search trial SPEC.toml`: a learned-search experiment over training seeds, with a verdict.

A trial spec names shared `[train]` settings (SearchTrainConfig fields) and `[eval]` settings
(EvalConfig fields), variants that override either, and seeds. Every (variant, seed) trains its
projections (`train_projections`, which resumes) into OUT/runs/<variant>/seed<k> and evaluates
them (variants whose training settings are identical train once, in the first one's folder, and
differ only in how they are evaluated) on the same held-out contexts (the eval seed is fixed; the training seed draws the training
contexts and the initial projections). The learned methods are evaluated in every run; the
methods that do not depend on the projections (oracle, quest, native, streaming) only in each
variant's first seed, and their numbers are repeated for the others (their sd over training seeds
is 0 by construction). The report gives mean ± sd over seeds per (variant, method, K) of the
perplexity gap (%), Mass@K and Recall@K, and the spec's `[[verdict]]` rules, judged as in
`attnlab sweep` on metrics named "<method>/gap@<K>", "<method>/mass@<K>", "<method>/recall@<K>".
Where the runs go is the configs' `device` and `dtype` (in `[train]` / `[eval]` like any field, or
for every run from `attnlab search trial --device / --dtype`); a finished evaluation counts as
finished on any device, while another dtype is another evaluation.

    title = "..."
    claim = "..."
    seeds = [0, 1, 2]
    [train]
    layers = "15"
    context = 2048
    [eval]
    layer_sets = ["15"]
    ks = [64]
    methods = ["learned"]
    [[variants]]
    name = "all-rows"
    [[variants]]
    name = "256-rows"
    train = { query_rows = 256 }
    [[verdict]]
    metric = "learned/mass@64"
    better = "higher"
    compare = ["256-rows", "all-rows"]
"""

from __future__ import annotations

import json
from dataclasses import MISSING, asdict, dataclass, field, fields
from pathlib import Path
from typing import Callable

from attnlab import interrupt
from attnlab.lock import FolderLock, check_free
from attnlab.experiments.report import markdown_table, report_head
from attnlab.experiments.sweep.verdict import check_rules, judge, verdict_lines
from attnlab.experiments.trial import (Trial as _Trial, keep_recorded, pm, read_spec, recorded_results, section,
                                      seed_stats, table as _table, variant_name, write_outputs)

from ..search.coverage import check_references, coverage_markdown, layer_masses, mean_masses, plot_coverage
from ..search.lm import FrozenLM
from ..search.retrieval import METHODS
from ..search.sweep import EvalConfig, run_eval
from ..search.train import CHECKPOINT, SearchTrainConfig, train_projections

SPEC_KEYS = ("title", "claim", "description", "seeds", "train", "eval", "variants", "verdict", "references", "out")
STATS = ("gap", "mass", "recall")
OWNED = {"train": ("seed", "out", "resume"), "eval": ("checkpoint", "out")}


@dataclass
class TrialRun:
    variant: str
    seed: int
    folder: Path
    train: SearchTrainConfig
    eval: EvalConfig


@dataclass
class Trial(_Trial):
    references: list[dict] = field(default_factory=list)  # published points drawn beside a coverage frontier


def _config(cls, shared: dict, own: dict, where: str, **owned):
    name = "train" if cls is SearchTrainConfig else "eval"
    return section(cls, name, shared, own, where, OWNED[name], **owned)


def metric_names(ev: EvalConfig) -> list[str]:
    """The metrics a run reports: '<method>/<stat>@<K>', prefixed by '<layer set>:' when there are several."""
    prefixes = [f"{spec}:" for spec in ev.layer_sets] if len(ev.layer_sets) > 1 else [""]
    return [f"{p}{m}/{s}@{K}" for p in prefixes for m in ev.methods for K in ev.ks for s in STATS]


def load_trial(path, device: str | None = None, dtype: str | None = None) -> Trial:
    """Read and check the spec and build every run's configs; raises ConfigError naming the key.
    device, dtype: set for every run's training and evaluation in place of the spec's (None: the spec's)."""
    given = {k: v for k, v in (("device", device), ("dtype", dtype)) if v is not None}
    head = read_spec(path, SPEC_KEYS)
    raw, seeds, out = head.raw, head.seeds, head.out
    train, ev = _table(raw.get("train", {}), "train"), _table(raw.get("eval", {}), "eval")
    runs, names, trained = [], [], {}
    for i, v in enumerate(head.variants):
        name = variant_name(v, i, names, {"train", "eval"})
        for seed in seeds:
            folder = out / "runs" / name / f"seed{seed}"
            where = f"variant {name!r}, seed {seed}"
            tc = _config(SearchTrainConfig, train, _table(v.get("train", {}), f"variants[{i}].train"), where,
                         seed=seed, out=str(folder), **given)
            key = json.dumps({**asdict(tc), "out": None}, sort_keys=True, default=str)
            tc.out = trained.setdefault(key, tc.out)  # variants that differ only in [eval] share one training
            own = _table(v.get("eval", {}), f"variants[{i}].eval")
            methods = {**ev, **own}.get("methods", METHODS)
            learned = any(str(m).startswith("learned") for m in methods)
            ec = _config(EvalConfig, ev, own, where, out=str(folder / "eval"), **given,
                         **({"checkpoint": str(Path(tc.out) / CHECKPOINT)} if learned else
                            {"checkpoint": None, "model": {**ev, **own}.get("model") or tc.model}))
            runs.append(TrialRun(name, seed, folder, tc, ec))
    metrics = sorted({m for r in runs for m in metric_names(r.eval)})
    rules = check_rules(raw["verdict"], names, metrics) if "verdict" in raw else []
    return Trial(head.path, head.title, head.claim, head.description, seeds, names, runs, rules, out,
                 check_references(raw.get("references", [])))


def _eval_config(run: TrialRun, first: bool) -> EvalConfig:
    """The run's evaluation: every method in a variant's first seed, else the learned ones only."""
    if first:
        return run.eval
    learned = [m for m in run.eval.methods if m.startswith("learned")]
    return EvalConfig(**{**asdict(run.eval), "methods": learned}) if learned else None


def _finished(cfg: EvalConfig) -> dict | None:
    try:
        res = json.loads((Path(cfg.out) / "results.json").read_text())
    except (OSError, ValueError):
        return None
    want = json.loads(json.dumps(asdict(cfg)))
    # results written before a field existed ran with that field's default
    have = {**{f.name: f.default for f in fields(EvalConfig) if f.default is not MISSING}, **res.get("config", {})}
    want.pop("device")  # where an evaluation ran does not change what it measured
    have.pop("device", None)
    n = len(cfg.layer_sets) * len(cfg.methods) * len(cfg.ks)
    return res if have == want and len(res.get("rows", [])) == n and "full" in res else None


def run_trial(trial: Trial, lm: FrozenLM | None = None, progress: bool = True, report_only: bool = False,
              launch: Callable[[list, Path], object] | None = None) -> dict:
    """Train and evaluate every run that is not finished, then write OUT/results.json and report.md.
    OUT is locked meanwhile; SIGINT/SIGTERM stop it after the current step (training) or evaluation,
    and the same command resumes. `launch(work, folder)`: run `trial_jobs(trial)` as cluster jobs
    instead (attnlab.experiments.launch, which `attnlab search trial --launcher` passes in)."""
    check_free(trial.out)
    with FolderLock(trial.out), interrupt.graceful():
        if launch is not None and not report_only:
            work = trial_jobs(trial)
            if work:
                launch(work, trial.out / "submitit")
        else:
            for tc, ev in _todo(trial, report_only):
                _train_and_evaluate(tc, ev, trial.out, lm, progress)
        return write_report(trial)


def _todo(trial: Trial, report_only: bool = False) -> list[tuple[SearchTrainConfig, EvalConfig]]:
    """(training, evaluation) of every run whose evaluation is not finished."""
    seen, todo = set(), []
    for run in trial.runs:
        first = run.variant not in seen
        seen.add(run.variant)
        cfg = _eval_config(run, first)
        if not (report_only or cfg is None or _finished(cfg) is not None):
            todo.append((run.train, cfg))
    return todo


def _train_and_evaluate(tc: SearchTrainConfig, ev: EvalConfig, out: Path, lm: FrozenLM | None, progress: bool) -> None:
    if ev.checkpoint:
        train_projections(tc, lm=lm, progress=progress)
    run_eval(ev, lm=lm, progress=progress, full_cache=out / "runs" / "full")


class TrialJob:
    """The unfinished runs of a trial that share one training, as one cluster job: train (or resume) the
    projections, then evaluate each. Running it again resumes (training from its checkpoint; finished
    evaluations are skipped), so submitit's `checkpoint()` (time limit, preemption) hands back the same job."""

    def __init__(self, items: list[tuple[SearchTrainConfig, EvalConfig]], out: str):
        self.items, self.out = items, out

    def __call__(self) -> int:
        with interrupt.graceful():
            for tc, ev in self.items:
                if _finished(ev) is None:
                    _train_and_evaluate(tc, ev, Path(self.out), None, False)
        return len(self.items)

    def checkpoint(self, *args, **kwargs):
        import submitit

        return submitit.helpers.DelayedSubmission(TrialJob(self.items, self.out))


def trial_jobs(trial: Trial) -> list[tuple[str, TrialJob]]:
    """One (name, job) per training folder with unfinished runs (runs sharing a training share a job)."""
    groups: dict[str, list] = {}
    for tc, ev in _todo(trial):
        groups.setdefault(tc.out, []).append((tc, ev))
    return [(Path(folder).relative_to(trial.out).as_posix() if Path(folder).is_relative_to(trial.out) else folder,
             TrialJob(items, str(trial.out))) for folder, items in groups.items()]


def _row_metrics(res: dict, n_sets: int) -> dict:
    out = {}
    for r in res["rows"]:
        prefix = r["method"] if n_sets == 1 else f"{r['layer_set']}:{r['method']}"
        out.update({f"{prefix}/gap@{r['K']}": 100 * r["rel_gap"], f"{prefix}/mass@{r['K']}": r.get("mass"),
                    f"{prefix}/recall@{r['K']}": r.get("recall")})
    return out


def collect(trial: Trial) -> dict:
    """Per variant: each finished seed's metrics, and their mean and sd over those seeds."""
    out = {}
    for v in trial.variants:
        runs = [r for r in trial.runs if r.variant == v]
        done, shared, sizes, per_layer = {}, {}, {}, []
        for i, run in enumerate(runs):
            cfg = _eval_config(run, i == 0)
            res = _finished(cfg) if cfg is not None else None
            if res is None:
                continue
            sizes = {"n_layers": res["dims"]["n_layers"],
                     "sets": {k: len(v) for k, v in res["layer_sets"].items()}}
            per_layer.append(layer_masses(res))
            vals = _row_metrics(res, len(run.eval.layer_sets))
            if i == 0:  # the projection-free methods, evaluated here only
                shared = {k: x for k, x in vals.items() if not k.split("/")[0].split(":")[-1].startswith("learned")}
            done[run.seed] = {**shared, **vals}
        out[v] = seed_stats(done)
        if len(runs[0].eval.layer_sets) > 1 and sizes:
            out[v]["coverage"] = {**sizes, "per_layer_mass": mean_masses(per_layer)}
    return out


WHERE = ("out", "checkpoint", "device", "resume")  # where a run lives and ran: not what it measured


def _same_config(recorded, current) -> bool:
    """A recorded config (a results.json entry) is the current one: the recorded fields, with the fields
    added since at their defaults, equal the current config's, but for the folders and the device."""
    try:
        filled = asdict(type(current)(**recorded))
    except (TypeError, ValueError):
        return False
    measured = lambda d: json.loads(json.dumps({k: x for k, x in d.items() if k not in WHERE}, default=str))  # noqa: E731
    return measured(filled) == measured(asdict(current))


def write_report(trial: Trial) -> dict:
    """Write OUT/results.json and report.md from the finished runs (and, for variants whose run
    folders are absent, the committed results measured with the same configs: `keep_recorded`)."""
    stats = collect(trial)
    last = {r.variant: r for r in trial.runs}
    old = recorded_results(trial.out)
    keep_recorded(stats, old, {v: [r.seed for r in trial.runs if r.variant == v] for v in trial.variants},
                  lambda v: all(isinstance((old.get(k) or {}).get(v), dict)
                                and _same_config(old[k][v], getattr(last[v], k)) for k in ("train", "eval")))
    judged = [judge(r, stats) for r in trial.rules]
    results = {"title": trial.title, "claim": trial.claim, "spec": str(trial.path), "variants": stats,
               "verdicts": judged, "train": {r.variant: asdict(r.train) for r in trial.runs},
               "eval": {r.variant: asdict(r.eval) for r in trial.runs}}
    write_outputs(trial.out, results, report_markdown(trial, stats, judged))
    if any("coverage" in s for s in stats.values()):
        plot_coverage(stats, trial.references, trial.out / "coverage.png")
    return results


def report_markdown(trial: Trial, stats: dict, judged: list[dict]) -> str:
    first = {r.variant: r for r in reversed(trial.runs)}
    lines = report_head(trial.title, "attnlab search trial", trial.path.name, trial.claim, trial.description)
    lines += ["## Setup", ""]
    for v in trial.variants:
        r = first[v]
        t, e = r.train, r.eval
        lines.append(f"- **{v}**: projections for layers {t.layers} of {t.model}, groups {t.groups}, trained {t.steps} "
                     f"steps on {t.n_contexts} contexts of {t.context} tokens ({t.split} split), k_pos {t.k_pos}, "
                     f"query rows {t.query_rows or 'all'}; evaluated on {e.n_contexts} held-out contexts of "
                     f"{e.context} tokens ({e.split} split), layer sets {e.layer_sets}, methods {e.methods}, "
                     f"K {e.ks}; seeds {stats[v]['seeds']}.")
    lines += ["", "## Results: mean ± sd over training seeds", "",
              "gap: perplexity gap against full attention in %; Mass@K and Recall@K against each layer's own "
              "attention. Methods that do not use the projections are evaluated once per variant (sd 0).", ""]
    rows = []
    for v in trial.variants:
        m, s = stats[v]["mean"], stats[v]["sd"]
        keys = sorted({k.rsplit("/", 1)[0] + "@" + k.rsplit("@", 1)[1] for k in m},
                      key=lambda k: (k.split("@")[0], int(k.split("@")[1])))
        for key in keys:
            method, K = key.split("@")
            row = [v, method, int(K), len(stats[v]["seeds"])]
            row += [pm(m.get(f"{method}/{st}@{K}"), s.get(f"{method}/{st}@{K}")) for st in STATS]
            rows.append(row)
    lines += [markdown_table(["variant", "method", "K", "seeds", "gap (%)", "Mass@K", "Recall@K"], rows), ""]
    lines += coverage_markdown(stats, trial.references, "coverage.png")
    lines += verdict_lines(trial.rules, judged)
    return "\n".join(lines).rstrip() + "\n"
