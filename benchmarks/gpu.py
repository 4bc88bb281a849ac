"""The GPU check's kernel table: attnlab's attention paths on one GPU, against SDPA's flash backend.

    python benchmarks/gpu.py --out benchmarks/results/gpu.json --parts speed,errors

Parts (--parts, in the order given):
- speed: forward + backward in bf16 at B = 4, H = 16, D = 64 and each T of --T, one row per path, each
  path timed against SDPA's flash backend in interleaved rounds in the same process (medians of
  device-event timings; ratio_to_flash the median of the rounds' ratios), the forward alone for the
  Triton kernels, the peak memory above the inputs. flash-linear-attention's paths (`*/fla`) take the
  first of their autotuning configs that runs (--fla-autotune first-fit; tests/triton_first_fit.py):
  fully tuned, one GLA step took 249.7 s on an H100;
- errors: every path of `benchmarks/gpu_paths.py` against its naive op in float64 on the same inputs
  (rounded to the run's dtype first, so the error is the path's and not the inputs'), in float32 and
  bf16, at T = --err-T: relative RMS of the output and of the worst gradient;
- tune: the Triton kernel's tile choices at 8K, timed;
- models: a two-layer model of each mechanism, forward + backward under bf16 autocast;
- train: `attnlab train` on CUDA, 60 steps of two configs.

Rows are written as they come (benchmarks/gpu_rows.py), each under --row-cap seconds (the GPU check kills
a row past it), none started after --seconds; run again on the same --out, a part measures only the
rows the file lacks. Top-level device, torch, triton, `rows` (path, dtype, T, ms, flash_ms,
ratio_to_flash, fwd_ms, peak_bytes, and rel_err, rel_err_grad once the errors part has measured the
path) and `errors` (path, dtype, T, rel_err, rel_err_grad, worst). `python docs/result_tables.py gpu`
renders it. --smoke runs the speed and errors parts on the CPU at tiny sizes (Triton in its interpreter).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

if "--smoke" in sys.argv[1:]:  # the CPU smoke mode runs Triton's interpreter, chosen before Triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import torch  # noqa: E402

T0 = time.time()  # --seconds count from here when run as a script (its imports included)
HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "src"))

from _interleaved import command  # noqa: E402
from gpu_paths import PATHS, as_reference, fwd_bwd, make, rel_err  # noqa: E402
from gpu_rows import RowFile, save  # noqa: E402

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def errors(name: str, dtype: torch.dtype, T: int, device, H: int = 4, D: int = 64) -> tuple[float, float, str]:
    """(output error, worst gradient error, its name) of path `name` in `dtype` against its naive op in
    float64 on the same inputs and output gradient (both rounded to `dtype` first)."""
    t = make(name, 1, H, T, D, dtype, device, seed=T)
    dout = torch.randn(1, H, T, D, generator=torch.Generator().manual_seed(1)).to(dtype).to(device)
    ref, ref_g, _ = fwd_bwd(name, "naive", as_reference(t), dout.double())
    out, got, _ = fwd_bwd(name, "fast", t, dout)
    worst = max(ref_g, key=lambda n: rel_err(got[n], ref_g[n]))
    return rel_err(out, ref), rel_err(got[worst], ref_g[worst]), worst


def timed(fn, reps: int, device=None) -> list[float]:
    """Milliseconds of each of `reps` calls: device events on CUDA, the wall clock elsewhere."""
    times = []
    for _ in range(reps):
        if device is not None and device.type != "cuda":
            t = time.perf_counter()
            fn()
            times.append(1e3 * (time.perf_counter() - t))
            continue
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    return times


def _step(name: str, shape, T: int, dtype, device, backward: bool = True):
    """One forward (+ backward) of path `name` on inputs of (B, H, T, D) = shape."""
    B, H, D = shape
    t = make(name, B, H, T, D, dtype, device)
    dout = torch.randn(B, H, T, D, device=device, dtype=dtype)
    leaves = [x for x in t.values() if x.requires_grad]

    def step():
        if not backward:
            with torch.no_grad():
                return PATHS[name][0]("fast", t)
        torch.autograd.grad(PATHS[name][0]("fast", t), leaves, dout)
    return step


def speed_row(name: str, T: int, device, rounds: int, reps: int, shape=(4, 16, 64), dtype=torch.bfloat16) -> dict:
    """Forward + backward of path `name` and of SDPA's flash backend on inputs of the same shape, warmed up,
    then `rounds` interleaved rounds (drift hits both alike): ms and flash_ms the medians of the rounds'
    medians, ratio_to_flash the median of the rounds' ratios; fwd_ms the forward alone (Triton kernels and
    flash); peak_bytes what a step holds above its inputs (CUDA). A step over 0.2 s gets 2 calls a round."""
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    names = list(dict.fromkeys(["sdpa-flash", name]))
    steps = {n: _step(n, shape, T, dtype, device) for n in names}
    fwd = _step(name, shape, T, dtype, device, backward=False) if name.endswith("/triton") or name == "sdpa-flash" else None
    for s in [*steps.values(), *([fwd] if fwd else [])]:  # compile / warm up
        s()
    sync()
    peak = None
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        base = torch.cuda.memory_allocated()
    t0 = time.perf_counter()
    steps[name]()
    sync()
    n = 2 if time.perf_counter() - t0 > 0.2 else reps
    if device.type == "cuda":
        peak = torch.cuda.max_memory_allocated() - base
    times, ratios, fwd_ms = {k: [] for k in names}, [], []
    for _ in range(rounds):
        for k in names:
            times[k].append(statistics.median(timed(steps[k], n, device)))
        ratios.append(times[name][-1] / times["sdpa-flash"][-1])
        fwd_ms += timed(fwd, n, device) if fwd else []
    return {"path": name, "dtype": str(dtype).removeprefix("torch."), "T": T, "ms": statistics.median(times[name]),
            "flash_ms": statistics.median(times["sdpa-flash"]), "ratio_to_flash": statistics.median(ratios),
            "fwd_ms": statistics.median(fwd_ms) if fwd_ms else None, "peak_bytes": peak, "rounds": rounds,
            "calls_per_round": n}


def _tile_ms(name: str, T: int, device, backward: bool = True):
    """The tuning's measure: median ms of 5 calls after a warm-up in bf16 at B = 4, H = 16, D = 64 (or what failed)."""
    try:
        step = _step(name, (4, 16, 64), T, torch.bfloat16, device, backward)
        step()
        return statistics.median(timed(step, 5, device))
    except Exception as e:  # noqa: BLE001 - the tuning records what failed
        return repr(e)[:300]


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
            ms = _tile_ms(name, T, device, backward=part == "bwd")
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
        ms = _tile_ms("scalar-gaussian/triton", T, device)
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


