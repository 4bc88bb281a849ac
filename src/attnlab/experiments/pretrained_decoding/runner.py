"""Run a decoding comparison in resumable, time-boxed batches: items still missing, per side.

Two sides score every item. "attnlab": the selectors in this environment, one exact prefill per
item shared by every (method, K) (`attnlab.search.decode_items`). "presses": kvpress's presses in
.venv-kvpress (its transformers pin differs), through a worker subprocess
(`python -m attnlab.search.presses`) that reads the same token ids from a work file and shares one
prefill per item across every (press, K). Each side appends one record per finished item to
RECORDS/<side>.jsonl (`attnlab.search.records`); a rerun skips the items recorded under the same
settings with the same tokens, so a batch cut anywhere loses at most its item in progress.
`minutes` bounds a batch: no item starts that the longest of its kind so far says would end past
it. The projections a method reads are trained first where missing (`[train.<method>]`,
`train_projections`, resumable), in chunks of checkpoint_every steps within the same limit.
Where .venv-kvpress is missing the presses are skipped with a message (`make kvpress-env`).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import attnlab
from attnlab.search.decode_items import run_item
from attnlab.search.hf_model import load_model, resolve_device, resolve_dtype, resolve_layers, resolve_source, model_dims
from attnlab.search.hf_model import load_hf_config
from attnlab.search.patch import selector_knobs
from attnlab.search.records import Slot, append_record, read_records, save_work
from attnlab.search.retrieval import resolve_groups
from attnlab.search.train import CHECKPOINT, train_projections

from .plan import plan
from .spec import Spec

SIDES = ("attnlab", "presses")


def kvpress_python() -> Path:
    """The interpreter of the kvpress environment: $ATTNLAB_KVPRESS_PYTHON, else the checkout's
    .venv-kvpress/bin/python (what `make kvpress-env` makes)."""
    given = os.environ.get("ATTNLAB_KVPRESS_PYTHON")
    if given:
        return Path(given)
    return Path(attnlab.__file__).resolve().parents[2] / ".venv-kvpress" / "bin" / "python"


def records_folder(spec: Spec) -> Path:
    return spec.folder / "records"


def recorded(spec: Spec, items: list[dict], folders) -> dict:
    """{(side, item id): record} of the records under `folders` that belong to this spec: its settings
    and the item's tokens (the first of duplicates wins; files in name order)."""
    settings, sha = spec.settings(), {it["id"]: it["sha"] for it in items}
    out = {}
    for r in read_records(folders):
        if r.get("settings") == settings and sha.get(r["item"]) == r.get("sha"):
            out.setdefault((r["side"], r["item"]), r)
    return out


def select(items: list[dict], only: dict | None) -> list[dict]:
    """The items that `only` keeps: {"lengths": [...], "kinds": [...], "tasks": [...]} (absent: all)."""
    only = only or {}
    keep = []
    for it in items:
        if "lengths" in only and it["length"] not in only["lengths"]:
            continue
        if "kinds" in only and it["kind"] not in only["kinds"]:
            continue
        if "tasks" in only and it["kind"] == "task" and it["task"] not in only["tasks"]:
            continue
        keep.append(it)
    return keep


def ensure_projections(spec: Spec, slot: Slot, progress: bool = True) -> dict | None:
    """{name: checkpoint path} of the projections the attnlab methods read, training what is missing
    (None when the time limit stopped a training before its last step)."""
    from attnlab.index.projections import SearchProjections

    paths = {}
    for name, cfg in spec.train.items():
        ckpt = Path(cfg.out) / CHECKPOINT
        while True:
            step = 0
            if ckpt.is_file():
                step = int(SearchProjections.load(ckpt)[1].get("step", 0))
            if step >= cfg.steps:
                break
            if not slot.fits(("train", name)):
                return None
            t0 = time.time()
            train_projections(cfg, progress=progress, until=step + cfg.checkpoint_every)
            slot.done(("train", name), time.time() - t0)
        paths[name] = str(ckpt)
    return paths


def run_attnlab(spec: Spec, todo: list[dict], out: Path, slot: Slot, device: str, progress: bool) -> int:
    """Score the attnlab side of `todo`; returns the items recorded."""
    from attnlab.index.projections import SearchProjections
    from tqdm.auto import tqdm

    ckpts = ensure_projections(spec, slot, progress)
    if ckpts is None:
        print("stopped while training the projections (the time limit); the next batch resumes", file=sys.stderr)
        return 0
    proj = {n: SearchProjections.load(p)[0] for n, p in ckpts.items()}
    source = resolve_source(spec.model, hub=False)
    dims = model_dims(load_hf_config(source))
    layers = resolve_layers(spec.layer_set, dims.n_layers)
    groups = resolve_groups(spec.groups, dims)
    a = spec.attnlab
    knobs = selector_knobs(a)
    models = {}
    done = 0
    for item in tqdm(todo, desc="attnlab", disable=not progress):
        where = spec.timing.device if item["kind"] == "time" else device
        key = (item["kind"], item["length"])
        if not slot.fits(key):
            print(f"stopped before {item['id']}: the next item would pass the time limit", file=sys.stderr)
            break
        if where not in models:
            models[where] = load_model(source, resolve_dtype(spec.dtype), resolve_device(where))
        model = models[where]
        by_method = {m: proj[spec.trained_for(m)].to(next(model.parameters()).device)
                     for m in a.methods if spec.trained_for(m)}
        t0, c0 = time.time(), time.process_time()
        res = run_item(model, layers, item, a.methods, spec.budgets, groups, by_method, knobs)
        append_record(out / "attnlab.jsonl", {"item": item["id"], "side": "attnlab", "settings": spec.settings(),
                                              "sha": item["sha"], "seconds": round(time.time() - t0, 3),
                                              "cpu_s": round(time.process_time() - c0, 3),
                                              "device": str(next(model.parameters()).device),
                                              "threads": torch.get_num_threads(), **res})
        slot.done(key, time.time() - t0)
        done += 1
    return done


