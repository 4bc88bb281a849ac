"""A GPU check part's rows in one JSON file, rewritten (atomically) after every row.

A part killed at its cap keeps every row it finished; started again on the same file (after one of its
rows was killed at that row's cap, or in a rerun of the check) it measures only the rows the file
lacks. While a row runs, the file's `running` names it with its start and its cap, so the check
(benchmarks/gpu_check.py) can kill a row that outlives its cap and record it (`record_kill`) before
starting the part again. A row's key is a few of its fields (`fields`); rows carried from an earlier
run for display (marked `from`) are measured again. Rows of another device are not kept.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Callable, Iterable


def _machine() -> str:
    """This boot of this machine: rows measured on one compare with each other (ratios to a baseline)."""
    try:
        return Path("/proc/sys/kernel/random/boot_id").read_text().strip()[:8]
    except OSError:
        return os.uname().nodename


MACHINE = _machine()


def save(path: Path, doc: dict) -> None:
    tmp = Path(path).with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, path)


def load(path: Path) -> dict | None:
    try:
        return json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return None


def complete(path: Path, section: str = "rows") -> bool:
    """Whether the part that writes `section` of `path` finished its whole plan there."""
    return bool(((load(path) or {}).get("complete") or {}).get(section))


def record_kill(path: Path, reason: str) -> dict | None:
    """The row `running` names, recorded with `reason` as its error (the part's process is gone); returns it."""
    doc = load(path)
    running = (doc or {}).pop("running", None)
    if not running:
        return None
    row = {**running["row"], "error": reason, "seconds": round(time.time() - running["since"], 1), "machine": MACHINE}
    doc.setdefault(running["section"], []).append(row)
    save(path, doc)
    return row


class RowFile:
    def __init__(self, path, header: dict, fields: Iterable[str], section: str = "rows"):
        self.path, self.fields, self.section = Path(path), tuple(fields), section
        self.path.parent.mkdir(parents=True, exist_ok=True)
        old = load(self.path) or {}
        if old.get(section) and old.get("device") != header.get("device"):
            print(f"{self.path}: its rows are of {old.get('device')}, not {header.get('device')}: measured again",
                  flush=True)
            old = {k: v for k, v in old.items() if k != section}
        self.doc = {**old, **header}
        self.doc.pop("running", None)
        self._open()

    def _open(self) -> None:
        self.doc.setdefault(self.section, [])
        self.doc.setdefault("complete", {}).setdefault(self.section, False)
        self.doc.setdefault("skipped", {}).setdefault(self.section, [])

    def view(self, fields: Iterable[str], section: str) -> "RowFile":
        """Another `section` of the same file and document, its rows keyed by `fields`."""
        other = object.__new__(RowFile)
        other.path, other.fields, other.section, other.doc = self.path, tuple(fields), section, self.doc
        other._open()
        return other

    def key(self, row: dict) -> tuple:
        return tuple(row.get(f) for f in self.fields)

    def done(self, spec: dict) -> bool:
        return any(self.key(r) == self.key(spec) for r in self.doc[self.section] if "from" not in r)

    def start(self, spec: dict, cap_s: float) -> None:
        row = {f: spec[f] for f in self.fields if spec.get(f) is not None}
        self.doc["running"] = {"section": self.section, "row": row, "since": time.time(), "cap_s": cap_s}
        save(self.path, self.doc)

    def add(self, row: dict) -> None:
        rows = self.doc[self.section]
        rows[:] = [r for r in rows if self.key(r) != self.key(row)] + [row]
        self.doc.pop("running", None)
        save(self.path, self.doc)

    def run(self, plan: list[dict], measure: Callable[[dict], dict], deadline: float,
            show: Callable[[str, dict | str], None] | None = None, min_s: float = 10.0) -> None:
        """Each row of `plan` the file lacks, in order: `measure(spec)` under the row's cap (spec["cap"],
        at most the time left), the row written as soon as it is measured (an exception is its error).
        A row is not started with less than min(its cap, `min_s`) seconds left (named in `skipped`, for a
        rerun). A spec with `overrun` sleeps past its cap (the smoke mode's row that the cap must stop).
        `show(label, row or message)` prints progress."""
        show = show or (lambda label, what: print(f"  {label}: {what}", flush=True))
        self.doc["complete"][self.section], self.doc["skipped"][self.section] = False, []
        for spec in plan:
            label = " ".join(f"{f}={spec[f]}" for f in self.fields if spec.get(f) is not None)
            if self.done(spec):
                show(label, "kept from an earlier run")
                continue
            left = deadline - time.time()
            if left < min(spec["cap"], min_s):
                show(label, f"not started ({left:.0f} s left)")
                self.doc["skipped"][self.section].append(label)
                continue
            self.start(spec, min(spec["cap"], left))
            t0 = time.time()
            try:
                if spec.get("overrun"):
                    time.sleep(10 * spec["cap"] + 10)
                row = measure(spec)
            except Exception as e:  # noqa: BLE001 - the row records what failed
                msg = str(e) if len(str(e)) <= 1500 else f"{str(e)[:500]} [...] {str(e)[-1000:]}"  # the cause is last
                row = {f: spec[f] for f in self.fields if spec.get(f) is not None}
                row["error"] = f"{type(e).__name__}: {msg}"
            row.update(seconds=round(time.time() - t0, 1), machine=MACHINE)
            self.add(row)
            show(label, row)
        self.doc["complete"][self.section] = not self.doc["skipped"][self.section]
        save(self.path, self.doc)
