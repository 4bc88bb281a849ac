"""Forward + backward time and activation memory of the linear family's chunked paths.

Compares cosformer, gla and ssd (fast path) with torch SDPA causal attention, and the
design choices inside the chunked core: SSD through its segment-sum form against SSD run as
GLA with the scalar decay broadcast over channels, and the GLA sub-chunk size.
Memory is the bytes autograd saves for backward (distinct storages), which is what grows
with T. Time is the best of --reps runs, as wall clock and as process CPU time (on a shared
machine the CPU time at --threads 1 is the steadier number). Prints a table and writes JSON.

    python benchmarks/bench_linear_family.py --threads 1 --T 2048 --mem-T 2048 8192
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F

from attnlab.ops import _chunked
from attnlab.ops.cosformer import cosformer_attention
from attnlab.ops.gla import gla_attention, ssd_attention


def _inputs(B, H, T, D, decay):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(B, H, T, D, generator=g).requires_grad_() for _ in range(3))
    shape = (B, H, T, D) if decay == "vector" else (B, H, T)
    ld = F.logsigmoid(torch.randn(shape, generator=g) + 3.0).requires_grad_() if decay else None
    return q, k, v, ld


def _cases(chunk):
    def sdpa(q, k, v, ld):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    def cos(q, k, v, ld):
        return cosformer_attention(q, k, v, chunk_size=chunk)[0]

    def gla(q, k, v, ld):
        return gla_attention(q, k, v, ld, chunk_size=chunk)[0]

    def ssd(q, k, v, ld):
        return ssd_attention(q, k, v, ld, chunk_size=chunk)[0]

    def ssd_as_gla(q, k, v, ld):
        ldv = ld[..., None].expand(*q.shape)  # (B, H, T, Dk): the scalar decay broadcast over channels
        return gla_attention(q, k, v, ldv, chunk_size=chunk)[0]

    return {
        "sdpa_causal": (sdpa, None),
        "cosformer": (cos, None),
        "gla": (gla, "vector"),
        "ssd_segsum": (ssd, "scalar"),
        "ssd_as_gla": (ssd_as_gla, "scalar"),
    }


def _time(fn, inputs, reps):
    """Best wall-clock and best process-CPU seconds of forward + backward."""

    def once():
        for x in inputs:
            if x is not None:
                x.grad = None
        out = fn(*inputs)
        out.backward(torch.ones_like(out))

    once()
    wall, cpu = float("inf"), float("inf")
    for _ in range(reps):
        w0, c0 = time.perf_counter(), time.process_time()
        once()
        wall, cpu = min(wall, time.perf_counter() - w0), min(cpu, time.process_time() - c0)
    return wall, cpu


def _saved_bytes(fn, inputs):
    storages = {}

    def pack(t):
        s = t.untyped_storage()
        storages[s.data_ptr()] = s.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn(*inputs)
    del out
    return sum(storages.values())


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--B", type=int, default=1)
    ap.add_argument("--H", type=int, default=8)
    ap.add_argument("--D", type=int, default=64)
    ap.add_argument("--T", type=int, default=2048)
    ap.add_argument("--chunk", type=int, default=64)
    ap.add_argument("--sub-chunks", type=int, nargs="*", default=[8, 16, 32])
    ap.add_argument("--mem-T", type=int, nargs="*", default=[2048, 8192])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: torch's default)")
    ap.add_argument("--only", nargs="*", default=None, help="case names to run (sdpa_causal always runs)")
    ap.add_argument("--out", default="bench_linear_family.json")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    rows = []
    default_sub = _chunked.SUB_CHUNK
    for name, (fn, decay) in _cases(args.chunk).items():
        if args.only and name != "sdpa_causal" and name not in args.only:
            continue
        subs = args.sub_chunks if name == "gla" else [default_sub]
        for sub in subs:
            _chunked.SUB_CHUNK = sub
            inputs = _inputs(args.B, args.H, args.T, args.D, decay)
            row = {"op": name if name != "gla" else f"gla(sub={sub})", "T": args.T}
            wall, cpu = _time(fn, inputs, args.reps)
            row["fwd_bwd_ms"], row["cpu_ms"] = 1e3 * wall, 1e3 * cpu
            for Tm in args.mem_T:
                row[f"saved_MB@T={Tm}"] = _saved_bytes(fn, _inputs(args.B, args.H, Tm, args.D, decay)) / 2**20
            rows.append(row)
            print(row, flush=True)
    _chunked.SUB_CHUNK = default_sub
    base = next(r for r in rows if r["op"] == "sdpa_causal")
    cols = ["op", "fwd_bwd_ms", "cpu_ms", "x_sdpa", "x_sdpa_cpu"] + [f"saved_MB@T={Tm}" for Tm in args.mem_T]
    print(f"\nB={args.B} H={args.H} D={args.D} chunk={args.chunk} threads={torch.get_num_threads()}")
    print(" | ".join(f"{c:>16}" for c in cols))
    for r in rows:
        r["x_sdpa"], r["x_sdpa_cpu"] = r["fwd_bwd_ms"] / base["fwd_bwd_ms"], r["cpu_ms"] / base["cpu_ms"]
        print(" | ".join(f"{r[c]:>16.2f}" if isinstance(r[c], float) else f"{r[c]:>16}" for c in cols))
    with open(args.out, "w") as f:
        json.dump({"config": vars(args), "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
