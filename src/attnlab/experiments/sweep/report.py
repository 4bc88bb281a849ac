"""A sweep's report.md and plots, from its aggregated results (.results)."""


from __future__ import annotations

import math
import os
from pathlib import Path

from .profiles import is_profile, profile_sections
from ..report import MISSING, fmt, markdown_table, rebuild_command, report_head, save_figure
from .runs import scalar_of
from .budget import budget_lines
from .spec import EVAL_ARG_KEYS, Spec, step_of
from .verdict import answer_lines, verdict_lines


# --------------------------------------------------------------------------- report


def _pm(mean, sd, digits: int = 4) -> str:
    """mean ± sd, the sd to 2 significant digits."""
    if mean is None:
        return MISSING
    if sd is None:
        return fmt(mean, digits)
    return f"{fmt(mean, digits)} ± {fmt(sd, digits) if sd >= 1 or sd == 0 or not math.isfinite(sd) else f'{sd:.2g}'}"


def results_table(results: dict) -> str:
    names = [n for n in results["scalars"] if not is_profile(n) and step_of(n)[1] is None]
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
    lines = report_head(spec.title, "attnlab sweep", spec.path.name, spec.claim, spec.description,
                        rebuild=rebuild_command(str(results.get("command") or ""), spec.path, out))
    lines += ["## Setup", "",
              f"- Base config: {base}" + (f"; shared overrides: {', '.join(f'`{o}`' for o in spec.overrides)}"
                                           if spec.overrides else "") + ".",
              "- Variants: " + "; ".join(f"**{name}** ({', '.join(f'`{o}`' for o in v['overrides']) or 'the base'}"
                                         f"{': ' + v['description'] if v['description'] else ''})" for name, v in vs.items()) + ".",
              "- Model size: " + ", ".join(f"{name} {fmt(v['params'] or v.get('params_planned'))} parameters"
                                           for name, v in vs.items()) +
              f" (d_model {common('d_model')}, {common('n_layers')} layers, {common('n_heads')} heads).",
              f"- Scale per run: {common('steps')} optimizer steps x {common('batch_size')} x {common('grad_accum')} "
              f"sequences of {common('seq_len')} tokens (context) = {common('tokens_per_run', fmt)} training tokens; "
              f"AdamW lr {common('lr')}" + _early_stop_text(first.get("early_stop")) + ".",
              f"- Data: {common('data')} ({first['tokenizer']} tokens"
              f"{', ' + str(first['max_docs']) + ' documents per split' if first['max_docs'] else ''}).",
              f"- Seeds: {', '.join(map(str, spec.seeds))}; {len(results['runs'])} of "
              f"{len(results['runs']) + len(results['missing'])} runs finished"
              + (f" (missing: {', '.join(results['missing'])})" if results["missing"] else "") + ".", ""]
    lines += ["## Results: mean ± sd over seeds", "", results_table(results), "",
              "sd is the sample standard deviation over seeds (n - 1); with one seed only the value is shown. "
              "val loss/ppl: the trainer's final validation (nats per token); tokens/s and train_seconds: training "
              "throughput and time, over every process that trained the run where it was resumed; τ per layer: mean over heads and seeds.", ""]
    if spec.metrics:
        lines += [_metrics_text(spec.metrics), ""]
    lines += budget_lines(results.get("budget"))
    lines += steps_lines(spec, results)
    lines += profile_sections(results, out)
    lines += answer_lines(results.get("answer"))
    lines += verdict_lines(spec.verdicts, results.get("verdicts") or [])
    lines += earlier_lines(spec, results)
    lines += ["## Plots", "", "![loss curves](loss_curves.png)", "",
              "Train and validation loss per variant (and, where a variant has scalar heads, its temperature τ, "
              "the mean over layers of the mean over heads): the mean over seeds as a line, the min-max over "
              "seeds as a band.", ""]
    if metrics_png:
        lines += ["![per-run metrics](metrics.png)", "", "Each per-run scalar: the mean over seeds as a bar, ±1 sd as an "
                  "error bar, each seed as a dot.", ""]
    if spec.metrics.get("at_steps"):
        lines += ["![by training tokens](by_tokens.png)", "", "Each metric measured on the checkpoints of "
                  "metrics.at_steps, against the training tokens seen: the mean over seeds as a line, ±1 sd as a band.", ""]
    if spec.per_seed:
        names = results["scalars"]
        rows = [[r["variant"], r["seed"]] + [scalar_of(r, n) for n in names] for r in results["runs"]]
        lines += ["## Per seed", "", markdown_table(["variant", "seed"] + names, rows), ""]
    lines += ["## Reproduce", "", f"Command: `{results['command']}`", "",
              f"Run folders: `{os.path.relpath(out / 'runs', out)}/<variant>/seed<k>/` (config, logs, checkpoints, "
              f"summary.json, sweep.json). " + machines_text(results)]
    return "\n".join(lines)


