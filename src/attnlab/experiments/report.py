"""Reports people read: aligned markdown tables, the `attnlab eval` page, and PNG plots.

Tables are GitHub markdown with padded columns, so the same text reads well in a terminal
and renders in a browser. Plots use matplotlib's Agg backend (no display needed).
"""

from __future__ import annotations

import math
import os
import platform
from pathlib import Path
from typing import Iterable, Sequence

from attnlab.layers import LINEAR_FAMILY

MISSING = "—"


# --------------------------------------------------------------------------- tables


def fmt(value, digits: int = 4) -> str:
    """A cell: floats to `digits` significant digits (`digits` decimals below 1, thousands
    separators from 1000, exponent outside [1e-3, 1e7)), ints with separators, None/NaN as
    a dash, lists joined by ' / '."""
    if value is None:
        return MISSING
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, float):
        if math.isnan(value):
            return MISSING
        if math.isinf(value):
            return "inf" if value > 0 else "-inf"
        if abs(value) >= 1e7 or 0 < abs(value) < 1e-3:
            return f"{value:.{digits - 1}e}"
        if abs(value) >= 1000:
            return f"{value:,.0f}"
        if abs(value) < 1:
            return f"{value:.{digits}f}"
        return f"{value:.{max(0, digits - len(str(int(abs(value)))))}f}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, (list, tuple)):
        return " / ".join(fmt(v, digits) for v in value) if value else MISSING
    return str(value)


def markdown_table(headers: Sequence[str], rows: Iterable[Sequence], *, digits: int = 4) -> str:
    """A padded GitHub markdown table; numbers are right-aligned, text left-aligned."""
    rows = [list(r) for r in rows]
    cells = [[fmt(v, digits) for v in row] for row in rows]
    numeric = _numeric_columns(rows, len(headers))
    widths = [max([len(h)] + [len(r[i]) for r in cells]) for i, h in enumerate(headers)]

    def line(values):
        parts = [v.rjust(w) if num else v.ljust(w) for v, w, num in zip(values, widths, numeric)]
        return "| " + " | ".join(parts) + " |"

    rule = "|" + "|".join(("-" * (w + 1) + ":") if num else (":" + "-" * (w + 1)) for w, num in zip(widths, numeric)) + "|"
    return "\n".join([line(headers), rule] + [line(r) for r in cells])


def _numeric_columns(rows: list[list], n: int) -> list[bool]:
    out = []
    for i in range(n):
        values = [r[i] for r in rows if r[i] is not None]
        out.append(bool(values) and all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values))
    return out


def machine_info(threads: int | None = None) -> dict:
    """Where a result was measured: Python, torch, platform, CPUs, torch threads (`threads`, or the
    current setting) and the CUDA device if any."""
    import torch

    return {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
            "cpus": os.cpu_count(), "torch_threads": threads or torch.get_num_threads(),
            "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def mean(values) -> float | None:
    values = [float(v) for v in values if v is not None and not (isinstance(v, float) and math.isnan(v))]
    return sum(values) / len(values) if values else None


# --------------------------------------------------------------------------- attnlab eval


def topk_summary(layers: list[dict]) -> dict[str, float | None]:
    """Mean top-k scalar mass over every scalar head of every layer, per k: {"8": 0.93, ...}."""
    per_k: dict[str, list[float]] = {}
    for layer in layers:
        for k, heads in (layer.get("topk_scalar_mass") or {}).items():
            per_k.setdefault(str(k), []).extend(heads)
    return {k: mean(v) for k, v in sorted(per_k.items(), key=lambda kv: int(kv[0]))}


def eval_markdown(result: dict, *, title: str | None = None) -> str:
    """The markdown page of one `attnlab eval` result (the dict `attnlab.train.evaluate` returns)."""
    lines = [f"# {title or 'Evaluation of ' + str(result.get('run_dir', 'a run'))}", ""]
    lines.append(f"Checkpoint `{result.get('checkpoint')}` (step {result.get('step')}); "
                 f"layers: {', '.join(result.get('attn', []))}.")
    lines.append("")
    if "loss" in result:
        lines += ["## Validation loss by context length", ""]
        rows = [(int(T), r["loss"], r["ppl"], r["tokens"]) for T, r in sorted(result["loss"].items(), key=lambda kv: int(kv[0]))]
        lines += [markdown_table(["context", "loss (nats/token)", "perplexity", "tokens"], rows), ""]
    if "mqar_accuracy" in result:
        lines += ["## MQAR", "", f"Accuracy at the query positions: {fmt(result['mqar_accuracy'])}", ""]
    if result.get("passkey"):
        lines += ["## Passkey retrieval", ""]
        rows = []
        for key, acc in result["passkey"].items():
            length, depth = key.split("@")
            rows.append((int(length), float(depth), acc))
        lines += [markdown_table(["length", "depth", "accuracy"], rows), ""]
    if result.get("layers"):
        lines += [f"## Attention per head (analysis length {result.get('analysis_len')})", ""]
        lines.append("Entropy in nats; sink share = mass on the first token (query 0 left out); "
                     "top-k = share of a query's mass inside its k nearest keys in scalar space.")
        lines.append("")
        ks = sorted({int(k) for layer in result["layers"] for k in (layer.get("topk_scalar_mass") or {})})
        has_learned = any("learned_sink_share" in layer for layer in result["layers"])
        headers = ["layer", "mechanism", "head", "entropy", "sink share"]
        headers += ["learned sink"] if has_learned else []
        headers += [f"top-{k}" for k in ks]
        rows = []
        for layer in result["layers"]:
            if "entropy" not in layer:
                rows.append([layer["layer"], layer["mechanism"], None, None, None] + [None] * (has_learned + len(ks)))
                continue
            topk = layer.get("topk_scalar_mass") or {}
            for h, ent in enumerate(layer["entropy"]):
                row = [layer["layer"], layer["mechanism"], h, ent, layer["first_token_share"][h]]
                if has_learned:
                    row.append(layer["learned_sink_share"][h] if "learned_sink_share" in layer else None)
                for k in ks:
                    heads = topk.get(str(k))
                    row.append(heads[h] if heads is not None and h < len(heads) else None)
                rows.append(row)
        lines += [markdown_table(headers, rows), ""]
        if any(layer["mechanism"] in LINEAR_FAMILY for layer in result["layers"]):
            lines += ["Linear-family layers have unnormalised mixing matrices: entropy and shares do not apply (—).", ""]
    return "\n".join(lines)


def write_eval_report(result: dict, run_dir: str | os.PathLike) -> Path:
    """Write `eval.md` into the run folder beside the `eval.json` that evaluate() wrote."""
    path = Path(run_dir) / "eval.md"
    path.write_text(eval_markdown(result) + "\n")
    return path


# --------------------------------------------------------------------------- plots


def pyplot():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig, path: str | os.PathLike, dpi: int | None = None) -> Path:
    """Lay out, write and close a figure; returns the path."""
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=dpi)
    pyplot().close(fig)
    return path


