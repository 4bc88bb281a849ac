"""Timing that holds on a busy machine: interleaved rounds, ratios within a round, medians.

Each round times every case once, in a fixed order (A, B, C, A, B, C, ...), so a slow spell of
the machine hits all cases alike; the ratio of a case to the baseline is taken within each
round, and the report gives the median of those per-round ratios next to the best round.
"""

from __future__ import annotations

import statistics
import time
from typing import Callable


def interleaved(cases: dict[str, Callable[[], object]], rounds: int, reps: int = 1, warmup: int = 1) -> dict[str, list[float]]:
    """Seconds per call of each case, one entry per round (the mean over `reps` calls)."""
    if rounds < 1 or reps < 1:
        raise ValueError(f"rounds and reps must be >= 1, got {rounds} and {reps}")
    for fn in cases.values():
        for _ in range(warmup):
            fn()
    times: dict[str, list[float]] = {name: [] for name in cases}
    for _ in range(rounds):
        for name, fn in cases.items():
            start = time.perf_counter()
            for _ in range(reps):
                fn()
            times[name].append((time.perf_counter() - start) / reps)
    return times


def ratios(times: dict[str, list[float]], baseline: str) -> dict[str, dict[str, float]]:
    """Per case: median and best seconds, and the median and best of its per-round ratio to `baseline`."""
    base = times[baseline]
    out = {}
    for name, ts in times.items():
        per_round = [t / b for t, b in zip(ts, base)]
        out[name] = {"median_s": statistics.median(ts), "best_s": min(ts),
                     "median_ratio": statistics.median(per_round), "best_ratio": min(ts) / min(base),
                     "rounds": len(ts)}
    return out


def command(script: str, argv=None) -> str:
    """The command line that ran benchmarks/SCRIPT with argv (None: this process's own arguments), as
    a results file records it (shell-quoted: pasted into a shell, it runs the same command)."""
    import shlex
    import sys

    return shlex.join(["python", f"benchmarks/{script}", *(sys.argv[1:] if argv is None else argv)])


def write_json(path, out: dict) -> None:
    """Write a benchmark's results with the machine they were measured on, and say where."""
    import json
    import os
    import platform
    from pathlib import Path

    import torch

    out = {**out, "machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                              "torch": torch.__version__, "load_average": os.getloadavg()}}
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    Path(path).write_text(json.dumps(out, indent=1) + "\n")
    print(f"wrote {path}")
