"""Training throughput (tokens/s, forward + backward + AdamW) of the LM for each mechanism.

    python benchmarks/train_speed.py                       # quickstart model, softmax/scalar/hybrid
    python benchmarks/train_speed.py --mechanisms all --steps 5 --threads 1

Every mechanism runs the same config (model size, batch, sequence length) on the embedded
corpus; the first `--warmup` steps are not timed. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from attnlab.models import MECHANISMS  # noqa: E402
from attnlab.train import load_config  # noqa: E402
from attnlab.train.trainer import Trainer  # noqa: E402


def measure(config: str, mechanism: str, steps: int, warmup: int, overrides: list[str], out_dir: str) -> dict:
    cfg = load_config(config, [
        f"model.attn={mechanism}", f"run.out_dir={out_dir}", f"run.name=speed-{mechanism}", "run.overwrite=true",
        "run.progress=false", "data.max_docs=50", f"train.steps={steps + warmup}", "train.warmup_steps=0",
        *overrides,
    ])
    trainer = Trainer(cfg)
    for _ in range(warmup):
        trainer.train_step()
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        trainer.train_step()
        times.append(time.perf_counter() - t0)
    times.sort()
    median = times[len(times) // 2]
    return {
        "mechanism": mechanism,
        "params": trainer.model.num_params(),
        "tokens_per_step": cfg.train.tokens_per_step,
        "median_step_s": median,
        "tokens_per_s": cfg.train.tokens_per_step / median,
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=str(ROOT / "configs" / "quickstart.toml"))
    ap.add_argument("--mechanisms", default="softmax,scalar,hybrid", help="comma-separated names, or 'all'")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per mechanism (the median is reported)")
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train_speed.json"))
    ap.add_argument("overrides", nargs="*", help="config overrides, e.g. model.d_model=64")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    names = list(MECHANISMS) if args.mechanisms == "all" else args.mechanisms.split(",")
    rows = [measure(args.config, m, args.steps, args.warmup, args.overrides, "/tmp/attnlab-bench") for m in names]
    base = next((r["tokens_per_s"] for r in rows if r["mechanism"] == "softmax"), None)
    print(f"{'mechanism':<12}{'params':>10}{'ms/step':>10}{'tokens/s':>11}{'vs softmax':>12}")
    for r in rows:
        rel = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        print(f"{r['mechanism']:<12}{r['params']:>10,}{r['median_step_s'] * 1e3:>10.0f}{r['tokens_per_s']:>11.0f}{rel:>12}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"config": args.config, "overrides": args.overrides, "threads": torch.get_num_threads(),
            "torch": torch.__version__, "machine": platform.processor() or platform.machine()}
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