def plot_loss_curves(histories: dict[str, dict], path: str | os.PathLike, *, x: str = "step") -> Path:
    """Train loss (thin line) and validation loss (markers) of every run on one axis.

    histories: {run label: {"train": [log rows], "eval": [log rows]}} as in a trainer summary."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 4.5), dpi=120)
    for i, (label, hist) in enumerate(histories.items()):
        color = f"C{i}"
        train = [r for r in hist.get("train", []) if "loss" in r]
        if train:
            ax.plot([r[x] for r in train], [r["loss"] for r in train], color=color, lw=1.0, alpha=0.7, label=f"{label} train")
        val = [r for r in hist.get("eval", []) if "val_loss" in r]
        if val:
            ax.plot([r[x] for r in val], [r["val_loss"] for r in val], color=color, lw=2.0, marker="o", ms=4,
                    label=f"{label} val")
    ax.set_xlabel("optimizer step" if x == "step" else x)
    ax.set_ylabel("loss (nats / token)")
    ax.set_title("Training and validation loss")
    ax.grid(alpha=0.3)
    ax.legend(ncol=2, fontsize=8)
    return save_figure(fig, path)


def tau_series(train_rows: list[dict]) -> dict[int, tuple[list[int], list[float]]]:
    """{layer: (steps, mean τ)} for the layers whose log rows carry τ."""
    series: dict[int, tuple[list[int], list[float]]] = {}
    for row in train_rows:
        for i, layer in enumerate(row.get("layers") or []):
            if layer.get("tau_mean") is not None:
                steps, taus = series.setdefault(i, ([], []))
                steps.append(row["step"])
                taus.append(layer["tau_mean"])
    return series


def plot_tau(histories: dict[str, dict], path: str | os.PathLike) -> Path | None:
    """τ (mean over heads) per layer over training, one panel per run that has τ; None if none has."""
    panels = {label: tau_series(h.get("train", [])) for label, h in histories.items()}
    panels = {label: s for label, s in panels.items() if s}
    if not panels:
        return None
    plt = pyplot()
    fig, axes = plt.subplots(1, len(panels), figsize=(4.5 * len(panels), 3.8), dpi=120, squeeze=False)
    for ax, (label, series) in zip(axes[0], panels.items()):
        for layer, (steps, taus) in sorted(series.items()):
            ax.plot(steps, taus, lw=1.5, label=f"layer {layer}")
        ax.set_title(f"{label}: τ per layer")
        ax.set_xlabel("optimizer step")
        ax.set_ylabel("τ (mean over heads)")
        values = [t for _, taus in series.values() for t in taus if t > 0]
        if values and max(values) > 4 * min(values):  # log scale only when τ moves by a factor
            ax.set_yscale("log")
        ax.grid(alpha=0.3, which="both")
        ax.legend(fontsize=8)
    return save_figure(fig, path)
