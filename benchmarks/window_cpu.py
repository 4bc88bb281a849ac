"""Training through the window on the CPU, by context length: the compiled kernels against the PyTorch path
and against exact attention of the same heads.

    .venv/bin/python benchmarks/window_cpu.py                      # T = 1024, 4096, 16384; k 16 + 32 recent
    .venv/bin/python benchmarks/window_cpu.py --T 2048 --rounds 3

For each T, forward + backward (gradients for qs, ks, q, k, v) of the hybrid head under the Cauchy kernel
(configs/windowed.toml's attention; B 1, H 4, D 32) in interleaved rounds: `windowed_attention` on the
compiled kernels (csrc/window.cpp: selection from one sort per head, attention over the selected keys),
the same op with the kernels off (ATTNLAB_NO_EXT: the merge-sort tree's selection, query chunks masked to
their selected keys), and exact `hybrid_attention` over every visible key. Ratios are taken within a
round and the medians reported (`_interleaved`); `select_ms` times the kernels' selection alone. The
PyTorch path and exact attention grow as T², the kernels as T·(k + w) after an O(T log T) sort; either
of those two whose first call at a length takes longer than --max-s seconds is not timed at longer lengths.
Results go to benchmarks/results/window_cpu.json.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

import torch

from _interleaved import command, interleaved, write_json
from attnlab.ops import _ext, hybrid_attention, windowed_attention
from attnlab.ops.scalar.window_cpu import select_nearest

RESULTS = Path(__file__).resolve().parent / "results" / "window_cpu.json"


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--T", default="1024,4096,16384", help="comma-separated context lengths")
    p.add_argument("--window", type=int, default=16, help="k: nearest keys per query")
    p.add_argument("--local", type=int, default=32, help="w: recent keys per query")
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--D", type=int, default=32)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--max-s", type=float, default=20.0, help="stop timing a path past this many seconds a call")
    p.add_argument("--out", default=str(RESULTS))
    a = p.parse_args(argv)
    a.T = [int(t) for t in a.T.split(",")]
    if min(a.T) < 1 or min(a.window, a.B, a.H, a.D, a.rounds, a.threads) < 1 or a.local < 0:
        p.error("--T, --window, --B, --H, --D, --rounds and --threads must be >= 1, --local >= 0")
    return a


def main(argv=None) -> None:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    if _ext.library() is None:
        raise SystemExit("the compiled CPU kernels are unavailable here (no C++ compiler?): nothing to compare")
    rows, slow = [], set()
    for T in a.T:
        g = torch.Generator().manual_seed(T)
        qs, ks = torch.randn(a.B, a.H, T, generator=g), torch.randn(a.B, a.H, T, generator=g)
        q, k, v = (torch.randn(a.B, a.H, T, a.D, generator=g) for _ in range(3))

        def run(fn):
            leaves = [x.clone().requires_grad_() for x in (qs, ks, q, k, v)]
            out = fn(*leaves)
            out.backward(torch.ones_like(out))

        def windowed(qs_, ks_, q_, k_, v_):
            return windowed_attention(qs_, ks_, v_, 0.5, a.window, q=q_, k=k_, local=a.local, kernel="cauchy")

        def fallback():
            with _ext.disabled():
                run(windowed)

        cases = {"kernels": lambda: run(windowed), "pytorch": fallback,
                 "exact": lambda: run(lambda qs_, ks_, q_, k_, v_: hybrid_attention(q_, k_, v_, qs_, ks_, 0.5,
                                                                                     kernel="cauchy"))}
        for name in list(cases):
            if name in slow:
                cases.pop(name)
                continue
            t0 = time.perf_counter()
            cases[name]()  # the warm-up call, timed to decide the next length
            if name != "kernels" and time.perf_counter() - t0 > a.max_s:
                slow.add(name)
        times = interleaved(cases, a.rounds, warmup=0)
        sel = interleaved({"select": lambda: select_nearest(qs, ks, a.window, 0, a.local)}, a.rounds)["select"]
        row = {"T": T, **{f"{n}_ms": 1e3 * statistics.median(ts) for n, ts in times.items()},
               "select_ms": 1e3 * statistics.median(sel)}
        for n in ("pytorch", "exact"):
            if n in times:
                row[f"{n}_over_kernels"] = statistics.median(x / y for x, y in zip(times[n], times["kernels"]))
        rows.append(row)
        print("  ".join(f"{key} {val:,.1f}" if isinstance(val, float) else f"{key} {val}" for key, val in row.items()),
              flush=True)
    write_json(a.out, {"command": command("window_cpu.py", argv),
                       "config": {key: getattr(a, key) for key in ("window", "local", "B", "H", "D", "rounds", "threads")},
                       "rows": rows})


if __name__ == "__main__":
    main()
