"""Run logs: one JSONL stream plus one CSV per kind of row ("train", "eval"), TensorBoard optional.

Every row carries `step`. Rows are flushed as they are written, so a killed run leaves
its log readable; on resume, `truncate_after(step)` drops the rows the killed run wrote
after its last checkpoint, so the resumed log reads as one uninterrupted run.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from pathlib import Path

from attnlab.data.cache import WriteError, atomic_write_text

LOG_JSONL = "log.jsonl"


def _flat(row: dict, prefix: str = "") -> dict:
    """Nested dicts and lists become dotted scalar columns (for CSV and TensorBoard)."""
    out = {}
    for key, value in row.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flat(value, f"{name}."))
        elif isinstance(value, (list, tuple)):
            out.update(_flat({str(i): v for i, v in enumerate(value)}, f"{name}."))
        else:
            out[name] = value
    return out


def _json_safe(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


class RunLogger:
    """Appends rows to `run_dir/log.jsonl` and `run_dir/<kind>.csv`; a no-op when not enabled
    (the non-main ranks of a data-parallel run)."""

    def __init__(self, run_dir: str | os.PathLike, *, enabled: bool = True, tensorboard: bool = True):
        self.dir = Path(run_dir)
        self.enabled = enabled
        self._csv_columns: dict[str, list[str]] = {}
        self.tb = None
        if not enabled:
            return
        self.dir.mkdir(parents=True, exist_ok=True)
        for kind_csv in self.dir.glob("*.csv"):
            with open(kind_csv, newline="") as f:
                header = next(csv.reader(f), None)
            if header:
                self._csv_columns[kind_csv.stem] = header
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:  # tensorboard not installed: JSONL and CSV only
                SummaryWriter = None
            if SummaryWriter is not None:
                self.tb = SummaryWriter(log_dir=str(self.dir / "tensorboard"))

    def log(self, kind: str, row: dict) -> None:
        if not self.enabled:
            return
        if "step" not in row:
            raise ValueError(f"a log row needs a 'step', got keys {sorted(row)}")
        path = self.dir / LOG_JSONL
        try:  # a line cut short by a failed write is skipped by read_log and dropped on resume
            with open(path, "a") as f:
                f.write(json.dumps(_json_safe({"kind": kind, **row})) + "\n")
            flat = _flat(row)
            path = self.dir / f"{kind}.csv"
            columns = self._csv_columns.get(kind)
            new_file = columns is None
            if new_file:
                columns = self._csv_columns[kind] = list(flat)
            with open(path, "a", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
                if new_file:
                    writer.writeheader()
                writer.writerow(flat)
        except OSError as e:
            raise WriteError(path, e, what="log file") from e
        if self.tb is not None:
            for name, value in flat.items():
                if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool):
                    self.tb.add_scalar(f"{kind}/{name}", value, row["step"])
            self.tb.flush()

    def history(self, kind: str | None = None) -> list[dict]:
        """The rows logged so far (of one kind, or all), oldest first."""
        return read_log(self.dir, kind)

    def truncate_after(self, step: int) -> None:
        """Drop every row with step > `step` from the JSONL and the CSVs."""
        if not self.enabled:
            return
        jsonl = self.dir / LOG_JSONL
        if jsonl.is_file():
            rows = [r for r in read_log(self.dir) if r["step"] <= step]
            atomic_write_text(jsonl, "".join(json.dumps(r) + "\n" for r in rows))
        for path in self.dir.glob("*.csv"):
            with open(path, newline="") as f:
                reader = csv.reader(f)
                header = next(reader, None)
                rows = list(reader)
            if not header or "step" not in header:
                continue
            col = header.index("step")
            kept = [r for r in rows if len(r) == len(header) and _step_of(r[col]) <= step]
            text = io.StringIO(newline="")
            writer = csv.writer(text)
            writer.writerow(header)
            writer.writerows(kept)
            atomic_write_text(path, text.getvalue())

    def close(self) -> None:
        if self.tb is not None:
            self.tb.close()
            self.tb = None


def _step_of(text: str) -> float:
    try:
        return float(text)
    except ValueError:  # a row cut short by a kill
        return math.inf


def read_log(run_dir: str | os.PathLike, kind: str | None = None) -> list[dict]:
    """Rows of `run_dir/log.jsonl` (of one kind, or all); a torn last line is skipped."""
    path = Path(run_dir) / LOG_JSONL
    if not path.is_file():
        return []
    rows = []
    with open(path) as f:
        for line in f:
            try:
                row = json.loads(line)
            except json.JSONDecodeError:
                continue  # a line cut short by a kill
            if kind is None or row.get("kind") == kind:
                rows.append(row)
    return rows