def run_presses(spec: Spec, todo: list[dict], out: Path, slot: Slot, device: str,
                threads: int | None = None) -> int | None:
    """Score the presses side of `todo` in the kvpress worker; None (with a message) where kvpress is
    not installed. Timing items run on spec.timing.device, the rest on `device`; threads: the
    worker's torch threads (None: torch's default)."""
    python = kvpress_python()
    if not python.is_file():
        print(f"kvpress is not installed ({python} is missing; `make kvpress-env` makes it): the presses are skipped",
              file=sys.stderr)
        return None
    done = 0
    groups = [(spec.timing.device, [it for it in todo if it["kind"] == "time"]),
              (device, [it for it in todo if it["kind"] != "time"])]
    for where, items in groups:
        if not items:
            continue
        left = None if slot.limit is None else (slot.limit - (time.time() - slot.start)) / 60.0
        if left is not None and left <= 0:
            break
        with tempfile.TemporaryDirectory() as tmp:
            work = Path(tmp) / "work.pt"
            save_work(work, {"model": spec.model, "dtype": spec.dtype, "device": where, "settings": spec.settings(),
                             "presses": spec.presses.methods, "budgets": spec.budgets, "items": items})
            cmd = [str(python), "-m", "attnlab.search.presses", "--work", str(work), "--records",
                   str(out / "presses.jsonl")] + ([] if left is None else ["--minutes", f"{left:.3f}"]) \
                + ([] if threads is None else ["--threads", str(threads)])
            before = len(read_records([out / "presses.jsonl"]))
            res = subprocess.run(cmd, env={**os.environ, "PYTHONPATH": str(Path(attnlab.__file__).resolve().parents[1])})
            if res.returncode == 3:
                print(f"kvpress is not importable by {python}: the presses are skipped", file=sys.stderr)
                return None
            if res.returncode != 0:
                raise RuntimeError(f"the kvpress worker exited with status {res.returncode}: {' '.join(cmd)}")
            done += len(read_records([out / "presses.jsonl"])) - before
    return done


def run(spec: Spec, sides=SIDES, minutes: float | None = None, records: str | Path | None = None,
        only: dict | None = None, device: str = "auto", progress: bool = True, threads: int | None = None) -> dict:
    """Score every item still missing on each side of `sides`, within `minutes`; records go to
    `records` (default the spec's records/ folder; a batch elsewhere is folded in with `merge`);
    threads: torch threads of this process and of the kvpress worker (None: torch's default).
    Returns {side: items recorded now (None: skipped)}."""
    if threads is not None and (not isinstance(threads, int) or isinstance(threads, bool) or threads < 1):
        raise ValueError(f"threads must be an int >= 1 or None, got {threads!r}")
    before = torch.get_num_threads()
    if threads is not None:
        torch.set_num_threads(threads)
    try:
        return _run(spec, sides, minutes, records, only, device, progress, threads)
    finally:
        torch.set_num_threads(before)


def _run(spec: Spec, sides, minutes, records, only, device: str, progress: bool, threads: int | None) -> dict:
    out = Path(records) if records is not None else records_folder(spec)
    items = select(plan(spec), only)
    have = recorded(spec, items, [records_folder(spec), out])
    slot = Slot(minutes)
    ran = {}
    for side in sides:
        todo = [it for it in items if (side, it["id"]) not in have]
        if side == "presses":
            ran[side] = run_presses(spec, todo, out, slot, device, threads) if todo and spec.presses.methods else 0
        else:
            ran[side] = run_attnlab(spec, todo, out, slot, device, progress) if todo else 0
    return ran


def merge(spec: Spec, folders) -> dict:
    """Fold the records of a batch run elsewhere (files or folders of *.jsonl) into the spec's records/:
    each record of this spec (its settings, an item the spec plans, the same tokens) that the folder
    does not hold yet is appended to records/<side>.jsonl; others are counted and left out. Merging
    the same files twice changes nothing. Returns {"added", "known", "foreign"}."""
    items = plan(spec)
    sha = {it["id"]: it["sha"] for it in items}
    dest = records_folder(spec)
    have = recorded(spec, items, [dest])
    counts = {"added": 0, "known": 0, "foreign": 0}
    for r in read_records(folders):
        if r.get("settings") != spec.settings() or sha.get(r["item"]) != r.get("sha") or r["side"] not in SIDES:
            counts["foreign"] += 1
        elif (r["side"], r["item"]) in have:
            counts["known"] += 1
        else:
            append_record(dest / f"{r['side']}.jsonl", r)
            have[r["side"], r["item"]] = r
            counts["added"] += 1
    return counts
