"""Eager vs torch.compile(fullgraph=True) training step of the quickstart model.

    python benchmarks/compile.py                                  # softmax, scalar, hybrid; 2 threads
    python benchmarks/compile.py --mechanisms softmax --rounds 3 --threads 1

One step: forward on a (batch_size, seq_len) batch of tokens, cross-entropy, backward, gradient
clipping at 1.0 and an AdamW update, the quickstart's model and batch (configs/quickstart.toml:
d_model 128, 4 layers, 4 heads, 16 x 256 tokens, byte vocabulary). The compiled model is
`torch.compile(model, fullgraph=True)` (inductor); the optimizer stays eager. "compile s" is the
wall time of the first compiled step (tracing, inductor codegen, forward and backward) less one
eager step. Unless --no-unchecked, a third case compiles with `attnlab.checks.COMPILED_VALUE_CHECKS
= False` (the value checks left out of the graph) to show what the in-graph asserts cost.

Timing: every case runs one step per round, in a fixed order, so a slow spell of a shared machine
falls on all alike; "speedup" is the median over rounds of eager / compiled within the round.
Prints a table and writes benchmarks/results/compile.json.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
import tomllib
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _interleaved import command, interleaved, write_json  # noqa: E402
from attnlab import checks  # noqa: E402
from attnlab.models import LM  # noqa: E402
from attnlab.models.config import ModelConfig  # noqa: E402

BYTE_VOCAB = 257  # the byte tokenizer's vocabulary (256 bytes + EOS)


def quickstart(config: Path) -> tuple[dict, int, int, float]:
    """The model table, seq_len, batch_size and lr of the quickstart config."""
    raw = tomllib.loads(config.read_text())
    return raw["model"], raw["data"]["seq_len"], raw["train"]["batch_size"], raw["train"]["lr"]


class Step:
    """One model and its optimizer; calling it runs one training step on a fixed batch."""

    def __init__(self, model_table: dict, mechanism: str, seq_len: int, batch: int, lr: float, compiled: bool):
        torch.manual_seed(0)
        cfg = ModelConfig(**{**model_table, "attn": mechanism, "vocab_size": BYTE_VOCAB, "max_seq_len": seq_len})
        self.model = LM(cfg)
        self.fn = torch.compile(self.model, fullgraph=True) if compiled else self.model
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=lr)
        g = torch.Generator().manual_seed(0)
        self.x = torch.randint(0, BYTE_VOCAB, (batch, seq_len), generator=g)
        self.y = torch.randint(0, BYTE_VOCAB, (batch, seq_len), generator=g)

    def __call__(self) -> float:
        _, loss = self.fn(self.x, self.y)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(self.model.parameters(), 1.0)
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return float(loss.detach())


def first_step(step: Step, unchecked: bool) -> float:
    old = checks.COMPILED_VALUE_CHECKS
    checks.COMPILED_VALUE_CHECKS = not unchecked  # read while tracing, i.e. in the first call
    try:
        t0 = time.perf_counter()
        step()
        return time.perf_counter() - t0
    finally:
        checks.COMPILED_VALUE_CHECKS = old


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mechanisms", default="softmax,scalar,hybrid", help="comma-separated mechanism names")
    ap.add_argument("--rounds", type=int, default=7, help="interleaved timed rounds (medians over them)")
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    ap.add_argument("--no-unchecked", action="store_true", help="skip the case compiled without value checks")
    ap.add_argument("--config", default=str(ROOT / "configs" / "quickstart.toml"))
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "compile.json"))
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    table, seq_len, batch, lr = quickstart(Path(args.config))
    mechanisms = [m.strip() for m in args.mechanisms.split(",")]

    cases, compile_s = {}, {}
    for m in mechanisms:
        eager = Step(table, m, seq_len, batch, lr, compiled=False)
        eager()  # warm-up (and the reference for the compile time)
        t0 = time.perf_counter()
        eager()
        eager_s = time.perf_counter() - t0
        cases[f"{m} eager"] = eager
        variants = [("compiled", False)] + ([] if args.no_unchecked else [("compiled, no checks", True)])
        for label, unchecked in variants:
            torch._dynamo.reset()
            step = Step(table, m, seq_len, batch, lr, compiled=True)
            compile_s[f"{m} {label}"] = first_step(step, unchecked) - eager_s
            print(f"{m} {label}: compiled in {compile_s[f'{m} {label}']:.1f} s", flush=True)
            cases[f"{m} {label}"] = step
    times = interleaved(cases, rounds=args.rounds, warmup=1)

    rows = []
    for m in mechanisms:
        base = times[f"{m} eager"]
        row = {"mechanism": m, "eager_ms": statistics.median(base) * 1e3}
        for label, key in (("compiled", "compiled"), ("compiled, no checks", "unchecked")):
            name = f"{m} {label}"
            if name in times:
                row[f"{key}_ms"] = statistics.median(times[name]) * 1e3
                row[f"{key}_speedup"] = statistics.median(b / t for b, t in zip(base, times[name]))
                row[f"{key}_compile_s"] = compile_s[name]
        rows.append(row)

    tokens = batch * seq_len
    print(f"\nquickstart model, {tokens:,} tokens per step, {args.threads} threads, medians of {args.rounds} interleaved rounds")
    head = f"{'mechanism':<10}{'eager ms':>10}{'compiled ms':>13}{'speedup':>9}{'compile s':>11}"
    if not args.no_unchecked:
        head += f"{'no-checks ms':>14}{'speedup':>9}"
    print(head)
    for r in rows:
        line = (f"{r['mechanism']:<10}{r['eager_ms']:>10.0f}{r['compiled_ms']:>13.0f}{r['compiled_speedup']:>8.2f}x"
                f"{r['compiled_compile_s']:>11.1f}")
        if "unchecked_ms" in r:
            line += f"{r['unchecked_ms']:>14.0f}{r['unchecked_speedup']:>8.2f}x"
        print(line)
    write_json(args.out, {
        "command": command("compile.py"),
        "model": {**table, "vocab_size": BYTE_VOCAB, "seq_len": seq_len, "batch_size": batch},
        "threads": args.threads, "rounds": args.rounds, "rows": rows,
        "times_s": {name: ts for name, ts in times.items()},
    })


if __name__ == "__main__":
    main()