def error_row(spec: dict, doc: dict, device, T: int, heads: int, dim: int) -> dict:
    """Path spec["path"]'s errors in spec["dtype"] at T, written into its speed rows of that dtype too."""
    e, eg, worst = errors(spec["path"], DTYPES[spec["dtype"]], T, device, H=heads, D=dim)
    if device.type == "cuda":
        torch.cuda.empty_cache()
    for r in doc["rows"]:
        if r["path"] == spec["path"] and r.get("dtype") == spec["dtype"]:
            r.update(rel_err=e, rel_err_grad=eg, err_T=T)
    return {"path": spec["path"], "dtype": spec["dtype"], "T": T, "rel_err": e, "rel_err_grad": eg, "worst": worst}


def _fla_pinned(name: str, how: str):
    """flash-linear-attention's autotuned kernels at their first config that runs, for `how` = first-fit."""
    import contextlib

    if how != "first-fit" or not name.endswith("/fla"):
        return contextlib.nullcontext()
    sys.path.insert(0, str(HERE.parent / "tests"))
    from triton_first_fit import first_fit

    return first_fit(("fla",))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "results" / "gpu.json"))
    ap.add_argument("--parts", default="speed,errors", help="in order, of speed,errors,tune,models,train")
    ap.add_argument("--T", default="2048,8192,32768", help="sequence lengths timed")
    ap.add_argument("--err-T", type=int, default=2048, help="sequence length of the float64 comparisons")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--paths", default=",".join(PATHS), help="in the order they are run")
    ap.add_argument("--err-paths", default=None, help="paths of the errors part (default: --paths)")
    ap.add_argument("--seconds", type=float, default=420.0, help="start no new row after this long")
    ap.add_argument("--row-cap", type=float, default=45.0, help="seconds a row may take, its compile included")
    ap.add_argument("--fla-autotune", choices=("first-fit", "full"), default="first-fit",
                    help="flash-linear-attention's autotuning in the speed rows")
    ap.add_argument("--models", default="", help="mechanisms of the models part (default: every one)")
    ap.add_argument("--keep-from", default="", help="an earlier gpu.json whose rows of paths not run now are kept "
                    "(marked with its command; measured again when a part reaches them), and its models")
    ap.add_argument("--smoke", action="store_true", help="speed and errors on the CPU at tiny sizes")
    a = ap.parse_args(argv)
    parts = [p for p in a.parts.split(",") if p]
    names = [n for n in a.paths.split(",") if n]
    bad = [p for p in parts if p not in ("speed", "errors", "tune", "models", "train")] + [n for n in names if n not in PATHS]
    if bad:
        raise SystemExit(f"--parts / --paths: unknown {bad}; parts are speed,errors,tune,models,train, paths {list(PATHS)}")
    if not a.smoke and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu.py needs a CUDA GPU (or --smoke)")
    import triton

    dev = torch.device("cpu" if a.smoke else "cuda")
    shape, dtypes = ((1, 2, 16), ["float32"]) if a.smoke else ((4, 16, 64), list(DTYPES))
    if a.smoke and set(parts) - {"speed", "errors"}:
        raise SystemExit("--smoke runs the speed and errors parts only")
    lengths = [int(x) for x in a.T.split(",")]
    rows = RowFile(a.out, {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu",
                           "torch": torch.__version__, "triton": triton.__version__,
                           "command": command("gpu.py", argv),
                           "shape": {"B": shape[0], "H": shape[1], "D": shape[2], "dtype": "float32" if a.smoke else
                                     "bfloat16", "what": "forward + backward"}, "err_T": a.err_T}, fields=("path", "T"))
    if a.keep_from:
        keep(rows.doc, json.loads(Path(a.keep_from).read_text()))
    start = T0 if argv is None else time.time()
    deadline = start + a.seconds - 2

    def speed_spec(spec: dict) -> dict:
        with _fla_pinned(spec["path"], a.fla_autotune):
            row = speed_row(spec["path"], spec["T"], dev, a.rounds, a.reps, shape, torch.float32 if a.smoke else
                            torch.bfloat16)
        if spec["path"].endswith("/fla"):
            row["autotune"] = a.fla_autotune
        if dev.type == "cuda":
            torch.cuda.empty_cache()
        return row

    for part in parts:
        print(f"part {part}", flush=True)
        if part == "speed":
            plan = [{"path": n, "T": T, "cap": a.row_cap} for T in lengths for n in names
                    if PATHS[n][2] is None or T <= PATHS[n][2]]
            rows.run(plan, speed_spec, deadline, show=_show)
        elif part == "errors":
            errs = rows.view(("path", "dtype"), "errors")
            plan = [{"path": n, "dtype": d, "cap": a.row_cap} for n in (a.err_paths or a.paths).split(",") if n
                    for d in dtypes]
            errs.run(plan, lambda spec: error_row(spec, errs.doc, dev, a.err_T, *((2, 16) if a.smoke else (4, 64))),
                     deadline, show=_show)
        elif part == "tune":
            tune(rows.doc, dev, 8192)
        elif part == "models":
            models(rows.doc, dev, deadline, {m for m in a.models.split(",") if m})
        elif part == "train":
            train(rows.doc, deadline)
        save(Path(a.out), rows.doc)
    print(f"wrote {a.out} in {time.time() - start:.1f} s")


def _show(label: str, row) -> None:
    if isinstance(row, str) or row.get("error"):
        print(f"  {label}: {row if isinstance(row, str) else row['error'][:300]}", flush=True)
    elif "ms" in row:
        print(f"  {label}: {row['ms']:.3f} ms, x{row['ratio_to_flash']:.3f} flash ({row['flash_ms']:.3f} ms), fwd "
              f"{row['fwd_ms']}, peak {(row['peak_bytes'] or 0) / 2**20:.0f} MiB, {row['seconds']} s", flush=True)
    else:
        print(f"  {label}: out {row['rel_err']:.2e} grad {row['rel_err_grad']:.2e} ({row['worst']})", flush=True)


if __name__ == "__main__":
    main()
