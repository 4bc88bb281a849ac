"""Reading a run's TOML and setting dotted `section.key=value` overrides into it: the raw-dict side of
`config.load_config`, before validation (`config.config_from_dict`)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

from attnlab.models.config import ConfigError

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

__all__ = ["apply_overrides", "parse_value", "read_toml"]


def parse_value(text: str):
    """A command-line value as a TOML literal; bare words and [a, b] lists fall back to strings."""
    try:
        return tomllib.loads(f"v = {text}")["v"]
    except tomllib.TOMLDecodeError:
        pass
    stripped = text.strip()
    if stripped.startswith("[") and stripped.endswith("]"):
        inner = stripped[1:-1].strip()
        return [parse_value(part.strip()) for part in inner.split(",")] if inner else []
    return text


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    """Set dotted `key=value` overrides into a raw config dict (validation comes later)."""
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} must look like section.key=value (e.g. train.steps=500)")
        key, text = item.split("=", 1)
        key = key.strip()
        parts = key.split(".")
        if not key or any(not p for p in parts):
            raise ConfigError(f"override {item!r} has an empty key part; use section.key=value")
        node = raw
        for i, part in enumerate(parts[:-1]):
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise ConfigError(f"override {key}: {'.'.join(parts[: i + 1])} is a value, not a table")
            node = child
        node[parts[-1]] = parse_value(text)
    return raw


def read_toml(path: str | os.PathLike) -> dict:
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"config file {str(path)!r} does not exist")
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"config file {str(path)!r} is not valid TOML: {e}") from e
