"""The results of a sweep: mean ± sd over seeds and the verdict rules, written to results.json (report.md and
the plots: .report)."""


from __future__ import annotations

import json
import os
from pathlib import Path

from attnlab.train.config import RunConfig

from ..trial import mean_sd, recorded_results, sample_sd, write_outputs
from ..report import machine_info, shown_path
from .report import metric_panels, plot_curves, plot_metrics, plot_steps, report_markdown, results_table
from .runs import (RunPlan, _record_of, collect_metrics, execute, plan, recorded_runs, recorded_threads, run_config,
                   scalar_of, summary_of)
from .budget import budget_of, params_of
from .verdict import answer, judge, verdict
from .spec import OWNED_KEYS, SUMMARY_SCALARS, Spec, SweepError, Variant, load_spec, metric_names


# --------------------------------------------------------------------------- results


def _run_entry(spec: Spec, variant: str, seed: int, cfg: RunConfig, run_dir: Path, out: Path) -> dict | None:
    from attnlab.train import read_log

    s = summary_of(run_dir, cfg.train.steps)
    if s is None:
        return None
    record = _record_of(run_dir) or {}
    log = read_log(run_dir)
    machine = {"machine": record["machine"]} if record.get("machine") else {}  # runs trained before it was kept: none
    return {
        "variant": variant, "seed": seed, "run_dir": f"runs/{variant}/seed{seed}",  # under runs_root(OUT)
        "params": s["params"], "steps": s["steps"], "tokens": s["steps"] * cfg.train.tokens_per_step,
        **{k: s.get(k) for k in SUMMARY_SCALARS},
        "wall_seconds": record.get("wall_seconds"), "tau": s.get("tau"), "resumed": s.get("resumed_from") is not None,
        "train_seconds_logged": logged_train_seconds(log),
        "metrics": _with_derived({n: (record.get("metrics") or {}).get(n) for n in metric_names(spec.metrics)}),
        "curves": {
            "train": [[r["step"], r["loss"]] for r in log if r.get("kind") == "train" and "loss" in r],
            "val": [[r["step"], r["val_loss"]] for r in log if r.get("kind") == "eval" and "val_loss" in r],
            "tau": [[r["step"], _mean_tau(r)] for r in log if r.get("kind") == "train" and _mean_tau(r) is not None],
        },
        **machine,
    }


def logged_train_seconds(log: list[dict]) -> float | None:
    """The training time of a run over every process that trained it, from its log: each logged interval's
    tokens over its measured tokens/s, summed (a run resumed after a kill counts the time of the processes
    before; validation and checkpoint writes between the intervals are not in it). None without a log."""
    total, seen, any_row = 0.0, 0, False
    for r in log:
        if r.get("kind") != "train" or not r.get("tokens_per_s") or r.get("tokens") is None:
            continue
        if r["tokens"] > seen:  # a resumed run logs again from its checkpoint: count each interval once
            total += (r["tokens"] - seen) / r["tokens_per_s"]
            seen, any_row = r["tokens"], True
    return round(total, 1) if any_row else None


def _with_derived(metrics: dict) -> dict:
    """Fill wloss@k/T=T from loss/T=T + wgap@k/T=T where a run recorded only those two (runs
    evaluated before the windowed loss by length was a metric of its own); the same numbers."""
    for name, value in metrics.items():
        if value is None and name.startswith("wloss@") and "/T=" in name:
            T = name.rsplit("/T=", 1)[1]
            gap, loss = metrics.get("wgap@" + name[len("wloss@"):]), metrics.get(f"loss/T={T}")
            if gap is not None and loss is not None:
                metrics[name] = loss + gap
    return metrics


def _mean_tau(row: dict) -> float | None:
    """A train-log row's temperature: the mean over the layers with scalar heads of their mean τ."""
    taus = [layer["tau_mean"] for layer in row.get("layers") or [] if layer.get("tau_mean") is not None]
    return sum(taus) / len(taus) if taus else None


def _early_stop_of(cfg: RunConfig) -> dict | None:
    t = cfg.train
    return ({"patience": t.early_stop_patience, "metric": t.early_stop_metric, "every": t.eval_every}
            if t.early_stop_patience else None)


