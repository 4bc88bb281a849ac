"""The quickstart: softmax, scalar and hybrid attention trained on the same budget, compared.

    from attnlab.experiments.quickstart import run
    results = run("runs/quickstart")          # what `attnlab quickstart` / `make quickstart` do

It is one sweep spec, experiments/quickstart/spec.toml, run by the sweep code
(`attnlab.experiments.sweep`): this module only turns the quickstart's options into that spec
(--steps, --minutes, --mechanisms, overrides for every model, --eval-tokens) and hands it to
`sweep.run`. Each model gets the same width, depth, heads, data, seed, batch and number of
optimizer steps, so the same training tokens; only `model.attn` differs. The data is the embedded
Python-stdlib corpus in byte tokens (no download). After training, every model is evaluated on the
validation split at the training length and at twice it, its attention is analysed (entropy,
first-token share, top-k scalar mass) and windowed decoding is measured (wloss@k, wgap@k). The
sweep writes OUT/results.json, OUT/report.md and the plots; each model's run folder is
OUT/runs/<mechanism>/seed<k>/. Run again, finished models are kept and only the report is rebuilt.

The budget is a step count, so a run is reproducible; `minutes=` instead measures the step
time of each model on this machine and picks the step count that fits (not reproducible
across machines). When every CPU is already busy the models train with one torch thread
(`busy_threads`).
"""

from __future__ import annotations

import dataclasses
import os
import time
from pathlib import Path
from typing import Sequence

import torch

from attnlab.checks import check_int
from attnlab.models.config import ConfigError
from attnlab.train.config import RunConfig, read_toml

COMPARED = ("softmax", "scalar", "hybrid")  # the quickstart's default mechanisms (a subset of layers.MECHANISMS)

# The shared configuration of every model, read where `attnlab train` reads it too (the source tree's
# configs/quickstart.toml), and the spec that the sweep runs.
ROOT = Path(__file__).resolve().parents[3]
CONFIG_FILE = ROOT / "configs" / "quickstart.toml"
SPEC_FILE = ROOT / "experiments" / "quickstart" / "spec.toml"
# Keys the quickstart sets itself: a user override of them would break the comparison.
OWNED_KEYS = ("model.attn", "run.name", "run.out_dir", "run.resume", "train.steps")


# --------------------------------------------------------------------------- configs


def base_config() -> dict:
    """The shared configuration as a fresh raw dict (ConfigError when CONFIG_FILE is missing,
    as it is outside a source checkout)."""
    return read_toml(CONFIG_FILE)


def _config_int(name: str, value) -> int:
    """`check_int`, its error reported as the ConfigError of a bad setting."""
    try:
        return check_int(name, value)
    except (TypeError, ValueError) as e:
        raise ConfigError(str(e)) from None


def _reject_owned(overrides: Sequence[str]) -> None:
    for item in overrides:
        key = item.split("=", 1)[0].strip()
        if key in OWNED_KEYS:
            hint = {"model.attn": "--mechanisms", "train.steps": "--steps", "run.out_dir": "--out"}.get(key)
            how = f"choose it with {hint} (mechanisms=/steps=/out= in Python)" if hint else "remove it"
            raise ConfigError(f"{key} is set by the quickstart for every model: {how}; it owns {', '.join(OWNED_KEYS)}")


def quickstart_spec(
    *,
    steps: int | None = None,
    mechanisms: Sequence[str] = COMPARED,
    overrides: Sequence[str] = (),
    eval_tokens: int | None = None,
):
    """The quickstart's sweep Spec: SPEC_FILE with one variant per mechanism, `overrides` (and the
    step budget) applied to every model, and the evaluation lengths and budget it measures at."""
    from .sweep import Variant, load_spec, run_config

    if not mechanisms:
        raise ConfigError(f"mechanisms must name at least one of {COMPARED}, got none")
    from attnlab.models.config import MECHANISMS as ALL

    for m in mechanisms:
        if m not in ALL:
            raise ConfigError(f"mechanisms: {m!r} is not a mechanism; allowed: {', '.join(ALL)}")
    if len(set(mechanisms)) != len(mechanisms):
        raise ConfigError(f"mechanisms must not repeat, got {list(mechanisms)}")
    if steps is not None:
        _config_int("steps", steps)
    if eval_tokens is not None:
        _config_int("eval_tokens", eval_tokens)
    _reject_owned(overrides)
    spec = load_spec(SPEC_FILE)
    spec = dataclasses.replace(spec, variants=[Variant(m, [f"model.attn={m}"]) for m in mechanisms])
    extra = [o for o in overrides if o.split("=", 1)[0].strip() != "run.seed"]
    seeds = [o.split("=", 1)[1].strip() for o in overrides if o.split("=", 1)[0].strip() == "run.seed"]
    if seeds:
        spec = dataclasses.replace(spec, seeds=[_config_int("run.seed", int(seeds[-1]) if seeds[-1].isdigit() else seeds[-1])])
    if steps is not None:
        warmup = read_toml(CONFIG_FILE)["train"].get("warmup_steps", 20)
        extra += [f"train.steps={steps}", f"train.warmup_steps={min(warmup, max(0, steps // 10))}"]
    spec = dataclasses.replace(spec, overrides=spec.overrides + extra)
    cfg, _ = run_config(spec, spec.variants[0], spec.seeds[0])
    T = cfg.data.seq_len
    spec.metrics = {**spec.metrics, "loss_at": [T, 2 * T], "analysis_len": min(T, 256),
                    "max_tokens": eval_tokens or cfg.train.eval_batches * cfg.train.batch_size * T}
    return spec


