"""`attnlab sweep SPEC.toml`: validate the spec and every run config, then train and report."""

from __future__ import annotations

import contextlib
import sys
from pathlib import Path

from ._common import Formatter, UsageError, check_model_builds, positive_options


def add_sweep(sub) -> None:
    p = sub.add_parser(
        "sweep", help="train variants x seeds from a TOML spec; one report with mean ± sd over seeds and a verdict",
        formatter_class=Formatter,
        description="Train every (variant, seed) of a sweep spec, then write results.json, report.md and plots\n"
                    "(loss curves with a band over seeds, per-run metrics as bars with error bars) into the output\n"
                    "folder (default: the spec's folder). Run folders: OUT/runs/<variant>/seed<k>.\n\n"
                    "  attnlab sweep experiments/seed000/exp1-hybrid-baseline/spec.toml --jobs 2\n"
                    "  attnlab sweep experiments/seed000/exp1-hybrid-baseline/spec.toml --report-only\n"
                    "  attnlab sweep SPEC.toml --launcher slurm --slurm-partition gpu --slurm-gpus-per-job 1\n"
                    "  attnlab sweep SPEC.toml --only softmax/seed0,hybrid/seed0 --records RECORDS/   # one piece\n"
                    "  attnlab sweep SPEC.toml --merge RECORDS/ MORE-RECORDS/    # fold pieces into results.json\n"
                    "  attnlab sweep SPEC.toml ... --plan --jobs 2               # what is left, and how long\n\n"
                    "A killed sweep resumes where it stopped when run again: finished runs are skipped, an\n"
                    "interrupted run resumes from its checkpoint. Every run config is loaded and checked before\n"
                    "anything is trained or written. The spec format is in experiments/README.md.\n\n"
                    "--launcher runs each unfinished run as a submitit job (SLURM, or local subprocesses); jobs that\n"
                    "die or time out are resubmitted and resume from their checkpoints (docs/guide/experiments.md: Sweeps on a cluster).\n\n"
                    "A sweep in pieces (a GPU lent for minutes at a time; docs/guide/experiments.md): --only trains some runs,\n"
                    "--records writes each finished run's record (metrics, loss curves, machine; no checkpoints) into one\n"
                    "small file as it finishes, and --merge folds such files into results.json and rebuilds the report.",
        epilog="The verdict rule: a difference in the [verdict] metric counts only when it exceeds twice the combined\n"
               "sd over seeds, 2*sqrt(sd_a^2 + sd_b^2); then the claim is supported (or not supported when the other\n"
               "variant is better), else inconclusive. A threshold rule ([[verdict]] with variant and threshold)\n"
               "needs the mean beyond the number by more than twice its sd. A compare rule with `by` needs the gain\n"
               "to exceed `by` plus the margin; `times` scales the second variant's mean and sd first.",
    )
    p.add_argument("spec", metavar="SPEC.toml", nargs="+", help="the sweep spec; several make one queue: every "
                   "unfinished run of each, in order, --jobs at once, each report written when its sweep is done")
    p.add_argument("--runs", metavar="DIR", help="keep the run folders (checkpoints, logs) under DIR instead of "
                   "OUT/runs, so they outlive the checkout: DIR/<OUT inside the repository>/runs/<variant>/seed<k> "
                   "(default: $ATTNLAB_RUNS, else OUT/runs)")
    p.add_argument("--jobs", type=int, metavar="N",
                   help="runs trained at once, in worker processes; each single-threaded unless the spec sets "
                        "run.threads (default: 1, in this process); with --launcher, jobs queued or running at "
                        "once (default: all)")
    p.add_argument("--report-only", action="store_true", help="rebuild results.json, report.md and plots from the "
                   "finished runs without training")
    p.add_argument("--out", metavar="DIR", help="output folder (default: the spec's `out`, else the spec's folder)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.add_argument("--only", metavar="RUNS", help="train only these runs, comma-separated variant/seedK names (one "
                   "piece of a sweep run in pieces, e.g. a batch for a GPU machine); results.json then holds them "
                   "beside the runs it recorded before")
    p.add_argument("--records", metavar="DIR", help="after each run finishes, write the records of the finished "
                   "runs (those --only names, else all) into DIR/<spec>-<hash>.records.json: everything results.json "
                   "and the report need, no checkpoints; `--merge DIR` folds them in elsewhere")
    p.add_argument("--merge", metavar="PATH", nargs="+", help="train nothing: fold the records files written by "
                   "--records (files, or folders holding them) into OUT/results.json and rebuild the report; "
                   "refuses records of another spec and a run recorded twice differently")
    p.add_argument("--plan", action="store_true", help="train and write nothing: each run's state (recorded, "
                   "done, in --records DIR, to resume at step N, new), its tokens per parameter, the budget rule's "
                   "outcome, and the training time left at the speed the sweep's own runs measured")
    p.add_argument("--replace", action="store_true", help="with --merge: a merged record replaces a different "
                   "record of the same run in results.json (default: refuse)")
    from attnlab.experiments.launch import add_launcher_options

    add_launcher_options(p)
    p.set_defaults(func=cmd_sweep)


def cmd_sweep(ns) -> int:
    from attnlab.experiments.launch import launcher_from_options

    positive_options(ns, "jobs")
    _check_piece_options(ns)
    launcher = launcher_from_options(ns)  # ConfigError names the option
    for path in ns.spec:
        if not Path(path).is_file():
            raise UsageError(f"spec file {path!r} does not exist")
    if ns.runs:
        if Path(ns.runs).exists() and not Path(ns.runs).is_dir():
            raise UsageError(f"--runs {ns.runs!r} is a file, not a folder")
        ns.command_line = _without_runs(ns.command_line)  # where the run folders live reproduces nothing
    with _runs_folder(ns.runs):
        if ns.plan:
            return _plan(ns, launcher)
        return _sweep(ns, launcher)


def _plan(ns, launcher) -> int:
    """`--plan`: every spec planned as a sweep or queue would plan it, printed; nothing trained or written."""
    from attnlab.experiments import sweep as sw
    from attnlab.experiments.sweep.status import fill_from_others, plan_text, sweep_plan, total_text

    clash = [o for o, given in (("--only", ns.only), ("--report-only", ns.report_only), ("--merge", ns.merge),
                                ("--launcher", launcher)) if given]
    if clash:
        raise UsageError(f"--plan trains nothing and prints what is left: drop {clash[0]}")
    if ns.out and len(ns.spec) > 1:
        raise UsageError(f"--out takes one spec; a queue of {len(ns.spec)} specs trains each into its own folder")
    jobs = ns.jobs or 1
    try:
        specs = [sw.load_spec(path) for path in ns.spec]
        plans = fill_from_others([sweep_plan(s, Path(ns.out) if ns.out else s.out, jobs=jobs, records=ns.records)
                                  for s in specs])
    except sw.SweepError as e:
        raise UsageError(str(e)) from None
    for p in plans:
        print(plan_text(p))
    print(total_text(plans, jobs))
    return 0


@contextlib.contextmanager
def _runs_folder(runs: str | None):
    """$ATTNLAB_RUNS = --runs for this command (the worker processes inherit it), as it was afterwards: a
    second command in the same process (a notebook, a test) finds its run folders where it would alone."""
    import os

    from attnlab.experiments.sweep.spec import RUNS_ENV

    if not runs:
        yield
        return
    before = os.environ.get(RUNS_ENV)
    os.environ[RUNS_ENV] = str(Path(runs).resolve())
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(RUNS_ENV, None)
        else:
            os.environ[RUNS_ENV] = before


def _sweep(ns, launcher) -> int:
    from attnlab.experiments import sweep as sw
    from attnlab.experiments.launch import JobFailed
    from attnlab.experiments.sweep.records import check_target
    from attnlab.experiments.sweep.runner import select_runs
    from attnlab.train.trainer import DataError

    if len(ns.spec) > 1:
        return _queue(ns, launcher)
    spec = sw.load_spec(ns.spec[0])  # ConfigError names the spec key
    out = Path(ns.out) if ns.out else spec.out
    # local jobs share this machine: single-threaded unless run.threads says otherwise (as --jobs N > 1)
    jobs = ns.jobs or 1 if launcher is None else (1 if launcher.kind == "slurm" or ns.jobs == 1 else 2)
    try:
        plans = sw.plan(spec, out, jobs=jobs)  # every (variant, seed) config loaded and checked
        if ns.report_only:
            sw.write_results(spec, out, command=ns.command_line, quiet=False, report_only=True)
            return 0
        if ns.merge:
            return _merge(spec, out, ns, plans)
        if ns.records:
            check_target(spec, ns.records)  # a foreign or damaged records file there: refused before training
    except sw.SweepError as e:
        raise UsageError(str(e)) from None
    for p in plans:
        check_model_builds(p.cfg, f"variant {p.variant!r}, seed {p.seed}: ")
        if launcher is None and p.cfg.run.nproc > 1:
            raise UsageError(f"variant {p.variant!r}, seed {p.seed}: run.nproc={p.cfg.run.nproc} starts torchrun "
                             f"inside a job: it needs --launcher local|slurm")
    if any(p.cfg.run.device == "cuda" for p in plans) and (launcher is None or launcher.kind == "local"):
        import torch

        if not torch.cuda.is_available():
            raise UsageError("run.device is 'cuda' but no CUDA device is available; allowed here: 'auto', 'cpu'")
    try:
        only = [n.strip() for n in ns.only.split(",") if n.strip()] if ns.only else None
        if only is not None:
            select_runs(plans, only)  # names checked before anything is trained or written
        sw.run(spec, out=out, jobs=jobs, progress=not ns.no_progress, command=ns.command_line, plans=plans,
               launcher=launcher, only=only, records=ns.records)
    except (DataError, sw.SweepError) as e:
        raise UsageError(str(e)) from None
    except JobFailed as e:  # a job's own error, in its log under OUT/submitit
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0


def _without_runs(command: str) -> str:
    import shlex

    words, out = shlex.split(command), []
    skip = False
    for w in words:
        if skip:
            skip = False
        elif w == "--runs":
            skip = True
        elif not w.startswith("--runs="):
            out.append(w)
    return shlex.join(out)


def _queue(ns, launcher) -> int:
    """Several specs: one queue of their unfinished runs (`sweep.run_queue`)."""
    from attnlab.experiments import sweep as sw
    from attnlab.experiments.sweep.runner import run_queue
    from attnlab.train.trainer import DataError

    clash = [o for o, given in (("--out", ns.out), ("--only", ns.only), ("--report-only", ns.report_only),
                                ("--merge", ns.merge), ("--launcher", launcher)) if given]
    if clash:
        raise UsageError(f"{clash[0]} takes one spec; a queue of {len(ns.spec)} specs trains each into its own folder")
    specs = [sw.load_spec(path) for path in ns.spec]
    try:
        for spec in specs:
            for p in sw.plan(spec, spec.out, jobs=ns.jobs or 1):
                check_model_builds(p.cfg, f"{spec.path}: variant {p.variant!r}, seed {p.seed}: ")
        run_queue(specs, jobs=ns.jobs or 1, progress=not ns.no_progress, records=ns.records)
    except (DataError, sw.SweepError) as e:
        raise UsageError(str(e)) from None
    return 0


def _check_piece_options(ns) -> None:
    """--records and --merge with the options they go with, before anything is read or written."""
    if ns.merge:
        clash = [o for o, given in (("--only", ns.only), ("--records", ns.records), ("--report-only", ns.report_only),
                                    ("--jobs", ns.jobs), ("--launcher", getattr(ns, "launcher", None))) if given]
        if clash:
            raise UsageError(f"--merge trains nothing: drop {clash[0]} (train a piece with --only RUNS --records DIR, "
                             f"merge its DIR afterwards)")
    elif ns.replace:
        raise UsageError("--replace says which record wins in a merge: it needs --merge")
    if ns.records and ns.report_only:
        raise UsageError("--records with --report-only: a report trains nothing, so there is nothing to record")


def _merge(spec, out: Path, ns, plans) -> int:
    """`--merge PATH...`: check every records file, then write results.json and the report once."""
    from attnlab.experiments.sweep.records import merge
    from attnlab.experiments.sweep.results import write_results

    runs, notes = merge(spec, ns.merge, out, replace=ns.replace, plans=plans)  # SweepError: nothing written
    for note in notes:
        print(f"merge: {note}")
    print(f"merge: {len(runs)} run(s) from the records ({', '.join(f'{v}/seed{s}' for v, s in runs) or 'none new'})",
          flush=True)
    write_results(spec, out, command=ns.command_line, quiet=False, records=runs)
    return 0