def scalar_names(spec: Spec, runs: list[dict]) -> list[str]:
    """Per-run scalars present in at least one run: the summary's, then the collected metrics."""
    names = [k for k in SUMMARY_SCALARS if any(r.get(k) is not None for r in runs)]
    return names + [n for n in metric_names(spec.metrics) if any(r["metrics"].get(n) is not None for r in runs)]


def aggregate(spec: Spec, out: str | os.PathLike | None = None, *, records: dict | None = None,
              machine: dict | None = None) -> dict:
    """Results from the run folders: every finished run, and per variant the mean ± sd over seeds.
    A run whose folder is absent is taken from `records` ({(variant, seed): run entry}, what
    `records.merge` returns) or else from OUT/results.json where that records it (`recorded_runs`: the
    committed results of an experiment stand for its runs). "machine" is the machine that trained the
    runs (each run's own where it names one, else `machine` or this one); with several, "machines"
    lists each with its runs and "machine" is the one that trained the most."""
    out = Path(out) if out is not None else spec.out
    runs, missing, setup = [], [], {}
    recorded = {**recorded_runs(spec, out), **(records or {})}
    for v in spec.variants:
        for seed in spec.seeds:
            cfg, _ = run_config(spec, v, seed, out)
            entry = _run_entry(spec, v.name, seed, cfg, Path(cfg.run_dir), out)
            if entry is None and not Path(cfg.run_dir).exists():
                entry = recorded.get((v.name, seed))
            if entry is None:
                missing.append(f"{v.name}/seed{seed}")
            else:
                runs.append(entry)
            setup.setdefault(v.name, {
                "overrides": v.overrides, "description": v.description, "attn": cfg.model.layer_attn,
                "d_model": cfg.model.d_model, "n_layers": cfg.model.n_layers, "n_heads": cfg.model.n_heads,
                "seq_len": cfg.data.seq_len, "batch_size": cfg.train.batch_size, "grad_accum": cfg.train.grad_accum,
                "steps": cfg.train.steps, "tokens_per_run": cfg.train.steps * cfg.train.tokens_per_step,
                "lr": cfg.train.lr, "early_stop": _early_stop_of(cfg), "data": cfg.data.source, "tokenizer": cfg.data.tokenizer, "max_docs": cfg.data.max_docs,
                "mqar_pairs": cfg.data.mqar_pairs if cfg.data.source == "mqar" else None,
                "params_planned": params_of(cfg),  # the model's size before any of its runs has finished
            })
    names = scalar_names(spec, runs)
    variants = {}
    for v in spec.variants:
        mine = [r for r in runs if r["variant"] == v.name]
        stats = {n: mean_sd([scalar_of(r, n) for r in mine]) for n in names}
        taus = [r["tau"] or [] for r in mine]
        n_layers = max((len(t) for t in taus), default=0)
        variants[v.name] = {
            **setup[v.name], "n": len(mine), "seeds": [r["seed"] for r in mine],
            "params": mine[0]["params"] if mine else None,
            "mean": {n: s[0] for n, s in stats.items()}, "sd": {n: s[1] for n, s in stats.items()},
            "tau": [mean_sd([t[i] if i < len(t) else None for t in taus])[0] for i in range(n_layers)],
        }
    judged = [judge(rule, variants) for rule in spec.verdicts]
    threads = {((_record_of(spec.run_dir(r["variant"], r["seed"], out)) or {}).get("threads")) for r in runs} - {None}
    if not threads and recorded:  # every run recorded: the threads they were measured with
        threads = {recorded_threads(out)} - {None}
    fallback = machine or machine_info(threads.pop() if len(threads) == 1 else None)
    trained_on, machines = _machines(runs, fallback)
    return {
        "title": spec.title, "claim": spec.claim, "description": spec.description,
        "spec": {"path": str(spec.path), **spec.raw}, "seeds": spec.seeds, "scalars": names,
        "runs": runs, "missing": missing, "variants": variants,
        "verdict": judged[0] if judged else None,
        "verdicts": judged,
        "answer": answer(spec.answer, spec.verdicts, judged, variants, len(spec.seeds)) if spec.answer else None,
        **({"budget": b} if (b := budget_of(spec, {"variants": variants, "runs": runs})) else {}),
        "machine": trained_on,
        **({"machines": machines} if machines else {}),
    }


