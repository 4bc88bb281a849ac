"""The quickstart: softmax, scalar and hybrid attention trained on the same budget, compared.

    from attnlab.experiments.quickstart import run
    results = run("runs/quickstart")          # what `attnlab quickstart` / `make quickstart` do

Each model gets the same width, depth, heads, data, seed, batch and number of optimizer
steps, so the same training tokens; only `model.attn` differs. The data is the embedded
Python-stdlib corpus in byte tokens (no download). After training, every model is
evaluated on the validation split at the training length and at twice it, and its
attention is analysed (entropy, sink share, top-k scalar mass). The comparison is printed
as a table and written to OUT/report.md and OUT/results.json with PNG plots of the loss
curves and of τ; each model's run folder (OUT/<mechanism>/) keeps its logs, checkpoint,
eval.json and eval.md.

The budget is a step count, so a run is reproducible; `minutes=` instead measures the step
time of each model on this machine and picks the step count that fits (not reproducible
across machines). The default budget (200 steps of 16 x 256 tokens per model) took 7.2
minutes in all, evaluation included, on a 2-core CPU that other jobs were also using.
When every CPU is already busy the models train with one torch thread (`busy_threads`).
"""

from __future__ import annotations

import copy
import json
import os
import time
from pathlib import Path
from typing import Sequence

import torch

from attnlab.checks import check_int
from attnlab.models.config import ConfigError
from attnlab.train.config import RunConfig, apply_overrides, config_from_dict, read_toml, to_dict

from .report import machine_info, markdown_table, mean, plot_loss_curves, plot_tau, topk_summary, write_eval_report

COMPARED = ("softmax", "scalar", "hybrid")  # the quickstart's default mechanisms (a subset of layers.MECHANISMS)
TOPK = (8, 16, 32, 64)

# The shared configuration of every model, read where `attnlab train` reads it too (the source tree's
# configs/quickstart.toml): each model is it with model.attn, run.name and run.out_dir set.
CONFIG_FILE = Path(__file__).resolve().parents[3] / "configs" / "quickstart.toml"
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


