"""A sweep in pieces: the records of finished runs as small files, and their merge into results.json.

    attnlab sweep SPEC --only softmax/seed0,hybrid/seed0 --records DIR   # on a machine lent for minutes
    attnlab sweep SPEC --merge DIR [DIR ...]                             # here: results.json + report

A records file (DIR/<spec folder>-<spec hash>.records.json, rewritten atomically as each run finishes)
holds, per finished run, everything results.json and the report take from a run folder: the summary's
scalars, the collected metrics, the loss and τ curves, the machine that trained it, and the settings
that decide its result (`runs.settings_of`); never checkpoints. Its spec hash covers what every run of
the spec shares (base config, shared overrides, [metrics]); a record's settings are checked against what
the spec gives that run now, so a record of another spec, or of this one before it changed, is refused
naming the file. A run recorded twice (in two files, or in a file and in results.json or a run folder)
is refused unless both say the same up to timings and machine; `replace` lets the merged record win
over results.json's."""

from __future__ import annotations

import hashlib
import json
import os
import re
from pathlib import Path

from attnlab.data.cache import atomic_write_text

from ..report import machine_info, shown_path
from .results import _run_entry
from .runs import RunPlan, _record_of, flat_changes, recorded_runs, run_config, settings_of, summary_of
from .spec import Spec, SweepError

FORMAT = "attnlab sweep records"
VERSION = 1
SUFFIX = ".records.json"
# what may differ between two records of the same run: how long it took, where, and how it got there
VOLATILE = ("wall_seconds", "tokens_per_s", "train_seconds", "train_seconds_logged", "machine", "resumed")
NEEDED = ("variant", "seed", "params", "steps", "tokens", "val_loss", "metrics", "curves", "settings")


def spec_hash(spec: Spec) -> str:
    """16 hex digits over what every run of the spec shares: the base config, the shared overrides and
    the [metrics] table (variants and seeds may grow without changing it)."""
    shared = {"base": spec.base_raw, "overrides": spec.overrides, "metrics": spec.metrics}
    return hashlib.sha256(json.dumps(shared, sort_keys=True, default=str).encode()).hexdigest()[:16]


def records_file(spec: Spec, folder: str | os.PathLike) -> Path:
    """Where `--records FOLDER` writes this spec's records: one file per spec (and spec hash)."""
    name = re.sub(r"[^A-Za-z0-9._-]", "_", spec.path.resolve().parent.name) or "sweep"
    return Path(folder) / f"{name}-{spec_hash(spec)[:8]}{SUFFIX}"


def same_run(a: dict, b: dict) -> bool:
    """Two records of one run agree on everything but timings and machine (NaN equals NaN)."""
    def key(r):
        return json.dumps({k: v for k, v in r.items() if k not in VOLATILE + ("settings", "run_dir")},
                          sort_keys=True, default=str)
    return key(a) == key(b)


def run_name(r: dict) -> str:
    return f"{r.get('variant')}/seed{r.get('seed')}"


# --------------------------------------------------------------------------- writing


def check_target(spec: Spec, folder: str | os.PathLike) -> Path:
    """The records file `--records FOLDER` will write, checked before any run starts: FOLDER is a folder
    (or not there yet) and a records file already in it belongs to this spec (SweepError naming it)."""
    folder = Path(folder)
    if folder.exists() and not folder.is_dir():
        raise SweepError(f"--records {str(folder)!r} is a file, not a folder")
    path = records_file(spec, folder)
    if path.exists():
        _read(path, spec)  # a damaged or foreign file is an error now, not after hours of training
    return path


def write_records(spec: Spec, plans: list[RunPlan], folder: str | os.PathLike,
                  out: str | os.PathLike | None = None) -> Path | None:
    """Write the records file of `folder` with every finished run among `plans` (their run folders
    under OUT), beside the runs an earlier call wrote into the same file. Atomic: a command cut off
    at any moment leaves the file of the runs finished before. Returns its path (None: nothing to write)."""
    out = Path(out) if out is not None else spec.out
    path = records_file(spec, folder)
    runs = {(r["variant"], r["seed"]): r for r in (_read(path, spec)["runs"] if path.exists() else [])}
    for p in plans:
        record = _record_of(p.run_dir)
        if record is None or record.get("metrics_spec") != spec.metrics:  # not finished: metrics to collect
            continue
        entry = _run_entry(spec, p.variant, p.seed, p.cfg, p.run_dir, out)
        if entry is None:
            continue
        threads = record.get("threads")
        entry.setdefault("machine", machine_info(threads))
        runs[(p.variant, p.seed)] = {**entry, "settings": settings_of(p.cfg)}
    if not runs:
        return None
    order = {(v.name, s): i for i, (v, s) in enumerate((v, s) for v in spec.variants for s in spec.seeds)}
    ordered = sorted(runs.values(), key=lambda r: order.get((r["variant"], r["seed"]), 0))
    body = {"format": FORMAT, "version": VERSION, "spec": shown_path(spec.path), "title": spec.title,
            "spec_hash": spec_hash(spec), "runs": ordered}
    atomic_write_text(path, json.dumps(body, indent=1, default=str) + "\n")
    return path


# --------------------------------------------------------------------------- reading and merging


