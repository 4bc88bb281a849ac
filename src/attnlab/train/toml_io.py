"""Config dataclasses as plain dicts, and a small TOML writer (tomllib only reads).

Only what configs hold is written: booleans, numbers, strings, lists, nested tables and
lists of tables. None values are left out, so the key takes its default when read back.
"""

from __future__ import annotations

import dataclasses
import json
import math


def to_dict(cfg, derived: bool = False) -> dict:
    """A config dataclass as plain nested dicts; derived (init=False) fields only if asked."""
    out = {}
    for f in dataclasses.fields(cfg):
        if not f.init and not derived:
            continue
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(value):
            value = to_dict(value, derived)
        elif isinstance(value, tuple):
            value = list(value)
        out[f.name] = value
    return out


def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, int):
        return str(v)
    if isinstance(v, float):
        return repr(v) if math.isfinite(v) else ("nan" if math.isnan(v) else ("inf" if v > 0 else "-inf"))
    if isinstance(v, str):
        return json.dumps(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{json.dumps(k)} = {_toml_value(x)}" for k, x in v.items() if x is not None) + "}"
    raise TypeError(f"cannot write {v!r} ({type(v).__name__}) to TOML")


def dumps_toml(data: dict, _prefix: str = "") -> str:
    """Write nested dicts as TOML: a table's plain values first, then a [table] per nested
    dict and an [[array of tables]] per list of dicts. None values are left out (the key
    then takes its default, which is what None meant)."""
    lines, tables, arrays = [], [], []
    for key, value in data.items():
        if value is None:
            continue
        if isinstance(value, dict):
            tables.append((key, value))
        elif isinstance(value, list) and value and all(isinstance(x, dict) for x in value):
            arrays.append((key, value))
        else:
            lines.append(f"{key} = {_toml_value(value)}")
    blocks = ["\n".join(lines)] if lines else []
    for key, value in tables:
        body = dumps_toml(value, f"{_prefix}{key}.")
        blocks.append(f"[{_prefix}{key}]" + ("\n" + body if body else ""))
    for key, items in arrays:
        for item in items:
            body = dumps_toml(item, f"{_prefix}{key}.")
            blocks.append(f"[[{_prefix}{key}]]" + ("\n" + body if body else ""))
    return "\n\n".join(blocks)


