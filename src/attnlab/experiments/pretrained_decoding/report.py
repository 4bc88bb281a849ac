"""results.json, report.md and the plots of a decoding comparison, generated from its records only.

Accuracy: per (task, length, depth) and method at each K, the share of examples solved, with its
95 % Wilson interval; the rules (`verdict.py`) judge the cells of examples full attention solves.
Perplexity: exp of the mean negative log-likelihood of the continuations, and its gap to full
attention in %. Step time: the median of a method's single-token steps, and its ratio to full
attention's median measured in the same process (the presses run in another). Bytes read per step,
per layer and KV head: the keys and values read (K of them, every key for full attention) plus
what the selection reads: the exact index's N search keys, Quest's N / page pairs of page bounds,
the sorted array's probes and candidates (counted) and the HNSW graph's distance computations
(counted by FAISS), at 4 bytes a number (the model's weights, the same for every method, apart).
"""

from __future__ import annotations

import json
import statistics
from collections import defaultdict
from pathlib import Path

from attnlab.data.cache import atomic_write_text
from attnlab.experiments.report import report_head
from attnlab.report_format import markdown_table, pyplot, save_figure
from attnlab.search.hf_model import load_hf_config, model_dims, resolve_layers, resolve_source

from .plan import plan
from .runner import recorded, records_folder
from .spec import Spec
from .verdict import judge, wilson

FULL = "full"


def _split(name: str) -> tuple[str, int | None]:
    m, _, k = name.partition("@")
    return m, (int(k) if k else None)


def _methods(spec: Spec) -> list[str]:
    return [m for m in spec.attnlab.methods if m != FULL] + list(spec.presses.methods)


def collect(spec: Spec, items: list[dict], recs: dict) -> dict:
    """The aggregates the report and results.json show (see the module docstring)."""
    budgets, methods = spec.budgets, _methods(spec)
    by_id = {it["id"]: it for it in items}
    acc = defaultdict(lambda: [0, 0])  # (task, L, depth, method, K) -> [solved, n]
    cells = defaultdict(lambda: defaultdict(lambda: [0, 0]))  # (task, L, K) -> method -> [solved | full, n full]
    ppl = defaultdict(lambda: [0.0, 0])  # (L, method, K) -> [nll, tokens]
    times = defaultdict(list)  # (L, side, method, K) -> ms
    reads = defaultdict(list)  # (L, method, K) -> (sorted reads, hnsw ndis) per step
    agree = [0, 0]  # full attention: the two sides' answers agree / compared
    for it in items:
        a, p = recs.get(("attnlab", it["id"])), recs.get(("presses", it["id"]))
        if it["kind"] == "task":
            base = a["results"].get(FULL) if a else None
            if a and p and FULL in p["results"]:
                agree[0] += int(p["results"][FULL]["solved"] == base["solved"])
                agree[1] += 1
            for rec in (a, p):
                if rec is None:
                    continue
                for name, r in rec["results"].items():
                    m, K = _split(name)
                    if m == FULL and rec is p:
                        continue
                    for k in ([K] if K is not None else budgets):
                        cell = acc[it["task"], it["length"], it["depth"], m, k]
                        cell[0], cell[1] = cell[0] + r["solved"], cell[1] + 1
                        if base is not None and base["solved"]:
                            c = cells[it["task"], it["length"], k][m]
                            c[0], c[1] = c[0] + r["solved"], c[1] + 1
        elif it["kind"] == "ppl":
            for rec in (a, p):
                for name, r in (rec or {}).get("results", {}).items():
                    m, K = _split(name)
                    if m == FULL and rec is p:
                        continue
                    s = ppl[it["length"], m, K]
                    s[0], s[1] = s[0] + r["nll"], s[1] + r["tokens"]
        else:
            for side, rec in (("attnlab", a), ("presses", p)):
                for name, r in (rec or {}).get("results", {}).items():
                    m, K = _split(name)
                    times[it["length"], side, m, K] += r["ms"]
                    if side == "attnlab" and m != FULL:
                        reads[it["length"], m, K] += list(zip(r["sorted_reads"], r["hnsw_ndis"]))
    cells = {k: {m: tuple(v) for m, v in d.items()} for k, d in cells.items()}
    verdicts = [{"rule": r, **judge(r, cells, budgets, spec.lengths, spec.tasks.tasks)} for r in spec.rules]
    n_items = {s: sum((s, it["id"]) in recs for it in items) for s in ("attnlab", "presses")}
    return {"acc": acc, "cells": cells, "ppl": ppl, "times": times, "reads": reads, "agree": agree,
            "verdicts": verdicts, "n_items": n_items, "n_planned": len(items), "methods": methods, "by_id": by_id}