def earlier_lines(spec: Spec, results: dict) -> list[str]:
    """With `earlier`: each rule's verdict at the earlier budget beside today's (rules matched by name; a
    rule that only one of them has shows a dash for the other)."""
    import json

    if spec.earlier is None:
        return []
    old = json.loads(spec.earlier.read_text(encoding="utf-8"))
    then = {v.get("name") or str(i): v for i, v in enumerate(old.get("verdicts") or [])}
    now = {v.get("name") or str(i): v for i, v in enumerate(results.get("verdicts") or [])}
    ratio = (old.get("budget") or {}).get("tokens_per_param") or {}
    scale = (f"{min(ratio.values()):g}-{max(ratio.values()):g} tokens per parameter" if ratio else "its budget")
    rows = [[name, then[name]["outcome"] if name in then else "—", now[name]["outcome"] if name in now else "—"]
            for name in [*now, *(n for n in then if n not in now)]]
    where = os.path.relpath(spec.earlier, spec.path.parent)
    return ["## Beside the earlier verdicts", "",
            f"The same rules judged on the earlier runs (`{where}`, at {scale}) and on these:", "",
            markdown_table(["rule", "earlier", "now"], rows), ""]


def _by_step(results: dict) -> tuple[list[str], list[int]]:
    """(the metrics measured at steps, the steps), in the spec's order."""
    names, steps = [], []
    for n in results["scalars"]:
        head, step = step_of(n)
        if step is not None:
            names += [head] if head not in names else []
            steps += [step] if step not in steps else []
    return names, steps


def steps_lines(spec: Spec, results: dict) -> list[str]:
    """With metrics.at_steps: per variant, each metric at each step (mean ± sd over seeds), by tokens seen."""
    names, steps = _by_step(results)
    if not steps:
        return []
    lines = ["## By training tokens", "", "Each metric on the checkpoint of each step of metrics.at_steps "
             "(mean ± sd over seeds); tokens/param: the training tokens seen per parameter of the model.", ""]
    for name, v in results["variants"].items():
        per = v["tokens_per_run"] / v["steps"]
        rows = [[N, fmt(N * per), f"{N * per / v['params']:.2f}" if v["params"] else None]
                + [_pm(v["mean"].get(f"{m}/step={N}"), v["sd"].get(f"{m}/step={N}")) for m in names] for N in steps]
        lines += [f"**{name}**", "", markdown_table(["step", "tokens", "tokens/param"] + names, rows), ""]
    return lines


def _panels(n: int, width: float, height: float):
    """A figure of n panels, up to 3 a row: (fig, axes as a 2-D array)."""
    from ..report import pyplot

    ncols = min(3, n)
    nrows = math.ceil(n / ncols)
    return pyplot().subplots(nrows, ncols, figsize=(width * ncols, height * nrows), dpi=120, squeeze=False)


def plot_steps(spec: Spec, results: dict, path: Path) -> Path | None:
    """One panel per metric of metrics.at_steps: mean over seeds against training tokens, ±1 sd band."""
    from ..report import pyplot

    names, steps = _by_step(results)
    if not steps:
        return None
    fig, axes = _panels(len(names), 4.4, 3.4)
    for ax, m in zip(axes.flat, names):
        for i, (name, v) in enumerate(results["variants"].items()):
            per = v["tokens_per_run"] / v["steps"]
            pts = [(N * per / 1e6, v["mean"].get(f"{m}/step={N}"), v["sd"].get(f"{m}/step={N}") or 0.0) for N in steps]
            pts = [p for p in pts if p[1] is not None]
            if not pts:
                continue
            x, y, sd = zip(*pts)
            ax.plot(x, y, color=f"C{i}", marker="o", ms=3, lw=1.6, label=f"{name} (n={v['n']})")
            ax.fill_between(x, [a - b for a, b in zip(y, sd)], [a + b for a, b in zip(y, sd)], color=f"C{i}", alpha=0.2, lw=0)
        ax.set_xscale("log")
        ax.set_xlabel("training tokens (millions)")
        ax.set_title(m, fontsize=9)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    for ax in list(axes.flat)[len(names):]:
        ax.set_visible(False)
    fig.suptitle(spec.title, fontsize=10)
    return save_figure(fig, path)