def quickstart_configs(
    out: str | os.PathLike | None = None,
    *,
    steps: int | None = None,
    mechanisms: Sequence[str] = COMPARED,
    overrides: Sequence[str] = (),
) -> list[RunConfig]:
    """One validated RunConfig per mechanism, identical but for model.attn and the run folder
    (OUT/runs/<mechanism>/seed<k>; OUT defaults to run.out_dir of the base config)."""
    from .sweep import run_config

    spec = quickstart_spec(steps=steps, mechanisms=mechanisms, overrides=overrides)
    out = base_config()["run"]["out_dir"] if out is None else out
    return [run_config(spec, v, spec.seeds[0], out)[0] for v in spec.variants]


# --------------------------------------------------------------------------- budget


def busy_threads(overrides: Sequence[str]) -> int | None:
    """1 when other processes already occupy every CPU (1-minute load average >= CPU count)
    and the user chose no run.threads, else None (torch's default). Several threads that
    must meet at every parallel region stall each other when the CPUs are shared; one
    thread does not, which on a busy 2-core machine is several times faster."""
    if any(item.split("=", 1)[0].strip() == "run.threads" for item in overrides) or not hasattr(os, "getloadavg"):
        return None
    cpus = os.cpu_count() or 1
    return 1 if cpus > 1 and os.getloadavg()[0] >= cpus else None


def step_seconds(cfg: RunConfig, repeats: int = 2) -> float:
    """Seconds per optimizer step of cfg's model on this machine (random tokens; forward,
    backward and AdamW step over train.grad_accum micro-batches; after one warm-up step)."""
    from attnlab.train.trainer import build_model, make_optimizer

    torch.manual_seed(cfg.run.seed)
    model = build_model(cfg, cfg.vocab_size)
    opt = make_optimizer(model, cfg.train)
    B, T = cfg.train.batch_size, cfg.data.seq_len
    x = torch.randint(0, cfg.vocab_size, (B, T))  # (B, T)
    times = []
    for i in range(repeats + 1):
        t0 = time.perf_counter()
        for _ in range(cfg.train.grad_accum):
            _, loss = model(x, x)
            loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        if i:
            times.append(time.perf_counter() - t0)
    return min(times)


def steps_for_minutes(cfgs: Sequence[RunConfig], minutes: float, *, eval_share: float = 0.15) -> tuple[int, dict]:
    """The step count that lets every model of `cfgs` train within `minutes` in total,
    keeping `eval_share` of the time for evaluation and the report. Returns (steps, {name: s/step})."""
    if isinstance(minutes, bool) or not isinstance(minutes, (int, float)) or not minutes > 0:
        raise ConfigError(f"minutes must be a number > 0, got {minutes!r}")
    before = torch.get_num_threads()
    try:
        per_step = {}
        for c in cfgs:
            torch.set_num_threads(c.run.threads or before)  # time the models as they will train
            per_step[Path(c.run_dir).parent.name] = step_seconds(c)  # the variant (mechanism)
    finally:
        torch.set_num_threads(before)
    steps = int(minutes * 60 * (1 - eval_share) / sum(per_step.values()))
    if steps < 1:
        raise ConfigError(
            f"minutes={minutes} is too short: one step of every model takes {sum(per_step.values()):.1f} s here"
        )
    return steps, per_step


# --------------------------------------------------------------------------- the run


def _log(msg: str, quiet: bool) -> None:
    if not quiet:
        print(msg, flush=True)


def run(
    out: str | os.PathLike | None = None,
    *,
    steps: int | None = None,
    minutes: float | None = None,
    mechanisms: Sequence[str] = COMPARED,
    overrides: Sequence[str] = (),
    eval_tokens: int | None = None,
    progress: bool = True,
    quiet: bool = False,
    command: str | None = None,
) -> dict:
    """Train and compare through the sweep; returns its results dict (also OUT/results.json; OUT
    defaults to run.out_dir of the base config). See the module docstring."""
    from .sweep import run as run_sweep

    out = base_config()["run"]["out_dir"] if out is None else out
    if steps is not None and minutes is not None:
        raise ConfigError("give steps or minutes, not both (steps fixes the budget; minutes measures it here)")
    extra = list(overrides)
    quickstart_spec(steps=steps, mechanisms=mechanisms, overrides=extra, eval_tokens=eval_tokens)  # validate first
    threads = busy_threads(extra)
    if threads:
        _log(f"the CPUs are busy (load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs): training with {threads} torch "
             f"thread; set run.threads=N to choose", quiet)
        extra.append(f"run.threads={threads}")
    if minutes is not None:
        steps, per_step = steps_for_minutes(quickstart_configs(out, mechanisms=mechanisms, overrides=extra), minutes)
        _log(f"measured s/step: {', '.join(f'{k} {v:.2f}' for k, v in per_step.items())} -> {steps} steps per model", quiet)
    spec = quickstart_spec(steps=steps, mechanisms=mechanisms, overrides=extra, eval_tokens=eval_tokens)
    t0 = time.perf_counter()
    threads_before = torch.get_num_threads()
    try:
        results = run_sweep(spec, out=out, progress=progress, quiet=quiet,
                            command=command or f"attnlab.experiments.quickstart.run({str(out)!r})")
    finally:
        torch.set_num_threads(threads_before)  # run.threads is process-wide; leave the caller's setting
    _log(f"total {(time.perf_counter() - t0) / 60:.1f} min", quiet)
    return results


__all__ = ["CONFIG_FILE", "COMPARED", "SPEC_FILE", "base_config", "quickstart_configs", "quickstart_spec", "run",
           "steps_for_minutes", "step_seconds"]