def quickstart_configs(
    out: str | os.PathLike | None = None,
    *,
    steps: int | None = None,
    mechanisms: Sequence[str] = COMPARED,
    overrides: Sequence[str] = (),
) -> list[RunConfig]:
    """One validated RunConfig per mechanism, identical but for model.attn and run.name, in the
    folder `out` (default: run.out_dir of the base config)."""
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
    _reject_owned(overrides)
    base = base_config()
    out = base["run"]["out_dir"] if out is None else out
    cfgs = []
    for m in mechanisms:
        raw = apply_overrides(copy.deepcopy(base), list(overrides))
        raw["model"]["attn"] = m
        raw["run"].update(name=m, out_dir=str(out), overwrite=True)
        if steps is not None:
            raw["train"]["steps"] = steps
            raw["train"]["warmup_steps"] = min(raw["train"].get("warmup_steps", 20), max(0, steps // 10))
        cfgs.append(config_from_dict(raw))
    return cfgs


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
            per_step[c.run.name] = step_seconds(c)
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
    """Train and compare; returns the results dict (also OUT/results.json; OUT defaults to run.out_dir
    of the base config). See the module docstring."""
    out = base_config()["run"]["out_dir"] if out is None else out
    if steps is not None and minutes is not None:
        raise ConfigError("give steps or minutes, not both (steps fixes the budget; minutes measures it here)")
    if eval_tokens is not None:
        _config_int("eval_tokens", eval_tokens)
    extra = list(overrides) + ([] if progress else ["run.progress=false"])
    cfgs = quickstart_configs(out, steps=steps, mechanisms=mechanisms, overrides=extra)
    threads = busy_threads(extra)
    if threads:
        _log(f"the CPUs are busy (load {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs): training with {threads} torch "
             f"thread; set run.threads=N to choose", quiet)
        extra.append(f"run.threads={threads}")
        cfgs = quickstart_configs(out, steps=steps, mechanisms=mechanisms, overrides=extra)
    t_start = time.perf_counter()
    per_step = None
    if minutes is not None:
        steps, per_step = steps_for_minutes(cfgs, minutes)
        _log(f"measured s/step: {', '.join(f'{k} {v:.2f}' for k, v in per_step.items())} -> {steps} steps per model", quiet)
        cfgs = quickstart_configs(out, steps=steps, mechanisms=mechanisms, overrides=extra)
    c0 = cfgs[0]
    tokens = c0.train.steps * c0.train.tokens_per_step
    _log(
        f"quickstart: {len(cfgs)} models ({', '.join(c.run.name for c in cfgs)}), each {c0.train.steps} steps x "
        f"{c0.train.tokens_per_step:,} tokens = {tokens:,} tokens; d_model {c0.model.d_model}, {c0.model.n_layers} layers, "
        f"{c0.model.n_heads} heads, seq_len {c0.data.seq_len}, seed {c0.run.seed}; torch threads {c0.run.threads or torch.get_num_threads()}",
        quiet,
    )
    Path(out).mkdir(parents=True, exist_ok=True)
    threads_before = torch.get_num_threads()
    try:
        models, histories = _train_and_evaluate(cfgs, eval_tokens, quiet)
        machine = machine_info()  # with the thread count the models trained with
    finally:
        torch.set_num_threads(threads_before)  # run.threads is process-wide; leave the caller's setting
    results = {
        "command": command or "attnlab.experiments.quickstart.run(" + repr(str(out)) + ")",
        "steps": c0.train.steps,
        "tokens_per_model": tokens,
        "steps_chosen_by": "minutes" if per_step else "steps",
        "seconds_per_step_measured": per_step,
        "config": {k: v for k, v in to_dict(c0).items() if k != "run"} | {"seed": c0.run.seed},
        "machine": machine,
        "models": models,
        "curves": {name: _curves(h) for name, h in histories.items()},
        "total_seconds": time.perf_counter() - t_start,
    }
    write_report(results, out, histories)
    _log("\n" + comparison_table(results), quiet)
    _log(f"\nreport: {Path(out) / 'report.md'} (results.json, loss_curves.png, tau.png beside it); "
         f"total {results['total_seconds'] / 60:.1f} min", quiet)
    return results


def _train_and_evaluate(cfgs: Sequence[RunConfig], eval_tokens: int | None, quiet: bool) -> tuple[list, dict]:
    """Train and evaluate each config in turn: (one result row per model, {name: log history})."""
    from attnlab.train import evaluate, train

    models, histories = [], {}
    for i, cfg in enumerate(cfgs):
        name = cfg.run.name
        _log(f"[{i + 1}/{len(cfgs)}] training {name}", quiet)
        summary = train(cfg)
        T = cfg.data.seq_len
        # by default the same validation text as the trainer's evaluations, so the table matches the curve's end
        n_eval = eval_tokens or cfg.train.eval_batches * cfg.train.batch_size * T
        ev = evaluate(cfg.run_dir, seq_lens=[T, 2 * T], max_tokens=n_eval, analysis_len=min(T, 256), topk=TOPK)
        write_eval_report(ev, cfg.run_dir)
        histories[name] = summary["history"]
        models.append(_model_row(name, cfg, summary, ev))
        m = models[-1]
        _log(f"[{i + 1}/{len(cfgs)}] {name}: val loss {m['val_loss']:.4f} (ppl {m['val_ppl']:.2f}), "
             f"{m['tokens_per_s']:,.0f} tokens/s", quiet)
    return models, histories


def _model_row(name: str, cfg: RunConfig, summary: dict, ev: dict) -> dict:
    T = cfg.data.seq_len
    loss = ev["loss"]
    return {
        "mechanism": name,
        "run_dir": cfg.run_dir,
        "params": summary["params"],
        "steps": summary["steps"],
        "tokens": summary["steps"] * cfg.train.tokens_per_step,
        "val_loss": loss[str(T)]["loss"],
        "val_ppl": loss[str(T)]["ppl"],
        "val_loss_2x": loss[str(2 * T)]["loss"],
        "val_tokens": loss[str(T)]["tokens"],
        "train_loss": summary["train_loss"],
        "tokens_per_s": summary["tokens_per_s"],
        "train_seconds": summary["train_seconds"],
        "tau": summary["tau"],
        "topk_mass": topk_summary(ev.get("layers", [])),
        "entropy": [mean(layer["entropy"]) if "entropy" in layer else None for layer in ev.get("layers", [])],
        "sink_share": [mean(layer["first_token_share"]) if "first_token_share" in layer else None
                       for layer in ev.get("layers", [])],
    }


def _curves(history: dict) -> dict:
    train_rows = history.get("train", [])
    return {
        "train": [[r["step"], r["loss"]] for r in train_rows],
        "val": [[r["step"], r["val_loss"]] for r in history.get("eval", [])],
        "tau": [[r["step"], [layer.get("tau_mean") for layer in r.get("layers", [])]] for r in train_rows if r.get("layers")],
    }


# --------------------------------------------------------------------------- report


def comparison_table(results: dict) -> str:
    """The printed comparison: one row per model."""
    T = results["config"]["data"]["seq_len"]
    headers = ["model", "params", "val loss", "val ppl", f"loss @{2 * T}", "tokens/s", "τ per layer"]
    headers += [f"top-{k} mass" for k in TOPK]
    rows = []
    for m in results["models"]:
        taus = [t for t in m["tau"] if t is not None]
        row = [m["mechanism"], m["params"], m["val_loss"], m["val_ppl"], m["val_loss_2x"], m["tokens_per_s"],
               " / ".join(f"{t:.3g}" for t in taus) if taus else None]
        row += [m["topk_mass"].get(str(k)) for k in TOPK]
        rows.append(row)
    return markdown_table(headers, rows)


def write_report(results: dict, out: str | os.PathLike, histories: dict) -> Path:
    """OUT/results.json, OUT/loss_curves.png, OUT/tau.png and OUT/report.md."""
    out = Path(out)
    (out / "results.json").write_text(json.dumps(results, indent=2, default=str) + "\n")
    plot_loss_curves(histories, out / "loss_curves.png")
    tau_png = plot_tau(histories, out / "tau.png")
    cfg = results["config"]
    mdl, dat, trn = cfg["model"], cfg["data"], cfg["train"]
    T = dat["seq_len"]
    mach = results["machine"]
    lines = [
        "# attnlab quickstart: softmax vs scalar vs hybrid attention",
        "",
        f"Command: `{results['command']}`",
        "",
        f"Every model: d_model {mdl['d_model']}, {mdl['n_layers']} layers, {mdl['n_heads']} heads, "
        f"seq_len {T}, batch {trn['batch_size']} x {trn['grad_accum']}, {results['steps']} steps "
        f"({results['tokens_per_model']:,} training tokens), AdamW lr {trn['lr']} with {trn['warmup_steps']} warmup steps "
        f"and cosine decay, seed {cfg['seed']}. Data: {dat['source']} corpus, {dat['tokenizer']} tokens. "
        f"Only `model.attn` differs.",
        "",
        comparison_table(results),
        "",
        f"- **val loss / ppl**: mean next-token loss (nats per byte token) on up to {results['models'][0]['val_tokens']:,} "
        f"validation tokens in windows of {T}; **loss @{2 * T}**: the same text in windows of {2 * T} "
        f"(twice the training length).",
        "- **tokens/s**: training throughput (forward, backward and optimizer step; evaluation excluded).",
        "- **τ per layer**: the scalar-kernel temperature at the end of training, mean over heads.",
        "- **top-k mass**: share of each query's attention inside its k nearest keys in scalar space, mean over the "
        "scalar heads of all layers and over the queries that see more than k keys; "
        "what a k-entry window of the sorted scalar cache would capture at decode time.",
        "",
        "![loss curves](loss_curves.png)",
        "",
    ]
    if tau_png is not None:
        lines += ["![tau trajectories](tau.png)", ""]
    lines += ["## Per layer", ""]
    rows = []
    for m in results["models"]:
        for i, ent in enumerate(m["entropy"]):
            rows.append([m["mechanism"], i, ent, m["sink_share"][i], m["tau"][i] if i < len(m["tau"]) else None])
    lines += [markdown_table(["model", "layer", "entropy (nats)", "sink share", "τ"], rows), ""]
    lines += [
        f"Each model's run folder (`{out}/<model>/`) holds its resolved config, logs (log.jsonl, train.csv, eval.csv), "
        "checkpoint, eval.json and eval.md with per-head numbers.",
        "",
        f"Machine: Python {mach['python']}, torch {mach['torch']}, {mach['cpus']} CPUs "
        f"({mach['torch_threads']} torch threads){', ' + mach['cuda'] if mach['cuda'] else ''}; "
        f"wall time {results['total_seconds'] / 60:.1f} min in total.",
    ]
    path = out / "report.md"
    path.write_text("\n".join(lines) + "\n")
    return path


__all__ = ["CONFIG_FILE", "COMPARED", "base_config", "comparison_table", "quickstart_configs", "run",
           "steps_for_minutes", "step_seconds", "write_report"]
