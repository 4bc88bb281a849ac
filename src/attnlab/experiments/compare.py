"""`attnlab compare RUN...`: several trained runs at a glance: one table (validation loss and perplexity,
tokens/s, parameters, steps, and the eval losses every run has measured at the same context lengths)
and one PNG of their loss curves, drawn by the sweep report's plotting code.

`compare(runs, out)` writes compare.md, compare.json and compare_loss.png into `out` (by default the
folder that holds the runs) and returns the table's rows."""

from __future__ import annotations

import json
import os
from pathlib import Path
from types import SimpleNamespace

from attnlab.train import read_log


class CompareError(ValueError):
    """A folder that is not a finished run."""


def run_row(run_dir: Path) -> dict:
    """The scalars of one finished run (its summary.json and, when present, eval.json) and its curves."""
    try:
        s = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        raise CompareError(f"{str(run_dir)!r} is not a finished run (no readable summary.json); train it first") from None
    ev = {}
    try:
        ev = json.loads((run_dir / "eval.json").read_text())
    except (OSError, ValueError):
        pass
    log = read_log(run_dir)
    attn = s.get("attn")
    return {
        "run": str(run_dir), "attn": "+".join(dict.fromkeys(attn)) if isinstance(attn, list) else attn,
        "params": s.get("params"), "steps": s.get("steps"), "val_loss": s.get("val_loss"), "val_ppl": s.get("val_ppl"),
        "tokens_per_s": s.get("tokens_per_s"),
        "eval_loss": {T: v.get("loss") for T, v in (ev.get("loss") or {}).items() if isinstance(v, dict)},
        "curves": {"train": [[r["step"], r["loss"]] for r in log if r.get("kind") == "train" and "loss" in r],
                   "val": [[r["step"], r["val_loss"]] for r in log if r.get("kind") == "eval" and "val_loss" in r]},
    }


def _names(dirs: list[Path]) -> list[str]:
    """Short unique labels: each run's path relative to the runs' common folder."""
    common = Path(os.path.commonpath([str(d.resolve()) for d in dirs])) if len(dirs) > 1 else dirs[0].resolve().parent
    names = [str(d.resolve().relative_to(common)) or d.name for d in dirs]
    return names if len(set(names)) == len(names) else [str(d) for d in dirs]


def _fmt(v, digits: int = 4) -> str:
    if v is None:
        return "—"
    if isinstance(v, float):
        return f"{v:,.0f}" if abs(v) >= 1000 else f"{v:.{digits}g}"
    return f"{v:,}" if isinstance(v, int) else str(v)


def compare(runs: list[str | os.PathLike], out: str | os.PathLike | None = None, *, plot: bool = True) -> dict:
    """Compare finished runs: returns {"rows", "lengths", "written"}; writes compare.md, compare.json
    and (plot) compare_loss.png into `out` (default: the runs' common folder)."""
    dirs = [Path(r) for r in runs]
    if len(dirs) < 2:
        raise CompareError(f"compare needs at least 2 runs, got {len(dirs)}")
    rows = [run_row(d) for d in dirs]  # every run checked before anything is written
    names = _names(dirs)
    for name, row in zip(names, rows):
        row["name"] = name
    shared = [T for T in rows[0]["eval_loss"] if all(T in r["eval_loss"] for r in rows)]
    shared.sort(key=int)
    head = ["run", "attn", "params", "steps", "val_loss", "val_ppl", "tokens/s"] + [f"loss@{T}" for T in shared]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in rows:
        cells = [r["name"], r["attn"], r["params"], r["steps"], r["val_loss"], r["val_ppl"], r["tokens_per_s"]]
        cells += [r["eval_loss"][T] for T in shared]
        lines.append("| " + " | ".join(_fmt(c) for c in cells) + " |")
    table = "\n".join(lines)
    where = Path(out) if out is not None else Path(os.path.commonpath([str(d.resolve()) for d in dirs]))
    where.mkdir(parents=True, exist_ok=True)
    written = [where / "compare.md", where / "compare.json"]
    (where / "compare.md").write_text(f"# Comparing {len(rows)} runs\n\n{table}\n\n"
                                      f"val_loss: the last evaluation of each run's training (nats/token); "
                                      f"loss@T: its `attnlab eval` loss at context length T, where every run has one."
                                      + ("\n\n![loss curves](compare_loss.png)\n" if plot else "\n"))
    (where / "compare.json").write_text(json.dumps({"runs": rows, "lengths": shared}, indent=1) + "\n")
    if plot:
        from .sweep.report import plot_curves

        results = {"runs": [{"variant": r["name"], "curves": r["curves"]} for r in rows],
                   "variants": {r["name"]: {} for r in rows}}
        written.append(plot_curves(SimpleNamespace(title=f"{len(rows)} runs"), results, where / "compare_loss.png"))
    return {"rows": rows, "lengths": shared, "table": table, "written": [str(p) for p in written]}
