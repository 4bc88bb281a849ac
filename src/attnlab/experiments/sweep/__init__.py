"""Sweeps: variants x seeds of one base config, trained, aggregated over seeds and judged.

    from attnlab.experiments.sweep import load_spec, run
    spec = load_spec("experiments/seed000/exp1-hybrid-baseline/spec.toml")
    results = run(spec, jobs=2)        # what `attnlab sweep SPEC.toml --jobs 2` does

A spec (TOML; the format is in experiments/README.md) names a base run config, the
variants (each a name and dotted overrides, as `attnlab train` takes them), the seeds,
shared overrides, optional metrics from `attnlab.train.evaluate` and an optional verdict
rule. Every (variant, seed) is one ordinary run folder, OUT/runs/<variant>/seed<k>,
trained by `attnlab.train.train`; the sweep owns run.seed, run.name, run.out_dir,
run.resume, run.overwrite and run.progress. OUT (default: the spec's folder) then gets
results.json, report.md, loss_curves.png and metrics.png, always rebuilt from the run
folders, so a killed sweep resumes where it stopped: finished runs are skipped, an
interrupted run resumes from its checkpoint, and the trainer's exact resume makes the
results those of an uninterrupted sweep. A sweep can also run in pieces on machines that keep
nothing (a GPU lent for one command): `--only RUNS --records DIR` writes each finished run's record
into one small file, `--merge DIR...` folds such files into results.json (.records).

The verdict rule: the claim "A is better than B in metric M" is supported when A's mean
beats B's by more than twice the combined sd, 2 * sqrt(sd_A^2 + sd_B^2) (sample sd over seeds),
not supported when B's beats A's by more than that, inconclusive otherwise (and with
fewer than 2 seeds). A spec may hold several rules, including thresholds (see .verdict).
"""

from .results import aggregate, judge, mean_sd, verdict, write_results
from .runner import run
from .runs import collect_metrics, plan, run_config
from .spec import OWNED_KEYS, Spec, SweepError, Variant, load_spec, metric_names

__all__ = ["OWNED_KEYS", "Spec", "SweepError", "Variant", "aggregate", "collect_metrics", "judge", "load_spec", "mean_sd",
           "metric_names", "plan", "run", "run_config", "verdict", "write_results"]
