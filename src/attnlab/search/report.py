"""Sweep results as JSON, a markdown table, and a PNG of perplexity gap (and Mass@K) vs K per method."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path


def _fmt(x, spec: str) -> str:
    return "–" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)


def markdown_table(results: dict) -> str:
    full = results.get("full", {})
    lines = [
        f"Full attention: PPL {_fmt(full.get('ppl'), '.4f')} on {full.get('tokens', 0)} predicted tokens "
        f"({results.get('model', '?')}); {results.get('groups', 1)} candidate set(s) per token.",
        "",
        "| layer set | layers | method | K | PPL | rel. PPL gap | Recall@K | Mass@K | filler rate |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results.get("rows", []):
        lines.append(
            f"| {r['layer_set']} | {r['n_layers']} | {r['method']} | {r['K']} | {_fmt(r['ppl'], '.4f')} | "
            f"{_fmt(100 * r['rel_gap'], '+.3f')}% | {_fmt(r.get('recall'), '.3f')} | {_fmt(r.get('mass'), '.3f')} | "
            f"{_fmt(r.get('filler_rate'), '.3f')} |"
        )
    return "\n".join(lines) + "\n"


def plot(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

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
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _clean(x):
    """NaN/inf -> None so the JSON is strict."""
    if isinstance(x, float) and not math.isfinite(x):
        return None
    if isinstance(x, dict):
        return {k: _clean(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_clean(v) for v in x]
    return x


def _atomic_text(path: Path, text: str) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_report(results: dict, out: str | Path, png: bool = True) -> dict[str, str]:
    """Write results.json, results.md and (with png) gap_vs_k.png under `out`; returns their paths."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "results.json", "markdown": out / "results.md", "png": out / "gap_vs_k.png"}
    _atomic_text(paths["json"], json.dumps(_clean(results), indent=2))
    _atomic_text(paths["markdown"], markdown_table(results))
    if png:
        plot(results, paths["png"])
    return {k: str(v) for k, v in paths.items()}
