"""Sweeps: variants x seeds of one base config, trained, aggregated over seeds and judged.

    from attnlab.experiments.sweep import load_spec, run
    spec = load_spec("experiments/000/hybrid-vs-softmax/spec.toml")
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
results those of an uninterrupted sweep.

The verdict rule: the claim "A is better than B in metric M" is supported when A's mean
beats B's by more than twice the combined sd, 2 * sqrt(sd_A^2 + sd_B^2) (sample sd over seeds),
not supported when B's beats A's by more than that, inconclusive otherwise (and with
fewer than 2 seeds).
"""

from __future__ import annotations

import copy
import json
import math
import os
import platform
import re
import sys
import time
from concurrent.futures import ProcessPoolExecutor, as_completed
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from attnlab.models.config import ConfigError
from attnlab.train.config import RunConfig, apply_overrides, config_from_dict, read_toml, to_dict

from .report import MISSING, fmt, markdown_table, topk_summary

SPEC_KEYS = ("title", "claim", "description", "base", "seeds", "overrides", "variants", "out", "per_seed",
             "metrics", "verdict")
VARIANT_KEYS = ("name", "overrides", "description")
VERDICT_KEYS = ("metric", "better", "compare")
# [metrics]: what to collect per run from attnlab.train.evaluate, and evaluate's arguments
METRIC_KEYS = ("loss_at", "topk_mass", "entropy", "sink_share", "passkey", "mqar_accuracy")
EVAL_ARG_KEYS = ("max_tokens", "batch_size", "analysis_len", "analysis_batch", "split", "passkey_depths")
OWNED_KEYS = ("run.seed", "run.name", "run.out_dir", "run.resume", "run.overwrite", "run.progress")
SUMMARY_SCALARS = ("val_loss", "val_ppl", "val_accuracy", "train_loss", "tokens_per_s", "train_seconds")
RECORD = "sweep.json"  # per run folder: the collected metrics and the wall time of the run
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]*$")


class SweepError(ValueError):
    """A run folder that the sweep cannot use as it stands (another config, a damaged checkpoint)."""


# --------------------------------------------------------------------------- the spec


@dataclass
class Variant:
    name: str
    overrides: list[str]
    description: str = ""


@dataclass
class Spec:
    path: Path
    title: str
    claim: str
    description: str
    base: str | dict  # the path as written (relative to the spec) or the inline table
    base_raw: dict  # the raw run config the base gives
    seeds: list[int]
    overrides: list[str]
    variants: list[Variant]
    out: Path
    per_seed: bool
    metrics: dict
    verdict: dict | None
    raw: dict = field(repr=False, default_factory=dict)

    def run_dir(self, variant: str, seed: int, out: str | os.PathLike | None = None) -> Path:
        return Path(out if out is not None else self.out) / "runs" / variant / f"seed{seed}"


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _unknown(table: dict, allowed: Sequence[str], where: str) -> None:
    for key in table:
        _need(key in allowed, f"unknown key {where}{key} in the spec; allowed: {', '.join(allowed)}")


def _str_list(value, key: str) -> list[str]:
    _need(isinstance(value, list) and all(isinstance(v, str) for v in value),
          f"{key} must be a list of strings, got {value!r}")
    return list(value)


def _int_list(value, key: str, lo: int) -> list[int]:
    ok = isinstance(value, list) and all(isinstance(v, int) and not isinstance(v, bool) and v >= lo for v in value)
    _need(ok, f"{key} must be a list of integers >= {lo}, got {value!r}")
    return list(value)


def _check_overrides(items: list[str], key: str) -> None:
    for item in items:
        _need("=" in item, f"{key}: {item!r} must look like section.key=value (e.g. train.steps=500)")
        name = item.split("=", 1)[0].strip()
        _need(name not in OWNED_KEYS,
              f"{key}: {name} is set by the sweep for every run; it owns {', '.join(OWNED_KEYS)}")


def _nest(table: dict, key: str) -> dict:
    """An inline [base] table as a raw config: dotted keys (quoted or not) become nested tables."""
    out: dict = {}
    for k, v in table.items():
        node = out
        parts = k.split(".")
        for p in parts[:-1]:
            node = node.setdefault(p, {})
            _need(isinstance(node, dict), f"{key}.{k}: {p} is a value, not a table")
        last = parts[-1]
        if isinstance(v, dict):
            v = _nest(v, f"{key}.{k}")
            if isinstance(node.get(last), dict):
                node[last].update(v)
                continue
        node[last] = v
    run = out.get("run")
    for name in run if isinstance(run, dict) else ():
        _need(f"run.{name}" not in OWNED_KEYS, f"{key}: run.{name} is set by the sweep; it owns {', '.join(OWNED_KEYS)}")
    return out


def metric_names(metrics: dict) -> list[str]:
    """The per-run scalars a [metrics] table asks for, in order."""
    names = [f"loss@{L}" for L in metrics.get("loss_at", [])]
    names += [f"topk_mass@{k}" for k in metrics.get("topk_mass", [])]
    names += [n for n in ("entropy", "sink_share") if metrics.get(n)]
    names += [f"passkey@{L}" for L in metrics.get("passkey", [])]
    names += ["mqar_accuracy"] if metrics.get("mqar_accuracy") else []
    return names


