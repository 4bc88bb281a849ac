"""Cost of the key-norm scalings of q·k (seed 003, open question 3) against √d.

    python benchmarks/scaling_cost.py                     # T = 512, 2048; 9 interleaved rounds
    python benchmarks/scaling_cost.py --T 1024 --rounds 15

`attnlab.ops.softmax_attention` at B = 1, H = 8, D = 64, causal, fast path, with each scale
(sqrt_d, ktotal, kmean, krms, pnorm, n_sqrt_d): forward alone and forward + backward, in
interleaved rounds; reported as the median over rounds of the per-round ratio to sqrt_d, with
the best beside it. ktotal's extra work is a prefix sum of the key norms and one division of
the queries (memory linear in T); n_sqrt_d needs no key norms at all.
Writes benchmarks/results/scaling_cost.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _interleaved import interleaved, ratios, write_json  # noqa: E402
from attnlab.ops import softmax_attention  # noqa: E402
from attnlab.ops.softmax import SCALES  # noqa: E402


def cases(T: int, B: int = 1, H: int = 8, D: int = 64) -> tuple[dict, dict]:
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    fwd, both = {}, {}
    for s in SCALES:
        def f(s=s):
            with torch.no_grad():
                return softmax_attention(q, k, v, scale=s)

        def fb(s=s):
            leaves = [x.detach().requires_grad_() for x in (q, k, v)]
            softmax_attention(*leaves, scale=s).sum().backward()
        fwd[s], both[s] = f, fb
    return fwd, both


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", default="512,2048", help="comma-separated sequence lengths")
    p.add_argument("--rounds", type=int, default=9)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "scaling_cost.json"))
    args = p.parse_args(argv)
    try:
        Ts = [int(t) for t in args.T.split(",")]
    except ValueError:
        p.error(f"--T must be comma-separated integers, got {args.T!r}")
    if args.rounds < 1 or any(t < 1 for t in Ts):
        p.error("--rounds and every --T must be >= 1")
    torch.set_num_threads(args.threads)
    rows = []
    for T in Ts:
        fwd, both = cases(T)
        for what, cs in (("forward", fwd), ("fwd+bwd", both)):
            r = ratios(interleaved(cs, args.rounds), "sqrt_d")
            for s in SCALES:
                rows.append({"T": T, "pass": what, "scale": s, **r[s]})
                print(f"T={T:5d} {what:7s} {s:8s} {1e3 * r[s]['median_s']:8.2f} ms  median x{r[s]['median_ratio']:.3f}  "
                      f"best x{r[s]['best_ratio']:.3f}", flush=True)
    out = {"B": 1, "H": 8, "D": 64, "rounds": args.rounds, "threads": args.threads, "rows": rows}
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
