"""Approximate causal scalar attention against the exact fused path and torch SDPA: forward +
backward time, peak memory, and the error of outputs and gradients, over sequence length.

Keys (and queries) are synthetic in two regimes: "spread", qs, ks ~ U[-3, 3] sqrt(T) (a fixed
density of keys per unit of the scalar axis, so each query has a bounded number of neighbours and
the sorted runs stay narrow), and "clustered", qs, ks ~ N(0, 0.1^2) (every key within reach of
every query: the approximate op detects this and runs the exact fused path). tau = 1 per head.
"exact" is `scalar_attention(impl="fast")` (one fused SDPA call on augmented vectors); "sdpa" is
plain causal `F.scaled_dot_product_attention` with head dimension D for q, k and v (GQA with G
key/value heads), the dot-product baseline of the same shapes.

Timing: medians of interleaved rounds (benchmarks/_interleaved.py), ratios within each round.
Memory: each (case, T, keys) in a fresh subprocess: VmHWM - VmRSS around one forward + backward
after resetting the peak counter (Linux). Errors: relative RMS against the exact formula computed
in float64 (the fused path on float64 inputs), on the output and the gradients of qs, ks, v and
tau, for the approximate op and for the float32 exact fused path. At lengths where the exact
paths are not timed (--approx-only-T), only the approximate op runs, and its output error is
measured on --check-rows random query rows against the naive formula in float64.

Results: benchmarks/results/scalar_approx.json and scalar_approx.png (time against T, log-log).
"""

from __future__ import annotations

import argparse
import json
import math
import subprocess
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _interleaved import interleaved, ratios  # noqa: E402

from attnlab.ops import approx_plan, scalar_attention, scalar_attention_approx  # noqa: E402
from attnlab.testing import rel_rms  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
CASES = ("approx", "exact", "sdpa")
KEYS = ("spread", "clustered")


def make_inputs(case: str, keys: str, B: int, H: int, G: int, T: int, D: int, dtype=torch.float32, seed: int = 0):
    """(fn, leaf inputs) of one case."""
    g = torch.Generator().manual_seed(seed)
    if case == "sdpa":
        q = torch.randn(B, H, T, D, generator=g)
        k = torch.randn(B, G, T, D, generator=g)
        v = torch.randn(B, G, T, D, generator=g)
        fn = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=G != H)  # noqa: E731
        return fn, [x.to(dtype).requires_grad_() for x in (q, k, v)]
    if keys == "spread":
        qs = (torch.rand(B, H, T, generator=g) * 2 - 1) * 3 * math.sqrt(T)
        ks = (torch.rand(B, H, T, generator=g) * 2 - 1) * 3 * math.sqrt(T)
    else:
        qs = torch.randn(B, H, T, generator=g) * 0.1
        ks = torch.randn(B, H, T, generator=g) * 0.1
    v = torch.randn(B, G, T, D, generator=g)
    tau = torch.ones(H)
    if case == "approx":
        fn = scalar_attention_approx
    else:
        fn = lambda qs, ks, v, tau: scalar_attention(qs, ks, v, tau, impl="fast")  # noqa: E731
    return fn, [x.to(dtype).requires_grad_() for x in (qs, ks, v, tau)]


def fwd_bwd(fn, inputs) -> None:
    out = fn(*inputs)
    out.backward(torch.ones_like(out))
    for x in inputs:
        x.grad = None


