"""Forward + backward time and peak memory of every op's fast path against torch SDPA.

    .venv/bin/python benchmarks/ops.py                       # B=1, H=8, D=64; T=2048 (all), 8192 (linear family)
    .venv/bin/python benchmarks/ops.py --no-memory --rounds 7 --ops principled gla
    .venv/bin/python benchmarks/ops.py --gqa-before-src /tmp/old/src   # GQA memory of an older checkout too

Time: each op runs forward and backward (gradients for every input and parameter) in rounds
interleaved with torch's fused causal SDPA on the same shapes: op, SDPA, op, SDPA, ... A round's
ratio is op / SDPA, so a change in the machine's load between rounds falls on both. The table
shows the median of the per-round ratios (the headline number) next to the best ratio (fastest op
round over fastest SDPA round: interference only ever adds time, so minima are the least
contaminated samples). Every op runs at T=2048, the linear family also at T=8192. "[fallback]"
rows run the pure-PyTorch fast path with the compiled kernels switched off (ATTNLAB_NO_EXT), so
one run shows what the kernels buy. "sdpa_math" is SDPA forced onto its unfused math backend:
the path a wrong head dimension or a grad-carrying mask falls back to.

Memory: each (op, T) runs in a fresh subprocess (no allocator reuse from earlier ops). It builds
the inputs, runs one small warm-up call (lazy initialisation, the kernels' build), then resets the
kernel's peak-RSS counter (writing 5 to /proc/self/clear_refs), runs one forward + backward and
reports VmHWM - VmRSS at the reset: the extra resident memory the call needed beyond its inputs
(activations, saved tensors, gradients). Linux only. Memory linear in T shows as a ratio near
T2/T1 between the two columns, a T x T buffer as (T2/T1)^2. The GQA section measures the ops
with grouped heads (H=8, G=2) the same way, and with --gqa-before-src also the code at that path.

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
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from tqdm import tqdm

from attnlab import ops
from attnlab.ops.softmax import SCALES

OPS = ("sdpa", "sdpa_math", *(f"softmax[{s}]" for s in SCALES), "scalar", "hybrid", "goat", "goat_hybrid",
       "principled", "principled[fallback]", "cosformer", "gla", "gla[fallback]", "ssd")
LONG_OPS = ("cosformer", "gla", "gla[fallback]", "ssd")  # also timed at --long-T
GQA_OPS = ("scalar", "hybrid", "principled", "principled[fallback]")
TARGETS = {"scalar": 1.2, "hybrid": 1.2, "goat": 1.1, "principled": 1.5, "gla": 1.5}  # median ratio at T=2048
LONG_TARGETS = {"gla": 1.0}  # faster than SDPA at the long T
GOAT_RANK = 8  # R frequencies, as GOAT's default
MEMORY_SKIP = {"sdpa_math": 4096}  # materialises T x T: above this T it would need gigabytes
RESULTS = Path(__file__).resolve().parent / "results" / "ops.json"
FALLBACK = "[fallback]"


def _leaf(x: torch.Tensor) -> torch.Tensor:
    return x.requires_grad_()


def _mode(name: str):
    """The fallback rows run with the compiled kernels off."""
    if name.endswith(FALLBACK):
        from attnlab.ops import _ext  # imported here: an older checkout (--gqa-before-src) has none
        return _ext.disabled()
    return nullcontext()


def make_case(name: str, B: int, H: int, T: int, D: int, groups: int | None = None):
    """(fn, inputs) for one op; every input tensor is a leaf that wants a gradient. groups: the
    number of key/value heads (GQA) for scalar, hybrid and principled; None means H."""
    g = torch.Generator().manual_seed(0)
    G = groups or H
    name = name.removesuffix(FALLBACK)

    def rand(*shape):
        return _leaf(torch.randn(*shape, generator=g))

    q, k, v = rand(B, H, T, D), rand(B, G, T, D), rand(B, G, T, D)
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
        qg, kg = rand(B, H, T, 16), rand(B, G, T, 16)
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


def fwd_bwd(fn, inputs, mode=None) -> float:
    """One forward + backward with a ones cotangent; returns its wall-clock seconds."""
    leaves = [x.detach().requires_grad_() for x in inputs]
    with mode or nullcontext():
        start = time.perf_counter()
        out = fn(*leaves)
        out = out[0] if isinstance(out, tuple) else out
        out.backward(torch.ones_like(out))
        return time.perf_counter() - start


def time_against_sdpa(name, B, H, T, D, rounds) -> dict:
    """rounds x (op, SDPA), after one warm-up call each: per-round times and ratios."""
    fn, inputs = make_case(name, B, H, T, D)
    ref, ref_inputs = make_case("sdpa", B, H, T, D)
    fwd_bwd(fn, inputs, _mode(name))
    fwd_bwd(ref, ref_inputs)
    op_s, sdpa_s = [], []
    for _ in range(rounds):
        op_s.append(fwd_bwd(fn, inputs, _mode(name)))
        sdpa_s.append(fwd_bwd(ref, ref_inputs))
    ratios = [a / b for a, b in zip(op_s, sdpa_s)]
    return {"op": name, "T": T, "median_ratio_vs_sdpa": statistics.median(ratios),
            "ratio_vs_sdpa": min(op_s) / min(sdpa_s), "time_ms": 1e3 * min(op_s),
            "median_ms": 1e3 * statistics.median(op_s), "sdpa_time_ms": 1e3 * min(sdpa_s),
            "sdpa_median_ms": 1e3 * statistics.median(sdpa_s), "samples_ms": [1e3 * s for s in op_s],
            "sdpa_samples_ms": [1e3 * s for s in sdpa_s]}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(name: str, B: int, H: int, T: int, D: int, groups: int | None) -> None:
    """Runs in its own process: prints {"peak_mb": ...} as JSON."""
    mode = _mode(name)
    fwd_bwd(*make_case(name, B, H, 64, D, groups), mode)  # lazy initialisation outside the measurement
    fn, inputs = make_case(name, B, H, T, D, groups)
    Path("/proc/self/clear_refs").write_text("5")
    base = _status_kb("VmRSS")
    fwd_bwd(fn, inputs, _mode(name))
    print(json.dumps({"peak_mb": (_status_kb("VmHWM") - base) / 1024}))


def measure_memory(name, B, H, T, D, groups=None, src=None) -> dict:
    """{"peak_mb": ...} or {"note": ...}; src: run against the attnlab package under this directory."""
    if T > MEMORY_SKIP.get(name, math.inf):
        return {"note": f"not run: materialises T x T ({B * H * T * T * 4 / 2**30:.1f} GiB per copy)"}
    cmd = [sys.executable, __file__, "--memory-child", name, "--B", str(B), "--H", str(H), "--D", str(D),
           "--T", str(T), "--groups", str(groups or H), "--threads", str(torch.get_num_threads())]
    env = dict(os.environ, PYTHONPATH=str(src)) if src else None
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        return {"note": f"failed: {proc.stderr.strip().splitlines()[-1] if proc.stderr.strip() else proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _fmt(x, spec):
    return format(x, spec) if x is not None else f"{'-':>{spec.split('.')[0]}}"


def print_rows(title, rows, mem_T):
    print(title)
    print(f"{'op':<22}{'median x':>9}{'best x':>8}{'target':>8}{'med ms':>9}{'SDPA ms':>9}"
          + "".join(f"{f'MB T={t}':>12}" for t in mem_T) + ("   growth" if len(mem_T) == 2 else ""))
    for r in rows:
        mems = [r.get(f"mem_mb_T{t}") for t in mem_T]
        line = (f"{r['op']:<22}{r['median_ratio_vs_sdpa']:>9.2f}{r['ratio_vs_sdpa']:>8.2f}"
                f"{('<= ' + str(r['target'])) if 'target' in r else '':>8}{r['median_ms']:>9.1f}"
                f"{r['sdpa_median_ms']:>9.1f}" + "".join(_fmt(m, "12.1f") for m in mems))
        if len(mems) == 2 and None not in mems and mems[0] > 0:
            line += f"{mems[1] / mems[0]:>8.1f}x"
        print(line)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--B", type=int, default=1)
    parser.add_argument("--H", type=int, default=8)
    parser.add_argument("--T", type=int, default=2048)
    parser.add_argument("--long-T", type=int, default=8192, help="T of the linear family's second table (0: skip)")
    parser.add_argument("--D", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=9, help="interleaved (op, SDPA) rounds per op, >= 7 advised")
    parser.add_argument("--mem-T", type=int, nargs="*", default=[2048, 8192])
    parser.add_argument("--no-memory", action="store_true")
    parser.add_argument("--ops", nargs="*", default=list(OPS), choices=OPS)
    parser.add_argument("--gqa-groups", type=int, default=2, help="key/value heads of the GQA memory table (0: skip)")
    parser.add_argument("--gqa-before-src", type=Path, help="src/ of an older checkout: its GQA memory too")
    parser.add_argument("--gqa-before-label", default="", help="what --gqa-before-src is (e.g. a commit)")
    parser.add_argument("--threads", type=int, default=0,
                        help="torch CPU threads (0: torch's default); on a shared machine 1 avoids threads "
                             "waiting for each other at every op's barrier")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--memory-child", help=argparse.SUPPRESS)
    parser.add_argument("--groups", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    B, H, T, D = args.B, args.H, args.T, args.D
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.memory_child:
        memory_child(args.memory_child, B, H, T, D, args.groups)
        return
    load = os.getloadavg()  # other processes on the machine inflate and scatter the times
    names = [n for n in args.ops if n != "sdpa"]
    long_names = [n for n in names if n in LONG_OPS] if args.long_T else []
    jobs = [(n, T) for n in ["sdpa", *names]] + [(n, args.long_T) for n in long_names]
    timed = {}
    for name, t in tqdm(jobs, desc="timing", leave=False):
        timed[(name, t)] = time_against_sdpa(name, B, H, t, D, args.rounds)
    mem_T = [] if args.no_memory else args.mem_T
    memory = {(n, t): measure_memory(n, B, H, t, D) for n, t in tqdm(
        [(n, t) for n in ["sdpa", *names] for t in mem_T], desc="memory", leave=False)}

    rows, long_rows = [], []
    for (name, t), row in timed.items():
        targets = TARGETS if t == T else LONG_TARGETS
        if name in targets:
            row.update(target=targets[name], meets_target=row["median_ratio_vs_sdpa"] <= targets[name])
        if t == T:
            for mt in mem_T:
                m = memory[(name, mt)]
                row[f"mem_mb_T{mt}"] = m.get("peak_mb")
                if "note" in m:
                    row[f"mem_note_T{mt}"] = m["note"]
        (rows if t == T else long_rows).append(row)

    gqa = None
    if args.gqa_groups and not args.no_memory:
        G = args.gqa_groups
        gqa_names = [n for n in GQA_OPS if n in names]
        gqa_rows = []
        for name in tqdm(gqa_names, desc="GQA memory", leave=False):
            row = {"op": name}
            for t in mem_T:
                row[f"mem_mb_T{t}"] = measure_memory(name, B, H, t, D, G).get("peak_mb")
                row[f"mem_mb_T{t}_all_heads"] = measure_memory(name, B, H, t, D, H).get("peak_mb")
                if args.gqa_before_src and not name.endswith(FALLBACK):
                    row[f"before_mem_mb_T{t}"] = measure_memory(name, B, H, t, D, G, args.gqa_before_src).get("peak_mb")
            gqa_rows.append(row)
        gqa = {"H": H, "G": G, "T": mem_T, "before": args.gqa_before_label or (str(args.gqa_before_src) or None),
               "rows": gqa_rows}

    print(f"B={B} H={H} D={D}, fp32, {torch.get_num_threads()} threads, torch {torch.__version__}, "
          f"load average at start {load[0]:.1f} on {os.cpu_count()} CPUs, {args.rounds} rounds of (op, SDPA)")
    print_rows(f"T={T}: median and best ratio of fwd+bwd time to SDPA", rows, mem_T)
    if long_rows:
        print_rows(f"T={args.long_T}", long_rows, [])
    if len(mem_T) == 2:
        print(f"growth: memory at T={mem_T[1]} / T={mem_T[0]}; linear in T is {mem_T[1] / mem_T[0]:.0f}x, "
              f"quadratic {(mem_T[1] / mem_T[0]) ** 2:.0f}x")
    for row in rows:
        for t in mem_T:
            if row.get(f"mem_note_T{t}"):
                print(f"{row['op']} memory at T={t}: {row[f'mem_note_T{t}']}")
    if gqa:
        print(f"GQA peak memory (MB), H={H}, G={gqa['G']}" + (f"; before = {gqa['before']}" if args.gqa_before_src else ""))
        for row in gqa["rows"]:
            print(f"  {row['op']:<22}" + "".join(
                f"  T={t}: {_fmt(row[f'mem_mb_T{t}'], '.1f')} (G=H {_fmt(row[f'mem_mb_T{t}_all_heads'], '.1f')}"
                + (f", before {_fmt(row.get(f'before_mem_mb_T{t}'), '.1f')})" if f"before_mem_mb_T{t}" in row else ")")
                for t in mem_T))

    args.out.parent.mkdir(parents=True, exist_ok=True)
    result = {
        "config": {"B": B, "H": H, "T": T, "long_T": args.long_T, "D": D, "dtype": "float32", "rounds": args.rounds,
                   "memory_T": mem_T, "threads": torch.get_num_threads(), "torch": torch.__version__,
                   "load_average_at_start": load[0], "cpus": os.cpu_count()},
        "method": {"time": "fwd+bwd wall-clock in interleaved rounds (op, SDPA, op, SDPA, ...); median_ratio_vs_sdpa "
                           "is the median of the per-round ratios, ratio_vs_sdpa the fastest op round over the "
                           "fastest SDPA round; [fallback] rows run with the compiled kernels off",
                   "memory": "fresh subprocess per (op, T): VmHWM - VmRSS after resetting the peak via "
                             "/proc/self/clear_refs, over one fwd+bwd beyond the inputs"},
        "rows": rows,
        "long_context": {"T": args.long_T, "rows": long_rows},
        "gqa_memory": gqa,
    }
    args.out.write_text(json.dumps(result, indent=2))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