def step_bytes(spec: Spec, method: str, K: int | None, N: int, measured, dims, layers: int) -> float:
    """Bytes read per decode step per layer and KV head (see the module docstring)."""
    D, n = dims.head_dim, 4
    kv = (N if K is None else K) * 2 * D * n
    if method in (FULL, "streaming") or method in spec.presses.methods:
        return kv
    if method == "quest":
        return kv + -(-N // spec.attnlab.page) * 2 * D * n
    if method == "sorted":
        return kv + statistics.mean(r for r, _ in measured) / layers * 8 if measured else float("nan")
    d = spec.train["learned"].d_search
    if method == "learned-hnsw":
        groups = dims.n_kv_heads
        return kv + statistics.mean(h for _, h in measured) / (layers * groups) * d * n if measured else float("nan")
    return kv + N * d * n  # learned: the exact index reads every search key


def summary_rows(spec: Spec, agg: dict) -> list[list]:
    """Per budget: each method's accuracy over every cell full attention solves (all tasks, lengths)."""
    rows = []
    for K in spec.budgets:
        for m in agg["methods"]:
            s = n = 0
            for (task, L, k), counts in agg["cells"].items():
                if k == K and m in counts:
                    s, n = s + counts[m][0], n + counts[m][1]
            if n:
                lo, hi = wilson(s, n)
                rows.append([K, m, s, n, s / n, f"[{lo:.3f}, {hi:.3f}]"])
    return rows


def best_per_budget(spec: Spec, agg: dict) -> list[str]:
    """One line per budget: the method that keeps the most of what full attention solves, and whether
    its lead over the next is beyond both intervals."""
    lines = []
    rows = summary_rows(spec, agg)
    for K in spec.budgets:
        here = sorted((r for r in rows if r[0] == K), key=lambda r: -r[4])
        if len(here) < 2:
            continue
        (_, m1, s1, n1, p1, i1), (_, m2, s2, n2, p2, i2) = here[0], here[1]
        clear = wilson(s1, n1)[0] > wilson(s2, n2)[1]
        lines.append(f"- K = {K}: **{m1}** keeps {p1:.3f} {i1} of the examples full attention solves, next "
                     f"{m2} {p2:.3f} {i2}: {'a lead beyond both intervals' if clear else 'within the intervals'}.")
    return lines


def write_report(spec: Spec, png: bool = True) -> dict:
    """Rebuild results.json, report.md and the plots beside the spec from its records."""
    items = plan(spec)
    recs = recorded(spec, items, [records_folder(spec)])
    agg = collect(spec, items, recs)
    source = resolve_source(spec.model, hub=False)
    dims = model_dims(load_hf_config(source))
    layers = len(resolve_layers(spec.layer_set, dims.n_layers))
    out = spec.folder
    complete = all(agg["n_items"][s] == len(items) for s in ("attnlab", "presses") if s == "attnlab" or spec.presses.methods)
    lines = report_head(spec.title, "attnlab search compare", spec.path.name, spec.claim, spec.description)
    lines += [f"Records: {agg['n_items']['attnlab']} of {len(items)} items on the attnlab side, "
              f"{agg['n_items']['presses']} on the presses side (settings {spec.settings()})."
              + ("" if complete else " **Partial: the verdicts below are not evidence until every item is recorded; "
                                      "rerun the command to continue.**"), ""]
    if agg["agree"][1]:
        lines += [f"Full attention answers alike in both environments on {agg['agree'][0]} of {agg['agree'][1]} "
                  "examples.", ""]
    lines += ["## Verdicts", ""]
    for v in agg["verdicts"]:
        r = v["rule"]
        per = ", ".join(f"K={K}: {o}" for K, o in v["by_budget"].items())
        lines.append(f"- {r.get('name') or r['kind']}: **{v['outcome']}** ({per})")
    lines += ["", "## Which selector at which budget", ""] + (best_per_budget(spec, agg) or
                                                                  ["No cell holds an example full attention solves yet."])
    lines += ["", "## Accuracy on what full attention solves, by budget", "",
              markdown_table(["K", "method", "solved", "of", "share", "95 % interval"], summary_rows(spec, agg)), ""]
    lines += ["## Accuracy by cell", "", "Share of all examples solved (full attention included), per length @ depth.", ""]
    cols = [(L, d) for L in spec.lengths for d in spec.tasks.depths]
    for task in spec.tasks.tasks:
        rows = []
        for m, K in [(FULL, spec.budgets[0])] + [(m, K) for m in agg["methods"] for K in spec.budgets]:
            vals = [agg["acc"].get((task, L, d, m, K)) for L, d in cols]
            rows.append([m, "—" if m == FULL else K, *[None if v is None else v[0] / v[1] for v in vals]])
        lines += [f"### {task}", "", markdown_table(["method", "K", *[f"{L} @ {d:g}" for L, d in cols]], rows, digits=3), ""]
    lines += ["## Perplexity of continuations", "",
              f"{spec.perplexity.continuation} tokens after each of {spec.perplexity.n_contexts} held-out contexts per "
              f"length ({spec.perplexity.corpus}, split {spec.perplexity.split}); gap to full attention in %.", ""]
    rows = []
    for L in spec.lengths:
        f = agg["ppl"].get((L, FULL, None))
        for m in agg["methods"]:
            for K in spec.budgets:
                s = agg["ppl"].get((L, m, K))
                if s and f:
                    p, pf = 2.718281828459045 ** (s[0] / s[1]), 2.718281828459045 ** (f[0] / f[1])
                    rows.append([L, m, K, p, 100 * (p / pf - 1)])
    lines += [markdown_table(["length", "method", "K", "PPL", "gap (%)"], rows), ""]
    lines += ["## Decode step", "", f"Median of {spec.timing.steps} single-token steps after the prefill, on "
              f"{spec.timing.device}; ratio to full attention in the same process; bytes read per step per layer "
              "and KV head.", ""]
    steps = []
    sides = (("attnlab", [m for m in spec.attnlab.methods if m != FULL]), ("presses", list(spec.presses.methods)))
    for L in spec.lengths:
        for side, names in sides:
            base = agg["times"].get((L, side, FULL, None))
            for m, K in [(FULL, None)] + [(m, K) for m in names for K in spec.budgets]:
                ms = agg["times"].get((L, side, m, K))
                if not ms:
                    continue
                med = statistics.median(ms)
                b = step_bytes(spec, m, K, L, agg["reads"].get((L, m, K)), dims, layers)
                steps.append([L, side, m, "—" if K is None else K, med, med / statistics.median(base) if base else None,
                              b])
    lines += [markdown_table(["length", "process", "method", "K", "step (ms)", "x full", "bytes read"], steps), ""]
    results = {"title": spec.title, "settings": spec.settings(), "complete": complete, "items": agg["n_items"],
               "planned": len(items), "verdicts": agg["verdicts"], "summary": summary_rows(spec, agg),
               "accuracy": [[*k, *v] for k, v in sorted(agg["acc"].items(), key=lambda kv: str(kv[0]))],
               "perplexity": rows, "steps": steps}
    if png and agg["acc"]:
        plot_accuracy(spec, agg, out / "accuracy_vs_budget.png")
        lines += ["![accuracy vs budget](accuracy_vs_budget.png)", ""]
    atomic_write_text(out / "results.json", json.dumps(results, indent=1, default=str) + "\n")
    atomic_write_text(out / "report.md", "\n".join(lines))
    return results


def plot_accuracy(spec: Spec, agg: dict, path: Path) -> None:
    """One panel per (task, length): each method's share of full attention's solved examples vs K."""
    plt = pyplot()
    tasks, lengths = spec.tasks.tasks, spec.lengths
    fig, axes = plt.subplots(len(tasks), len(lengths), figsize=(4 * len(lengths), 3.2 * len(tasks)), squeeze=False)
    for i, task in enumerate(tasks):
        for j, L in enumerate(lengths):
            ax = axes[i][j]
            for m in agg["methods"]:
                pts = [(K, *agg["cells"][task, L, K][m]) for K in spec.budgets
                       if m in agg["cells"].get((task, L, K), {}) and agg["cells"][task, L, K][m][1]]
                if not pts:
                    continue
                ks = [p[0] for p in pts]
                ps = [p[1] / p[2] for p in pts]
                ci = [wilson(p[1], p[2]) for p in pts]
                ax.errorbar(ks, ps, yerr=[[p - c[0] for p, c in zip(ps, ci)], [c[1] - p for p, c in zip(ps, ci)]],
                            marker="o", capsize=2, label=m)
            ax.set_xscale("log", base=2)
            ax.set_ylim(-0.02, 1.02)
            ax.set_title(f"{task}, {L} tokens")
            ax.set_xlabel("keys per step per KV head")
            ax.grid(alpha=0.3)
        axes[i][0].set_ylabel("share of full's solved")
    if axes[0][-1].get_legend_handles_labels()[0]:
        axes[0][-1].legend(fontsize=7)
    save_figure(fig, path, dpi=100)


__all__ = ["collect", "step_bytes", "write_report"]
