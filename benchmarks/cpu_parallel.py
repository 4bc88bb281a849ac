"""How a sweep should use this machine's cores: one run on every thread, or one single-threaded run per core.

    python benchmarks/cpu_parallel.py                       # softmax and the shipped window, 3 rounds
    python benchmarks/cpu_parallel.py --variants softmax --rounds 5 --seconds 40

Each round measures, for each variant, the machine's training throughput two ways, one after the
other: `together` (one process, torch threads = the cores) and `apart` (one process per core, one
thread each, started at once; their tokens added). Each process trains the quickstart model
(configs/quickstart.toml) through `Trainer.train_step()` for `--seconds` after `--warmup` untimed
steps. The ratio apart / together is taken within each round (both halves saw the same machine)
and the median over rounds is reported. Prints a table and writes benchmarks/results/cpu_parallel.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from _interleaved import command

ROOT = Path(__file__).resolve().parents[1]
VARIANTS = {
    "softmax": ["model.attn=softmax"],
    "window": ["model.attn=hybrid", "model.attention.train_window=16", "model.attention.local_window=32",
               "model.attention.kernel=cauchy"],
    "softmax-compiled": ["model.attn=softmax", "train.compile=true"],  # torch.compile on the CPU (Inductor's C++)
}


def worker(variant: str, threads: int, seconds: float, warmup: int, out_dir: str) -> None:
    """One process: train `variant` for `seconds` after `warmup` steps; print {"tokens": ..., "seconds": ...}."""
    import torch

    sys.path.insert(0, str(ROOT / "src"))
    from attnlab.train import load_config
    from attnlab.train.trainer import Trainer

    torch.set_num_threads(threads)
    cfg = load_config(str(ROOT / "configs" / "quickstart.toml"), [
        *VARIANTS[variant], f"run.out_dir={out_dir}", f"run.name={variant}-{os.getpid()}", "run.overwrite=true",
        "run.progress=false", "run.tensorboard=false", "train.steps=100000", "train.warmup_steps=0",
        "train.log_every=100000"])
    trainer = Trainer(cfg)
    for _ in range(warmup):
        trainer.train_step()
    steps, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        trainer.train_step()
        steps += 1
    wall = time.perf_counter() - t0
    print(json.dumps({"tokens": steps * cfg.train.tokens_per_step, "seconds": wall}), flush=True)


def machine_rate(variant: str, procs: int, threads: int, seconds: float, warmup: int, tmp: str) -> float:
    """Tokens/s of the machine: `procs` processes of `threads` threads each, started together."""
    cmd = [sys.executable, __file__, "--worker", variant, str(threads), str(seconds), str(warmup), tmp]
    running = [subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True) for _ in range(procs)]
    rates = []
    for p in running:
        out, _ = p.communicate()
        if p.returncode != 0:
            raise SystemExit(f"a worker failed (exit {p.returncode})")
        r = json.loads(out.strip().splitlines()[-1])
        rates.append(r["tokens"] / r["seconds"])
    return sum(rates)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        v, t, s, w, d = sys.argv[2:7]
        worker(v, int(t), float(s), int(w), d)
        return
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="softmax,window", help=f"comma-separated: {', '.join(VARIANTS)}")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=30.0, help="timed seconds per process")
    ap.add_argument("--warmup", type=int, default=3, help="untimed steps per process")
    ap.add_argument("--cores", type=int, default=os.cpu_count(), help="cores to use (default: all)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "cpu_parallel.json"))
    args = ap.parse_args()
    names = [v.strip() for v in args.variants.split(",")]
    bad = [n for n in names if n not in VARIANTS]
    if bad:
        ap.error(f"--variants: unknown {bad}; allowed: {', '.join(VARIANTS)}")
    if args.rounds < 1 or args.seconds <= 0 or args.cores < 2:
        ap.error("--rounds must be >= 1, --seconds > 0 and --cores >= 2")
    rows = {n: {"together": [], "apart": [], "ratio": []} for n in names}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(args.rounds):
            for n in names:
                together = machine_rate(n, 1, args.cores, args.seconds, args.warmup, tmp)
                apart = machine_rate(n, args.cores, 1, args.seconds, args.warmup, tmp)
                rows[n]["together"].append(together)
                rows[n]["apart"].append(apart)
                rows[n]["ratio"].append(apart / together)
                print(f"round {r + 1}: {n}: together {together:,.0f} tokens/s, apart {apart:,.0f} ({apart / together:.2f}x)",
                      flush=True)
    print(f"{'variant':<10}{'together':>12}{'apart':>12}{'apart/together':>16}")
    summary = []
    for n in names:
        row = {"variant": n, "overrides": VARIANTS[n], "together_tokens_per_s": statistics.median(rows[n]["together"]),
               "apart_tokens_per_s": statistics.median(rows[n]["apart"]),
               "apart_over_together": statistics.median(rows[n]["ratio"]), "rounds": rows[n]}
        summary.append(row)
        print(f"{n:<10}{row['together_tokens_per_s']:>12,.0f}{row['apart_tokens_per_s']:>12,.0f}"
              f"{row['apart_over_together']:>15.2f}x")
    meta = {"command": command("cpu_parallel.py"), "cores": args.cores,
            "seconds": args.seconds, "warmup": args.warmup, "machine": platform.processor() or platform.machine(),
            "load_avg_after": os.getloadavg()}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "rows": summary}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
