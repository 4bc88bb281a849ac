"""Decode benchmark: the sorted scalar cache against full attention, one layer, batch 1.

For every context length n the same run measures
  * sorted cache, pure scalar heads, window k in --ks: per-token cost of a decode step
    (append the new token, then attend), split into append and attend;
  * sorted cache, hybrid heads (d_k = d_v), k = 64: the same (skip with --no-hybrid);
  * full attention: torch SDPA over an ordinary preallocated KV cache (write k, v, attend
    over all n), with one thread and with the default thread count;
  * insertion: --insert-steps appends in a row (amortized over the index's merges), and as
    many bare key insertions into a copy of the key index;
  * error control: attention mass left outside the window vs the full computation, and the
    seed's erfc(r / sqrt(tau)) at the realized radius r (distance to the nearest key left out),
    at a fixed tau and at a tau whose bandwidth spans 8 key spacings.
Times are thread CPU time (time.thread_time, one intra-op thread on both sides: the work a
step does on one core, unaffected by other processes on a shared machine) and wall-clock
(median). Keys and queries are uniform on [-3, 3] per head (the spread the seed's
regulariser aims at). The cache is bulk-loaded (one sort) before timing. Writes JSON + PNG.

    python benchmarks/decode.py            # n = 4K .. 1M (about 5 GB of RAM at 1M)
    python benchmarks/decode.py --quick    # n = 4K .. 64K, a short run
    python benchmarks/decode.py --smoke    # n = 4K, a few steps: checks the script runs (seconds)

Every decode and full-attention row also carries `step_ms` (the median wall-clock step),
`tokens_per_s` and `bytes_per_step`: what the step must read (the sorted cache: per head the k keys'
scalar key, value and vector key, and two binary searches over n 8-byte codes; full attention: every
cached key and value), so a memory-bandwidth floor can stand beside the time.
"""

from __future__ import annotations

import argparse
import copy
import gc
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

from attnlab.cache.sorted import SortedScalarCache, bytes_per_token
from attnlab.cache.window_error import window_error

HERE = os.path.dirname(os.path.abspath(__file__))
KEY_RANGE = 3.0


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="n up to 64K, fewer steps")
    p.add_argument("--smoke", action="store_true", help="n = 4K, k = 16, a few steps, no PNG (written to a temporary "
                   "folder unless --out)")
    p.add_argument("--ns", type=str, default=None, help="comma-separated context lengths")
    p.add_argument("--ks", type=str, default="16,64,256", help="comma-separated windows")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--groups", type=int, default=8, help="value groups G (H %% G == 0)")
    p.add_argument("--dv", type=int, default=64)
    p.add_argument("--tau", type=float, default=0.05, help="fixed temperature for the error report")
    p.add_argument("--steps", type=int, default=None, help="timed decode steps per (n, k)")
    p.add_argument("--sdpa-steps", type=int, default=None, help="timed full-attention steps per n")
    p.add_argument("--insert-steps", type=int, default=None, help="appends for the throughput run")
    p.add_argument("--error-queries", type=int, default=8, help="query batches (x heads) for the error report")
    p.add_argument("--threads", type=int, default=1, help="intra-op threads for the sorted cache")
    p.add_argument("--no-hybrid", action="store_true")
    p.add_argument("--out", type=str, default=None, help="JSON path (PNG beside it)")
    args = p.parse_args(argv)
    if args.smoke:
        import tempfile

        args.ns, args.ks = args.ns or "4096", "16"
        args.steps, args.sdpa_steps, args.insert_steps, args.error_queries = 20, 2, 200, 1
        args.out = args.out or os.path.join(tempfile.mkdtemp(), "decode_smoke.json")
    quick = args.quick
    args.ns = [int(x) for x in (args.ns or ("4096,16384,65536" if quick else "4096,16384,65536,262144,1048576")).split(",")]
    args.ks = [int(x) for x in args.ks.split(",")]
    args.steps = args.steps or (100 if quick else 400)
    args.sdpa_steps = args.sdpa_steps or (3 if quick else 5)
    args.insert_steps = args.insert_steps or (3000 if quick else 20000)
    args.out = args.out or os.path.join(HERE, "results", "decode_quick.json" if quick else "decode.json")
    return args