def _check_metrics(m, key: str = "metrics") -> dict:
    _need(isinstance(m, dict), f"{key} must be a table, got {m!r}")
    _unknown(m, METRIC_KEYS + EVAL_ARG_KEYS, f"{key}.")
    for name in ("loss_at", "topk_mass", "passkey"):
        if name in m:
            _int_list(m[name], f"{key}.{name}", 1)
    for name in ("entropy", "sink_share", "mqar_accuracy"):
        if name in m:
            _need(isinstance(m[name], bool), f"{key}.{name} must be true or false, got {m[name]!r}")
    for name in ("max_tokens", "batch_size", "analysis_len", "analysis_batch"):
        if name in m:
            v = m[name]
            _need(isinstance(v, int) and not isinstance(v, bool) and v >= 1, f"{key}.{name} must be an integer >= 1, got {v!r}")
    if "split" in m:
        _need(m["split"] in ("val", "test"), f"{key}.split must be 'val' or 'test', got {m['split']!r}")
    if "passkey_depths" in m:
        d = m["passkey_depths"]
        ok = isinstance(d, list) and d and all(isinstance(x, (int, float)) and not isinstance(x, bool) and 0 <= x <= 1 for x in d)
        _need(ok, f"{key}.passkey_depths must be a non-empty list of numbers in [0, 1], got {d!r}")
    return dict(m)


def _check_verdict(v, variants: list[str], metrics: list[str]) -> dict:
    _need(isinstance(v, dict), f"verdict must be a table, got {v!r}")
    _unknown(v, VERDICT_KEYS, "verdict.")
    for k in VERDICT_KEYS:
        _need(k in v, f"verdict.{k} is missing; a verdict needs metric, better and compare")
    allowed = list(SUMMARY_SCALARS) + metrics
    _need(v["metric"] in allowed, f"verdict.metric must be a per-run scalar: one of {', '.join(allowed)}; got {v['metric']!r}")
    _need(v["better"] in ("lower", "higher"), f"verdict.better must be 'lower' or 'higher', got {v['better']!r}")
    c = v["compare"]
    _need(isinstance(c, list) and len(c) == 2 and all(isinstance(x, str) for x in c) and c[0] != c[1],
          f"verdict.compare must name two different variants [A, B] (the claim: A is better than B), got {c!r}")
    for x in c:
        _need(x in variants, f"verdict.compare: {x!r} is not a variant; variants: {', '.join(variants)}")
    return dict(v)


def load_spec(path: str | os.PathLike) -> Spec:
    """Read and check a sweep spec; raises ConfigError naming the key (the run configs
    themselves are checked by `plan`)."""
    path = Path(path)
    _need(path.is_file(), f"spec file {str(path)!r} does not exist")
    raw = read_toml(path)
    _unknown(raw, SPEC_KEYS, "")
    here = path.parent
    for key in ("title", "claim", "description", "out"):
        _need(isinstance(raw.get(key, ""), str), f"{key} must be a string, got {raw.get(key)!r}")
    _need("base" in raw, "base is missing: give a run config path (relative to the spec) or a [base] table")
    base = raw["base"]
    if isinstance(base, str):
        base_path = here / base
        _need(base_path.is_file(), f"base: config file {str(base_path)!r} does not exist")
        base_raw = read_toml(base_path)
    else:
        _need(isinstance(base, dict), f"base must be a config path or a table of dotted keys, got {base!r}")
        base_raw = _nest(base, "base")
    _need("seeds" in raw, "seeds is missing: list at least one seed, e.g. seeds = [0, 1, 2]")
    seeds = _int_list(raw["seeds"], "seeds", 0)
    _need(len(seeds) >= 1, "seeds must list at least one seed, got []")
    _need(len(set(seeds)) == len(seeds), f"seeds must not repeat, got {seeds}")
    overrides = _str_list(raw.get("overrides", []), "overrides")
    _check_overrides(overrides, "overrides")
    vs = raw.get("variants")
    _need(isinstance(vs, list) and vs and all(isinstance(v, dict) for v in vs),
          "variants must be a non-empty array of tables ([[variants]] with name and overrides)")
    variants = []
    for i, v in enumerate(vs):
        _unknown(v, VARIANT_KEYS, f"variants[{i}].")
        name = v.get("name")
        _need(isinstance(name, str) and bool(NAME_RE.match(name)),
              f"variants[{i}].name must be a folder-safe name (letters, digits, _ . + -), got {name!r}")
        _need(name not in [x.name for x in variants], f"variants[{i}].name: {name!r} is a duplicate variant name")
        ov = _str_list(v.get("overrides", []), f"variants[{i}].overrides")
        _check_overrides(ov, f"variant {name!r}")
        _need(isinstance(v.get("description", ""), str), f"variants[{i}].description must be a string")
        variants.append(Variant(name, ov, v.get("description", "")))
    _need(isinstance(raw.get("per_seed", False), bool), f"per_seed must be true or false, got {raw.get('per_seed')!r}")
    metrics = _check_metrics(raw["metrics"]) if "metrics" in raw else {}
    verdict = _check_verdict(raw["verdict"], [v.name for v in variants], metric_names(metrics)) if "verdict" in raw else None
    return Spec(
        path=path, title=raw.get("title") or path.stem, claim=raw.get("claim", ""), description=raw.get("description", ""),
        base=base, base_raw=base_raw, seeds=seeds, overrides=overrides, variants=variants,
        out=here / raw["out"] if raw.get("out") else here, per_seed=raw.get("per_seed", False), metrics=metrics,
        verdict=verdict, raw=raw,
    )


