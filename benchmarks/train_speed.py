"""Training throughput of the LM for each attention mechanism: tokens/s of full optimizer steps.

    python benchmarks/train_speed.py                          # every mechanism + gated variants
    python benchmarks/train_speed.py --variants softmax,hybrid --steps 5 --threads 1
    python benchmarks/train_speed.py model.d_model=64 data.seq_len=512

One step = `Trainer.train_step()`: the next packed batch of the embedded corpus, forward,
backward, gradient clipping and the AdamW update (no evaluation, no logging records).
Every variant runs the same config (default: the quickstart model, configs/quickstart.toml)
with the default fast paths; the first `--warmup` steps are not timed. tokens/s comes from
the fastest timed step (as timeit does: on a shared machine the slower steps measure the
other jobs); the median is printed beside it. The "[fallback]" variants train the same model
with the compiled CPU kernels switched off (the pure-PyTorch fast paths), so one run shows
what the kernels buy a whole training step. Prints a table and writes
benchmarks/results/train_speed.json.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _interleaved import command  # noqa: E402
from attnlab.ops import _ext  # noqa: E402
from attnlab.train import load_config  # noqa: E402
from attnlab.train.trainer import Trainer  # noqa: E402

FALLBACK = "[fallback]"  # suffix: the variant runs with the compiled CPU kernels off

# name -> overrides; the gated variants add the zero-initialised sigmoid output gate (docs/mechanisms.md#output-gate),
# the +window variants train through the sorted cache's selection (train_window, local_window), the +cauchy
# ones under the Cauchy kernel (docs/mechanisms.md#a-heavier-tailed-kernel)
VARIANTS = {
    "softmax": ["model.attn=softmax"],
    "scalar": ["model.attn=scalar"],
    "hybrid": ["model.attn=hybrid"],
    "principled": ["model.attn=principled"],
    "principled[fallback]": ["model.attn=principled"],
    "cosformer": ["model.attn=cosformer"],
    "gla": ["model.attn=gla"],
    "gla[fallback]": ["model.attn=gla"],
    "ssd": ["model.attn=ssd"],
    "scalar+window64": ["model.attn=scalar", "model.attention={train_window=64}"],
    "hybrid+window64": ["model.attn=hybrid", "model.attention={train_window=64}"],
    "hybrid+window64+local32": ["model.attn=hybrid", "model.attention={train_window=64, local_window=32}"],
    "hybrid+window16+local32": ["model.attn=hybrid", "model.attention={train_window=16, local_window=32}"],
    "hybrid+window16+local32+cauchy": ["model.attn=hybrid",
                                       'model.attention={train_window=16, local_window=32, kernel="cauchy"}'],
    "hybrid+cauchy": ["model.attn=hybrid", 'model.attention={kernel="cauchy"}'],
    "softmax+gate": ["model.attn=softmax", 'model.attention={output_gate="elementwise"}'],
    "cosformer+gate": ["model.attn=cosformer", 'model.attention={output_gate="elementwise"}'],
}


def build(config: str, name: str, overrides: list[str], out_dir: str) -> Trainer:
    cfg = load_config(config, [
        *overrides, *VARIANTS[name], f"run.out_dir={out_dir}", f"run.name=speed-{name.replace('+', '-').replace(FALLBACK, '-fallback')}",
        "run.overwrite=true", "run.progress=false", "run.tensorboard=false",
        "train.steps=100000", "train.warmup_steps=0", "train.log_every=100000",  # no per-step records
    ])
    return Trainer(cfg)


def timed_step(trainer: Trainer, fallback: bool = False) -> float:
    sync = torch.cuda.synchronize if trainer.device.type == "cuda" else (lambda: None)
    with _ext.disabled() if fallback else contextlib.nullcontext():
        sync()
        t0 = time.perf_counter()
        trainer.train_step()
        sync()
        return time.perf_counter() - t0


def measure(trainers: dict[str, Trainer], steps: int, warmup: int) -> list[dict]:
    """Round-robin: each round times one step of every variant, so a change in the load of a
    shared machine falls on all of them alike rather than on whichever ran at that moment."""
    for name, trainer in trainers.items():
        for _ in range(warmup):
            timed_step(trainer, name.endswith(FALLBACK))
    times = {name: [] for name in trainers}
    for _ in range(steps):
        for name, trainer in trainers.items():
            times[name].append(timed_step(trainer, name.endswith(FALLBACK)))
    rows = []
    for name, trainer in trainers.items():
        ts = sorted(times[name])
        tokens = trainer.cfg.train.tokens_per_step
        rows.append({
            "variant": name,
            "overrides": VARIANTS[name],
            "compiled_kernels": not name.endswith(FALLBACK) and _ext.library() is not None,
            "params": trainer.model.num_params(),
            "tokens_per_step": tokens,
            "min_step_s": ts[0],
            "median_step_s": ts[len(ts) // 2],
            "tokens_per_s": tokens / ts[0],
            "tokens_per_s_median": tokens / ts[len(ts) // 2],
        })
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("overrides", nargs="*", help="config overrides for every variant, e.g. model.d_model=64")
    ap.add_argument("--config", default=str(ROOT / "configs" / "quickstart.toml"), help="base TOML config")
    ap.add_argument("--variants", default="all", help=f"comma-separated, or 'all': {', '.join(VARIANTS)}")
    ap.add_argument("--steps", type=int, default=5, help="timed steps per variant (the fastest sets tokens/s)")
    ap.add_argument("--warmup", type=int, default=1, help="untimed steps first")
    ap.add_argument("--threads", type=int, default=0, help="torch CPU threads (0: torch's default)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "train_speed.json"))
    args = ap.parse_args()
    names = list(VARIANTS) if args.variants == "all" else [v.strip() for v in args.variants.split(",")]
    unknown = [n for n in names if n not in VARIANTS]
    if unknown:
        ap.error(f"--variants: unknown {unknown}; allowed: {', '.join(VARIANTS)} or all")
    if args.steps < 1 or args.warmup < 0:
        ap.error("--steps must be >= 1 and --warmup >= 0")
    if args.threads:
        torch.set_num_threads(args.threads)
    with tempfile.TemporaryDirectory() as tmp:
        trainers = {name: build(args.config, name, args.overrides, tmp) for name in names}
        rows = measure(trainers, args.steps, args.warmup)
    base = next((r["tokens_per_s"] for r in rows if r["variant"] == "softmax"), None)
    print(f"{'variant':<22}{'params':>10}{'tokens/step':>13}{'best ms':>9}{'median ms':>11}{'tokens/s':>10}{'vs softmax':>12}")
    for r in rows:
        rel = f"{r['tokens_per_s'] / base:.2f}x" if base else "-"
        print(f"{r['variant']:<22}{r['params']:>10,}{r['tokens_per_step']:>13,}{r['min_step_s'] * 1e3:>9.0f}"
              f"{r['median_step_s'] * 1e3:>11.0f}{r['tokens_per_s']:>10,.0f}{rel:>12}")
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {
        "command": command("train_speed.py"),
        "config": os.path.relpath(args.config, ROOT), "overrides": args.overrides, "steps": args.steps,
        "warmup": args.warmup, "threads": torch.get_num_threads(), "torch": torch.__version__,
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else (platform.processor() or platform.machine()),
        "cpus": os.cpu_count(), "load_avg": os.getloadavg() if hasattr(os, "getloadavg") else None,
    }
    out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