def _read(path: Path, spec: Spec) -> dict:
    """A records file of `spec`, every run checked against what the spec gives it now."""
    try:
        body = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError) as e:
        raise SweepError(f"records file {str(path)!r} cannot be read: {e}") from None
    except ValueError as e:
        raise SweepError(f"records file {str(path)!r} is not JSON ({e}); a file cut off while written is left "
                         f"under a temporary name, so this one was damaged after") from None
    if not isinstance(body, dict) or body.get("format") != FORMAT or not isinstance(body.get("runs"), list):
        raise SweepError(f"{str(path)!r} is not a records file of `attnlab sweep --records`")
    if body.get("version") != VERSION:
        raise SweepError(f"records file {str(path)!r} has version {body.get('version')!r}; this attnlab reads "
                         f"version {VERSION}")
    if body.get("spec_hash") != spec_hash(spec):
        raise SweepError(f"records file {str(path)!r} holds runs of another spec ({body.get('spec')!r}, "
                         f"{body.get('title')!r}, spec hash {body.get('spec_hash')}): {shown_path(spec.path)} has "
                         f"spec hash {spec_hash(spec)}, so its base config, shared overrides or [metrics] differ")
    variants = {v.name: v for v in spec.variants}
    for i, r in enumerate(body["runs"]):
        if not isinstance(r, dict) or any(k not in r for k in NEEDED):
            missing = [k for k in NEEDED if not isinstance(r, dict) or k not in r]
            raise SweepError(f"records file {str(path)!r}: run {i} lacks {', '.join(missing)}")
        if r["variant"] not in variants or r["seed"] not in spec.seeds:
            raise SweepError(f"records file {str(path)!r} records {run_name(r)}, which is no run of "
                             f"{shown_path(spec.path)} (variants {', '.join(variants)}; seeds "
                             f"{', '.join(map(str, spec.seeds))})")
        cfg, _ = run_config(spec, variants[r["variant"]], r["seed"])
        settings = r["settings"]
        changes = flat_changes(settings, cfg) if isinstance(settings, dict) else [("settings", settings, "a table")]
        if changes:
            diff = "; ".join(f"{k}: {a!r} -> {b!r}" for k, a, b in changes[:4])
            raise SweepError(f"records file {str(path)!r}: {run_name(r)} was trained with other settings than "
                             f"{shown_path(spec.path)} gives it now ({diff})")
    return body


def record_files(paths: list[str | os.PathLike]) -> list[Path]:
    """The records files that `--merge PATH...` names: each PATH a records file or a folder holding
    some (its *.records.json). SweepError naming a PATH that is neither."""
    files = []
    for given in paths:
        p = Path(given)
        if p.is_dir():
            found = sorted(p.glob(f"*{SUFFIX}"))
            if not found:
                raise SweepError(f"--merge: folder {str(p)!r} holds no records file (*{SUFFIX}); `attnlab sweep SPEC "
                                 f"--only RUNS --records {p}` writes one")
            files += found
        elif p.is_file():
            files.append(p)
        else:
            raise SweepError(f"--merge: {str(p)!r} does not exist")
    return list({f.resolve(): f for f in reversed(files)}.values())[::-1]  # each file once, as first named


def merge(spec: Spec, paths: list[str | os.PathLike], out: str | os.PathLike | None = None, *,
          replace: bool = False, plans: list[RunPlan] | None = None) -> tuple[dict, list[str]]:
    """The runs the records files under `paths` add to OUT/results.json, checked and without writing
    anything: ({(variant, seed): run entry}, notes for the user). Refuses (SweepError naming the files)
    a file of another spec, a run two files record differently, a run results.json records differently
    (unless `replace`: the merged record wins), and a run whose folder under OUT is there (a finished one
    that differs, or an unfinished one, which the next sweep would resume over the record)."""
    from .runs import plan as make_plan

    out = Path(out) if out is not None else spec.out
    merged: dict[tuple[str, int], tuple[dict, Path]] = {}
    for f in record_files(paths):
        for r in _read(f, spec)["runs"]:
            key = (r["variant"], r["seed"])
            if key in merged and not same_run(merged[key][0], r):
                raise SweepError(f"--merge: {run_name(r)} is recorded differently in {str(merged[key][1])!r} and "
                                 f"{str(f)!r} (trained twice); merge the one that should stand")
            merged.setdefault(key, (r, f))
    recorded = recorded_runs(spec, out)
    states = {(p.variant, p.seed): p for p in (plans if plans is not None else make_plan(spec, out))}
    runs, notes = {}, []
    for key, (r, f) in merged.items():
        entry = {k: v for k, v in r.items() if k != "settings"}
        p = states[key]
        if p.run_dir.exists():
            here = summary_of(p.run_dir, p.cfg.train.steps)
            if here is None or p.state != "done":
                raise SweepError(f"--merge: {p.run_dir} holds an unfinished run of {run_name(r)}, which the next "
                                 f"sweep would resume over the record in {str(f)!r}: delete that folder first")
            if not same_run(_run_entry(spec, p.variant, p.seed, p.cfg, p.run_dir, out) or {}, entry):
                raise SweepError(f"--merge: {p.run_dir} holds a finished run of {run_name(r)} that differs from the "
                                 f"record in {str(f)!r}; merge into another --out, or delete the folder")
            notes.append(f"{run_name(r)}: its run folder here holds the same run")
            continue
        old = recorded.get(key)
        if old is not None and not same_run(old, entry):
            if not replace:
                raise SweepError(f"--merge: {run_name(r)} in {str(f)!r} differs from the run "
                                 f"{out / 'results.json'} records; --replace lets the merged record win")
            notes.append(f"{run_name(r)}: the record in {f.name} replaces the one results.json held")
        elif old is not None:
            notes.append(f"{run_name(r)}: already in results.json, the same")
        runs[key] = entry
    pythons = {(r.get("machine") or {}).get("python") for r in [*recorded.values(), *runs.values()]} - {None}
    if len(pythons) > 1 and any(p.cfg.data.source.startswith("stdlib") for p in states.values()):
        notes.append(f"the runs were trained under Python {', '.join(sorted(pythons))}: the stdlib corpus is each "
                     f"Python's own library, so their training text differs (the report names each run's machine)")
    return runs, notes
