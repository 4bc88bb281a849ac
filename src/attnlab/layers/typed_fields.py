"""Type checks of config dataclass fields against their annotations: one rule set for every config.

`field_problem(obj)` walks a dataclass's init fields; `value_problem(value, tp, path)` checks one value.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import numbers
import types
import typing
from typing import Any, Literal, Union


@functools.cache
def _hints(cls) -> dict:
    return typing.get_type_hints(cls)


def _problem(value, tp, path: str) -> tuple[str, Any, str] | None:
    """None when `value` fits the annotation `tp`, else (path, offending value, what it needs)."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return None
    if tp is type(None):
        return None if value is None else (path, value, "None")
    if origin is Literal:
        allowed = typing.get_args(tp)
        ok = value in allowed and type(value) in {type(a) for a in allowed}
        return None if ok else (path, value, f"one of {allowed}")
    if origin in (Union, types.UnionType):
        problems = [_problem(value, arg, path) for arg in typing.get_args(tp)]
        if any(p is None for p in problems):
            return None
        deeper = [p for p in problems if p[0] != path]  # a list of the right kind with one bad item
        if deeper:
            return deeper[0]
        return path, value, " or ".join(dict.fromkeys(p[2] for p in problems))
    if tp is bool:
        return None if isinstance(value, bool) else (path, value, "a bool (true or false)")
    if tp is int:
        ok = isinstance(value, numbers.Integral) and not isinstance(value, bool)
        return None if ok else (path, value, "an int")
    if tp is float:
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return path, value, "a finite number"
        return None if math.isfinite(value) else (path, value, "a finite number")
    if tp is str:
        return None if isinstance(value, str) else (path, value, "a str")
    if origin in (list, tuple):
        if not isinstance(value, (list, tuple)):
            return path, value, f"a {origin.__name__}"
        args = [a for a in typing.get_args(tp) if a is not Ellipsis] or [Any]
        fixed = origin is tuple and Ellipsis not in typing.get_args(tp)
        if fixed and len(value) != len(args):
            return path, value, f"a {origin.__name__} of {len(args)} items"
        for i, item in enumerate(value):
            found = _problem(item, args[i] if fixed else args[0], f"{path}[{i}]")
            if found:
                return found
        return None
    if origin is dict:
        if not isinstance(value, dict):
            return path, value, "a table (dict)"
        _, arg = typing.get_args(tp) or (Any, Any)
        for key, item in value.items():
            found = _problem(item, arg, f"{path}.{key}")
            if found:
                return found
        return None
    if isinstance(tp, type):
        return None if isinstance(value, tp) else (path, value, f"a {tp.__name__}")
    return None


def value_problem(value, tp, path: str) -> tuple[str, Any, str] | None:
    """None when `value` fits the annotation `tp` (the rules of `field_problem`), else
    (path, offending value, what it needs)."""
    return _problem(value, tp, path)


def field_problem(obj) -> tuple[str, Any, str] | None:
    """The first init field of dataclass `obj` whose value does not fit its type annotation,
    as (field path, value, what it needs); None when all fit.

    Walks the fields by annotation, so every config dataclass gets the same rules: a bool
    field holds True/False only; an int field an int (never a bool); a float field a finite
    real number (ints accepted; NaN and ±inf are not), also inside lists, tuples and unions.
    Nested dataclass fields are only checked to be of their class (they validate themselves)."""
    hints = _hints(type(obj))
    for f in dataclasses.fields(obj):
        if f.init:
            found = _problem(getattr(obj, f.name), hints[f.name], f.name)
            if found:
                return found
    return None
