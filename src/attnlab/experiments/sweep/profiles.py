"""The parts of a sweep report that are profiles rather than single numbers: metrics by context
length (`[metrics] lengths`), the alignment profile over attention-weight deciles
(`[metrics] alignment`) and the histogram of output-gate values (`[metrics] gate`). Each is a
table (mean ± sd over seeds) and a line plot with error bars."""

from __future__ import annotations

import re
from pathlib import Path

from attnlab.eval.tasks import MQAR_ATTENTION

from ..report import markdown_table, pyplot, save_figure

LENGTH_RE = re.compile(r"^(?P<what>.+)/T=(?P<T>\d+)$")
DECILE_RE = re.compile(r"^align_d(?P<i>\d+)$")
GATE_RE = re.compile(r"^gate_h(?P<i>\d+)$")
MQAR_ATTENTION_RE = re.compile(rf"^mqar_(?P<what>{'|'.join(MQAR_ATTENTION)})@L(?P<layer>\d+)(?P<window>/window=\d+)?$")
RECALLS = 0.5  # mqar_accuracy above which a run counts as recalling (chance: about 1 / data.mqar_pairs)
REACHES = 0.01  # region mass below which a layer's queries count as not reaching the pairs


def is_profile(name: str) -> bool:
    """A per-run scalar shown in a profile table/plot instead of the main table and the bars."""
    return bool(LENGTH_RE.match(name) or DECILE_RE.match(name) or GATE_RE.match(name) or MQAR_ATTENTION_RE.match(name))


def _pm(mean, sd) -> str:
    if mean is None:
        return "—"
    return f"{mean:.4g}" if sd is None else f"{mean:.4g} ± {sd:.2g}"


def length_series(results: dict) -> tuple[list[int], list[str]]:
    """(context lengths, quantities) of the '<quantity>/T=<T>' scalars."""
    Ts, whats = set(), []
    for n in results["scalars"]:
        m = LENGTH_RE.match(n)
        if m:
            Ts.add(int(m["T"]))
            if m["what"] not in whats:
                whats.append(m["what"])
    return sorted(Ts), whats


def lengths_table(results: dict) -> str | None:
    Ts, whats = length_series(results)
    if not Ts:
        return None
    rows = []
    for name, v in results["variants"].items():
        for T in Ts:
            rows.append([name, T] + [_pm(v["mean"].get(f"{w}/T={T}"), v["sd"].get(f"{w}/T={T}")) for w in whats])
    return markdown_table(["variant", "context T"] + whats, rows)


def indexed_table(results: dict, pattern: re.Pattern, label: str) -> str | None:
    """One row per variant, one column per scalar whose name matches `pattern` (numbered by its group i)."""
    names = [n for n in results["scalars"] if pattern.match(n)]
    if not names:
        return None
    rows = [[name] + [_pm(v["mean"].get(n), v["sd"].get(n)) for n in names] for name, v in results["variants"].items()]
    return markdown_table(["variant"] + [label.format(i=pattern.match(n)["i"]) for n in names], rows)


def _lines(ax, results: dict, xs: list, names: list[str], label_x: str) -> None:
    for i, (variant, v) in enumerate(results["variants"].items()):
        pts = [(x, v["mean"].get(n), v["sd"].get(n)) for x, n in zip(xs, names) if v["mean"].get(n) is not None]
        if not pts:
            continue
        ax.errorbar([p[0] for p in pts], [p[1] for p in pts], yerr=[p[2] or 0.0 for p in pts], color=f"C{i}",
                    marker="o", ms=3, capsize=3, lw=1.5, label=variant)
    ax.set_xlabel(label_x)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)


def plot_lengths(results: dict, path: Path) -> Path | None:
    """One panel per quantity against context length (log x): mean over seeds, ±1 sd."""
    Ts, whats = length_series(results)
    if not Ts:
        return None
    plt = pyplot()
    ncols = min(3, len(whats))
    nrows = -(-len(whats) // ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.3 * ncols, 3.3 * nrows), dpi=120, squeeze=False)
    for ax, w in zip(axes.flat, whats):
        _lines(ax, results, Ts, [f"{w}/T={T}" for T in Ts], "context length T")
        ax.set_xscale("log", base=2)
        ax.set_title(w, fontsize=9)
    for ax in list(axes.flat)[len(whats):]:
        ax.set_visible(False)
    return save_figure(fig, path)


def plot_indexed(results: dict, pattern: re.Pattern, path: Path, xs, label_x: str, label_y: str, title: str) -> Path | None:
    """The `pattern` scalars of every variant as one line each against xs(i)."""
    names = [n for n in results["scalars"] if pattern.match(n)]
    if not names:
        return None
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(5.5, 3.6), dpi=120)
    _lines(ax, results, [xs(int(pattern.match(n)["i"])) for n in names], names, label_x)
    ax.set_ylabel(label_y)
    ax.set_title(title, fontsize=9)
    return save_figure(fig, path)