def _machines(runs: list[dict], fallback: dict) -> tuple[dict, list[dict] | None]:
    """(the machine that trained the most runs, [{"machine", "runs"}] when more than one trained them)."""
    groups: list[dict] = []
    for r in runs:
        m = r.get("machine") or fallback
        group = next((g for g in groups if g["machine"] == m), None)
        if group is None:
            groups.append(group := {"machine": m, "runs": []})
        group["runs"].append(f"{r['variant']}/seed{r['seed']}")
    if len(groups) <= 1:
        return (groups[0]["machine"] if groups else fallback), None
    return max(groups, key=lambda g: len(g["runs"]))["machine"], groups


def _trained_by(spec: Spec, out: Path) -> tuple[str, dict | None]:
    """For a report-only rebuild: the command that trains the runs (the committed results.json's, unless
    that was itself a rebuild) and the machine that results.json names."""
    old = recorded_results(out)
    made_by = str(old.get("command") or "")
    if not made_by or {"--report-only", "--merge"} & set(made_by.split()):
        made_by = whole_command(spec, out)
    return made_by, old.get("machine")


def whole_command(spec: Spec, out: Path) -> str:
    """The command that trains every run of the spec in one go (into OUT)."""
    at = "" if out.resolve() == spec.out.resolve() else f" --out {shown_path(out)}"
    return f"attnlab sweep {shown_path(spec.path)}{at}"


def write_results(spec: Spec, out: str | os.PathLike | None = None, *, command: str | None = None,
                  quiet: bool = True, report_only: bool = False, records: dict | None = None) -> dict:
    """Rebuild OUT/results.json, report.md, loss_curves.png and metrics.png from the run folders
    (and `records`, the runs a merge adds: `aggregate`). report_only: nothing trained now, so the report
    keeps the command that trained the runs and, for runs that do not name their machine, the machine the
    committed results.json names. results.json and report.md are written every time (a rebuild of a
    finished sweep writes the same bytes, and restores a report edited by hand); the plots are drawn
    again only when the results differ from the recorded results.json or a plot is missing."""
    out = Path(out) if out is not None else spec.out
    made_by, machine = _trained_by(spec, out) if report_only or records is not None else (None, None)
    results = aggregate(spec, out, records=records, machine=machine)
    if not results["runs"]:
        raise SweepError(f"no finished runs under {str(out / 'runs')!r} and none recorded in its results.json: "
                         f"run the sweep first")
    results["command"] = command or f"attnlab.experiments.sweep.run({str(spec.path)!r})"
    if records is not None:  # runs trained in pieces: the command that trains them all at once
        results["command"] = whole_command(spec, out)
    elif report_only:
        results["command"] = made_by
    old = recorded_results(out)
    same = bool(old) and json.loads(json.dumps(results, default=str)) == old
    out.mkdir(parents=True, exist_ok=True)
    plots = {"loss_curves.png": plot_curves, "metrics.png": plot_metrics}
    if spec.metrics.get("at_steps"):
        plots["by_tokens.png"] = plot_steps
    if same and all((out / name).is_file() for name in plots):
        # the results are those on disk: the plots stand; the report is written again all the same, so that
        # a rebuild shows the committed report is the one its results make (a hand edit does not survive)
        metrics_png = bool(metric_panels(results))
        if not quiet:
            print(f"\nresults unchanged: {out / 'report.md'} and results.json written again from them (the same "
                  f"bytes unless edited by hand), the plots left as they are")
    else:
        metrics_png = False
        for name, draw in plots.items():
            drawn = draw(spec, results, out / name)
            metrics_png = drawn is not None if name == "metrics.png" else metrics_png
    write_outputs(out, results, report_markdown(spec, results, out, metrics_png) + "\n", indent=2)
    if not quiet:
        print("\n" + results_table(results))
        for v in results.get("verdicts") or []:
            print(f"\nverdict{' ' + v['name'] if v.get('name') else ''}: {v['outcome']} ({v['reason']})")
        if a := results.get("answer"):
            print(f"\nanswer: {a['outcome']} ({a['chosen'] or 'no candidate finished'}"
                  f"{', provisional' if a['provisional'] else ''})")
        print(f"\nreport: {out / 'report.md'} (results.json, loss_curves.png{', metrics.png' if metrics_png else ''} beside it)")
    return results


__all__ = ["OWNED_KEYS", "RunPlan", "Spec", "SweepError", "Variant", "aggregate", "collect_metrics", "execute",
           "judge", "load_spec", "mean_sd", "metric_names", "plan", "run_config", "sample_sd", "verdict",
           "write_results"]
