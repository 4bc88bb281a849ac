"""Forward + backward time and peak memory of every op's fast path against torch SDPA.

    .venv/bin/python benchmarks/ops.py                 # B=1, H=8, T=2048, D=64; memory at T=2048, 8192
    .venv/bin/python benchmarks/ops.py --no-memory --reps 3

Time: each op runs forward and backward (a fixed random cotangent, gradients for every
input and parameter). Ops are timed round-robin, one call each per round, so drift in the
machine's load hits all of them alike. The table shows the fastest round (interference from
other processes only ever adds time, so the minimum is the least contaminated sample) and
its ratio to torch's fused causal SDPA timed in the same rounds, plus the ratio of medians. "sdpa_math" is the same attention
forced onto SDPA's unfused math backend: the path a wrong head dimension or a grad-carrying
mask falls back to, shown so that hitting the fused kernel is visible in the numbers.

Memory: each (op, T) runs in a fresh subprocess (so no allocator reuse from earlier ops).
It builds the inputs, runs one small warm-up call (lazy initialisation), then resets the
kernel's peak-RSS counter (writing 5 to /proc/self/clear_refs), runs one forward + backward
and reports VmHWM - VmRSS at the reset: the extra resident memory the call needed beyond its
inputs (activations, saved tensors, gradients). Linux only. Memory linear in T shows as a
ratio near T2/T1 between the two columns; a T x T buffer as (T2/T1)^2.

Results go to benchmarks/results/ops.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

from attnlab import ops

from attnlab.ops.softmax import SCALES

OPS = ("sdpa", "sdpa_math", *(f"softmax[{s}]" for s in SCALES),
       "scalar", "hybrid", "goat", "goat_hybrid", "principled", "cosformer", "gla", "ssd")
TARGETS = {"scalar": 1.2, "hybrid": 1.2, "goat": 1.1, "principled": 4.0}
GOAT_RANK = 8  # R frequencies, as GOAT's default
MEMORY_SKIP = {"sdpa_math": 4096}  # materialises T x T: above this T it would need gigabytes
RESULTS = Path(__file__).resolve().parent / "results" / "ops.json"


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.requires_grad_()


def make_case(name: str, B: int, H: int, T: int, D: int):
    """(fn, inputs) for one op; every input tensor is a leaf that wants a gradient."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return _leaf(torch.randn(*shape, generator=g))

    q, k, v = rand(B, H, T, D), rand(B, H, T, D), rand(B, H, T, D)
    if name == "sdpa":
        return (lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True)), [q, k, v]
    if name == "sdpa_math":
        def math_sdpa(q, k, v):
            with sdpa_kernel(SDPBackend.MATH):
                return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return math_sdpa, [q, k, v]
    if name.startswith("softmax["):
        scale = name[len("softmax["):-1]
        return (lambda q, k, v: ops.softmax_attention(q, k, v, scale=scale)), [q, k, v]
    qs, ks = rand(B, H, T), rand(B, H, T)
    tau = _leaf(torch.full((H,), 0.5))
    if name == "scalar":
        return ops.scalar_attention, [qs, ks, v, tau]
    if name == "hybrid":
        return ops.hybrid_attention, [q, k, v, qs, ks, tau]
    if name in ("goat", "goat_hybrid"):
        # as the layer does: the prior (2R + 1 columns, + 2 for the scalar term) shares the head
        # width, so q and k carry D - 2R - 1 (- 2) content dims and the fused call is D wide
        freqs = 10000.0 ** (-torch.arange(GOAT_RANK) / (GOAT_RANK - 1))
        prior = [rand(H, GOAT_RANK), rand(H, GOAT_RANK), rand(1, H, T)]  # lam_sym, lam_asym, u
        dc = D - 2 * GOAT_RANK - 1 - (2 if name == "goat_hybrid" else 0)
        qc, kc = rand(B, H, T, dc), rand(B, H, T, dc)
        if name == "goat":
            return (lambda q, k, v, a, b, u: ops.goat_attention(q, k, v, freqs, a, b, u)), [qc, kc, v, *prior]

        def goat_hybrid(q, k, v, a, b, u, qs, ks, tau):
            return ops.goat_attention(q, k, v, freqs, a, b, u, qs=qs, ks=ks, tau=tau)
        return goat_hybrid, [qc, kc, v, *prior, qs, ks, tau]
    if name == "principled":
        qg, kg = rand(B, H, T, 16), rand(B, H, T, 16)
        alpha, beta, gamma = (_leaf(torch.full((H,), c)) for c in (0.0, 0.0, -2.0))

        def principled(q, k, qg, kg, v, alpha, beta, gamma):
            return ops.principled_attention(q, k, qg, kg, v, alpha=alpha, beta=beta, gamma=gamma)
        return principled, [q, k, qg, kg, v, alpha, beta, gamma]
    if name == "cosformer":
        return ops.cosformer_attention, [q, k, v]
    if name == "gla":
        log_decay = _leaf(F.logsigmoid(torch.randn(B, H, T, D, generator=g) + 3.0))
        return ops.gla_attention, [q, k, v, log_decay]
    if name == "ssd":
        log_decay = _leaf(F.logsigmoid(torch.randn(B, H, T, generator=g) + 3.0))
        return ops.ssd_attention, [q, k, v, log_decay]
    raise ValueError(f"unknown op {name!r}; known: {OPS}")


def fwd_bwd(fn, inputs, cot=None) -> None:
    leaves = [x.detach().requires_grad_() for x in inputs]
    out = fn(*leaves)
    out = out[0] if isinstance(out, tuple) else out
    out.backward(torch.ones_like(out) if cot is None else cot)


