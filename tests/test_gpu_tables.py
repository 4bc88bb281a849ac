"""docs/gpu_tables.py's decode speed table: the ratios and, where rows carry the memory-bandwidth floor
(a GPU run of benchmarks/decode_speed.py), the compiled steps' multiples of it."""

from __future__ import annotations

import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parents[1] / "docs"


def _table(rows):
    sys.path.insert(0, str(DOCS))
    try:
        from gpu_tables import decode_speed_table
    finally:
        sys.path.remove(str(DOCS))
    return decode_speed_table({"rows": rows})


def row(method, ms, x_floor=None, context=4096):
    r = {"model": "windowed", "batch": 1, "context": context, "method": method, "step_ms": ms}
    if x_floor is not None:
        r["x_floor"] = x_floor
    return r


def test_floor_columns_only_where_rows_carry_the_floor():
    plain = _table([row("exact", 8.0), row("window", 2.0), row("exact_compiled", 4.0), row("window_compiled", 1.0)])
    assert "× floor" not in plain and "4.0×" in plain  # the window's speedup, caches and compiled
    gpu = _table([row("exact_compiled", 4.0, 1.6), row("window_compiled", 0.5, 12.5),
                  row("exact_compiled", 9.0, 1.2, context=32768)])
    header, *_ = [line for line in gpu.splitlines() if "floor" in line]
    assert "exact, compiled: × floor" in header and "window, compiled: × floor" in header
    cells = [line for line in gpu.splitlines() if "32,768" in line][0]
    assert "1.2×" in cells and cells.rstrip(" |").endswith("—")  # no window row at 32K: a dash
    assert "1.6×" in gpu and "12.5×" in gpu and "8.0×" in gpu  # 4.0 / 0.5: the compiled window's speedup