# --------------------------------------------------------------------------- the runs


def run_config(spec: Spec, variant: Variant, seed: int, out: str | os.PathLike | None = None, *,
               jobs: int = 1, resume: bool = False, overwrite: bool = False) -> tuple[RunConfig, dict]:
    """(validated RunConfig, its raw dict) of one run: base, shared overrides, the variant's,
    then what the sweep owns. With jobs > 1 a run with no run.threads trains single-threaded."""
    try:
        raw = apply_overrides(copy.deepcopy(spec.base_raw), spec.overrides + variant.overrides)
        run = raw.setdefault("run", {})
        _need(isinstance(run, dict), f"run must be a table, got {run!r}")
        run_dir = spec.run_dir(variant.name, seed, out)
        run.update(seed=seed, name=run_dir.name, out_dir=str(run_dir.parent), progress=False,
                   resume=resume, overwrite=overwrite)
        if jobs > 1 and not run.get("threads"):
            run["threads"] = 1
        return config_from_dict(raw), raw
    except ConfigError as e:
        raise ConfigError(f"variant {variant.name!r}, seed {seed}: {e}") from None


@dataclass
class RunPlan:
    variant: str
    seed: int
    run_dir: Path
    state: str  # done | evaluate | resume | restart | new
    cfg: RunConfig
    raw: dict


def _flat(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict):
            out.update(_flat(v, f"{prefix}{k}."))
        elif v is not None:
            out[f"{prefix}{k}"] = v
    return out


def config_changes(run_dir: Path, cfg: RunConfig) -> list[tuple[str, Any, Any]]:
    """(key, saved, now) for every setting of the run folder's config.toml that differs from
    `cfg`; run.* other than run.seed is free (threads, resume...), vocab_size may be resolved."""
    saved = _flat(read_toml(run_dir / "config.toml"))
    now = _flat(to_dict(cfg))
    ignore = {k for k in set(saved) | set(now) if k.startswith("run.") and k != "run.seed"}
    if not cfg.model.vocab_size:
        ignore.add("model.vocab_size")
    return [(k, saved.get(k), now.get(k)) for k in sorted((set(saved) | set(now)) - ignore) if saved.get(k) != now.get(k)]


def summary_of(run_dir: Path, steps: int | None = None) -> dict | None:
    """The run's summary.json when it is present and complete, else None."""
    try:
        s = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(s, dict) or not all(k in s for k in ("val_loss", "steps", "params", "history")):
        return None
    return s if steps is None or s["steps"] == steps else None


def _record_of(run_dir: Path) -> dict | None:
    try:
        r = json.loads((run_dir / RECORD).read_text())
    except (OSError, ValueError):
        return None
    return r if isinstance(r, dict) else None


def _run_state(run_dir: Path, cfg: RunConfig, metrics: dict) -> str:
    from attnlab.train.checkpoint import latest_checkpoint
    from attnlab.train.trainer import CKPT_DIR

    if summary_of(run_dir, cfg.train.steps) is not None:
        record = _record_of(run_dir)
        return "done" if record is not None and record.get("metrics_spec") == metrics else "evaluate"
    if latest_checkpoint(run_dir / CKPT_DIR) is not None:
        return "resume"
    return "restart" if (run_dir / "log.jsonl").exists() else "new"


def plan(spec: Spec, out: str | os.PathLike | None = None, *, jobs: int = 1) -> list[RunPlan]:
    """Load and validate the config of every (variant, seed), and find what each run folder
    needs: nothing (done), only the metrics (evaluate), a resume from its checkpoint, a restart
    (killed before its first checkpoint) or a new run. Raises ConfigError for a config the
    trainer rejects, SweepError for a run folder trained with another config or whose
    checkpoint is damaged. Writes nothing."""
    from attnlab.train.checkpoint import CheckpointError
    from attnlab.train.trainer import ResumeError, check_resume

    plans = []
    for v in spec.variants:
        for seed in spec.seeds:
            cfg, _ = run_config(spec, v, seed, out, jobs=jobs)
            _check_eval_lengths(cfg, spec.metrics, v.name)
            run_dir = Path(cfg.run_dir)
            state = _run_state(run_dir, cfg, spec.metrics)
            if state in ("done", "evaluate", "resume") and (run_dir / "config.toml").is_file():
                changes = config_changes(run_dir, cfg)
                if changes:
                    diff = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changes[:4])
                    raise SweepError(f"run folder {str(run_dir)!r} was trained with another config ({diff}); "
                                     f"delete it, or give the sweep another output folder")
            if state == "resume":
                try:
                    check_resume(cfg)
                except (CheckpointError, ResumeError) as e:
                    raise SweepError(f"variant {v.name!r}, seed {seed}: {e}") from None
            cfg, raw = run_config(spec, v, seed, out, jobs=jobs, resume=state in ("resume", "evaluate", "done"),
                                  overwrite=state == "restart")
            plans.append(RunPlan(v.name, seed, run_dir, state, cfg, raw))
    return plans


