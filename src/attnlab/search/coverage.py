"""The coverage frontier of a search trial: perplexity gap against how many layers retrieve.

A trial variant that evaluates several layer sets (e.g. middle6 < middle12 < ... < all) gives one
point per set and per (method, K); the frontier is that gap as a function of the fraction of the
model's layers substituted. Published points (`[[references]]` in the spec: label, coverage as a
fraction of layers, gap in %) are drawn beside it; they may come from another model, which is why
the x axis is a fraction and not a count.
"""

from __future__ import annotations

from attnlab.report_format import fmt, markdown_table
from attnlab.models.config import ConfigError


def check_references(refs) -> list[dict]:
    """[[references]] entries: {label: str, coverage: 0 < x <= 1, gap: %} (ConfigError naming the entry)."""
    if not isinstance(refs, list):
        raise ConfigError(f"references must be an array of tables, got {refs!r}")
    out = []
    for i, r in enumerate(refs):
        ok = (isinstance(r, dict) and set(r) == {"label", "coverage", "gap"} and isinstance(r["label"], str)
              and all(isinstance(r[k], (int, float)) and not isinstance(r[k], bool) for k in ("coverage", "gap"))
              and 0 < r["coverage"] <= 1)
        if not ok:
            raise ConfigError(f"references[{i}] must have exactly label (string), coverage (0 < x <= 1) and gap "
                              f"(% number), got {r!r}")
        out.append(dict(r))
    return out


def layer_masses(res: dict) -> dict:
    """Each layer's Mass@K in the largest layer set of one evaluation: {"<method> K=<K>": {layer: mass}}."""
    biggest = max(res["layer_sets"], key=lambda k: len(res["layer_sets"][k]))
    return {f"{r['method']} K={r['K']}": {str(l): d["mass"] for l, d in r["per_layer"].items()}
            for r in res["rows"] if r["layer_set"] == biggest and r.get("per_layer")}


def mean_masses(runs: list[dict]) -> dict:
    """The per-layer masses averaged over runs (training seeds)."""
    out = {}
    for col in sorted({c for r in runs for c in r}):
        rs = [r[col] for r in runs if col in r]
        out[col] = {l: sum(r[l] for r in rs) / len(rs) for l in sorted(rs[0], key=int) if all(l in r for r in rs)}
    return out


def frontier(stat: dict) -> tuple[list[tuple[str, int]], list[tuple[str, int]]]:
    """(layer sets sorted by size with their sizes, the (method, K) pairs with a gap for every set)."""
    sets = sorted(stat["coverage"]["sets"].items(), key=lambda kv: (kv[1], kv[0]))
    pairs = set()
    for key in stat["mean"]:
        name, _, rest = key.partition(":")
        metric, _, K = rest.partition("@")
        if rest and metric.endswith("/gap"):
            pairs.add((metric[:-4], int(K)))
    full = [p for p in sorted(pairs) if all(f"{s}:{p[0]}/gap@{p[1]}" in stat["mean"] for s, _ in sets)]
    return sets, full


def coverage_markdown(stats: dict, refs: list[dict], png: str) -> list[str]:
    lines = []
    for v, stat in stats.items():
        if "coverage" not in stat:
            continue
        sets, pairs = frontier(stat)
        n = stat["coverage"]["n_layers"]
        rows = []
        for name, size in sets:
            row = [name, f"{size} / {n}", size / n]
            for method, K in pairs:
                key = f"{name}:{method}/gap@{K}"
                m, s = stat["mean"].get(key), stat["sd"].get(key)
                row.append(fmt(m) if s is None else f"{fmt(m)} ± {fmt(s)}")
            rows.append(row)
        lines += [f"## Coverage frontier: {v}", "",
                  "Perplexity gap (%) against full attention with the layer set substituted, "
                  f"over {len(stat['seeds'])} training seed(s).", "",
                  markdown_table(["layer set", "layers", "coverage", *[f"{m} K={K}" for m, K in pairs]], rows), ""]
        masses = stat["coverage"].get("per_layer_mass") or {}
        if masses:
            cols = sorted(masses, key=lambda c: (c.split(" K=")[0], int(c.split(" K=")[1])))
            layers = sorted({l for c in cols for l in masses[c]}, key=int)
            lines += [f"Mass@K of each layer when the largest set ({sets[-1][0]}) retrieves: how much of its "
                      "own attention each layer keeps, which is where the weak layers show.", "",
                      markdown_table(["layer", *cols], [[int(l), *[masses[c].get(l) for c in cols]] for l in layers]),
                      ""]
    if lines and refs:
        lines += ["Published points drawn beside it: " + "; ".join(
            f"{r['label']}: {fmt(r['gap'])} % at coverage {fmt(r['coverage'])}" for r in refs) + ".", ""]
    if lines:
        lines += [f"![coverage frontier]({png})", ""]
    return lines


def plot_coverage(stats: dict, refs: list[dict], path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2))
    for v, stat in stats.items():
        if "coverage" not in stat:
            continue
        sets, pairs = frontier(stat)
        n = stat["coverage"]["n_layers"]
        xs = [size / n for _, size in sets]
        for method, K in pairs:
            keys = [f"{name}:{method}/gap@{K}" for name, _ in sets]
            ys = [stat["mean"][k] for k in keys]
            err = [stat["sd"].get(k) or 0.0 for k in keys]
            label = f"{method} K={K}" if len(stats) == 1 else f"{v}: {method} K={K}"
            ax.errorbar(xs, ys, yerr=err, marker="o", capsize=3, label=label)
    for r in refs:
        ax.scatter([r["coverage"]], [r["gap"]], marker="*", s=120, color="black", zorder=5)
        ax.annotate(r["label"], (r["coverage"], r["gap"]), textcoords="offset points", xytext=(-6, 6),
                    ha="right", fontsize=8)
    ax.axhline(0.0, color="grey", lw=0.8)
    ax.set_xlabel("fraction of layers retrieving")
    ax.set_ylabel("perplexity gap vs full attention (%)")
    ax.legend(fontsize=8)
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
