"""benchmarks/gpu_train.py's comparison on the CPU (`--device cpu`): the same models at the quickstart's
shape (or others, --cpu-shape), every model prepared first, then interleaved rounds; JSON in
benchmarks/results/train_cpu.json, so the gap to the plain PyTorch baseline is watched between GPU runs."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

import torch

from _interleaved import command
from gpu_train import CPU_SHAPES, prepare, time_steps


def _cpu_shapes(spec: str, T: int, batch: int) -> list[tuple[str, int, int]]:
    """--cpu-shape: NAME or NAME:T:BATCH, comma-separated, NAME in CPU_SHAPES (a bare NAME takes --cpu-T
    and --cpu-batch)."""
    out = []
    for part in spec.split(","):
        name, *rest = part.split(":")
        if name not in CPU_SHAPES or len(rest) not in (0, 2):
            raise SystemExit(f"--cpu-shape: {part!r} is not NAME or NAME:T:BATCH with NAME in {sorted(CPU_SHAPES)}")
        out.append((name, int(rest[0]), int(rest[1])) if rest else (name, T, batch))
    return out


def cpu_comparison(a, argv) -> None:
    """The same comparison on the CPU at the quickstart's shape: every model prepared (compiled where
    asked) first, then `--rounds` interleaved rounds of `--steps` steps each; per model the median step
    over all rounds, and its ratio to the baseline of the same kind (compiled or eager) as the median
    of the per-round ratios."""
    import resource

    dev = torch.device("cpu")
    shapes = _cpu_shapes(a.cpu_shape, a.cpu_T, a.cpu_batch)
    names = [m for m in a.models.split(",") if m]
    kinds = [(m, c, s) for s in shapes for m in names
             for c in ((True, False) if a.cpu_both else (m in a.compile.split(",") or a.compile == "all",))]
    prepared = {}
    for k in kinds:
        m, c, (s, T, batch) = k
        prepared[k] = prepare(m, T, batch, a.warmup, c, dev, CPU_SHAPES[s])
        print(f"  prepared {m} ({'compiled' if c else 'eager'}, {s}): warm-up {prepared[k][1]['warmup_s']} s",
              flush=True)
    per_round = {k: [] for k in kinds}
    for r in range(a.rounds):
        for k in kinds:
            per_round[k].append(statistics.median(time_steps(prepared[k][0], a.steps)))
    rows = []
    for (m, c, (s, T, batch)), meds in per_round.items():
        base = per_round.get(("baseline", c, (s, T, batch)))
        info = dict(prepared[(m, c, (s, T, batch))][1])
        info.pop("flops_per_token")
        ms = 1e3 * statistics.median(meds)
        rows.append({"model": m, "compiled": c, "shape": s, "T": T, "batch": batch, "ms": round(ms, 3),
                     "tokens_per_s": round(batch * T / (ms / 1e3)),
                     "vs_baseline": None if base is None else round(statistics.median(
                         [b / x for b, x in zip(base, meds)]), 3),
                     "round_ms": [round(1e3 * x, 3) for x in meds], **info})
        print(f"  {m} ({'compiled' if c else 'eager'}, {s}): {rows[-1]['tokens_per_s']:,} tok/s, "
              f"{rows[-1]['vs_baseline']}x the baseline", flush=True)
    doc = {"device": "cpu", "torch": torch.__version__, "threads": torch.get_num_threads(),
           "shape": CPU_SHAPES[shapes[0][0]] if len(shapes) == 1 else {s: CPU_SHAPES[s] for s, _, _ in shapes},
           "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
           "rounds": a.rounds, "steps_per_round": a.steps,
           "command": command("gpu_train.py", argv),
           "rows": rows}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}")