def _machine_text(m: dict, cuda: bool = True) -> str:
    return (f"Python {m['python']}, torch {m['torch']}, {m['platform']}, {m['cpus']} CPUs, torch threads per run: "
            f"{m['torch_threads']}{', ' + m['cuda'] if cuda and m.get('cuda') else ''}")


def machines_text(results: dict) -> str:
    """The machine that trained the runs, or each machine with the runs it trained (a sweep in pieces)."""
    groups = results.get("machines")
    if not groups:
        return f"Machine: {_machine_text(results['machine'])}."
    return ("The runs were trained on " + str(len(groups)) + " machines (a sweep in pieces): " + "; ".join(
        (f"{g['machine']['cuda']} ({_machine_text(g['machine'], cuda=False)})" if g["machine"].get("cuda")
         else _machine_text(g["machine"])) + f" trained {', '.join(g['runs'])}" for g in groups) + ".")


def _early_stop_text(early: dict | None) -> str:
    if not early:
        return ""
    return (f"; steps and tokens are the most a run may take: each stops early after {early['patience']} evaluations "
            f"(every {early['every']} steps) without a better {early['metric']} on the validation split and ends "
            f"with the best evaluation's weights (stopped_at: the steps it trained; best_step: the weights kept)")


# What each [metrics] key adds to the report's 'Collected metrics' paragraph, in this order.
_METRIC_TEXT = (
    ("loss_at", "**loss@L**: validation loss (nats/token) at context length L"),
    ("topk_mass", "**topk_mass@k**: share of each query's attention inside its k nearest keys in scalar space, "
     "mean over the scalar heads (— for variants without any)"),
    ("entropy", "**entropy**: attention entropy (nats), mean over heads and layers"),
    ("sink_share", "**sink_share**: attention mass on the first token, mean over heads and layers (for the linear "
     "family, the share of the first token in the row mass of |A|, A its effective mixing matrix)"),
    ("learned_sink_share", "**learned_sink_share**: attention mass on the learned sink entry, mean over scalar "
     "heads and layers"),
    ("alignment", "**align_top**: mean |qs − ks| of the 10% (query, key) pairs with the most attention weight; "
     "**align_ratio**: align_top over the mean |qs − ks| of all visible pairs (scale-free: < 1 means "
     "heavy pairs sit closer than average)"),
    ("gate", "**gate_low**: fraction of the output gate's values below 0.1 on the analysis batch, mean over "
     "gated layers (— for variants without a gate)"),
    ("principled", "**ground_weight**: principled attention's mass on the ground value v0 (1 − the key weights' sum), "
     "mean over queries, heads and principled layers; **gate_suppression**: mean of its suppress-only gate "
     "b = softplus(β)·softplus(−qg·kg) ≥ 0 over visible pairs (nats taken off a logit); "
     "**gate_suppression_strong**: fraction of pairs with b > 1"),
    ("windowed_loss", "**wloss@k**: validation loss when every scalar/hybrid head reads only its k nearest keys in "
     "scalar space plus the sink (what decoding through the sorted cache computes); **wgap@k**: "
     "wloss@k minus the exact loss on the same tokens"),
    ("compress", "**wloss@k/span=s**: windowed decoding with density compression (after each step, runs of 4 "
     "adjacent keys spanning <= s merge into one entry), token by token on one batch at the training "
     "length; **wgap@k/span=s**: minus the exact loss of the same tokens; **kept@k/span=s**: cache "
     "entries per head over tokens at the end"),
    ("lengths", "**miss_slope@k**: least-squares slope of (1 − topk_mass@k) against ln T over the context lengths"),
    ("passkey", "**passkey@L**: passkey retrieval accuracy at length L, mean over depths"),
    ("heldout_lengths", "**heldout/T=L**: loss (nats/token) at context length L on held-out text (the metrics' "
     "`heldout` source, or the evaluated split), the same text budget at every length"),
    ("repeat_lengths", "**repeat/T=L**: loss (nats/token) on the second copy of a span of held-out text repeated "
     "about 3L/4 tokens earlier in a context of L tokens, its first token left out (`attnlab.eval.repeat`); "
     "**repeat_control/T=L**: the same tokens with the earlier copy replaced by other text; "
     "**repeat_gain/T=L**: repeat_control minus repeat (what reaching the earlier copy is worth)"),
    ("at_steps", "**<name>/step=N**: each metric again on the run's checkpoint of step N (metrics.at_steps; the "
     "section \"By training tokens\" below)"),
    ("mqar_accuracy", "**mqar_accuracy**: MQAR accuracy at the query positions (256 test sequences of the training "
     "length, a seed no run trains or validates on)"),
    ("mqar_attention", "**mqar_region_mass@L, mqar_value_share@L, mqar_value_reach@L**: where layer L's attention at the "
     "MQAR queries goes (the section below)"),
    ("mqar_windows", "**…/window=k**: the same with every scalar/hybrid head reading only its k nearest keys in scalar "
     "space (`attnlab.eval.window.decode_window`; — for variants without such heads). A layer trained "
     "through a window keeps its local window, so it reads k keys plus that window: a window composed "
     "differently from the one it trained through, not a superset of it"),
)