def _check_eval_lengths(cfg: RunConfig, metrics: dict, variant: str) -> None:
    lengths = list(metrics.get("loss_at", [])) + list(metrics.get("passkey", []))
    if not lengths:
        return
    if cfg.model.pos_embedding == "learned" and max(lengths) > cfg.model.max_seq_len:
        raise ConfigError(f"variant {variant!r}: metrics length {max(lengths)} exceeds model.max_seq_len="
                          f"{cfg.model.max_seq_len} of its learned position embedding")
    horizons = [a.horizon for a in cfg.model.attention_configs() if a.horizon is not None]
    if horizons and max(lengths) > min(horizons):
        raise ConfigError(f"variant {variant!r}: metrics length {max(lengths)} exceeds the cosformer horizon "
                          f"{min(horizons)} (model.attention.cosformer_max_len)")


def collect_metrics(run_dir: str | os.PathLike, metrics: dict) -> dict[str, float | None]:
    """The scalars of a [metrics] table, measured by `attnlab.train.evaluate` on the run's checkpoint."""
    names = metric_names(metrics)
    if not names:
        return {}
    from attnlab.train import evaluate

    args = {k: metrics[k] for k in ("max_tokens", "batch_size", "analysis_len", "analysis_batch", "split") if k in metrics}
    ev = evaluate(run_dir, seq_lens=metrics.get("loss_at") or None, topk=tuple(metrics.get("topk_mass") or (8,)),
                  passkey_lengths=metrics.get("passkey") or None,
                  passkey_depths=tuple(metrics.get("passkey_depths", (0.0, 0.5, 1.0))), write=False, **args)
    layers = ev.get("layers", [])
    topk = topk_summary(layers)
    out: dict[str, float | None] = {}
    for L in metrics.get("loss_at", []):
        out[f"loss@{L}"] = (ev.get("loss") or {}).get(str(L), {}).get("loss")
    for k in metrics.get("topk_mass", []):
        out[f"topk_mass@{k}"] = topk.get(str(k))
    if metrics.get("entropy"):
        out["entropy"] = _mean_or_none([h for layer in layers for h in layer.get("entropy", [])])
    if metrics.get("sink_share"):
        out["sink_share"] = _mean_or_none([h for layer in layers for h in layer.get("first_token_share", [])])
    for L in metrics.get("passkey", []):
        out[f"passkey@{L}"] = _mean_or_none([v for key, v in (ev.get("passkey") or {}).items() if key.split("@")[0] == str(L)])
    if metrics.get("mqar_accuracy"):
        out["mqar_accuracy"] = ev.get("mqar_accuracy")
    return out


def _mean_or_none(values) -> float | None:
    values = [float(v) for v in values if v is not None]
    return sum(values) / len(values) if values else None


def execute(job: dict) -> dict:
    """Train (or resume) one run and collect its metrics; writes RUN_DIR/sweep.json. `job` is
    picklable: {"raw": run config dict, "state": ..., "metrics": the spec's [metrics]}."""
    import torch

    from attnlab.train import train

    cfg = config_from_dict(job["raw"])
    run_dir = Path(cfg.run_dir)
    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    try:
        with _run_lock(run_dir):
            if job["state"] != "evaluate":
                train(cfg)
            metrics = collect_metrics(run_dir, job["metrics"])
    finally:
        torch.set_num_threads(threads)  # run.threads is process-wide: leave the caller's setting
    old = _record_of(run_dir) or {}
    wall = time.perf_counter() - t0 if job["state"] != "evaluate" else old.get("wall_seconds")
    record = {"metrics_spec": job["metrics"], "metrics": metrics, "wall_seconds": wall,
              "threads": cfg.run.threads or threads}
    tmp = run_dir / f".{RECORD}.tmp"
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, run_dir / RECORD)
    return record