def errors(keys: str, B: int, H: int, G: int, T: int, D: int) -> dict:
    """Relative RMS error of the approximate op and of the float32 fused path against float64."""
    fn64, ref_in = make_inputs("exact", keys, B, H, G, T, D, torch.float64)
    ref = fn64(*ref_in)
    cot = torch.randn(ref.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    ref.backward(cot)
    out = {}
    for case in ("approx", "exact"):
        fn, inputs = make_inputs(case, keys, B, H, G, T, D)
        o = fn(*inputs)
        o.backward(cot.float())
        names = ("out", "qs", "ks", "v", "tau")
        got = [o, *(x.grad for x in inputs)]
        want = [ref, *(x.grad for x in ref_in)]
        out[case] = {n: rel_rms(a, b) for n, a, b in zip(names, got, want)}
    return out


def row_errors(keys: str, B: int, H: int, G: int, T: int, D: int, rows: int) -> dict:
    """Output error of the approximate op on `rows` random queries, against the naive formula in float64."""
    fn, inputs = make_inputs("approx", keys, B, H, G, T, D)
    with torch.no_grad():
        o = fn(*inputs)
        qs, ks, v, tau = (x.detach().double() for x in inputs)
        t = torch.randperm(T, generator=torch.Generator().manual_seed(2))[:rows]
        w = torch.softmax((-(qs[..., t, None] - ks[..., None, :]) ** 2 / tau[:, None, None]).masked_fill(
            torch.arange(T) > t[:, None], float("-inf")), dim=-1)  # (B, H, rows, T)
        ref = w.view(B, G, (H // G) * rows, T) @ v  # (B, G, H/G * rows, D)
        ref = ref.view(B, H, rows, D)
    return {"out_rows": rel_rms(o[:, :, t], ref), "rows": rows}


def _status_kb(field: str) -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise RuntimeError(f"{field} not in /proc/self/status")


def memory_child(case, keys, B, H, G, T, D) -> None:
    fwd_bwd(*make_inputs(case, keys, B, H, G, 256, D))  # lazy initialisation outside the measurement
    fn, inputs = make_inputs(case, keys, B, H, G, T, D)
    Path("/proc/self/clear_refs").write_text("5")
    base = _status_kb("VmRSS")
    fwd_bwd(fn, inputs)
    print(json.dumps({"peak_mb": (_status_kb("VmHWM") - base) / 1024}))


def measure_memory(case, keys, B, H, G, T, D) -> float | None:
    cmd = [sys.executable, __file__, "--memory-child", case, keys, "--B", str(B), "--H", str(H), "--G", str(G),
           "--T", str(T), "--D", str(D), "--threads", str(torch.get_num_threads())]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode != 0:
        return None
    return json.loads(proc.stdout.strip().splitlines()[-1])["peak_mb"]


def crossover(rows: list[dict]) -> float | None:
    """The T at which the approximate op's median time meets the exact path's on spread keys,
    interpolated on log-log axes between the measured lengths; None if it never gets faster."""
    pts = [(r["T"], r["time"]["approx"]["median_s"] / r["time"]["exact"]["median_s"])
           for r in rows if r["keys"] == "spread" and "exact" in r["time"]]
    for (t0, r0), (t1, r1) in zip(pts, pts[1:]):
        if r0 >= 1 > r1:
            f = math.log(r0) / (math.log(r0) - math.log(r1))
            return math.exp(math.log(t0) + f * (math.log(t1) - math.log(t0)))
    return pts[0][0] if pts and pts[0][1] < 1 else None


def plot(rows: list[dict], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.5, 4.5))
    styles = {("approx", "spread"): "o-", ("approx", "clustered"): "s--", ("exact", "spread"): "^-",
              ("exact", "clustered"): "v--", ("sdpa", "spread"): "x:"}
    for (case, keys), style in styles.items():
        pts = sorted((r["T"], r["time"][case]["median_s"]) for r in rows if r["keys"] == keys and case in r["time"])
        if pts:
            label = f"{case} ({keys} keys)" if case != "sdpa" else "SDPA (D=64)"
            ax.plot(*zip(*pts), style, label=label)
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("sequence length T")
    ax.set_ylabel("forward + backward, median seconds")
    ax.set_title("Causal scalar attention: approximate vs exact")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--B", type=int, default=1)
    p.add_argument("--H", type=int, default=4)
    p.add_argument("--G", type=int, default=2, help="value groups (scalar op) / key-value heads (SDPA)")
    p.add_argument("--D", type=int, default=64)
    p.add_argument("--T", type=int, nargs="*", default=[256, 1024, 4096, 16384])
    p.add_argument("--approx-only-T", type=int, nargs="*", default=[65536])
    p.add_argument("--rounds", type=int, default=5, help="interleaved rounds (3 at T >= 16384)")
    p.add_argument("--check-rows", type=int, default=256)
    p.add_argument("--error-max-T", type=int, default=16384, help="longest T of the float64 error reference")
    p.add_argument("--no-memory", action="store_true")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", type=Path, default=RESULTS)
    p.add_argument("--memory-child", nargs=2, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    torch.set_num_threads(a.threads)
    if a.memory_child:
        memory_child(*a.memory_child, a.B, a.H, a.G, a.T[0], a.D)
        return
    shape = dict(B=a.B, H=a.H, G=a.G, D=a.D)
    jobs = [(T, keys, True) for T in a.T for keys in KEYS] + [(T, "spread", False) for T in a.approx_only_T]
    rows = []
    for T, keys, full in tqdm(jobs, desc="scalar_approx"):
        cases = (CASES if keys == "spread" else CASES[:2]) if full else CASES[:1]
        made = {c: make_inputs(c, keys, T=T, **shape) for c in cases}
        fns = {c: (lambda fn=fn, x=x: fwd_bwd(fn, x)) for c, (fn, x) in made.items()}
        rounds = (a.rounds if T < 16384 else 3) if full else 1
        times = interleaved(fns, rounds=rounds, warmup=1 if T < 16384 else 0)
        fn_a, x_a = made["approx"]
        plan = approx_plan(x_a[0].detach(), x_a[1].detach(), x_a[3].detach())
        row = {"T": T, "keys": keys, "window": plan["window"], "max_window": plan["max_window"],
               "route": "sorted runs" if plan["window"] <= plan["max_window"] else "exact fused",
               "time": ratios(times, "exact") if full else {c: {"median_s": min(ts)} for c, ts in times.items()}}
        if "sdpa" in times:
            row["approx_over_sdpa_median_ratio"] = ratios(times, "sdpa")["approx"]["median_ratio"]
        del made, fns
        if full and T <= a.error_max_T:
            row["error"] = errors(keys, T=T, **shape)
        elif a.check_rows:
            row["error"] = {"approx": row_errors(keys, T=T, rows=a.check_rows, **shape)}
        if not a.no_memory:
            row["peak_mb"] = {c: measure_memory(c, keys, a.B, a.H, a.G, T, a.D) for c in cases}
        rows.append(row)
        tqdm.write(_line(row))
    result = {"config": {**shape, "threads": a.threads, "tau": 1.0, "tol": 1e-4, "dtype": "float32",
                         "rounds": a.rounds, "device": "cpu", "torch": torch.__version__},
              "rows": rows, "crossover_T_spread": crossover(rows)}
    a.out.mkdir(parents=True, exist_ok=True)
    (a.out / "scalar_approx.json").write_text(json.dumps(result, indent=1))
    plot(rows, a.out / "scalar_approx.png")
    print(f"crossover (spread keys, approx = exact): T ~ {result['crossover_T_spread']}")


def _line(r: dict) -> str:
    t = r["time"]
    parts = [f"T={r['T']:>6} {r['keys']:<9} W={r['window']:>5} ({r['route']})",
             f"approx {1e3 * t['approx']['median_s']:9.1f} ms"]
    for c in ("exact", "sdpa"):
        if c in t:
            ratio = t["approx"]["median_s"] / t[c]["median_s"]
            parts.append(f"{c} {1e3 * t[c]['median_s']:9.1f} ms (approx/{c} {ratio:.3f})")
    if "error" in r:
        errs = {k: {n: float(f"{e:.2e}") for n, e in v.items()} for k, v in r["error"].items()}
        parts.append("err " + json.dumps(errs))
    if "peak_mb" in r:
        parts.append("peak MB " + json.dumps({c: None if m is None else round(m, 1) for c, m in r["peak_mb"].items()}))
    return " | ".join(parts)


if __name__ == "__main__":
    main()
