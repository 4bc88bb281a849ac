"""Pieces every `attnlab` command shares: the one-line usage error, the parser classes and small
argument helpers."""

from __future__ import annotations

import argparse
import json
from typing import Sequence

EXIT_USAGE = 2
HF_EXTRA = "pip install 'attnlab[hf]'"  # how to install the optional [hf] extra, as error messages say it


class UsageError(ValueError):
    """Bad command-line input, reported as one line with exit status 2."""


class Parser(argparse.ArgumentParser):
    """argparse, but its errors are one line (no usage dump) and go through UsageError."""

    def error(self, message: str):
        raise UsageError(f"{self.prog}: {message} (see {self.prog} --help)")


class Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog):
        super().__init__(prog, max_help_position=30, width=110)


# --------------------------------------------------------------------------- helpers


def csv_of(kind):
    """An argparse `type`: a comma-separated list of `kind` values (empty items dropped); a value that
    `kind` refuses is argparse's one-line error."""
    def parse(text: str):
        try:
            return [kind(x) for x in text.split(",") if x.strip()]
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a comma-separated list of {kind.__name__}, got {text!r}")

    return parse


def positive_options(ns, *names: str) -> None:
    """Int options the parser read (None when not given) must be >= 1; errors name the option."""
    for name in names:
        value = getattr(ns, name)
        if value is not None and value < 1:
            raise UsageError(f"--{name.replace('_', '-')} must be >= 1, got {value}")


def check_model_builds(cfg, what: str = "") -> None:
    """Build the model of `cfg` on the meta device (no memory, no RNG draws), so a shape error
    surfaces now, as a usage error, rather than after the run folder exists."""
    import torch

    from attnlab.train.trainer import build_model

    try:
        with torch.device("meta"):
            build_model(cfg, cfg.vocab_size)
    except (ValueError, TypeError) as e:
        raise UsageError(f"{what}{e}") from None


def int_list(text: str, name: str) -> list[int]:
    try:
        values = [int(p) for p in text.split(",") if p.strip()]
    except ValueError:
        raise UsageError(f"{name} must be comma-separated positive integers such as 128,256, got {text!r}") from None
    if not values or any(v < 1 for v in values):
        raise UsageError(f"{name} must be comma-separated positive integers such as 128,256, got {text!r}")
    return values


def float_list(text: str, name: str, lo: float, hi: float) -> list[float]:
    try:
        values = [float(p) for p in text.split(",") if p.strip()]
    except ValueError:
        values = []
    if not values or any(not lo <= v <= hi for v in values):
        raise UsageError(f"{name} must be comma-separated numbers in [{lo}, {hi}] such as 0,0.5,1, got {text!r}")
    return values


def split_config_args(args: Sequence[str]) -> tuple[str | None, list[str]]:
    """[CONFIG] key=value ... -> (config path or None, overrides)."""
    args = list(args)
    path = args[0] if args and "=" not in args[0] else None
    overrides = args[1:] if path is not None else args
    stray = [a for a in overrides if "=" not in a]
    if stray:
        raise UsageError(f"expected section.key=value overrides after the config file, got {stray[0]!r}")
    return path, overrides


def command_line(argv: Sequence[str]) -> str:
    safe = set("-_=./,:@+")
    return " ".join(["attnlab"] + [a if a and all(c.isalnum() or c in safe for c in a) else json.dumps(a) for a in argv])


def print_table(rows: dict) -> None:
    width = max(len(k) for k in rows)
    for k, v in rows.items():
        print(f"  {k:<{width}}  {v}")
