"""Run logs: one JSONL stream plus one CSV per kind of row ("train", "eval"), and the backends
of `run.logger` (TensorBoard, W&B, MLflow: `attnlab.train.loggers`).

Every row carries `step`. Rows are flushed as they are written, so a killed run leaves
its log readable; on resume, `truncate_after(step)` drops the rows the killed run wrote
after its last checkpoint, so the resumed log reads as one uninterrupted run. A row with a
column its CSV lacks (a run resumed by a newer attnlab that logs more) rewrites the CSV with
the column added, empty in the older rows.
"""

from __future__ import annotations

import csv
import io
import json
import math
import os
from pathlib import Path

from attnlab.data.cache import WriteError, atomic_write_text

from . import loggers as backends

LOG_JSONL = "log.jsonl"
LOG_PATHS = (LOG_JSONL, "train.csv", "eval.csv") + backends.PATHS  # what an overwritten run's folder loses
FIRST_COLUMNS = ("step", "loss", "ppl", "lr", "grad_norm", "tokens_per_s", "mfu", "peak_mem_gib", "tokens")


def _flat(row: dict, prefix: str = "") -> dict:
    """Nested dicts and lists become dotted scalar columns (for the CSVs and the backends)."""
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
    """Appends rows to `run_dir/log.jsonl` and `run_dir/<kind>.csv`, and hands them to the backends
    named in `loggers` (each must import: `loggers.check_loggers` says so before a run starts) and to
    TensorBoard when `tensorboard` is true and it imports. A no-op when not enabled (the non-main
    ranks of a data-parallel run). Backends start on `open()` or the first row, so that a resumed
    run (`truncate_after`) continues theirs; `meta` gives them the run's title, project and config."""

    def __init__(self, run_dir: str | os.PathLike, *, enabled: bool = True, tensorboard: bool = True,
                 loggers=(), meta: dict | None = None):
        self.dir = Path(run_dir)
        self.enabled = enabled
        self._csv_columns: dict[str, list[str]] = {}
        self._names = list(dict.fromkeys(loggers))
        self._meta = {"title": self.dir.name, "project": "", "config": {}, **(meta or {})}
        self._resumed_at = 0
        self.backends: list | None = None  # started by open()
        if not enabled:
            return
        if tensorboard and "tensorboard" not in self._names:
            try:  # optional here: JSONL and CSV only when it is not installed
                backends.check_loggers(["tensorboard"])
                self._names.append("tensorboard")
            except backends.LoggerUnavailable:
                pass
        self.dir.mkdir(parents=True, exist_ok=True)
        for kind_csv in self.dir.glob("*.csv"):
            with open(kind_csv, newline="") as f:
                header = next(csv.reader(f), None)
            if header:
                self._csv_columns[kind_csv.stem] = header

    def open(self) -> None:
        """Start the backends (once); a run calls it before its first step, so a backend that cannot
        start (no W&B login, an unreachable MLflow server) stops it there."""
        if self.enabled and self.backends is None:
            self.backends = backends.open_backends(self._names, self.dir, resumed_at=self._resumed_at, **self._meta)

    def log(self, kind: str, row: dict) -> None:
        if not self.enabled:
            return
        if "step" not in row:
            raise ValueError(f"a log row needs a 'step', got keys {sorted(row)}")
        self.open()
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
            elif not set(flat) <= set(columns):
                columns = self._csv_columns[kind] = self._widen(path, columns, [k for k in flat if k not in columns])
            with open(path, "a", newline="") as f:
                writer = csv.DictWriter(f, fieldnames=columns, extrasaction="ignore")
                if new_file:
                    writer.writeheader()
                writer.writerow(flat)
        except OSError as e:
            raise WriteError(path, e, what="log file") from e
        scalars = {name: value for name, value in flat.items()
                   if name != "step" and isinstance(value, (int, float)) and not isinstance(value, bool)}
        for backend in self.backends:
            backend.log(kind, scalars, row["step"])

    @staticmethod
    def _widen(path: Path, columns: list[str], added: list[str]) -> list[str]:
        """Rewrite the CSV at `path` with `added` columns after `columns`, empty in the rows it holds."""
        with open(path, newline="") as f:
            reader = csv.reader(f)
            next(reader, None)
            rows = list(reader)
        width, columns = len(columns), columns + added
        text = io.StringIO(newline="")
        writer = csv.writer(text)
        writer.writerow(columns)
        writer.writerows(r + [""] * len(added) if len(r) == width else r for r in rows)  # a torn row stays torn
        atomic_write_text(path, text.getvalue())
        return columns

    def history(self, kind: str | None = None) -> list[dict]:
        """The rows logged so far (of one kind, or all), oldest first."""
        return read_log(self.dir, kind)

    def truncate_after(self, step: int) -> None:
        """Drop every row with step > `step` from the JSONL and the CSVs (a run resumed at `step`; its
        backends, started after this, continue from there)."""
        self._resumed_at = step
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

    def close(self, status: str = "finished") -> None:
        """Finish the backends' runs: status 'finished', 'killed' (stopped by a signal) or 'failed'."""
        started, self.backends = self.backends or [], None if self.backends is None else []
        for backend in started:
            backend.close(status)


def ordered(row: dict, first=FIRST_COLUMNS) -> dict:
    """`row` with the `first` columns leading, in that order."""
    return {**{k: row[k] for k in first if k in row}, **{k: v for k, v in row.items() if k not in first}}


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
