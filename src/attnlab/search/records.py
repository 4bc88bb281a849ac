"""Per-item records of a decoding comparison, one JSON line each, and the work files that tell a worker
what to run.

A record is everything one item (an example, a perplexity context, a timing prompt) gave under
every method of one side ("attnlab" or "presses"), written as a single line, flushed and synced
before the next item starts: a run cut anywhere keeps every finished item and loses at most the one
in progress (whose line is either absent or, cut mid-write, unreadable and skipped). Two processes
never write the same file. A work file holds the items' token ids (a torch file: both sides read the
very tokens one tokenizer made, whatever transformers each environment has).
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Iterable

import torch


def append_record(path: str | Path, record: dict) -> None:
    """Append one record as one line, flushed and fsynced."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    line = json.dumps(record, separators=(",", ":"), allow_nan=False) + "\n"
    if path.is_file() and path.stat().st_size:
        with open(path, "rb") as f:
            f.seek(-1, os.SEEK_END)
            if f.read(1) != b"\n":  # a write cut short: end its line, so the new record stands on its own
                line = "\n" + line
    with open(path, "a") as f:
        f.write(line)
        f.flush()
        os.fsync(f.fileno())


def read_records(paths: Iterable[str | Path]) -> list[dict]:
    """Every readable record of the files (and of the *.jsonl files of folders) given, in order; a line
    that does not parse (a write cut short) is skipped."""
    out = []
    for p in paths:
        p = Path(p)
        files = sorted(p.glob("*.jsonl")) if p.is_dir() else [p] if p.is_file() else []
        for f in files:
            for line in f.read_text().splitlines():
                try:
                    rec = json.loads(line)
                except ValueError:
                    continue
                if isinstance(rec, dict) and "item" in rec and "side" in rec:
                    out.append(rec)
    return out


def save_work(path: str | Path, work: dict) -> None:
    """A work file: JSON-able settings plus each item's token ids (int32 tensors), one torch file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + f".{os.getpid()}.part")
    torch.save(work, tmp)
    os.replace(tmp, path)


def load_work(path: str | Path) -> dict:
    return torch.load(path, weights_only=True)


class Slot:
    """A time limit for a batch of items: `fits(key)` says whether one more item of that kind (key: e.g.
    (kind, length)) should start, from the longest such item so far (the first of a kind always
    starts; minutes None: no limit); `done(key, seconds)` records one."""

    def __init__(self, minutes: float | None):
        self.limit = None if minutes is None else 60.0 * minutes
        self.start = time.time()
        self.longest: dict = {}

    def fits(self, key) -> bool:
        if self.limit is None:
            return True
        left = self.limit - (time.time() - self.start)
        return left > 0 and (key not in self.longest or self.longest[key] <= left)

    def done(self, key, seconds: float) -> None:
        self.longest[key] = max(seconds, self.longest.get(key, 0.0))
