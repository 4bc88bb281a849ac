"""Decode-step cost of candidate selection + sparse attention vs context length N (one query token).

SmolLM2-135M shapes (9 query / 3 KV heads, head dim 64, d_search 128) on random vectors: full
attention over N keys, learned exact top-K (N dot products in d_search per candidate set), learned
FAISS HNSW, Quest page selection, and the scoring-cost proxies of the seed (full N*d_h, Quest
N/P*2*d_h, HNSW M*ef*log2(N)*d_search). --groups 3 gives one candidate set per KV head. Prints a
table and writes JSON.

    python benchmarks/search.py --ns 2048 8192 32768 --K 256 --reps 20 --out bench_search.json
"""

from __future__ import annotations

import argparse
import json
import math
import time

import torch

from attnlab.search.retrieval import ExactIndex, HNSWIndex, quest_select
from attnlab.search.sparse import sparse_attention


def timed(fn, reps: int) -> float:
    fn()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    return 1e3 * (time.perf_counter() - t) / reps


def run(ns, K, reps, H=9, Hkv=3, D=64, ds=128, M=32, ef=128, page=16, groups=1):
    torch.manual_seed(0)
    rows = []
    for N in ns:
        q = torch.randn(1, H, 1, D)
        k, v = torch.randn(1, Hkv, N, D), torch.randn(1, Hkv, N, D)
        qs = torch.nn.functional.normalize(torch.randn(1, groups, 1, ds), dim=-1)
        ks = torch.nn.functional.normalize(torch.randn(1, groups, N, ds), dim=-1)
        allowed = torch.ones(1, 1, 1, N, dtype=torch.bool)
        exact, hnsw = ExactIndex(), HNSWIndex(ds, M, 64, ef)
        exact.add(ks)
        t = time.perf_counter()
        hnsw.add(ks)
        build_ms = 1e3 * (time.perf_counter() - t)
        full = lambda: torch.nn.functional.scaled_dot_product_attention(  # noqa: E731
            q, k.repeat_interleave(H // Hkv, 1), v.repeat_interleave(H // Hkv, 1))

        def attend(select):
            def f():
                idx, valid = select()
                return sparse_attention(q, k, v, idx, valid, D ** -0.5, impl="naive")
            return f

        row = {"N": N, "K": K, "hnsw_build_ms": build_ms,
               "full_ms": timed(full, reps),
               "learned_exact_ms": timed(attend(lambda: exact.search(qs, allowed, K)), reps),
               "learned_hnsw_ms": timed(attend(lambda: hnsw.search(qs, allowed, K)), reps),
               "quest_ms": timed(attend(lambda: quest_select(q, k, allowed, D ** -0.5, K, page, groups)), reps),
               "proxy_full": N * D, "proxy_quest": N / page * 2 * D, "proxy_hnsw": M * ef * math.log2(N) * ds}
        rows.append(row)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ns", type=int, nargs="+", default=[2048, 8192, 32768])
    ap.add_argument("--K", type=int, default=256)
    ap.add_argument("--reps", type=int, default=20)
    ap.add_argument("--groups", type=int, default=1, help="candidate sets per token (3: one per KV head)")
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: leave the default)")
    ap.add_argument("--out", default="bench_search.json")
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = run(args.ns, args.K, args.reps, groups=args.groups)
    cols = ["N", "full_ms", "learned_exact_ms", "learned_hnsw_ms", "quest_ms", "hnsw_build_ms", "proxy_full",
            "proxy_quest", "proxy_hnsw"]
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for r in rows:
        print("| " + " | ".join(f"{r[c]:.3g}" if isinstance(r[c], float) else str(r[c]) for c in cols) + " |")
    with open(args.out, "w") as f:
        json.dump({"K": args.K, "groups": args.groups, "reps": args.reps, "threads": torch.get_num_threads(), "rows": rows}, f, indent=2)
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