def _metrics_text(metrics: dict) -> str:
    parts = []
    for key, text in _METRIC_TEXT:
        if metrics.get(key) and (key != "lengths" or len(metrics["lengths"]) >= 2):  # a slope needs 2 lengths
            parts.append(text)
        if key == "mqar_accuracy" and metrics.get("mqar_scales"):
            parts.append("**mqar_accuracy@sx**: the same at s times the training length with "
                         + ("s times the pairs (and queries)" if metrics.get("mqar_scale_pairs", True) else
                            "the training's pairs and queries (mqar_scale_pairs = false)")
                         + ", every query as far from every pair as in training (data.mqar_min_gap)")
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
    from ..report import pyplot

    plt = pyplot()
    kinds = ["train", "val"] + (["tau"] if any(r["curves"].get("tau") for r in results["runs"]) else [])
    fig, axes = plt.subplots(1, len(kinds), figsize=(5.5 * len(kinds), 4.2), dpi=120)
    for i, name in enumerate(results["variants"]):
        runs = [r for r in results["runs"] if r["variant"] == name]
        for ax, kind in zip(axes, kinds):
            curves = [r["curves"].get(kind) for r in runs if r["curves"].get(kind)]
            if not curves:
                continue
            steps, mean, lo, hi = _band(curves)
            ax.plot(steps, mean, color=f"C{i}", lw=1.8, marker="o" if kind == "val" else None, ms=3,
                    label=f"{name} (n={len(curves)})")
            ax.fill_between(steps, lo, hi, color=f"C{i}", alpha=0.2, lw=0)
    for ax, kind in zip(axes, kinds):
        what = {"train": "train loss", "val": "validation loss", "tau": "τ (mean over scalar layers)"}[kind]
        ax.set_title(f"{what}: mean over seeds, min-max band", fontsize=9)
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("τ" if kind == "tau" else "loss (nats / token)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(spec.title, fontsize=10)
    return save_figure(fig, path)


def metric_panels(results: dict) -> list[str]:
    """The per-run scalars metrics.png draws a panel for (none: no metrics.png)."""
    return [n for n in results["scalars"]  # val_ppl, train_seconds: as val_loss, tokens_per_s
            if n not in ("val_ppl", "train_seconds") and not is_profile(n) and step_of(n)[1] is None]


def plot_metrics(spec: Spec, results: dict, path: Path) -> Path | None:
    """One panel per per-run scalar: bars (mean), error bars (sd), dots (seeds)."""
    from ..report import pyplot

    names = metric_panels(results)
    if not names:
        return None
    fig, axes = _panels(len(names), 4.0, 3.2)
    variants = list(results["variants"])
    for ax, name in zip(axes.flat, names):
        spans: list[float] = []
        for i, v in enumerate(variants):
            stats = results["variants"][v]
            mean, sd = stats["mean"][name], stats["sd"][name]
            if mean is None:
                continue
            ax.bar(i, mean, yerr=sd or 0.0, color=f"C{i}", alpha=0.75, capsize=4)
            seeds = [scalar_of(r, name) for r in results["runs"] if r["variant"] == v]
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
    return save_figure(fig, path)