def summary(wall: list[float], cpu: list[float]) -> dict:
    ms = sorted(x * 1e3 for x in wall)
    return {"cpu_mean_ms": statistics.fmean(cpu) * 1e3, "wall_median_ms": statistics.median(ms),
            "wall_mean_ms": statistics.fmean(ms), "wall_p90_ms": ms[min(len(ms) - 1, int(0.9 * len(ms)))]}


def clocks() -> tuple[float, float]:
    return time.perf_counter(), time.thread_time()


def decode_steps(cache, H, G, Dv, d_k, k, tau, steps, gen) -> dict:
    """Time `steps` decode steps (append + attend), each part separately, wall and CPU time."""
    ks = (torch.rand(steps, 1, H, generator=gen) * 2 - 1) * KEY_RANGE
    qs = (torch.rand(steps, 1, H, generator=gen) * 2 - 1) * KEY_RANGE
    vs = torch.randn(steps, 1, G, Dv, generator=gen)
    kv = torch.randn(steps, 1, H, d_k, generator=gen) if d_k else None
    qv = torch.randn(steps, 1, H, d_k, generator=gen) if d_k else None
    for i in range(min(20, steps)):  # warm up
        cache.attend(qs[i], tau, qv[i] if d_k else None, window=k)
    wall, cpu, app_cpu, att_cpu = [], [], [], []
    with torch.no_grad():
        for i in range(steps):
            w0, c0 = clocks()
            cache.append(ks[i], vs[i], kv[i] if d_k else None)
            w1, c1 = clocks()
            cache.attend(qs[i], tau, qv[i] if d_k else None, window=k)
            w2, c2 = clocks()
            wall.append(w2 - w0)
            cpu.append(c2 - c0)
            app_cpu.append(c1 - c0)
            att_cpu.append(c2 - c1)
    return {**summary(wall, cpu), "append_cpu_us": statistics.fmean(app_cpu) * 1e6,
            "attend_cpu_us": statistics.fmean(att_cpu) * 1e6}


def insertion(cache, H, G, Dv, d_k, steps, gen) -> dict:
    """Appends in a row (amortized cost including the index's buffer and level merges), and the
    same number of bare key insertions into a copy of the key index (no values, no checks)."""
    ks = (torch.rand(steps, 1, H, generator=gen) * 2 - 1) * KEY_RANGE
    vs = torch.randn(steps, 1, G, Dv, generator=gen)
    kv = torch.randn(steps, 1, H, d_k, generator=gen) if d_k else None
    index = copy.deepcopy(cache.index)
    bits = ks.reshape(steps, H).contiguous().view(torch.int32)
    with torch.no_grad():
        w0, c0 = clocks()
        for i in range(steps):
            cache.append(ks[i], vs[i], kv[i] if d_k else None)
        w1, c1 = clocks()
        for i in range(steps):
            index.insert(bits[i], i)
        c2 = time.thread_time()
    return {"appends": steps, "append_cpu_us": (c1 - c0) / steps * 1e6, "append_wall_us": (w1 - w0) / steps * 1e6,
            "tokens_per_s_cpu": steps / (c1 - c0), "key_insert_cpu_us": (c2 - c1) / steps * 1e6}


