"""Forward + backward time of sliding-window attention against full causal attention, by context length.

    .venv/bin/python benchmarks/sliding_window.py                 # B=1, H=8, D=64, w=256, T=1024,2048,4096,8192
    .venv/bin/python benchmarks/sliding_window.py --window 48 --T 2048,8192 --rounds 5

For each T, `attnlab.ops.softmax_attention(q, k, v, window=w)` (query chunks over their band of keys
through the fused SDPA kernel) and torch's fused causal SDPA over every key run forward and backward
(gradients for q, k, v) in interleaved rounds, window, full, window, full, ...; a round's ratio is
window / full, so a change in the machine's load falls on both, and the table shows the median of
the per-round ratios beside each side's median time. The window's work grows as T·w, the full
causal attention's as T²/2: the ratio should fall about as 2w/T once T is well past w. One torch
thread by default. Results go to benchmarks/results/sliding_window.json.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.nn.functional as F

from attnlab.ops import softmax_attention

RESULTS = Path(__file__).resolve().parent / "results" / "sliding_window.json"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", default="1024,2048,4096,8192", help="comma-separated context lengths")
    p.add_argument("--window", type=int, default=256, help="keys per query of the sliding window")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=8)
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds per length")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(RESULTS))
    args = p.parse_args(argv)
    args.T = [int(t) for t in args.T.split(",")]
    if min(args.T) < 1 or args.window < 1 or args.rounds < 1 or min(args.B, args.H, args.D) < 1:
        p.error("--T, --window, --rounds, --B, --H and --D must be >= 1")
    return args


def fwd_bwd(fn, q, k, v) -> float:
    q, k, v = (x.detach().requires_grad_(True) for x in (q, k, v))
    t0 = time.perf_counter()
    out = fn(q, k, v)
    out.backward(torch.ones_like(out))
    return time.perf_counter() - t0


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    window = lambda q, k, v: softmax_attention(q, k, v, window=args.window)  # noqa: E731
    full = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    rows = []
    for T in args.T:
        q, k, v = (torch.randn(args.B, args.H, T, args.D) for _ in range(3))
        fwd_bwd(window, q, k, v), fwd_bwd(full, q, k, v)  # warm-up
        times = {"window": [], "full": []}
        for _ in range(args.rounds):
            times["window"].append(fwd_bwd(window, q, k, v))
            times["full"].append(fwd_bwd(full, q, k, v))
        ratios = [a / b for a, b in zip(times["window"], times["full"])]
        rows.append({"T": T, "window_s": statistics.median(times["window"]), "full_s": statistics.median(times["full"]),
                     "ratio": statistics.median(ratios), "ratios": ratios, "ideal": min(1.0, 2 * args.window / T)})
        r = rows[-1]
        print(f"T={T:6d}  window {r['window_s'] * 1e3:9.1f} ms  full {r['full_s'] * 1e3:9.1f} ms  "
              f"ratio {r['ratio']:.3f} (2w/T {r['ideal']:.3f})", flush=True)
    out = {"config": {k: getattr(args, k) for k in ("B", "H", "D", "window", "rounds", "threads")},
           "machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": args.threads},
           "rows": rows}
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
