"""The GPU check: one command on one GPU that tests, checks and times attnlab's GPU paths.

    python benchmarks/gpu.py --out benchmarks/results/gpu.json

1. `pytest -m cuda` (the tests that need a GPU; the CPU suite skips them).
2. Errors: every path of `benchmarks/gpu_paths.py` against its naive op in float64 on the same inputs
   (rounded to the run's dtype first, so the error is the path's and not the inputs'), in float32 and
   bf16, at T = --err-T: relative RMS of the output and of the worst gradient.
3. Speed: forward + backward in bf16 at B = 4, H = 16, D = 64 and each T of --T, every path and SDPA's
   flash backend timed in interleaved rounds in the same run (medians of device-event timings), with
   the peak memory above the inputs.
4. Models: a two-layer model of each mechanism, forward + backward under bf16 autocast on CUDA,
   tokens per second (or the error it raised).

Writes the JSON after each part (a run stopped early keeps what it measured): top-level device, torch,
triton and `rows`, one per (path, dtype, T) with path, dtype, T, ms, ratio_to_flash, peak_bytes,
rel_err, rel_err_grad (errors measured at err_T). `python docs/result_tables.py gpu` renders it.
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from gpu_paths import PATHS, as_reference, fwd_bwd, make, rel_err  # noqa: E402
from gpu_tests import run_cuda_tests  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def save(path: Path, doc: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    tmp.replace(path)


def errors(name: str, dtype: torch.dtype, T: int, device, H: int = 4, D: int = 64) -> tuple[float, float, str]:
    """(output error, worst gradient error, its name) of path `name` in `dtype` against its naive op in
    float64 on the same inputs and output gradient (both rounded to `dtype` first)."""
    t = make(name, 1, H, T, D, dtype, device, seed=T)
    dout = torch.randn(1, H, T, D, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    ref, ref_g, _ = fwd_bwd(name, "naive", as_reference(t), dout.double())
    out, got, _ = fwd_bwd(name, "fast", t, dout)
    worst = max(ref_g, key=lambda n: rel_err(got[n], ref_g[n]))
    return rel_err(out, ref), rel_err(got[worst], ref_g[worst]), worst


def timed(fn, reps: int) -> list[float]:
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return times


def speed(names, T: int, device, rounds: int, reps: int, budget_s: float, backward: bool = True) -> dict:
    """name -> (median ms, peak bytes above the inputs) of forward + backward (or the forward alone) in
    bf16, interleaved rounds; a path slower than 200 ms a step gets 2 repetitions a round."""
    B, H, D = 4, 16, 64
    steps, peaks, times = {}, {}, {n: [] for n in names}
    for name in names:
        t = make(name, B, H, T, D, torch.bfloat16, device)
        dout = torch.randn(B, H, T, D, device=device, dtype=torch.bfloat16)
        leaves = [x for x in t.values() if x.requires_grad]

        def step(name=name, t=t, dout=dout, leaves=leaves):
            if not backward:
                with torch.no_grad():
                    return PATHS[name][0]("fast", t)
            out = PATHS[name][0]("fast", t)
            torch.autograd.grad(out, leaves, dout)

        try:
            torch.cuda.synchronize()
            t0 = time.time()
            step()  # compile / warm up
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            base = torch.cuda.memory_allocated()
            step()
            torch.cuda.synchronize()
            peaks[name] = torch.cuda.max_memory_allocated() - base
            if time.time() - t0 > budget_s:
                raise TimeoutError(f"one step took {time.time() - t0:.1f} s")
            steps[name] = (step, 2 if time.time() - t0 > 0.4 else reps)
        except Exception as e:  # noqa: BLE001 - the row records what failed
            print(f"  {name} T={T}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            times[name] = repr(e)[:300]
    for _ in range(rounds):  # interleaved rounds: drift hits every path alike
        for name, (step, n) in steps.items():
            times[name] += timed(step, n)
    return {n: (statistics.median(v) if isinstance(v, list) and v else v, peaks.get(n)) for n, v in times.items()}


FWD_TILES = [(128, 64, 8, 3), (128, 64, 4, 3), (64, 64, 4, 3), (128, 128, 8, 3), (64, 32, 4, 4)]
BWD_TILES = [(64, 64, 8, 2), (64, 64, 4, 2), (32, 64, 4, 2), (64, 32, 4, 3), (32, 32, 4, 3)]


def tune(doc: dict, device, T: int) -> None:
    """Time the Triton kernel's tile choices (forward, then backward with the best forward) on the
    hybrid Cauchy path at T, keep the fastest for the rest of the run, and re-check its errors."""
    from attnlab.ops.scalar import triton_op as scalar_triton

    name = "hybrid-cauchy/triton"
    res = {}
    for part, tiles in (("fwd", FWD_TILES), ("bwd", BWD_TILES)):
        for tile in tiles:  # the forward's tiles timed on the forward alone
            scalar_triton.BLOCKS[part] = tile
            ms = speed([name], T, device, rounds=1, reps=5, budget_s=20.0, backward=part == "bwd")[name][0]
            res[part, tile] = ms
            print(f"  tune {part} {tile}: {ms if isinstance(ms, str) else round(ms, 3)}", flush=True)
        ok = {t: ms for (p, t), ms in res.items() if p == part and isinstance(ms, float)}
        scalar_triton.BLOCKS[part] = min(ok, key=ok.get) if ok else scalar_triton._blocks(device, 64, 64)[part]
    doc["tuning"] = {"path": name, "T": T, "chosen": {k: list(v) for k, v in scalar_triton.BLOCKS.items()},
                     "ms": [{"kernel": p, "tiles": list(t), "ms": ms, "what": "forward" if p == "fwd" else
                             "forward + backward"} for (p, t), ms in res.items()]}
    dots = {}
    for flag in (False, True, False):  # scalar heads with and without the dot-product kernel's layout
        scalar_triton.SCALAR_DOT = flag
        ms = speed(["scalar-gaussian/triton"], T, device, rounds=1, reps=5, budget_s=20.0)["scalar-gaussian/triton"][0]
        dots.setdefault(str(flag), []).append(ms)
    scalar_triton.SCALAR_DOT = False
    doc["tuning"]["scalar_dot_ms"] = dots
    print(f"  scalar heads via the dot kernel: {dots}", flush=True)
    for check in ("hybrid-cauchy/triton", "hybrid-gaussian/triton", "scalar-cauchy/triton"):
        e, eg, worst = errors(check, torch.bfloat16, 1000, device)
        doc["tuning"].setdefault("errors_bf16", []).append({"path": check, "rel_err": e, "rel_err_grad": eg})
        print(f"  tuned {check}: out {e:.2e} grad {eg:.2e}", flush=True)
        if not (e < 2e-2 and eg < 2e-2):  # a tiling that computes wrong is no candidate
            scalar_triton.BLOCKS.clear()
            doc["tuning"]["reverted"] = f"{check}: errors {e:.2e} / {eg:.2e} with the chosen tiles"
            break


def models(doc: dict, device, deadline: float, only: set) -> None:
    from attnlab.models.config import ModelConfig
    from attnlab.models.lm import LM
    from attnlab.layers.mechanisms import REGISTRY

    out = doc.setdefault("models", [])
    settings = {name: {} for name in sorted(REGISTRY)}
    settings["hybrid (configs/windowed.toml)"] = dict(attn="hybrid", attention=dict(
        train_window=16, local_window=32, kernel="cauchy"))
    for label, kw in settings.items():
        if only and label.split(" ")[0] not in only:
            continue
        if time.time() > deadline:
            out.append({"model": label, "error": "skipped: out of time"})
            continue
        kw = dict(kw) or dict(attn=label)
        cfg = ModelConfig(vocab_size=256, d_model=512, n_layers=2, n_heads=8, max_seq_len=1024, **kw)
        row = {"model": label, "d_model": 512, "n_layers": 2, "n_heads": 8, "T": 1024, "B": 8}
        try:
            model = LM(cfg).to(device)
            idx = torch.randint(0, 256, (8, 1025), device=device)

            def step():
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    _, loss = model(idx[:, :-1], targets=idx[:, 1:])
                loss.backward()

            step()
            torch.cuda.synchronize()
            ms = statistics.median(timed(step, 5))
            row.update(ms=round(ms, 3), tokens_per_s=round(8 * 1024 / ms * 1e3))
        except Exception as e:  # noqa: BLE001
            row["error"] = f"{type(e).__name__}: {str(e)[:300]}"
        print(f"  model {label}: {row.get('ms', row.get('error'))}", flush=True)
        out.append(row)


def train(doc: dict, deadline: float) -> None:
    """`attnlab train` on CUDA in bf16: the quickstart's softmax model and configs/windowed.toml, 60
    steps each; the tail of its output and its summary (or how it failed)."""
    import tempfile

    out = doc.setdefault("train", [])
    for cfg in ("configs/quickstart.toml", "configs/windowed.toml"):
        if time.time() > deadline:
            out.append({"config": cfg, "error": "skipped: out of time"})
            continue
        run_dir = Path(tempfile.mkdtemp()) / "run"
        cmd = [sys.executable, "-m", "attnlab", "train", cfg, "run.device=cuda", "train.dtype=bfloat16",
               "train.steps=60", "train.eval_every=60", "--run-dir", str(run_dir)]
        t0 = time.time()
        try:
            p = subprocess.run(cmd, cwd=HERE.parent, capture_output=True, text=True, timeout=90,
                               env={**os.environ, "PYTHONPATH": os.pathsep.join(
                               [str(HERE.parent / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])})
            row = {"config": cfg, "returncode": p.returncode, "seconds": round(time.time() - t0, 1),
                   "tail": (p.stdout + p.stderr)[-1500:]}
            summary = run_dir / "summary.json"
            if summary.exists():
                row["summary"] = json.loads(summary.read_text())
        except subprocess.TimeoutExpired:
            row = {"config": cfg, "error": "timed out after 90 s"}
        print(f"  train {cfg}: {row.get('returncode', row.get('error'))} in {row.get('seconds')} s", flush=True)
        out.append(row)


def keep(doc: dict, old: dict) -> dict:
    """Carry over an earlier run's rows, errors and models for what this run did not measure, each
    marked with the earlier command (its ratios are to that run's flash timing)."""
    have = {(r["path"], r["T"]) for r in doc["rows"]}
    erred = {(e["path"], e["dtype"]) for e in doc.get("errors", [])}
    mark = {"from": old.get("command", "an earlier run")}
    doc["rows"] += [{**r, **mark} for r in old.get("rows", []) if (r["path"], r["T"]) not in have]
    doc.setdefault("errors", []).extend({**e, **mark} for e in old.get("errors", []) if (e["path"], e["dtype"]) not in erred)
    ran = {m["model"] for m in doc.get("models", [])}
    doc.setdefault("models", []).extend({**m, **mark} for m in old.get("models", []) if m["model"] not in ran)
    if "cuda_tests" not in doc and "cuda_tests" in old:  # the check's first part, kept by its later parts
        doc["cuda_tests"] = old["cuda_tests"]
    return doc


def error_rows(doc: dict, errs: dict, names, T: int, dev, deadline: float, flush) -> None:
    """Each path's errors in float32 and bf16 (written after each path); none started in the last
    quarter of the run's time, which the timings need."""
    for name in names:
        if time.time() > deadline - 0.25 * (deadline - doc["_start"]):
            print(f"  err {name}: skipped (out of time)", flush=True)
            doc.setdefault("skipped", []).append(f"errors {name}")
            continue
        for dn, dt in DTYPES.items():
            try:
                errs[name, dn] = errors(name, dt, T, dev)
                print(f"  err {name} {dn}: out {errs[name, dn][0]:.2e} grad {errs[name, dn][1]:.2e} "
                      f"({errs[name, dn][2]})", flush=True)
            except Exception as ex:  # noqa: BLE001
                errs[name, dn] = (None, None, f"{type(ex).__name__}: {str(ex)[:200]}")
                print(f"  err {name} {dn}: {errs[name, dn][2]}", flush=True)
            torch.cuda.empty_cache()
        doc["errors"] = [{"path": n, "dtype": d, "T": T, "rel_err": v[0], "rel_err_grad": v[1], "worst": v[2]}
                         for (n, d), v in errs.items()]
        flush()


def speed_rows(doc: dict, errs: dict, names, lengths, a, dev, deadline: float, flush) -> None:
    for T in lengths:
        if time.time() > deadline - 60:
            print(f"speed T={T}: skipped (out of time)", flush=True)
            doc.setdefault("skipped", []).append(f"speed T={T}")
            break
        todo = [n for n in names if PATHS[n][2] is None or T <= PATHS[n][2]]
        res = speed(todo, T, dev, a.rounds, a.reps, budget_s=20.0)
        fwd_only = speed([n for n in todo if n == "sdpa-flash" or n.endswith("/triton")], T, dev, a.rounds,
                         a.reps, budget_s=20.0, backward=False)
        flash = res.get("sdpa-flash", (None,))[0]
        for name, (ms, peak) in res.items():
            e = errs.get((name, "bfloat16"), (None, None, None))
            ok = isinstance(ms, float)
            row = {"path": name, "dtype": "bfloat16", "T": T, "ms": ms if ok else None,
                   "ratio_to_flash": ms / flash if ok and isinstance(flash, float) else None,
                   "peak_bytes": peak, "rel_err": e[0], "rel_err_grad": e[1], "err_T": a.err_T}
            if not ok:
                row["error"] = ms
            if name in fwd_only and isinstance(fwd_only[name][0], float):
                row["fwd_ms"] = fwd_only[name][0]
            doc["rows"].append(row)
            print(f"  T={T} {name}: " + (f"{ms:.3f} ms, x{row['ratio_to_flash'] or 0:.3f}, fwd {row.get('fwd_ms')}, "
                                         f"peak {(peak or 0) / 2**20:.0f} MiB" if ok else str(ms)), flush=True)
        flush()
        torch.cuda.empty_cache()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "results" / "gpu.json"))
    ap.add_argument("--T", default="2048,8192,32768", help="sequence lengths timed")
    ap.add_argument("--err-T", type=int, default=2048, help="sequence length of the float64 comparisons")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--paths", default=",".join(PATHS))
    ap.add_argument("--minutes", type=float, default=7.0, help="stop starting new work after this long")
    ap.add_argument("--tests-minutes", type=float, default=2.5, help="time given to the cuda tests (part of --minutes)")
    ap.add_argument("--skip", default="", help="parts to skip: tests,errors,tune,speed,models,train")
    ap.add_argument("--models", default="", help="mechanisms of the models part (default: every one)")
    ap.add_argument("--keep-from", default="", help="an earlier gpu.json whose rows of paths not run now are kept "
                    "(marked with its command), and its models where not run now")
    a = ap.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA GPU")
    import triton

    start = time.time()
    deadline = start + 60 * a.minutes
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    names = [n for n in a.paths.split(",") if n]
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
           "command": "python benchmarks/gpu.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "shape": {"B": 4, "H": 16, "D": 64, "dtype": "bfloat16", "what": "forward + backward"},
           "err_T": a.err_T, "rows": [], "_start": start}
    old = json.loads(Path(a.keep_from).read_text()) if a.keep_from else None

    def flush() -> None:  # what is measured so far, the earlier run's rows beside it: a cut run keeps both
        now = {k: v for k, v in doc.items() if k != "_start"}
        save(out, keep(copy.deepcopy(now), old) if old else now)

    skip = set(a.skip.split(","))
    errs: dict = {}
    parts = {
        "tests": lambda: run_cuda_tests(doc, timeout=60 * a.tests_minutes, log=out.with_suffix(".tests.log")),
        "errors": lambda: error_rows(doc, errs, names, a.err_T, dev, deadline, flush),
        "tune": lambda: tune(doc, dev, 8192),
        "speed": lambda: speed_rows(doc, errs, names, [int(x) for x in a.T.split(",")], a, dev, deadline, flush),
        "models": lambda: models(doc, dev, deadline, {m for m in a.models.split(",") if m}),
        "train": lambda: train(doc, deadline),
    }
    for part, fn in parts.items():
        if part in skip:
            continue
        if part in ("models", "train") and time.time() > deadline - 30:
            doc.setdefault("skipped", []).append(part)
            continue
        try:
            fn()
        except Exception as e:  # noqa: BLE001 - a part that fails is recorded; the others still run
            import traceback

            doc.setdefault("failures", {})[part] = traceback.format_exc()[-2000:]
            print(f"part {part} failed: {type(e).__name__}: {e}", flush=True)
        flush()
        torch.cuda.empty_cache()
    doc["seconds"] = round(time.time() - start, 1)
    flush()
    print(f"wrote {out} in {doc['seconds']} s")


if __name__ == "__main__":
    main()
