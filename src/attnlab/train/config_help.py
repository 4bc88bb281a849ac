"""Every configurable key of a run, with its type, default and help: `attnlab train --help` and
`python -m attnlab.train --keys`."""

from __future__ import annotations

import dataclasses
import re
import typing
from typing import Any

from attnlab.models.config import field_help, type_name

from .config import RunConfig



def config_keys() -> list[tuple[str, str, Any, str]]:
    """Every configurable key as (dotted key, type, default, help), model.attention.* included."""
    rows = []

    def walk(cls, prefix):
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            if not f.init:
                continue
            tp = hints[f.name]
            if dataclasses.is_dataclass(tp):
                walk(tp, f"{prefix}{f.name}.")
                continue
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            rows.append((f"{prefix}{f.name}", type_name(tp), default, field_help(f)))

    walk(RunConfig, "")
    from attnlab.layers import MECHANISMS, AttentionConfig, mechanism_class
    from attnlab.layers.config import option_keys

    doc = docstring_help(AttentionConfig)
    shared = {f.name for f in dataclasses.fields(AttentionConfig)}
    readers: dict[str, list[str]] = {}
    for m in MECHANISMS:
        cls = mechanism_class(m)
        for key in cls.options:
            readers.setdefault(key, []).append(m)
        for options_cls in reversed((cls.Options or object).__mro__):  # an option's text where it is declared
            doc.update({k: v for k, v in docstring_help(options_cls).items() if k not in doc})
    for key, (hint, default) in option_keys().items():
        if key in ("mechanism", "d_model", "n_heads"):
            continue
        help_text = doc.get(key, "see attnlab.layers.AttentionConfig")
        if key not in shared:  # a mechanism's option: say whose
            help_text = f"{', '.join(readers[key])}: {help_text}"
        if key == "rope":
            default = "on for softmax/scalar/hybrid/principled layers, off for the linear family"
        if key == "cosformer_max_len":
            default = "model.max_seq_len"
        rows.append((f"model.attention.{key}", type_name(hint), default, help_text))
    return rows


_DOC_ENTRY = re.compile(r"^(\s+)([a-z_]\w*(?:, [a-z_]\w*)*)(?: \([a-z_]\w*\))?:\s+(\S.*)$")


def docstring_help(cls) -> dict[str, str]:
    """Field descriptions from the `Args:` section of a Google-style docstring: `name: text` lines
    (several names joined by ", " share one text), continuation lines indented further, as
    AttentionConfig's is."""
    out: dict[str, str] = {}
    names, indent, in_args = [], 0, False
    for line in (cls.__doc__ or "").splitlines():
        if line.strip() == "Args:":
            in_args = True
            continue
        if not in_args:
            continue
        m = _DOC_ENTRY.match(line)
        if m and (not names or len(m.group(1)) <= indent):
            names, indent = m.group(2).split(", "), len(m.group(1))
            for n in names:
                out[n] = m.group(3).strip()
        elif names and line.strip() and len(line) - len(line.lstrip()) > indent:
            for n in names:
                out[n] += " " + line.strip()
        elif line.strip() and names and len(line) - len(line.lstrip()) < indent:
            break  # the section ended
        else:
            names = [] if not line.strip() else names
    return out


def format_config_keys() -> str:
    """The key listing as aligned text, for `--help`."""
    rows = config_keys()
    w_key = max(len(r[0]) for r in rows)
    w_type = min(28, max(len(r[1]) for r in rows))
    lines = []
    for key, tp, default, help_text in rows:
        lines.append(f"  {key:<{w_key}}  {tp:<{w_type}}  default {default!r}" + (f"\n  {'':<{w_key}}  {help_text}" if help_text else ""))
    return "\n".join(lines)
