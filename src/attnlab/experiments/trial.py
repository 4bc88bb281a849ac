"""The skeleton the experiment runners over seeds share (`attnlab sweep`, `attnlab retrofit trial`,
`attnlab search trial`): reading a spec's header (title, claim, description), seeds, variants and
output folder, each checked with a ConfigError naming the key before any work; building a run's
config section from the shared and per-variant tables; the statistics over seeds; writing
results.json and report.md."""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Sequence

from attnlab.data.cache import atomic_write_text
from attnlab.experiments.report import fmt
from attnlab.index.options import respell
from attnlab.models.config import ConfigError
from attnlab.train.config import read_toml


def need(cond: bool, message: str) -> None:
    """ConfigError(message) unless cond."""
    if not cond:
        raise ConfigError(message)


def table(raw, key: str) -> dict:
    """raw, checked to be a TOML table (a dict), named `key` in the error."""
    need(isinstance(raw, dict), f"{key} must be a table, got {raw!r}")
    return raw


@dataclass
class SpecHead:
    """A spec's shared part: its path, the raw TOML, the header strings, seeds, variant tables and
    the folder its runs and report go to (`out`, relative to the spec; default the spec's folder)."""
    path: Path
    raw: dict
    title: str
    claim: str
    description: str
    seeds: list[int]
    variants: list[dict]
    out: Path


@dataclass
class Trial:
    """A loaded experiment over seeds: the spec's header, the variant names in order, one run per
    (variant, seed) (the runner's own TrialRun), the checked verdict rules and the output folder."""
    path: Path
    title: str
    claim: str
    description: str
    seeds: list[int]
    variants: list[str]
    runs: list
    rules: list[dict]
    out: Path


def read_spec(path, allowed: tuple[str, ...]) -> SpecHead:
    """Read the spec file at `path` (top-level keys in `allowed`) and check its shared part."""
    path = Path(path)
    need(path.is_file(), f"spec file {str(path)!r} does not exist")
    raw = read_toml(path)
    unknown = sorted(set(raw) - set(allowed))
    need(not unknown, f"unknown key(s) {', '.join(unknown)} in the spec; allowed: {', '.join(allowed)}")
    for k in ("title", "claim", "description"):
        need(isinstance(raw.get(k, ""), str), f"{k} must be a string")
    seeds = raw.get("seeds", [0, 1, 2])
    need(isinstance(seeds, list) and seeds and len(set(seeds)) == len(seeds)
         and all(isinstance(s, int) and not isinstance(s, bool) and s >= 0 for s in seeds),
         f"seeds must be a list of distinct integers >= 0, got {seeds!r}")
    variants = raw.get("variants", [{"name": "default"}])
    need(isinstance(variants, list) and variants and all(isinstance(v, dict) for v in variants),
         "variants must be an array of tables")
    out = (path.parent / raw["out"]) if "out" in raw else path.parent
    return SpecHead(path, raw, raw.get("title", path.parent.name), raw.get("claim", ""), raw.get("description", ""),
                    list(seeds), variants, out)


def variant_name(v: dict, i: int, names: list[str], keys: set[str], reserved: str | None = None) -> str:
    """variants[i]'s name, checked (unique, non-empty, no '/', not `reserved`) and appended to
    `names`; its other keys must be in `keys`."""
    bad = sorted(set(v) - {"name", *keys})
    need(not bad, f"variants[{i}]: unknown key(s) {', '.join(bad)}")
    name = v.get("name")
    need(isinstance(name, str) and name and "/" not in name and name not in names and name != reserved,
         f"variants[{i}].name must be a unique non-empty string without '/'"
         + (f", not {reserved!r}" if reserved else "") + f"; got {name!r}")
    names.append(name)
    return name


def pm(mean, sd) -> str:
    """'mean ± sd' for a report (the mean alone without an sd, '—' without a mean)."""
    return fmt(mean) if sd is None or mean is None else f"{fmt(mean)} ± {fmt(sd)}"


def section(cls, name: str, shared: dict, own: dict, where: str, fixed: tuple[str, ...] = (), **owned):
    """`cls` (a config dataclass) from a spec's shared `[name]` table and a variant's own, which wins;
    `owned` are the values the runner sets (a spec naming one of `fixed` is refused). ConfigError
    naming `where` and the key for an unknown or owned key or a value the dataclass rejects. An index
    option in its older spelling (`nprobe` for `ivf_nprobe`, `attnlab.index.options`) is taken as the other."""
    allowed = {f.name for f in fields(cls)} - set(fixed)
    try:
        shared, own = respell(shared, allowed, f"{name}."), respell(own, allowed, f"{name}.")
    except ValueError as e:
        raise ConfigError(f"{where}: {e}") from None
    for k in {**shared, **own}:
        need(k in allowed, f"{where}: unknown or owned key {name}.{k}; allowed: {', '.join(sorted(allowed))}"
                           + (f" (the trial sets {', '.join(fixed)})" if fixed else ""))
    try:
        return cls(**{**shared, **own, **owned})
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{where}: {name}: {e}") from None


def sample_sd(values: Sequence[float]) -> float | None:
    """Sample standard deviation (n - 1), None below 2 values."""
    if len(values) < 2:
        return None
    m = sum(values) / len(values)
    return math.sqrt(sum((v - m) ** 2 for v in values) / (len(values) - 1))


def mean_sd(values: Sequence[float | None]) -> tuple[float | None, float | None, int]:
    """(mean, sample sd, n) over the values that are not None."""
    vals = [float(v) for v in values if v is not None]
    if not vals:
        return None, None, 0
    return sum(vals) / len(vals), sample_sd(vals), len(vals)


def seed_stats(per_seed: dict) -> dict:
    """{"seeds", "runs", "mean", "sd"} of per-seed metric dicts {seed: {metric: value or None}}: per
    metric, the mean and sample sd over the seeds that have it (sd None below 2)."""
    names = sorted({k for m in per_seed.values() for k in m})
    stats = {k: mean_sd([m.get(k) for m in per_seed.values()]) for k in names}
    return {"seeds": sorted(per_seed), "runs": {str(s): m for s, m in per_seed.items()},
            "mean": {k: v[0] for k, v in stats.items()}, "sd": {k: v[1] for k, v in stats.items()}}


def recorded_results(out: str | os.PathLike) -> dict:
    """The committed OUT/results.json ({} when there is none or it does not parse)."""
    try:
        return json.loads((Path(out) / "results.json").read_text())
    except (OSError, ValueError):
        return {}


def keep_recorded(stats: dict, old: dict, seeds: dict, same) -> list[str]:
    """A fresh clone has a trial's results.json but not its run folders: where the committed results
    record more finished seeds of a variant than its folders hold now, every recorded seed is one the
    spec still asks for (`seeds[variant]`) and `same(variant)` says they were measured with the setup
    the spec gives now, put the recorded statistics back into `stats`. Returns the variants kept."""
    kept = []
    for v, rec in (old.get("variants") or {}).items():
        had, now = rec.get("seeds") or [], (stats.get(v) or {}).get("seeds") or []
        if v in seeds and len(had) > len(now) and set(had) <= set(seeds[v]) and same(v):
            stats[v] = rec
            kept.append(v)
    return kept


def write_outputs(out: str | os.PathLike, results: dict, markdown: str, indent: int = 1) -> Path:
    """OUT/results.json and OUT/report.md, each written atomically (a reader never sees half a file)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", json.dumps(results, indent=indent, default=str) + "\n")
    atomic_write_text(out / "report.md", markdown)
    return out