def error_report(cache, n, H, ks, tau_fixed, batches, gen) -> list[dict]:
    spacing = 2 * KEY_RANGE / n
    rows = []
    for name, tau in (("fixed", tau_fixed), ("8_spacings", (8 * spacing) ** 2)):
        qs = [(torch.rand(1, H, generator=gen) * 2 - 1) * (KEY_RANGE - 0.5) for _ in range(batches)]
        for k in ks:
            errs = [window_error(cache, q, tau, window=k) for q in qs]
            mass = torch.cat([e.mass_out.flatten() for e in errs])
            bound = torch.cat([e.bound.flatten() for e in errs])
            rows.append({"n": n, "k": k, "tau_kind": name, "tau": tau, "mass_out_mean": mass.mean().item(),
                         "mass_out_max": mass.max().item(), "bound_mean": bound.mean().item(),
                         "within_bound_frac": (mass <= bound * 1.05 + 1e-12).double().mean().item()})
    return rows


def bench_sorted(n, args, gen, d_k=None, ks=None) -> tuple[list[dict], dict, list[dict]]:
    H, G, Dv = args.heads, args.groups, args.dv
    ks = ks or args.ks
    keys = (torch.rand(1, H, n, generator=gen) * 2 - 1) * KEY_RANGE
    # value and vector-key contents do not change the cost: one random row per head/group,
    # expanded (no copy), keeps peak memory at the cache's own store
    vals = torch.randn(1, G, 1, Dv, generator=gen).expand(1, G, n, Dv)
    vkeys = torch.randn(1, H, 1, d_k, generator=gen).expand(1, H, n, d_k) if d_k else None
    extra = 64 + len(ks) * (args.steps + 20) + args.insert_steps
    t0 = time.perf_counter()
    cache = SortedScalarCache.from_tensors(keys, vals, vkeys, capacity=n + extra,
                                           sink_key=0.0, sink_value=torch.zeros(Dv))
    build_s = time.perf_counter() - t0
    del keys, vals, vkeys
    gc.collect()
    err = [] if d_k else error_report(cache, n, H, ks, args.tau, args.error_queries, gen)  # exactly n keys
    torch.set_num_threads(args.threads)
    rows = []
    for k in ks:
        r = decode_steps(cache, H, G, Dv, d_k, k, args.tau, args.steps, gen)
        reads = H * (k * (4 + 4 * Dv + 4 * (d_k or 0)) + 2 * max(1, n - 1).bit_length() * 8)
        rows.append({"n": n, "k": k, "mode": "hybrid" if d_k else "scalar", **r, "step_ms": r["wall_median_ms"],
                     "tokens_per_s": 1e3 / r["wall_median_ms"], "bytes_per_step": reads})
    ins = {"n": n, "mode": "hybrid" if d_k else "scalar", "build_s": build_s,
           **insertion(cache, H, G, Dv, d_k, args.insert_steps, gen),
           "memory_bytes_per_token": cache.memory_bytes() / len(cache)}
    torch.set_num_threads(args.default_threads)
    del cache
    gc.collect()
    return rows, ins, err


def bench_full(n, args, gen) -> dict:
    """Full-attention decode: an ordinary KV cache (B, H, n, D) and torch SDPA over all of it,
    with one thread (CPU time, as the sorted cache) and with the default thread count (wall)."""
    H, D, steps = args.heads, args.dv, args.sdpa_steps
    K = torch.empty(1, H, n + 2 * steps + 4, D)
    V = torch.empty_like(K)
    K[:, :, :n].normal_(generator=gen)
    V[:, :, :n].normal_(generator=gen)
    q, kn, vn = (torch.randn(2 * steps + 2, 1, H, 1, D, generator=gen) for _ in range(3))
    out, pos = {"n": n}, n
    for threads in (1, args.default_threads):
        torch.set_num_threads(threads)
        wall, cpu = [], []
        with torch.no_grad():
            for i in range(steps + 1):
                w0, c0 = clocks()
                K[:, :, pos: pos + 1] = kn[pos - n]
                V[:, :, pos: pos + 1] = vn[pos - n]
                F.scaled_dot_product_attention(q[pos - n], K[:, :, : pos + 1], V[:, :, : pos + 1])
                w1, c1 = clocks()
                wall.append(w1 - w0)
                cpu.append(c1 - c0)
                pos += 1
        out[f"threads_{threads}"] = summary(wall[1:], cpu[1:])  # the first step warms up
    torch.set_num_threads(args.default_threads)
    out["cpu_1thread_ms"] = out["threads_1"]["cpu_mean_ms"]
    out["wall_best_ms"] = min(out[f"threads_{t}"]["wall_median_ms"] for t in (1, args.default_threads))
    out["step_ms"], out["tokens_per_s"] = out["wall_best_ms"], 1e3 / out["wall_best_ms"]
    out["bytes_per_step"] = 2 * H * n * D * K.element_size()  # every cached key and value
    del K, V
    gc.collect()
    return out


