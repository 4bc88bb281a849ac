"""The runs of a sweep: plan every (variant, seed) run, check its state, train and measure it, in one
process or several."""


from __future__ import annotations

import copy
import json
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from attnlab import interrupt
from attnlab.data.cache import atomic_write_text
from attnlab.eval.metrics import GATE_BINS
from attnlab.lock import FolderLock
from attnlab.models.config import ConfigError
from attnlab.train.config import RunConfig, apply_overrides, config_from_dict, read_toml, to_dict

from ..report import machine_info, topk_summary
from .spec import RECORD, Spec, SweepError, Variant, _need, final_metric_names, mqar_values, window_keys


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
    state: str  # done | recorded | evaluate | resume | restart | new
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
    `cfg`; run.* other than run.seed is free (threads, resume...), vocab_size may be resolved.
    A key the saved config lacks (written before the option existed) counts as its default; a
    data.tokenizer naming the run folder's copy of the configured tokenizer file is that file."""
    from attnlab.train.data import is_recorded_copy

    saved = _flat(read_toml(run_dir / "config.toml"))
    if is_recorded_copy(run_dir, saved.get("data.tokenizer"), cfg.data.tokenizer):
        saved["data.tokenizer"] = cfg.data.tokenizer
    return flat_changes(saved, cfg)


def flat_changes(saved: dict, cfg: RunConfig) -> list[tuple[str, Any, Any]]:
    """`config_changes` against a saved config already flattened ("section.key": value)."""
    saved = dict(saved)
    now = _flat(to_dict(cfg))
    defaults = _flat(to_dict(RunConfig()))
    saved.update({k: defaults[k] for k in now if k not in saved and k in defaults})
    ignore = {k for k in set(saved) | set(now) if k.startswith("run.") and k != "run.seed"}
    if not cfg.model.vocab_size:
        ignore.add("model.vocab_size")
    return [(k, saved.get(k), now.get(k)) for k in sorted((set(saved) | set(now)) - ignore) if saved.get(k) != now.get(k)]


def settings_of(cfg: RunConfig) -> dict:
    """The flat settings that decide a run's result: every key of its config but run.* (where it is
    written, threads, progress...), run.seed kept. What a records file stores per run."""
    return {k: v for k, v in _flat(to_dict(cfg)).items() if not k.startswith("run.") or k == "run.seed"}


def summary_of(run_dir: Path, steps: int | None = None) -> dict | None:
    """The run's summary.json when it is present and complete (trained to `steps`, or ended
    earlier by early stopping), else None."""
    try:
        s = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(s, dict) or not all(k in s for k in ("val_loss", "steps", "params", "history")):
        return None
    return s if steps is None or s["steps"] == steps or "early_stop" in s else None


def scalar_of(run: dict, name: str):
    """One run record's per-run scalar: a collected metric, else a summary value. A run resumed across
    processes has its train_seconds and tokens_per_s over all of them (from its log: its training time
    summed over every process, and its tokens over that), not the last process's alone."""
    if name in run["metrics"]:
        return run["metrics"].get(name)
    logged = run.get("train_seconds_logged")
    if run.get("resumed") and logged and logged > (run.get("train_seconds") or 0):
        if name == "train_seconds":
            return logged
        if name == "tokens_per_s" and run.get("tokens"):
            return run["tokens"] / logged
    return run.get(name)


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


def recorded_runs(spec: Spec, out: str | os.PathLike | None = None) -> dict[tuple[str, int], dict]:
    """The finished runs that OUT/results.json records, by (variant, seed), for the runs this spec
    still trains the same way: the same base, shared overrides and variant overrides as when they
    were recorded. Run folders are not committed with an experiment; its results.json is, so a
    spec given a new variant (a control) trains only that one on a fresh clone, and the report
    is rebuilt from the recorded runs and the new ones alike. Unreadable files count as empty."""
    out = Path(out) if out is not None else spec.out
    try:
        old = json.loads((out / "results.json").read_text())
        old_spec, runs = old["spec"], old["runs"]
        same_base = old_spec.get("base") == spec.raw.get("base") and old_spec.get("overrides", []) == spec.overrides
        before = {v["name"]: v.get("overrides", []) for v in old_spec.get("variants", [])}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return {}
    if not same_base:
        return {}
    now = {v.name: v.overrides for v in spec.variants}
    return {(r["variant"], r["seed"]): r for r in runs
            if isinstance(r, dict) and r.get("variant") in now and before.get(r["variant"]) == now[r["variant"]]
            and r.get("seed") in spec.seeds}


