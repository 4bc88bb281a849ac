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
    if result.get("windowed_loss"):
        lines += ["## Windowed-decode loss", "",
                  "Every scalar/hybrid head reads only its k nearest keys in scalar space (plus the sink), as decoding "
                  "through the sorted cache does; gap = windowed minus exact loss on the same tokens.", ""]
        rows = [(int(T), k, r["loss"], r["loss"] - result["loss"][T]["loss"], r["ppl"])
                for T, per_k in result["windowed_loss"].items() for k, r in per_k.items()]
        lines += [markdown_table(["context", "k (/M = memory budget)", "loss", "gap (nats)", "perplexity"], rows), ""]
    if result.get("compressed"):
        lines += ["## Windowed decoding with density compression", "",
                  "Token by token through the sorted cache on one batch at the training length; after each step, runs "
                  "of 4 adjacent keys spanning at most the given span merge into one entry. gap = its loss minus the "
                  "exact loss of the same tokens; kept = cache entries per head over tokens at the end.", ""]
        rows = [(k, r["loss"], r["loss"] - r["exact"], r["kept"], r["tokens"]) for k, r in result["compressed"].items()]
        lines += [markdown_table(["k / span", "loss", "gap (nats)", "kept", "tokens"], rows), ""]
    if result.get("by_length"):
        by = result["by_length"]
        ks = sorted({int(k) for r in by["lengths"].values() for k in r.get("topk_mass", {})})
        ws = sorted({k for r in by["lengths"].values() for k in (r.get("windowed_loss") or {})},
                    key=lambda k: (int(k.split("/")[0]), k))
        lines += ["## By context length", ""]
        rows = []
        for T, r in by["lengths"].items():
            rows.append([int(T), r["loss"]] + [r["windowed_loss"][k] - r["loss"] if k in (r.get("windowed_loss") or {})
                                               else None for k in ws]
                        + [r["topk_mass"].get(str(k)) for k in ks] + [r.get("entropy")])
        lines += [markdown_table(["context", "exact loss"] + [f"gap k={k}" for k in ws] + [f"top-{k} mass" for k in ks]
                                 + ["entropy"], rows), ""]
        if by.get("miss_slope"):
            lines += ["Slope of (1 − top-k mass) against ln T: " + ", ".join(f"k={k}: {fmt(v)}" for k, v in by["miss_slope"].items())
                      + " (positive: the window misses more as the context grows).", ""]
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