def plot(result, path):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (a, b) = plt.subplots(1, 2, figsize=(12, 4.5))
    rows, full = result["decode"], result["full_attention"]
    for mode in ("scalar", "hybrid"):
        for k in sorted({r["k"] for r in rows if r["mode"] == mode}):
            sel = [r for r in rows if r["mode"] == mode and r["k"] == k]
            a.plot([r["n"] for r in sel], [r["cpu_mean_ms"] for r in sel], "o-" if mode == "scalar" else "s--",
                   label=f"sorted {mode}, k={k}")
    a.plot([f["n"] for f in full], [f["cpu_1thread_ms"] for f in full], "k^-", label="full attention (SDPA)")
    a.set(xscale="log", yscale="log", xlabel="cached tokens n", ylabel="ms per decode step (CPU time, 1 thread)",
          title=f"one layer, H={result['config']['heads']}, d_v={result['config']['dv']}, batch 1")
    a.legend(fontsize=8)
    a.grid(alpha=0.3, which="both")
    for kind, style in (("fixed", "-"), ("8_spacings", "--")):
        for k in sorted({e["k"] for e in result["error"]}):
            sel = [e for e in result["error"] if e["k"] == k and e["tau_kind"] == kind]
            if sel:
                tau = "tau=%g" % sel[0]["tau"] if kind == "fixed" else "sqrt(tau)=8 spacings"
                b.plot([e["n"] for e in sel], [max(e["mass_out_mean"], 1e-30) for e in sel], style + "o",
                       label=f"k={k}, {tau}")
    b.set(xscale="log", yscale="log", ylim=(1e-30, 2), xlabel="cached tokens n",
          ylabel="mean attention mass outside window (floor 1e-30)",
          title="error control (pure scalar heads)")
    b.legend(fontsize=8)
    b.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def targets(result) -> dict:
    """The issue's targets at the largest n (CPU time, one thread on both sides; wall-clock too)."""
    dec = {(r["n"], r["k"]): r for r in result["decode"] if r["mode"] == "scalar"}
    full = {f["n"]: f for f in result["full_attention"]}
    ins = {i["n"]: i for i in result["insertion"] if i["mode"] == "scalar"}
    out = {"key_index_bytes_per_head": bytes_per_token(1, 1, 1)["key_index_per_head"]}
    out["key_index_ok"] = out["key_index_bytes_per_head"] <= 12
    n = max(full)
    if (n, 64) in dec:
        d = dec[(n, 64)]
        out["n"] = n
        out["speedup_k64_cpu"] = full[n]["cpu_1thread_ms"] / d["cpu_mean_ms"]
        out["speedup_k64_wall"] = full[n]["wall_best_ms"] / d["wall_median_ms"]
        out["speedup_ok"] = out["speedup_k64_cpu"] >= 200
        step = ins[n]["append_cpu_us"] + d["attend_cpu_us"]
        out["append_share_of_step_k64"] = ins[n]["append_cpu_us"] / step
        out["key_insert_share_of_step_k64"] = ins[n]["key_insert_cpu_us"] / step
        out["insertion_ok"] = out["key_insert_share_of_step_k64"] < 0.10
    if (4096, 64) in dec and (n, 64) in dec:
        out["latency_ratio_vs_4096_k64_cpu"] = dec[(n, 64)]["cpu_mean_ms"] / dec[(4096, 64)]["cpu_mean_ms"]
        out["latency_ratio_vs_4096_k64_wall"] = dec[(n, 64)]["wall_median_ms"] / dec[(4096, 64)]["wall_median_ms"]
        out["latency_ratio_ok"] = out["latency_ratio_vs_4096_k64_cpu"] <= 2
    return out


