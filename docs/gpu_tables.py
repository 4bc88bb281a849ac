"""The GPU results tables (docs/result_tables.py registers them), from benchmarks/gpu.py's JSON: speed
against SDPA's flash backend, errors against float64, and whole models per mechanism; and the decode
speed table of benchmarks/decode_speed.py (CPU or GPU)."""

from __future__ import annotations

from table_format import _ratio, _sci, _table, _tokens  # docs/table_format.py

Json = dict


def _earlier(r: Json) -> str:
    return " †" if "from" in r else ""


def gpu_speed_table(res: Json) -> str:
    """Forward + backward (and forward alone where timed) per path and T, its ratio to flash in the
    same run, peak memory and the bf16 errors; rows carried from an earlier run are marked †."""
    rows = []
    for r in sorted(res["rows"], key=lambda r: (r["T"], r["path"] != "sdpa-flash", "from" in r, r["path"])):
        ms = f"{r['ms']:.1f}" if r.get("ms") is not None else f"failed: {r.get('error', '')[:40]}"
        fwd = f"{r['fwd_ms']:.1f}" if r.get("fwd_ms") is not None else ""
        ratio = f"{_ratio(r['ratio_to_flash'])}×" if r.get("ratio_to_flash") is not None else ""
        peak = f"{r['peak_bytes'] / 2**20:,.0f}" if r.get("peak_bytes") is not None else ""
        err = (f"{_sci(r['rel_err'])} / {_sci(r['rel_err_grad'])}" if r.get("rel_err") is not None else "")
        rows.append([_tokens(r["T"]), r["path"] + _earlier(r), ms, fwd, ratio, peak, err])
    return _table(["T", "path", "fwd + bwd (ms)", "fwd (ms)", "÷ flash", "peak (MiB)", "bf16 error out / grad"],
                  "llrrrrr", rows)


def gpu_errors_table(res: Json) -> str:
    """Relative RMS error of the output and of the worst gradient against float64 on the same inputs."""
    by_path: dict[str, dict[str, Json]] = {}
    for e in res.get("errors", []):
        by_path.setdefault(e["path"], {})[e["dtype"]] = e

    def cell(e: Json | None) -> str:
        if e is None or e.get("rel_err") is None:
            return "" if e is None else f"failed: {str(e.get('worst'))[:40]}"
        return f"{_sci(e['rel_err'])} / {_sci(e['rel_err_grad'])} ({e['worst']})"

    rows = [[p + _earlier(next(iter(d.values()))), cell(d.get("float32")), cell(d.get("bfloat16"))]
            for p, d in by_path.items()]
    return _table(["path", "float32: out / worst grad", "bf16: out / worst grad"], "lll", rows)


def gpu_models_table(res: Json) -> str:
    """A two-layer model of each mechanism on CUDA under bf16 autocast: forward + backward per step."""
    rows = []
    for m in sorted(res.get("models", []), key=lambda m: m.get("ms") or 1e9):
        if m.get("ms") is None:
            rows.append([m["model"] + _earlier(m), f"failed: {m.get('error', '')[:60]}", ""])
        else:
            rows.append([m["model"] + _earlier(m), f"{m['ms']:.1f}", f"{m['tokens_per_s']:,}"])
    return _table(["mechanism", "ms per step", "tokens/s"], "lrr", rows)


DECODE_METHODS = ("exact", "exact_static", "exact_compiled", "window", "window_static", "window_compiled",
                  "window_ops_static", "window_ops_compiled", "learned", "learned_static", "learned_compiled", "hf_static")
DECODE_HEADS = ("exact (growing caches)", "exact, static", "exact, compiled", "window (sorted cache)",
                "window, static", "window, compiled", "window by PyTorch ops, static", "window by PyTorch ops, compiled",
                "learned (caches)", "learned, static", "learned, compiled", "HF static cache")


def decode_speed_table(res: dict) -> str:
    """benchmarks/decode_speed.py: the median decode step (ms) of each method per model, batch and
    context, with the window's speedup over exact decoding (each decoded the same way: the caches
    eagerly, static and compiled) and attnlab's compiled exact step against transformers'
    static-cache generate (a ratio above 1: attnlab is slower). Where the rows carry the memory-bandwidth
    floor (`x_floor`: the step's time over the time its bytes take at the device's bandwidth), the
    compiled exact and window steps' multiples of it stand beside them."""
    cells: dict = {}
    floors: dict = {}
    for r in res["rows"]:
        cells.setdefault((r["model"], r["batch"], r["context"]), {})[r["method"]] = r.get("step_ms")
        if r.get("x_floor") is not None:
            floors.setdefault((r["model"], r["batch"], r["context"]), {})[r["method"]] = r["x_floor"]
    floored = [m for m in ("exact_compiled", "window_compiled") if any(m in by for by in floors.values())]
    shown = [m for m in DECODE_METHODS if any(m in by for by in cells.values())]

    def ratio(by, a, b, fmt):
        return fmt.format(by[a] / by[b]) if by.get(a) and by.get(b) else "—"

    rows = []
    for (model, batch, ctx), by in sorted(cells.items(), key=lambda kv: kv[0]):
        ms = [f"{by[m]:.2f}" if by.get(m) is not None else "—" for m in shown]
        fl = floors.get((model, batch, ctx), {})
        rows.append([model, str(batch), f"{ctx:,}", *ms, ratio(by, "exact", "window", "{:.1f}×"),
                     ratio(by, "exact_compiled", "window_compiled", "{:.1f}×"),
                     ratio(by, "exact_compiled", "hf_static", "{:.2f}"),
                     *(f"{fl[m]:.1f}×" if m in fl else "—" for m in floored)])
    header = ["model", "batch", "context", *(DECODE_HEADS[DECODE_METHODS.index(m)] for m in shown),
              "window speedup (caches)", "window speedup (compiled)", "compiled / HF",
              *(f"{DECODE_HEADS[DECODE_METHODS.index(m)]}: × floor" for m in floored)]
    return _table(header, "lrr" + "r" * (len(shown) + 3 + len(floored)), rows)