def profile_sections(results: dict, out: Path) -> list[str]:
    """Markdown (tables and plots) for the profile scalars; writes lengths.png / alignment.png."""
    lines = []
    table = lengths_table(results)
    if table:
        plot_lengths(results, out / "lengths.png")
        slopes = [n for n in results["scalars"] if n.startswith("miss_slope@")]
        lines += ["## By context length", "", table, "",
                  "loss: exact validation loss; wgap@k: windowed-decode loss (k nearest keys per scalar head, plus the "
                  "sink) minus the exact loss on the same tokens; topk_mass@k: share of attention inside the k "
                  "nearest keys. Mean ± sd over seeds." + (" The slopes of (1 − mass@k) against ln T are in the "
                                                           "main table (" + ", ".join(slopes) + ")." if slopes else ""),
                  "", "![by context length](lengths.png)", ""]
    lines += mqar_attention_section(results)
    table = indexed_table(results, DECILE_RE, "decile {i}")
    if table:
        plot_indexed(results, DECILE_RE, out / "alignment.png", int, "attention-weight decile (10 = heaviest pairs)",
                     "mean |qs − ks|", "scalar distance of (query, key) pairs by attention weight")
        lines += ["## Alignment profile", "", table, "",
                  "Every visible (query, key) pair of the scalar heads on the analysis batch, ranked by attention weight "
                  "and cut into ten equal groups (decile 10 = heaviest); each cell is the mean |qs − ks| of a group, "
                  "averaged over layers, mean ± sd over seeds.", "", "![alignment](alignment.png)", ""]
    table = indexed_table(results, GATE_RE, "{i}")
    if table:
        n = sum(1 for s in results["scalars"] if GATE_RE.match(s))
        plot_indexed(results, GATE_RE, out / "gate.png", lambda i: (i - 0.5) / n, "gate value (bin centre)",
                     "fraction of gate values", "output-gate values on the analysis batch")
        lines += ["## Output-gate values", "", table, "",
                  f"The fraction of the output gate's values (every head, channel and query of the analysis batch, "
                  f"mean over gated layers) in each of {n} equal bins of [0, 1], bin 1 = [0, {1 / n:.2g}); mean ± sd over "
                  "seeds. gate_low in the main table is the fraction below 0.1.", "", "![gate values](gate.png)", ""]
    return lines


def mqar_attention_section(results: dict) -> list[str]:
    """Where the MQAR queries' attention goes (`[metrics] mqar_attention`): a table of mean ± sd over
    seeds per variant, and per run what it says, by the rules stated under the table: whether the
    run's queries reach the pairs and whether it recalls."""
    names = [n for n in results["scalars"] if MQAR_ATTENTION_RE.match(n)]
    if not names:
        return []
    rows = [[variant] + [_pm(v["mean"][n], v["sd"][n]) for n in names] for variant, v in results["variants"].items()]
    pairs = {v.get("mqar_pairs") for v in results["variants"].values()} - {None}
    chance = f"1/{pairs.pop()}" if len(pairs) == 1 else "1 / data.mqar_pairs"
    lines = ["## Where the queries' attention goes", "", markdown_table(["variant"] + names, rows), "",
             f"At each MQAR query of 64 test sequences, per layer L, with the heads' weights averaged: region_mass, the "
             f"weight on the pair tokens; value_share, the weight on the queried value over the weight on all values "
             f"({chance} for heads blind to which pair is asked, 1 for heads that read the answer alone); value_reach, the "
             f"share of queries whose value gets at least 1% of some head's weight (a window that does not select it gives "
             f"it none). /window=k: through the decode window of k keys. Mean ± sd over seeds.", ""]
    exact = [n for n in names if "/window=" not in n]
    verdicts = []
    for run in results["runs"]:
        m, acc = run["metrics"], run["metrics"].get("mqar_accuracy")
        regions = [m[n] for n in exact if n.startswith("mqar_region_mass@") and m.get(n) is not None]
        reaches = [m[n] for n in exact if n.startswith("mqar_value_reach@") and m.get(n) is not None]
        if acc is None or not regions:
            continue
        reached = max(regions) >= REACHES
        what = ("reaches the pairs" if reached else "does not reach the pairs") + (
            f" (region mass up to {max(regions):.2f}, the queried value read in up to {max(reaches):.0%} of queries)"
            if reaches else f" (region mass up to {max(regions):.2f})")
        verdicts.append((run["variant"], run["seed"], reached, acc > RECALLS,
                         f"- {run['variant']}, seed {run['seed']}: {what}; it "
                         f"{'recalls' if acc > RECALLS else 'does not recall'} (mqar_accuracy {acc:.3f})."))
    if verdicts:
        lines += [f"Per run, by the layers above without a decode window: a run reaches the pairs when some layer's "
                  f"region mass is at least {REACHES}; it recalls when its mqar_accuracy exceeds {RECALLS}.", ""]
        lines += [v[-1] for v in verdicts] + [""]
        stuck = sorted({v[0] for v in verdicts if v[2] and not v[3]})
        blind = sorted({v[0] for v in verdicts if not v[2] and not v[3]})
        if stuck:
            lines += [f"Runs that reach the pairs yet do not recall ({', '.join(stuck)}) have what they need in what "
                      f"they read: a selection that reaches further would not help them; what fails is the use of "
                      f"what is read (compare their value_share with the runs that recall).", ""]
        if blind:
            lines += [f"Runs that do not reach the pairs ({', '.join(blind)}) read none of them: no readout can "
                      f"recall what their window leaves out; where that window is chosen by scalar distance, what to "
                      f"measure next is why it misses the pairs (the pairs' scalar keys against the queries').", ""]
    return lines
