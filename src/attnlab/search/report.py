"""Sweep results as JSON, a markdown table, and a PNG of perplexity gap (and Mass@K) vs K per method;
the markdown of the long-context tasks (`attnlab search tasks`)."""

from __future__ import annotations

import json
import math
from pathlib import Path

from attnlab.data.cache import atomic_write_text
from attnlab.report_format import fmt, markdown_table, pyplot, save_figure

FULL = "full"  # long-context tasks: no substitution, the model's own attention
HEADERS = ("layer set", "layers", "method", "K", "PPL", "rel. PPL gap (%)", "Recall@K", "Mass@K", "filler rate")


def results_markdown(results: dict) -> str:
    """A line on full attention, then one table row per (layer set, method, K)."""
    full = results.get("full", {})
    head = (f"Full attention: PPL {fmt(full.get('ppl'))} on {full.get('tokens', 0)} predicted tokens "
            f"({results.get('model', '?')}); {results.get('groups', 1)} candidate set(s) per token.")
    rows = [[r["layer_set"], r["n_layers"], r["method"], r["K"], r["ppl"],
             None if r["rel_gap"] is None else 100 * r["rel_gap"], r.get("recall"), r.get("mass"), r.get("filler_rate")]
            for r in results.get("rows", [])]
    return f"{head}\n\n{markdown_table(HEADERS, rows)}\n"


def plot(results: dict, path: Path) -> None:
    plt = pyplot()
    rows = results.get("rows", [])
    sets = list(dict.fromkeys(r["layer_set"] for r in rows))
    if not sets:
        return
    fig, axes = plt.subplots(2, len(sets), figsize=(4.5 * len(sets), 7), squeeze=False)
    for c, spec in enumerate(sets):
        for method in dict.fromkeys(r["method"] for r in rows):
            pts = sorted((r["K"], 100 * r["rel_gap"], r.get("mass")) for r in rows
                         if r["layer_set"] == spec and r["method"] == method)
            if not pts:
                continue
            ks = [p[0] for p in pts]
            axes[0][c].plot(ks, [p[1] for p in pts], marker="o", label=method)
            axes[1][c].plot(ks, [p[2] for p in pts], marker="o", label=method)
        axes[0][c].set_title(f"{spec} ({next(r['n_layers'] for r in rows if r['layer_set'] == spec)} layers)")
        axes[0][c].set_ylabel("relative PPL gap (%), symlog")
        axes[0][c].set_yscale("symlog", linthresh=0.1)
        axes[0][c].axhline(0.0, color="gray", lw=0.8)
        axes[1][c].set_ylabel("Mass@K")
        for ax in (axes[0][c], axes[1][c]):
            ax.set_xscale("log", base=2)
            ax.set_xlabel("K")
            ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    save_figure(fig, path, dpi=110)


def _clean(x):
    """NaN/inf -> None so the JSON is strict."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def write_results(results: dict, out: str | Path, png: bool = True) -> dict[str, str]:
    """Write results.json, results.md and (with png) gap_vs_k.png under `out`; returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md", "png": out / "gap_vs_k.png"}
    atomic_write_text(paths["json"], json.dumps(_clean(results), indent=2))
    atomic_write_text(paths["markdown"], results_markdown(results))
    if png:
        plot(results, paths["png"])
    return {k: str(v) for k, v in paths.items()}


# ---------------------------------------------------------------- long-context tasks


def task_combos(methods, ks) -> list[tuple[str, int | None]]:
    """(method, K) in run order: full attention (K None) first, then each method at each K."""
    first = [(FULL, None)] if FULL in methods else []
    return first + [(m, K) for m in methods if m != FULL for K in ks]


def task_key(row) -> tuple:
    return row["task"], row["length"], float(row["depth"]), row["method"], row["K"]


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def tasks_markdown(results: dict) -> str:
    """Per task, two tables (whole-answer accuracy, answer-token accuracy): one row per method and K
    (full attention first), one column per length x depth, and the mean over the columns."""
    conf = results["config"]
    lengths, depths = conf["lengths"], conf["depths"]
    combos = task_combos(conf["methods"], conf["ks"])
    cols = [(L, d) for L in lengths for d in depths]
    by_key = {task_key(r): r for r in results.get("rows", [])}
    lines = [f"Model {results.get('model')}; retrieve-then-attend in layers {results.get('layers')} "
             f"(layer set {conf['layer_set']!r}), {results.get('groups')} candidate set(s) per token; "
             f"{conf['n_examples']} examples per cell, scored by teacher forcing. Columns: length @ needle depth. "
             "A method can only be judged where full attention solves the task.", ""]
    haystack = {"passkey": "a fixed sentence repeated",
                "needle": f"held-out text ({conf['corpus']}, split {conf['split']})"}
    for task in conf["tasks"]:
        for what, title in (("accuracy", "whole answer right"), ("token_accuracy", "answer tokens right")):
            table = []
            for method, K in combos:
                vals = [by_key.get((task, L, float(d), method, K), {}).get(what) for L, d in cols]
                table.append([method, K, *vals, _mean(vals) if None not in vals else None])
            lines += [f"### {task}: {title} (haystack: {haystack[task]})", "",
                      markdown_table(["method", "K", *[f"{L} @ {d:g}" for L, d in cols], "mean"], table, digits=3), ""]
    if not results.get("complete"):
        done = len(results.get("rows", []))
        total = len(combos) * len(conf["tasks"]) * len(cols)
        lines.append(f"Partial: {done} of {total} cells finished; rerun the same command to resume.")
    return "\n".join(lines) + "\n"