def main(argv=None):
    args = parse_args(argv)
    args.default_threads = torch.get_num_threads()
    gen = torch.Generator().manual_seed(0)
    result = {"config": {k: v for k, v in vars(args).items()}, "decode": [], "insertion": [],
              "full_attention": [], "error": [],
              "environment": {"torch": torch.__version__, "python": platform.python_version(),
                              "machine": platform.machine(), "cpu_count": os.cpu_count(),
                              "default_threads": args.default_threads},
              "memory": {name: bytes_per_token(args.heads, g, args.dv, dk, weighted=w)
                         for name, g, dk, w in (("scalar_G8", 8, None, False), ("scalar_G2", 2, None, False),
                                                ("scalar_G1", 1, None, False),
                                                ("scalar_G8_compressed", 8, None, True),
                                                ("hybrid_G8", 8, args.dv, False))}}
    jobs = [(n, kind) for n in args.ns for kind in ["scalar"] + ([] if args.no_hybrid else ["hybrid"]) + ["full"]]
    for n, kind in tqdm(jobs, desc="decode benchmark", unit="job"):
        if kind == "full":
            result["full_attention"].append(bench_full(n, args, gen))
        else:
            d_k = args.dv if kind == "hybrid" else None
            rows, ins, err = bench_sorted(n, args, gen, d_k=d_k, ks=[64] if d_k else None)
            result["decode"] += rows
            result["insertion"].append(ins)
            result["error"] += err
    result["targets"] = targets(result)

    full = {f["n"]: f for f in result["full_attention"]}
    ins = {(i["n"], i["mode"]): i for i in result["insertion"]}
    print("\nper decode step (append + attend); cpu = thread CPU time, 1 thread; wall = median wall-clock")
    print(f"{'mode':7} {'n':>8} {'k':>4} {'cpu ms':>8} {'wall ms':>8} {'append us':>10} {'attend us':>10} "
          f"{'SDPA cpu ms':>12} {'SDPA wall ms':>13} {'speedup':>8} {'append amort us':>16} {'key insert us':>14}")
    for r in result["decode"]:
        i, f = ins[(r["n"], r["mode"])], full[r["n"]]
        print(f"{r['mode']:7} {r['n']:8d} {r['k']:4d} {r['cpu_mean_ms']:8.3f} {r['wall_median_ms']:8.3f} "
              f"{r['append_cpu_us']:10.1f} {r['attend_cpu_us']:10.1f} {f['cpu_1thread_ms']:12.2f} "
              f"{f['wall_best_ms']:13.2f} {f['cpu_1thread_ms'] / r['cpu_mean_ms']:8.0f} "
              f"{i['append_cpu_us']:16.1f} {i['key_insert_cpu_us']:14.1f}")
    print(f"\n{'n':>8} {'k':>4} {'tau':>10} {'mass out (mean)':>16} {'max':>10} {'erfc bound (mean)':>18} {'<= bound':>9}")
    for e in result["error"]:
        print(f"{e['n']:8d} {e['k']:4d} {e['tau']:10.3g} {e['mass_out_mean']:16.3e} {e['mass_out_max']:10.3e} "
              f"{e['bound_mean']:18.3e} {e['within_bound_frac']:9.2f}")
    print("\nbytes per token per layer:", json.dumps(result["memory"]["scalar_G8"]))
    print("targets:", json.dumps(result["targets"], indent=1))
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    if args.smoke:
        print(f"wrote {args.out}")
        return
    png = os.path.splitext(args.out)[0] + ".png"
    plot(result, png)
    print(f"wrote {args.out} and {png}")


if __name__ == "__main__":
    main()