def recorded_threads(out: Path) -> int | None:
    """The torch threads OUT/results.json says its runs were measured with (None if unknown)."""
    try:
        return json.loads((out / "results.json").read_text())["machine"]["torch_threads"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def plan(spec: Spec, out: str | os.PathLike | None = None, *, jobs: int = 1) -> list[RunPlan]:
    """Load and validate the config of every (variant, seed), and find what each run folder
    needs: nothing (done), only the metrics (evaluate), a resume from its checkpoint, a restart
    (killed before its first checkpoint) or a new run. Raises ConfigError for a config the
    trainer rejects, SweepError for a run folder trained with another config or whose
    checkpoint is damaged. Writes nothing."""
    from attnlab.train.checkpoint import CheckpointError
    from attnlab.train.resume import ResumeError, check_resume

    plans = []
    recorded = recorded_runs(spec, out)
    for v in spec.variants:
        for seed in spec.seeds:
            cfg, _ = run_config(spec, v, seed, out, jobs=jobs)
            _check_eval_lengths(cfg, spec.metrics, v.name)
            check_at_steps(cfg, spec.metrics, v.name)
            run_dir = Path(cfg.run_dir)
            state = _run_state(run_dir, cfg, spec.metrics)
            if state == "new" and (v.name, seed) in recorded:
                state = "recorded"
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
    layers = metrics.get("mqar_attention") or []
    if layers and cfg.data.source != "mqar":
        raise ConfigError(f"variant {variant!r}: metrics.mqar_attention measures the attention at MQAR queries; "
                          f"data.source is {cfg.data.source!r}, not 'mqar'")
    if layers and max(layers) >= cfg.model.n_layers:
        raise ConfigError(f"variant {variant!r}: metrics.mqar_attention names layer {max(layers)}; the model has "
                          f"model.n_layers={cfg.model.n_layers} (layers 0..{cfg.model.n_layers - 1})")
    if metrics.get("mqar_scales") or metrics.get("mqar_windows"):
        from attnlab.train.evaluate import check_mqar_scales

        try:
            check_mqar_scales(cfg, metrics.get("mqar_scales") or [1],
                              key="metrics.mqar_scales" if metrics.get("mqar_scales") else "metrics.mqar_windows",
                              scale_pairs=metrics.get("mqar_scale_pairs", True))
        except ValueError as e:
            raise ConfigError(f"variant {variant!r}: {e}") from None
    lengths = [*metrics.get("loss_at", []), *metrics.get("passkey", []), *metrics.get("heldout_lengths", []),
               *metrics.get("repeat_lengths", [])]
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
    """The scalars of a [metrics] table, measured by `attnlab.train.evaluate` on the run's final checkpoint
    and, with at_steps, on its checkpoint of each of those steps ("<name>/step=N"). Raises SweepError
    for a step whose checkpoint the run folder does not hold."""
    from attnlab.train.checkpoint import checkpoint_name, read_state
    from attnlab.train.trainer import CKPT_DIR

    out = _measure(run_dir, metrics)
    final = (json.loads((Path(run_dir) / "summary.json").read_text()) or {}).get("steps") if metrics.get("at_steps") else None
    for N in metrics.get("at_steps", []):
        if N == final:
            values = out
        else:
            ckpt = Path(run_dir) / CKPT_DIR / checkpoint_name(N)
            if not (ckpt / "state.json").is_file() or read_state(ckpt)["step"] != N:
                raise SweepError(f"metrics.at_steps: run folder {str(run_dir)!r} holds no checkpoint of step {N} "
                                 f"(train.ckpt_every and train.keep_checkpoints decide which are kept)")
            values = _measure(run_dir, metrics, str(ckpt))
        out.update({f"{name}/step={N}": v for name, v in list(values.items()) if "/step=" not in name})
    return out


def check_at_steps(cfg: RunConfig, metrics: dict, variant: str) -> None:
    """Every step of metrics.at_steps is one the run writes a checkpoint at and keeps to the end
    (a multiple of train.ckpt_every, or train.steps; train.keep_checkpoints large enough)."""
    steps, t = metrics.get("at_steps") or [], cfg.train
    if not steps:
        return
    if steps[-1] > t.steps:
        raise ConfigError(f"variant {variant!r}: metrics.at_steps names step {steps[-1]}, past train.steps={t.steps}")
    off = [N for N in steps if N != t.steps and (not t.ckpt_every or N % t.ckpt_every)]
    if off:
        raise ConfigError(f"variant {variant!r}: metrics.at_steps {off} are not checkpoint steps (multiples of "
                          f"train.ckpt_every={t.ckpt_every}, or train.steps)")
    written = len(range(t.ckpt_every * -(-steps[0] // t.ckpt_every), t.steps + 1, t.ckpt_every)) if t.ckpt_every else 1
    written += bool(t.ckpt_every) and t.steps % t.ckpt_every != 0
    if t.keep_checkpoints < written:
        raise ConfigError(f"variant {variant!r}: metrics.at_steps from step {steps[0]} needs the last {written} "
                          f"checkpoints kept; train.keep_checkpoints is {t.keep_checkpoints}")


def _measure(run_dir: str | os.PathLike, metrics: dict, checkpoint: str | None = None) -> dict[str, float | None]:
    """The final-checkpoint scalars of a [metrics] table (`final_metric_names`), measured on `checkpoint`
    (default: the newest)."""
    names = final_metric_names(metrics)
    if not names:
        return {}
    from attnlab.train import evaluate

    args = {k: metrics[k] for k in ("max_tokens", "batch_size", "analysis_len", "analysis_batch", "split") if k in metrics}
    ev = evaluate(run_dir, seq_lens=metrics.get("loss_at") or None, topk=tuple(metrics.get("topk_mass") or (8,)),
                  passkey_lengths=metrics.get("passkey") or None,
                  passkey_depths=tuple(metrics.get("passkey_depths", (0.0, 0.5, 1.0))),
                  windows=metrics.get("windowed_loss") or None, budgets=metrics.get("budgets") or None,
                  compress=metrics.get("compress") or None, context_lengths=metrics.get("lengths") or None,
                  mqar_scales=metrics.get("mqar_scales") or None, mqar_windows=metrics.get("mqar_windows") or None,
                  mqar_scale_pairs=metrics.get("mqar_scale_pairs", True),
                  mqar_attention=bool(metrics.get("mqar_attention")), heldout=metrics.get("heldout"),
                  heldout_lengths=metrics.get("heldout_lengths") or None, repeat_lengths=metrics.get("repeat_lengths") or None,
                  repeat_span=metrics.get("repeat_span", 32), repeat_probes=metrics.get("repeat_probes", 64),
                  checkpoint=checkpoint, write=False, **args)
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
    if metrics.get("learned_sink_share"):
        out["learned_sink_share"] = _mean_or_none([h for layer in layers for h in layer.get("learned_sink_share", [])])
    if metrics.get("alignment"):
        profiles = [layer["alignment"] for layer in layers if layer.get("alignment")]
        top = _mean_or_none([p[-1] for p in profiles])
        every = _mean_or_none([sum(p) / len(p) for p in profiles])
        out["align_top"] = top  # mean |qs - ks| of the top weight decile, mean over scalar layers
        out["align_ratio"] = top / every if top is not None and every else None  # ... over that of all pairs
        for i in range(10):  # the whole profile, lowest weight decile first
            out[f"align_d{i + 1}"] = _mean_or_none([p[i] for p in profiles if len(p) == 10])
    if metrics.get("gate"):  # mean over gated layers of the fraction of gate values below 0.1, and the histogram
        gated = [layer for layer in layers if layer.get("gate_hist")]
        out["gate_low"] = _mean_or_none([layer["gate_low"] for layer in gated])
        for i in range(GATE_BINS):
            out[f"gate_h{i + 1}"] = _mean_or_none([layer["gate_hist"][i] for layer in gated])
    if metrics.get("principled"):  # means over principled layers (and heads)
        for name in ("ground_weight", "gate_suppression", "gate_suppression_strong"):
            vals = [layer[name] for layer in layers if name in layer]
            out[name] = _mean_or_none([x for v in vals for x in (v if isinstance(v, list) else [v])])
    # windowed-decode loss at the first evaluated length (loss_at's first, else data.seq_len), and its gap to exact
    T0 = next(iter(ev.get("loss") or {}), None)
    base = (ev.get("loss") or {}).get(T0, {}).get("loss")
    for k in window_keys(metrics):
        w = ((ev.get("windowed_loss") or {}).get(T0, {}).get(k) or {}).get("loss")
        out[f"wloss@{k}"] = w
        out[f"wgap@{k}"] = w - base if w is not None and base is not None else None
    for key, r in (ev.get("compressed") or {}).items():  # "k/span=s", token by token on one batch
        out[f"wloss@{key}"], out[f"wgap@{key}"], out[f"kept@{key}"] = r["loss"], r["loss"] - r["exact"], r["kept"]
    rows = (ev.get("by_length") or {}).get("lengths", {})
    for T in metrics.get("lengths", []):
        row = rows.get(str(T), {})
        out[f"loss/T={T}"] = row.get("loss")
        for k in window_keys(metrics):
            w = (row.get("windowed_loss") or {}).get(k)
            out[f"wloss@{k}/T={T}"] = w
            out[f"wgap@{k}/T={T}"] = w - row["loss"] if w is not None and row.get("loss") is not None else None
        for k in metrics.get("topk_mass", []):
            out[f"topk_mass@{k}/T={T}"] = (row.get("topk_mass") or {}).get(str(k))
    if len(metrics.get("lengths", [])) >= 2:
        for k in metrics.get("topk_mass", []):
            out[f"miss_slope@{k}"] = ((ev.get("by_length") or {}).get("miss_slope") or {}).get(str(k))
    for L in metrics.get("passkey", []):
        out[f"passkey@{L}"] = _mean_or_none([v for key, v in (ev.get("passkey") or {}).items() if key.split("@")[0] == str(L)])
    for T in metrics.get("heldout_lengths", []):
        out[f"heldout/T={T}"] = (ev.get("heldout") or {}).get(str(T), {}).get("loss")
    for T in metrics.get("repeat_lengths", []):
        r = (ev.get("repeat") or {}).get(str(T), {})
        out[f"repeat/T={T}"], out[f"repeat_control/T={T}"], out[f"repeat_gain/T={T}"] = (
            r.get("repeat"), r.get("control"), r.get("gain"))
    out.update(mqar_values(ev, metrics))
    return out


def _mean_or_none(values) -> float | None:
    values = [float(v) for v in values if v is not None]
    return sum(values) / len(values) if values else None


def execute(job: dict) -> dict:
    """Train (or resume) one run and collect its metrics; writes RUN_DIR/sweep.json. `job` is
    picklable: {"raw": run config dict, "state": ..., "metrics": the spec's [metrics]}. Holds the
    run folder's lock throughout; a stop already requested (SIGINT/SIGTERM) starts nothing."""
    import torch

    from attnlab.train import train

    cfg = config_from_dict(job["raw"])
    run_dir = Path(cfg.run_dir)
    interrupt.check(f"{run_dir} not started")
    threads = torch.get_num_threads()
    t0 = time.perf_counter()
    try:
        with FolderLock(run_dir):
            if job["state"] != "evaluate":
                train(cfg)
            metrics = collect_metrics(run_dir, job["metrics"])
            old = _record_of(run_dir) or {}
            wall = time.perf_counter() - t0 if job["state"] != "evaluate" else old.get("wall_seconds")
            used = cfg.run.threads or threads
            # the machine that trained the run (a re-evaluation keeps the one recorded when it was trained)
            machine = old.get("machine") if job["state"] == "evaluate" and old.get("machine") else machine_info(used)
            record = {"metrics_spec": job["metrics"], "metrics": metrics, "wall_seconds": wall,
                      "threads": used, "machine": machine}
            atomic_write_text(run_dir / RECORD, json.dumps(record, indent=2) + "\n")
    finally:
        torch.set_num_threads(threads)  # run.threads is process-wide: leave the caller's setting
    return record


# --------------------------------------------------------------------------- the sweep
