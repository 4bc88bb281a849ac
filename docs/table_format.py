"""Formatting for the generated result tables (docs/result_tables.py): markdown tables, signed and
rounded numbers, token counts."""

from __future__ import annotations

from collections.abc import Callable, Sequence

MINUS = "\u2212"


def _table(header: Sequence[str], align: str, rows: Sequence[Sequence[str]]) -> str:
    """A markdown table; align holds one letter per column: l (left) or r (right)."""
    rule = ["---:" if a == "r" else "---" for a in align]
    lines = [header, rule, *rows]
    return "\n".join("| " + " | ".join(cells) + " |" for cells in lines)


def _f(x: float, digits: int) -> str:
    """Fixed-point, with a typographic minus."""
    return f"{x:.{digits}f}".replace("-", MINUS)


def _signed(x: float, digits: int) -> str:
    """+0.17, −0.007; a value that rounds to zero keeps its sign (−0.0000: below zero, not by much)."""
    return ("+" if x >= 0 else MINUS) + f"{abs(x):.{digits}f}"


def _sig2(x: float) -> str:
    """Two significant figures, never in exponent form: 5.8, 27, 0.65, 154."""
    return f"{x:.0f}" if abs(x) >= 100 else f"{x:.2g}"


def _ratio(x: float) -> str:
    """A time ratio: two decimals, three below 0.1."""
    return _f(x, 3 if x < 0.1 else 2)


def _sci(x: float) -> str:
    """8.7e-8 (two significant figures, no zero-padded exponent)."""
    mantissa, exp = f"{x:.1e}".split("e")
    return f"{mantissa}e{int(exp)}"


def _span(values: Sequence[float], fmt: Callable[[float], str]) -> str:
    """The range of values as formatted: '0.99–1.04', or one value when both ends agree."""
    lo, hi = fmt(min(values)), fmt(max(values))
    return lo if lo == hi else f"{lo}–{hi}"


def _tokens(n: int) -> str:
    """128, 1K, 64K, 1M."""
    if n >= 1 << 20 and n % (1 << 20) == 0:
        return f"{n >> 20}M"
    return f"{n >> 10}K" if n >= 1024 and n % 1024 == 0 else str(n)


# --------------------------------------------------------------------------- the tables