class _run_lock:
    """An exclusive lock beside the run folder while a process trains it, so two sweeps (or an
    orphaned worker) never write one run at once."""

    def __init__(self, run_dir: Path):
        self.path = run_dir.parent / f".{run_dir.name}.lock"

    def __enter__(self):
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.f = open(self.path, "w")
        try:
            import fcntl

            fcntl.flock(self.f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except ImportError:  # pragma: no cover - not POSIX
            pass
        except OSError:
            self.f.close()
            raise SweepError(f"run folder {str(self.path.parent / self.path.name[1:-5])!r} is being trained by "
                             f"another process (another sweep of the same spec?)") from None
        return self

    def __exit__(self, *exc):
        self.f.close()


def _worker_init(parent: int) -> None:
    """A pool worker dies with the sweep (Linux), so a killed sweep leaves no run training."""
    if sys.platform.startswith("linux"):
        try:
            import ctypes
            import signal

            ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        except (OSError, AttributeError):
            pass
    if os.getppid() != parent:
        os._exit(1)


# --------------------------------------------------------------------------- the sweep


def run(
    spec: Spec | str | os.PathLike,
    *,
    out: str | os.PathLike | None = None,
    jobs: int = 1,
    progress: bool = True,
    quiet: bool = False,
    command: str | None = None,
    plans: list[RunPlan] | None = None,
) -> dict:
    """Train every run that is not finished (`jobs` at once), then write OUT/results.json,
    report.md and plots from all run folders; returns the results dict."""
    from tqdm.auto import tqdm

    spec = spec if isinstance(spec, Spec) else load_spec(spec)
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ConfigError(f"jobs must be an int >= 1, got {jobs!r}")
    out = Path(out) if out is not None else spec.out
    plans = plans if plans is not None else plan(spec, out, jobs=jobs)
    todo = [p for p in plans if p.state != "done"]
    counts = {s: sum(p.state == s for p in plans) for s in ("done", "evaluate", "resume", "restart", "new")}
    if not quiet:
        print(f"sweep {spec.title!r}: {len(spec.variants)} variants x {len(spec.seeds)} seeds = {len(plans)} runs "
              f"({', '.join(f'{n} {s}' for s, n in counts.items() if n)}) in {out}", flush=True)
    jobs_list = [{"raw": p.raw, "state": p.state, "metrics": spec.metrics} for p in todo]
    bar = tqdm(total=len(plans), initial=len(plans) - len(todo), desc="sweep", unit="run", disable=not progress,
               dynamic_ncols=True)
    try:
        if jobs == 1 or len(todo) <= 1:
            for p, job in zip(todo, jobs_list):
                bar.set_postfix_str(f"{p.variant}/seed{p.seed}")
                execute(job)
                bar.update(1)
        else:
            import multiprocessing as mp

            with ProcessPoolExecutor(max_workers=min(jobs, len(todo)), mp_context=mp.get_context("spawn"),
                                     initializer=_worker_init, initargs=(os.getpid(),)) as pool:
                futures = {pool.submit(execute, job): p for p, job in zip(todo, jobs_list)}
                try:
                    for fut in as_completed(futures):
                        fut.result()
                        p = futures[fut]
                        bar.set_postfix_str(f"{p.variant}/seed{p.seed}")
                        bar.update(1)
                except BaseException:
                    pool.shutdown(wait=False, cancel_futures=True)
                    raise
    finally:
        bar.close()
    return write_results(spec, out, command=command, quiet=quiet)


# --------------------------------------------------------------------------- results


def sample_sd(values: Sequence[float]) -> float | None:
    """Sample standard deviation (n - 1), None below 2 values."""
    if len(values) < 2:
        return None
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def mean_sd(values: Sequence[float | None]) -> tuple[float | None, float | None, int]:
    """(mean, sample sd, n) over the values that are not None."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None, None, 0
    return sum(vals) / len(vals), sample_sd(vals), len(vals)


def verdict(mean_a, sd_a, mean_b, sd_b, better: str = "lower") -> str:
    """'supported' when A beats B by more than 2 * sqrt(sd_a^2 + sd_b^2), 'not supported' when
    B beats A by more than that, else (or when a mean or sd is missing) 'inconclusive'."""
    if better not in ("lower", "higher"):
        raise ValueError(f"better must be 'lower' or 'higher', got {better!r}")
    if None in (mean_a, sd_a, mean_b, sd_b):
        return "inconclusive"
    gain = (mean_b - mean_a) if better == "lower" else (mean_a - mean_b)  # > 0: A is better
    threshold = 2.0 * math.sqrt(sd_a ** 2 + sd_b ** 2)
    if gain > threshold:
        return "supported"
    if -gain > threshold:
        return "not supported"
    return "inconclusive"


def judge(rule: dict, variants: dict) -> dict:
    """The spec's [verdict] applied to the per-variant statistics, with its numbers and a sentence."""
    m, better = rule["metric"], rule["better"]
    a, b = rule["compare"]
    sa, sb = variants.get(a, {}), variants.get(b, {})
    ma, da = sa.get("mean", {}).get(m), sa.get("sd", {}).get(m)
    mb, db = sb.get("mean", {}).get(m), sb.get("sd", {}).get(m)
    outcome = verdict(ma, da, mb, db, better)
    threshold = 2.0 * math.sqrt(da ** 2 + db ** 2) if None not in (da, db) else None
    diff = ma - mb if None not in (ma, mb) else None
    if None in (ma, mb):
        why = f"{m} is missing for {a if ma is None else b}"
    elif threshold is None:
        why = "fewer than 2 finished seeds for a variant, so no sd"
    else:
        why = (f"{a} {fmt(ma)} ± {fmt(da)} vs {b} {fmt(mb)} ± {fmt(db)}: difference {fmt(diff)}, "
               f"threshold 2·sqrt(sd_a² + sd_b²) = {fmt(threshold)}")
    return {"metric": m, "better": better, "compare": [a, b], "mean": [ma, mb], "sd": [da, db], "difference": diff,
            "threshold": threshold, "outcome": outcome, "reason": why}


def verdict_rule_text(rule: dict) -> str:
    a, b = rule["compare"]
    m, better = rule["metric"], rule["better"]
    worse = "higher" if better == "lower" else "lower"
    return (f"the claim ({a} is better than {b} in {m}, {better} is better) is **supported** when {a}'s mean {m} is "
            f"{better} than {b}'s by more than twice the combined sd, 2·sqrt(sd_{a}² + sd_{b}²) (sample sd over seeds); "
            f"**not supported** when it is {worse} by more than that; **inconclusive** otherwise, and when a variant "
            f"has fewer than 2 finished seeds.")


def _run_entry(spec: Spec, variant: str, seed: int, cfg: RunConfig, run_dir: Path, out: Path) -> dict | None:
    from attnlab.train import read_log

    s = summary_of(run_dir, cfg.train.steps)
    if s is None:
        return None
    record = _record_of(run_dir) or {}
    log = read_log(run_dir)
    return {
        "variant": variant, "seed": seed, "run_dir": os.path.relpath(run_dir, out),
        "params": s["params"], "steps": s["steps"], "tokens": s["steps"] * cfg.train.tokens_per_step,
        **{k: s.get(k) for k in SUMMARY_SCALARS},
        "wall_seconds": record.get("wall_seconds"), "tau": s.get("tau"), "resumed": s.get("resumed_from") is not None,
        "metrics": {n: (record.get("metrics") or {}).get(n) for n in metric_names(spec.metrics)},
        "curves": {
            "train": [[r["step"], r["loss"]] for r in log if r.get("kind") == "train" and "loss" in r],
            "val": [[r["step"], r["val_loss"]] for r in log if r.get("kind") == "eval" and "val_loss" in r],
        },
    }


def scalar_names(spec: Spec, runs: list[dict]) -> list[str]:
    """Per-run scalars present in at least one run: the summary's, then the collected metrics."""
    names = [k for k in SUMMARY_SCALARS if any(r.get(k) is not None for r in runs)]
    return names + [n for n in metric_names(spec.metrics) if any(r["metrics"].get(n) is not None for r in runs)]


def _scalar(run: dict, name: str):
    return run["metrics"].get(name) if name in run["metrics"] else run.get(name)


def machine_info(threads: int | None = None) -> dict:
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "cpus": os.cpu_count(), "torch_threads": threads or torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def aggregate(spec: Spec, out: str | os.PathLike | None = None) -> dict:
    """Results from the run folders: every finished run, and per variant the mean ± sd over seeds."""
    out = Path(out) if out is not None else spec.out
    runs, missing, setup = [], [], {}
    for v in spec.variants:
        for seed in spec.seeds:
            cfg, _ = run_config(spec, v, seed, out)
            entry = _run_entry(spec, v.name, seed, cfg, Path(cfg.run_dir), out)
            if entry is None:
                missing.append(f"{v.name}/seed{seed}")
            else:
                runs.append(entry)
            setup.setdefault(v.name, {
                "overrides": v.overrides, "description": v.description, "attn": cfg.model.layer_attn,
                "d_model": cfg.model.d_model, "n_layers": cfg.model.n_layers, "n_heads": cfg.model.n_heads,
                "seq_len": cfg.data.seq_len, "batch_size": cfg.train.batch_size, "grad_accum": cfg.train.grad_accum,
                "steps": cfg.train.steps, "tokens_per_run": cfg.train.steps * cfg.train.tokens_per_step,
                "lr": cfg.train.lr, "data": cfg.data.source, "tokenizer": cfg.data.tokenizer, "max_docs": cfg.data.max_docs,
            })
    names = scalar_names(spec, runs)
    variants = {}
    for v in spec.variants:
        mine = [r for r in runs if r["variant"] == v.name]
        stats = {n: mean_sd([_scalar(r, n) for r in mine]) for n in names}
        taus = [r["tau"] or [] for r in mine]
        n_layers = max((len(t) for t in taus), default=0)
        variants[v.name] = {
            **setup[v.name], "n": len(mine), "seeds": [r["seed"] for r in mine],
            "params": mine[0]["params"] if mine else None,
            "mean": {n: s[0] for n, s in stats.items()}, "sd": {n: s[1] for n, s in stats.items()},
            "tau": [mean_sd([t[i] if i < len(t) else None for t in taus])[0] for i in range(n_layers)],
        }
    threads = {((_record_of(out / r["run_dir"]) or {}).get("threads")) for r in runs} - {None}
    return {
        "title": spec.title, "claim": spec.claim, "description": spec.description,
        "spec": {"path": str(spec.path), **spec.raw}, "seeds": spec.seeds, "scalars": names,
        "runs": runs, "missing": missing, "variants": variants,
        "verdict": judge(spec.verdict, variants) if spec.verdict else None,
        "machine": machine_info(threads.pop() if len(threads) == 1 else None),
    }


def write_results(spec: Spec, out: str | os.PathLike | None = None, *, command: str | None = None,
                  quiet: bool = True) -> dict:
    """Rebuild OUT/results.json, report.md, loss_curves.png and metrics.png from the run folders."""
    out = Path(out) if out is not None else spec.out
    results = aggregate(spec, out)
    if not results["runs"]:
        raise SweepError(f"no finished runs under {str(out / 'runs')!r}: run the sweep first")
    results["command"] = command or f"attnlab.experiments.sweep.run({str(spec.path)!r})"
    out.mkdir(parents=True, exist_ok=True)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    plot_curves(spec, results, out / "loss_curves.png")
    metrics_png = plot_metrics(spec, results, out / "metrics.png")
    (out / "report.md").write_text(report_markdown(spec, results, out, metrics_png is not None) + "\n")
    if not quiet:
        print("\n" + results_table(results))
        if results["verdict"]:
            print(f"\nverdict: {results['verdict']['outcome']} ({results['verdict']['reason']})")
        print(f"\nreport: {out / 'report.md'} (results.json, loss_curves.png{', metrics.png' if metrics_png else ''} beside it)")
    return results


# --------------------------------------------------------------------------- report


def _pm(mean, sd, digits: int = 4) -> str:
    """mean ± sd, the sd to 2 significant digits."""
    if mean is None:
        return MISSING
    if sd is None:
        return fmt(mean, digits)
    return f"{fmt(mean, digits)} ± {fmt(sd, digits) if sd >= 1 or sd == 0 or not math.isfinite(sd) else f'{sd:.2g}'}"


def results_table(results: dict) -> str:
    names = results["scalars"]
    headers = ["variant", "seeds", "params", "tokens/run"] + names + ["τ per layer"]
    rows = []
    for name, v in results["variants"].items():
        taus = [t for t in v["tau"] if t is not None]
        rows.append([name, v["n"], v["params"], v["tokens_per_run"]] + [_pm(v["mean"][n], v["sd"][n]) for n in names]
                    + [" / ".join(f"{t:.3g}" for t in taus) if taus else None])
    return markdown_table(headers, rows)


def _same(values: list):
    return values[0] if all(v == values[0] for v in values) else None


def report_markdown(spec: Spec, results: dict, out: Path, metrics_png: bool = True) -> str:
    vs = results["variants"]
    first = next(iter(vs.values()))

    def common(key, show=str):
        value = _same([v[key] for v in vs.values()])
        return show(value) if value is not None else "varies by variant (see the table)"

    base = f"`{spec.base}`" if isinstance(spec.base, str) else "an inline [base] table"
    lines = [f"# {spec.title}", "",
             f"*Generated by `attnlab sweep` from `{spec.path.name}`; rebuild it with "
             f"`attnlab sweep {spec.path.name} --report-only`, do not edit it.*", ""]
    if spec.claim:
        lines += [f"**Claim.** {spec.claim}", ""]
    if spec.description:
        lines += [spec.description, ""]
    lines += ["## Setup", "",
              f"- Base config: {base}" + (f"; shared overrides: {', '.join(f'`{o}`' for o in spec.overrides)}"
                                           if spec.overrides else "") + ".",
              "- Variants: " + "; ".join(f"**{name}** ({', '.join(f'`{o}`' for o in v['overrides']) or 'the base'}"
                                         f"{': ' + v['description'] if v['description'] else ''})" for name, v in vs.items()) + ".",
              "- Model size: " + ", ".join(f"{name} {fmt(v['params'])} parameters" for name, v in vs.items()) +
              f" (d_model {common('d_model')}, {common('n_layers')} layers, {common('n_heads')} heads).",
              f"- Scale per run: {common('steps')} optimizer steps x {common('batch_size')} x {common('grad_accum')} "
              f"sequences of {common('seq_len')} tokens (context) = {common('tokens_per_run', fmt)} training tokens; "
              f"AdamW lr {common('lr')}.",
              f"- Data: {common('data')} ({first['tokenizer']} tokens"
              f"{', ' + str(first['max_docs']) + ' documents per split' if first['max_docs'] else ''}).",
              f"- Seeds: {', '.join(map(str, spec.seeds))}; {len(results['runs'])} of "
              f"{len(results['runs']) + len(results['missing'])} runs finished"
              + (f" (missing: {', '.join(results['missing'])})" if results["missing"] else "") + ".", ""]
    lines += ["## Results: mean ± sd over seeds", "", results_table(results), "",
              "sd is the sample standard deviation over seeds (n - 1); with one seed only the value is shown. "
              "val loss/ppl: the trainer's final validation (nats per token); tokens/s and train_seconds: training "
              "throughput and time of the session that finished the run; τ per layer: mean over heads and seeds.", ""]
    if spec.metrics:
        lines += [_metrics_text(spec.metrics), ""]
    if results["verdict"]:
        v = results["verdict"]
        lines += ["## Verdict", "", f"**{v['outcome']}**: {v['reason']}.", "", "Rule: " + verdict_rule_text(spec.verdict), ""]
    lines += ["## Plots", "", "![loss curves](loss_curves.png)", "",
              "Train (left) and validation (right) loss per variant: the mean over seeds as a line, the min-max over "
              "seeds as a band.", ""]
    if metrics_png:
        lines += ["![per-run metrics](metrics.png)", "", "Each per-run scalar: the mean over seeds as a bar, ±1 sd as an "
                  "error bar, each seed as a dot.", ""]
    if spec.per_seed:
        names = results["scalars"]
        rows = [[r["variant"], r["seed"]] + [_scalar(r, n) for n in names] for r in results["runs"]]
        lines += ["## Per seed", "", markdown_table(["variant", "seed"] + names, rows), ""]
    m = results["machine"]
    lines += ["## Reproduce", "", f"Command: `{results['command']}`", "",
              f"Run folders: `{os.path.relpath(out / 'runs', out)}/<variant>/seed<k>/` (config, logs, checkpoints, "
              f"summary.json, sweep.json). Machine: Python {m['python']}, torch {m['torch']}, {m['platform']}, "
              f"{m['cpus']} CPUs, torch threads per run: {m['torch_threads']}{', ' + m['cuda'] if m['cuda'] else ''}."]
    return "\n".join(lines)


def _metrics_text(metrics: dict) -> str:
    parts = []
    if metrics.get("loss_at"):
        parts.append("**loss@L**: validation loss (nats/token) at context length L")
    if metrics.get("topk_mass"):
        parts.append("**topk_mass@k**: share of each query's attention inside its k nearest keys in scalar space, "
                     "mean over the scalar heads (— for variants without any)")
    if metrics.get("entropy"):
        parts.append("**entropy**: attention entropy (nats), mean over heads and layers")
    if metrics.get("sink_share"):
        parts.append("**sink_share**: attention mass on the first token, mean over heads and layers")
    if metrics.get("passkey"):
        parts.append("**passkey@L**: passkey retrieval accuracy at length L, mean over depths")
    if metrics.get("mqar_accuracy"):
        parts.append("**mqar_accuracy**: MQAR accuracy at the query positions")
    args = {k: metrics[k] for k in EVAL_ARG_KEYS if k in metrics}
    how = f" (`attnlab.train.evaluate` on each run's final checkpoint{', ' + ', '.join(f'{k}={v}' for k, v in args.items()) if args else ''})"
    return "Collected metrics" + how + ": " + "; ".join(parts) + "."


# --------------------------------------------------------------------------- plots


def _band(curves: list[list[list[float]]]) -> tuple[list, list, list, list]:
    """(steps, mean, min, max) over the runs' [step, value] curves, at steps every run has."""
    by_step: dict[float, list[float]] = {}
    for c in curves:
        for step, value in c:
            by_step.setdefault(step, []).append(value)
    steps = sorted(s for s, vals in by_step.items() if len(vals) == len(curves))
    vals = [by_step[s] for s in steps]
    return steps, [sum(v) / len(v) for v in vals], [min(v) for v in vals], [max(v) for v in vals]


def plot_curves(spec: Spec, results: dict, path: Path) -> Path:
    from .report import _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), dpi=120)
    for i, name in enumerate(results["variants"]):
        runs = [r for r in results["runs"] if r["variant"] == name]
        for ax, kind in zip(axes, ("train", "val")):
            curves = [r["curves"][kind] for r in runs if r["curves"][kind]]
            if not curves:
                continue
            steps, mean, lo, hi = _band(curves)
            ax.plot(steps, mean, color=f"C{i}", lw=1.8, marker="o" if kind == "val" else None, ms=3,
                    label=f"{name} (n={len(curves)})")
            ax.fill_between(steps, lo, hi, color=f"C{i}", alpha=0.2, lw=0)
    for ax, kind in zip(axes, ("train", "validation")):
        ax.set_title(f"{kind} loss: mean over seeds, min-max band")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("loss (nats / token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(spec.title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def plot_metrics(spec: Spec, results: dict, path: Path) -> Path | None:
    """One panel per per-run scalar: bars (mean), error bars (sd), dots (seeds)."""
    from .report import _pyplot

    names = [n for n in results["scalars"] if n not in ("val_ppl", "train_seconds")]  # same as val_loss, tokens_per_s
    if not names:
        return None
    plt = _pyplot()
    ncols = min(3, len(names))
    nrows = math.ceil(len(names) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.0 * ncols, 3.2 * nrows), dpi=120, squeeze=False)
    variants = list(results["variants"])
    for ax, name in zip(axes.flat, names):
        spans: list[float] = []
        for i, v in enumerate(variants):
            stats = results["variants"][v]
            mean, sd = stats["mean"][name], stats["sd"][name]
            if mean is None:
                continue
            ax.bar(i, mean, yerr=sd or 0.0, color=f"C{i}", alpha=0.75, capsize=4)
            seeds = [_scalar(r, name) for r in results["runs"] if r["variant"] == v]
            seeds = [s for s in seeds if s is not None]
            ax.plot([i] * len(seeds), seeds, "k.", ms=5)
            spans += [mean - (sd or 0.0), mean + (sd or 0.0)] + seeds
        bars = sum(results["variants"][v]["mean"][name] is not None for v in variants)
        zoom = bars >= 2 and min(spans) > 0 and (max(spans) - min(spans)) < 0.2 * max(spans)
        if zoom:  # differences of a few percent would be invisible on bars from 0
            pad = 0.15 * (max(spans) - min(spans)) or 0.01 * max(spans)
            ax.set_ylim(min(spans) - pad, max(spans) + pad)
        ax.set_xticks(range(len(variants)), variants, rotation=20, fontsize=8)
        ax.set_title(name + (" (y axis not from 0)" if zoom else ""), fontsize=9)
        ax.grid(alpha=0.3, axis="y")
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


__all__ = ["OWNED_KEYS", "RunPlan", "Spec", "SweepError", "Variant", "aggregate", "collect_metrics", "execute",
           "judge", "load_spec", "mean_sd", "metric_names", "plan", "run", "run_config", "sample_sd", "verdict",
           "write_results"]
