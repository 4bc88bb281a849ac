"""Formatting shared by every report writer, below the layers that write reports: numbers (`fmt`),
markdown tables (`markdown_table`) and figures (`pyplot`, `save_figure`). `attnlab.experiments.report`
re-exports them; `attnlab.search` and `attnlab.retrofit` import them from here."""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Iterable, Sequence

MISSING = "—"  # how a table shows a value that is not there


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

def pyplot():
    """matplotlib.pyplot on the Agg backend (no display needed), imported on first use."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt

def save_figure(fig, path: str | os.PathLike, dpi: int | None = None) -> Path:
    """Lay out, write and close a figure; returns the path. The format follows the suffix (png by
    default); the file is written atomically (WriteError naming it when that fails)."""
    import io

    from attnlab.data.cache import atomic_write_bytes

    fig.tight_layout()
    path = Path(path)
    buf = io.BytesIO()
    fig.savefig(buf, dpi=dpi, format=path.suffix[1:] or "png")
    pyplot().close(fig)
    return atomic_write_bytes(path, buf.getvalue())  # a reader never sees half a plot; WriteError names it