def time_ops(names, B, H, T, D, reps):
    """fwd+bwd seconds per op and round over `reps` round-robin rounds (after one warm-up call each)."""
    cases = {}
    for name in tqdm(names, desc="warm-up", leave=False):
        fn, inputs = make_case(name, B, H, T, D)
        fwd_bwd(fn, inputs)
        cases[name] = (fn, inputs)
    times = {name: [] for name in cases}
    for _ in tqdm(range(reps), desc=f"timing T={T}", leave=False):
        for name, (fn, inputs) in cases.items():
            start = time.perf_counter()
            fwd_bwd(fn, inputs)
            times[name].append(time.perf_counter() - start)
    return times


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(name: str, B: int, H: int, T: int, D: int) -> None:
    """Runs in its own process: prints {"peak_mb": ...} or {"note": ...} as JSON."""
    fwd_bwd(*make_case(name, B, H, 64, D))  # lazy initialisation outside the measurement
    fn, inputs = make_case(name, B, H, T, D)
    Path("/proc/self/clear_refs").write_text("5")
    base = _status_kb("VmRSS")
    fwd_bwd(fn, inputs)
    print(json.dumps({"peak_mb": (_status_kb("VmHWM") - base) / 1024}))


def measure_memory(name, B, H, T, D):
    if T > MEMORY_SKIP.get(name, math.inf):
        return {"note": f"not run: materialises T x T ({B * H * T * T * 4 / 2**30:.1f} GiB per copy)"}
    cmd = [sys.executable, __file__, "--memory-child", name, "--B", str(B), "--H", str(H), "--D", str(D), "--T", str(T)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return {"note": f"failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--B", type=int, default=1)
    parser.add_argument("--H", type=int, default=8)
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--D", type=int, default=64)
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--mem-T", type=int, nargs="*", default=[2048, 8192])
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--ops", nargs="*", default=list(OPS), choices=OPS)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.memory_child:
        memory_child(args.memory_child, args.B, args.H, args.T, args.D)
        return
    load = os.getloadavg()  # other processes on the machine inflate and scatter the times
    names = list(dict.fromkeys(["sdpa", *args.ops]))
    B, H, T, D = args.B, args.H, args.T, args.D
    samples = time_ops(names, B, H, T, D, args.reps)
    mem_T = [] if args.no_memory else args.mem_T
    memory = {}
    runs = [(n, t) for n in names for t in mem_T]
    for name, t in tqdm(runs, desc="memory", leave=False):
        memory[(name, t)] = measure_memory(name, B, H, t, D)

    best = {name: min(ts) for name, ts in samples.items()}
    medians = {name: statistics.median(ts) for name, ts in samples.items()}
    rows = []
    for name in names:
        ratio = best[name] / best["sdpa"]
        row = {"op": name, "time_ms": 1e3 * best[name], "median_ms": 1e3 * medians[name], "ratio_vs_sdpa": ratio,
               "median_ratio_vs_sdpa": medians[name] / medians["sdpa"], "samples_ms": [1e3 * s for s in samples[name]]}
        if name in TARGETS:
            row.update(target=TARGETS[name], meets_target=ratio <= TARGETS[name])
        for t in mem_T:
            row[f"mem_mb_T{t}"] = memory.get((name, t), {}).get("peak_mb")
            if "note" in memory.get((name, t), {}):
                row[f"mem_note_T{t}"] = memory[(name, t)]["note"]
        rows.append(row)

    header = f"{'op':<20}{'min ms':>9}{'x SDPA':>8}{'target':>8}{'median ms':>11}{'x SDPA':>8}" + "".join(f"{f'MB T={t}':>13}" for t in mem_T)
    if len(mem_T) == 2:
        header += f"{'growth':>9}"
    print(f"B={B} H={H} T={T} D={D}, fp32, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"load average at start {load[0]:.1f} on {os.cpu_count()} CPUs")
    print(header)
    for row in rows:
        line = f"{row['op']:<20}{row['time_ms']:>9.1f}{row['ratio_vs_sdpa']:>8.2f}"
        line += f"{('<= ' + str(row['target'])) if 'target' in row else '':>8}"
        line += f"{row['median_ms']:>11.1f}{row['median_ratio_vs_sdpa']:>8.2f}"
        mems = [row.get(f"mem_mb_T{t}") for t in mem_T]
        line += "".join(f"{m:>13.1f}" if m is not None else f"{'-':>13}" for m in mems)
        if len(mems) == 2 and None not in mems and mems[0] > 0:
            line += f"{mems[1] / mems[0]:>8.1f}x"
        print(line)
    if len(mem_T) == 2:
        print(f"growth: memory at T={mem_T[1]} / T={mem_T[0]}; linear in T is {mem_T[1] / mem_T[0]:.0f}x, "
              f"quadratic {(mem_T[1] / mem_T[0]) ** 2:.0f}x")
    for row in rows:
        for t in mem_T:
            if row.get(f"mem_note_T{t}"):
                print(f"{row['op']} memory at T={t}: {row[f'mem_note_T{t}']}")

    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "config": {"B": B, "H": H, "T": T, "D": D, "dtype": "float32", "reps": args.reps, "memory_T": mem_T,
                   "threads": torch.get_num_threads(), "torch": torch.__version__,
                   "load_average_at_start": load[0], "cpus": os.cpu_count()},
        "method": {"time": "round-robin fwd+bwd wall-clock; time_ms is the fastest round, ratio_vs_sdpa its ratio "
                           "to fused causal SDPA in the same run; medians alongside",
                   "memory": "fresh subprocess per (op, T): VmHWM - VmRSS after resetting the peak via "
                             "/proc/self/clear_refs, over one fwd+bwd beyond the inputs"},
        "rows": rows,
    }
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
