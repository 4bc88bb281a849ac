"""`attnlab sweep SPEC.toml`: validate the spec and every run config, then train and report."""

from __future__ import annotations

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
                    "  attnlab sweep SPEC.toml --launcher slurm --slurm-partition gpu --slurm-gpus-per-job 1\n\n"
                    "A killed sweep resumes where it stopped when run again: finished runs are skipped, an\n"
                    "interrupted run resumes from its checkpoint. Every run config is loaded and checked before\n"
                    "anything is trained or written. The spec format is in experiments/README.md.\n\n"
                    "--launcher runs each unfinished run as a submitit job (SLURM, or local subprocesses); jobs that\n"
                    "die or time out are resubmitted and resume from their checkpoints (docs/guide/experiments.md: Sweeps on a cluster).",
        epilog="The verdict rule: a difference in the [verdict] metric counts only when it exceeds twice the combined\n"
               "sd over seeds, 2*sqrt(sd_a^2 + sd_b^2); then the claim is supported (or not supported when the other\n"
               "variant is better), else inconclusive. A threshold rule ([[verdict]] with variant and threshold)\n"
               "needs the mean beyond the number by more than twice its sd. A compare rule with `by` needs the gain\n"
               "to exceed `by` plus the margin; `times` scales the second variant's mean and sd first.",
    )
    p.add_argument("spec", metavar="SPEC.toml", help="the sweep spec")
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
    from attnlab.experiments.launch import add_launcher_options

    add_launcher_options(p)
    p.set_defaults(func=cmd_sweep)


def cmd_sweep(ns) -> int:
    from attnlab.experiments import sweep as sw
    from attnlab.experiments.launch import JobFailed, launcher_from_options
    from attnlab.experiments.sweep.runner import select_runs
    from attnlab.train.trainer import DataError

    positive_options(ns, "jobs")
    launcher = launcher_from_options(ns)  # ConfigError names the option
    if not Path(ns.spec).is_file():
        raise UsageError(f"spec file {ns.spec!r} does not exist")
    spec = sw.load_spec(ns.spec)  # ConfigError names the spec key
    out = Path(ns.out) if ns.out else spec.out
    # local jobs share this machine: single-threaded unless run.threads says otherwise (as --jobs N > 1)
    jobs = ns.jobs or 1 if launcher is None else (1 if launcher.kind == "slurm" or ns.jobs == 1 else 2)
    try:
        plans = sw.plan(spec, out, jobs=jobs)  # every (variant, seed) config loaded and checked
        if ns.report_only:
            sw.write_results(spec, out, command=ns.command_line, quiet=False, report_only=True)
            return 0
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
               launcher=launcher, only=only)
    except (DataError, sw.SweepError) as e:
        raise UsageError(str(e)) from None
    except JobFailed as e:  # a job's own error, in its log under OUT/submitit
        print(f"error: {e}", file=sys.stderr)
        return 1
    return 0
