"""`attnlab sweep SPEC.toml`: validate the spec and every run config, then train and report."""

from __future__ import annotations

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
                    "  attnlab sweep experiments/seed000/exp1-hybrid-baseline/spec.toml --report-only\n\n"
                    "A killed sweep resumes where it stopped when run again: finished runs are skipped, an\n"
                    "interrupted run resumes from its checkpoint. Every run config is loaded and checked before\n"
                    "anything is trained or written. The spec format is in experiments/README.md.",
        epilog="The verdict rule: a difference in the [verdict] metric counts only when it exceeds twice the combined\n"
               "sd over seeds, 2*sqrt(sd_a^2 + sd_b^2); then the claim is supported (or not supported when the other\n"
               "variant is better), else inconclusive. A threshold rule ([[verdict]] with variant and threshold)\n"
               "needs the mean beyond the number by more than twice its sd. A compare rule with `by` needs the gain\n"
               "to exceed `by` plus the margin; `times` scales the second variant's mean and sd first.",
    )
    p.add_argument("spec", metavar="SPEC.toml", help="the sweep spec")
    p.add_argument("--jobs", type=int, default=1, metavar="N",
                   help="runs trained at once, in worker processes; each single-threaded unless the spec sets "
                        "run.threads (default: 1, in this process)")
    p.add_argument("--report-only", action="store_true", help="rebuild results.json, report.md and plots from the "
                   "finished runs without training")
    p.add_argument("--out", metavar="DIR", help="output folder (default: the spec's `out`, else the spec's folder)")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_sweep)


def cmd_sweep(ns) -> int:
    from attnlab.experiments import sweep as sw
    from attnlab.train.trainer import DataError


    positive_options(ns, "jobs")
    if not Path(ns.spec).is_file():
        raise UsageError(f"spec file {ns.spec!r} does not exist")
    spec = sw.load_spec(ns.spec)  # ConfigError names the spec key
    out = Path(ns.out) if ns.out else spec.out
    try:
        plans = sw.plan(spec, out, jobs=ns.jobs)  # every (variant, seed) config loaded and checked
        if ns.report_only:
            sw.write_results(spec, out, command=ns.command_line, quiet=False)
            return 0
    except sw.SweepError as e:
        raise UsageError(str(e)) from None
    for p in plans:
        check_model_builds(p.cfg, f"variant {p.variant!r}, seed {p.seed}: ")
    if any(p.cfg.run.device == "cuda" for p in plans):
        import torch

        if not torch.cuda.is_available():
            raise UsageError("run.device is 'cuda' but no CUDA device is available; allowed here: 'auto', 'cpu'")
    try:
        sw.run(spec, out=out, jobs=ns.jobs, progress=not ns.no_progress, command=ns.command_line, plans=plans)
    except (DataError, sw.SweepError) as e:
        raise UsageError(str(e)) from None
    return 0
