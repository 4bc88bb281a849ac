"""The tables of the results pages, made from the committed files they cite (docs/hooks.py).

A page asks for a table with a marker on a line of its own, naming the table and the committed
files it reads, in order:

    <!-- table: ops benchmarks/results/ops.json -->

`TABLES` maps each name to its generator and those files; the hook checks that the marker names
the same files, reads them and puts the generator's markdown in place of the marker. Every number
in a table comes from the files; what a generator adds is labels, the choice of rows and columns,
and the rounding.
"""

from __future__ import annotations

import math
from collections.abc import Callable

Json = dict

from table_format import _table, _f, _signed, _sig2, _ratio, _sci, _span, _tokens  # docs/table_format.py
from search_tables import coverage_table, middle6_table, search_decode_table, tasks_table  # docs/search_tables.py
from gpu_tables import decode_speed_table, gpu_errors_table, gpu_models_table, gpu_speed_table  # docs/gpu_tables.py


OPS_LABELS = {
    "sdpa": "SDPA (fused)",
    "sdpa_math": "SDPA math path (what a mask with grad gets)",
    "goat": "goat (R = 8)",
    "goat_hybrid": "goat_hybrid (R = 8)",
    "principled": "principled (fused C++ kernel)",
    "principled[fallback]": "principled [fallback]",
    "gla": "gla (chunked C++ kernel)",
    "gla[fallback]": "gla [fallback]",
}


def ops_table(ops: Json) -> str:
    """benchmarks/ops.py: forward + backward against SDPA at T = 2048, with the memory of one call.
    The softmax scalings share one row (their ranges)."""
    t_long = ops["config"]["long_T"]

    def mem(r: Json, t: int) -> str:
        mb = r.get(f"mem_mb_T{t}")
        if mb is not None:
            return f"{mb:.0f}"
        note = r.get(f"mem_note_T{t}", "not run")
        size = note[note.find("(") + 1:note.find(" per copy")] if "(" in note else ""
        return f"(not run: {size})" if size else "(not run)"

    def row(label: str, rs: list[Json]) -> list[str]:
        target = next((r["target"] for r in rs if "target" in r), None)
        return [label,
                _span([r["time_ms"] for r in rs], lambda x: f"{x:.0f}"),
                _span([r["median_ratio_vs_sdpa"] for r in rs], _ratio),
                _span([r["ratio_vs_sdpa"] for r in rs], _ratio),
                f"≤ {target}" if target is not None else "",
                _span([r["mem_mb_T2048"] for r in rs], lambda x: f"{x:.0f}"),
                mem(rs[0], t_long) if len(rs) == 1 else _span([r[f"mem_mb_T{t_long}"] for r in rs],
                                                                  lambda x: f"{x:.0f}")]

    rows, softmax = [], [r for r in ops["rows"] if r["op"].startswith("softmax[")]
    for r in ops["rows"]:
        if r is softmax[0]:
            scales = " / ".join(f"`{s['op'][8:-1]}`" for s in softmax)
            rows.append(row(f"softmax {scales}", softmax))
        elif r not in softmax:
            rows.append(row(OPS_LABELS.get(r["op"], r["op"]), [r]))
    header = ["op", "ms (best)", "× SDPA (median)", "× SDPA (best)", "target (median)",
              "MB at T=2048", f"MB at T={t_long}"]
    return _table(header, "lrrrrrr", rows)


def scalar_approx_table(res: Json) -> str:
    """benchmarks/scalar_approx.py: the approximate op against the exact fused path and SDPA, one row
    per (T, keys); spread keys first."""
    rows = []
    for r in sorted(res["rows"], key=lambda r: (r["keys"] != "spread", r["T"])):
        time, err = r["time"], r["error"]
        sorted_runs = r["route"] == "sorted runs"
        route = "sorted runs" if sorted_runs else "exact path (W > T/4)"
        if "exact" not in time:
            vs_exact = f"(exact not run) {_sig2(time['approx']['median_s'])} s"
        else:
            vs_exact = _ratio(time["approx"]["median_ratio"])
            if time["exact"]["median_s"] >= 1:
                vs_exact += f" ({_sig2(time['approx']['median_s'])} s vs {_sig2(time['exact']['median_s'])} s)"
        vs_sdpa = _ratio(r["approx_over_sdpa_median_ratio"]) if "approx_over_sdpa_median_ratio" in r else ""
        if not sorted_runs:
            error = "as the exact path"
        elif "out_rows" in err["approx"]:
            error = f"{_sci(err['approx']['out_rows'])} on {err['approx']['rows']} rows"
        else:
            error = f"{_sci(err['approx']['out'])} / {_sci(err['approx']['tau'])}"
        rows.append([_tokens(r["T"]), r["keys"], route, str(r["window"]), vs_exact, vs_sdpa, error])
    header = ["T", "keys", "route", "key run W", "× exact fused (median)", "× SDPA",
              "error of output / τ-gradient vs float64"]
    return _table(header, "lllrrrl", rows)


def decode_table(dec: Json) -> str:
    """benchmarks/decode.py: one decode step (CPU time, one thread) at the smallest and the largest
    cache, every window k and the hybrid heads, against SDPA over a plain KV cache."""
    full = {r["n"]: r["cpu_1thread_ms"] for r in dec["full_attention"]}
    ns = (min(full), max(full))
    rows = []
    for r in dec["decode"]:
        if r["n"] not in ns:
            continue
        sdpa, step = full[r["n"]], r["cpu_mean_ms"]
        k = f"{r['k']}, hybrid heads" if r["mode"] == "hybrid" else str(r["k"])
        rows.append([_tokens(r["n"]), k, f"{step:.3f} ms", f"{_f(sdpa, 1 if sdpa >= 100 else 2)} ms",
                     f"{sdpa / step:.0f}×"])
    header = ["n", "k", "sorted cache step", "SDPA over a plain KV cache", "speedup"]
    return _table(header, "llrrr", rows)


def generate_table(gen: Json) -> str:
    """benchmarks/generate.py: per bucket of context, the median step and the loss gap of the window
    decoders; mass left out at the bucket's last position, mean over layers and heads."""
    by = {(r["from"], r["decoder"]): r for r in gen["rows"]}
    mass: dict[int, list[float]] = {}
    for m in gen["mass_out"]:
        if m["k"] == 64:
            mass.setdefault(m["n"], []).extend(m["mass_out"])

    def gap(x: float) -> str:
        s = _signed(x, 2)
        return "0.00" if s[1:] == "0.00" else s

    rows = []
    for start in sorted({r["from"] for r in gen["rows"]}):
        exact, k64, k256 = by[(start, "exact")], by[(start, "k=64")], by[(start, "k=256")]
        end = exact["to"]
        out = mass.get(end)
        rows.append([f"{_tokens(start)}–{_tokens(end)}", f"{exact['step_ms_median']:.1f} ms",
                     f"{k64['step_ms_median']:.1f} ms", gap(k64["gap"]), gap(k256["gap"]),
                     f"{sum(out) / len(out):.2f}" if out else ""])
    header = ["context", "exact step", "k = 64 step", "k = 64 loss gap (nats)", "k = 256 loss gap",
              "k = 64 mass left out (at the bucket end)"]
    return _table(header, "lrrrrr", rows)


def generate_window_table(gen: Json) -> str:
    """benchmarks/generate.py on a model trained through its window: per bucket of context, the
    median step of decoding over every key (exact=True) and through the trained window (the sorted
    cache and the ring of recent tokens), their ratio, and the mean NLL of each on the same tokens."""
    k = gen["ks"][0]
    by = {(r["from"], r["decoder"]): r for r in gen["rows"]}
    rows = []
    for start in sorted({r["from"] for r in gen["rows"]}):
        exact, win = by[(start, "exact")], by[(start, f"k={k}")]
        rows.append([f"{_tokens(start)}–{_tokens(exact['to'])}", f"{exact['step_ms_median']:.1f} ms",
                     f"{win['step_ms_median']:.1f} ms", f"{exact['step_ms_median'] / win['step_ms_median']:.1f}×",
                     f"{exact['nll']:.3f}", f"{win['nll']:.3f}"])
    header = ["context", "every key: step", f"window (k = {k} + ring): step", "speed-up", "every key: NLL",
              "window: NLL"]
    return _table(header, "lrrrrr", rows)


def generate_selector_table(*runs: Json) -> str:
    """benchmarks/generate.py --selector on trained hybrids: in the buckets ending at 4x and 16x the
    training length, each decoder's loss gap against the model's own exact decoding and against the
    softmax model on the same tokens (nats/token), and its median step against the exact step."""
    rows = []
    for gen in runs:
        model = gen["run"].split("/runs/")[-1].split("/")[0]
        if gen.get("selector", {}).get("rope") is False:
            model += ", search without RoPE"
        T = gen["train_seq_len"]
        by = {(r["to"], r["decoder"]): r for r in gen["rows"]}
        for end in (4 * T, 16 * T):
            exact = by[(end, "exact")]
            for name in gen["decoders"]:
                if name in ("exact", "softmax"):
                    continue
                r = by[(end, name)]
                rows.append([model, f"{end // T}× ({_tokens(exact['from'])}–{_tokens(end)})", name,
                             _signed(r["gap"], 3), _signed(r["gap_softmax"], 3), f"{r['step_ms_median']:.1f} ms",
                             f"{r['step_ms_median'] / exact['step_ms_median']:.2f}×"])
    header = ["model", "context", "decoder", "gap to its exact", "gap to softmax", "step", "step / exact step"]
    return _table(header, "lllrrrr", rows)


WINDOWED_ROWS = {"scalar": "scalar (the earlier `configs/windowed.toml`)", "softmax": "softmax",
                 "hybrid": "hybrid (the quickstart's)"}


def windowed_table(res: Json) -> str:
    """experiments/windowed: exact and windowed loss at the training length and at 4× it (mean ± sd
    over seeds for the exact losses and for the k = 64 loss at 4×, the claim's number); the
    perplexity change e^gap − 1 beside each windowed loss."""
    lengths = res["spec"]["metrics"]["lengths"]
    ks = res["spec"]["metrics"]["windowed_loss"]

    def pct(gap: float) -> str:
        p = 100 * math.expm1(gap)
        return f"{_signed(p, 2 if abs(p) < 1 else 1 if abs(p) < 20 else 0)} %"

    rows = []
    for name, label in WINDOWED_ROWS.items():
        mean, sd = res["variants"][name]["mean"], res["variants"][name]["sd"]
        row = [label]
        for t in lengths:
            row.append(f"{mean[f'loss/T={t}']:.3f} ± {sd[f'loss/T={t}']:.3f}")
            for k in ks:
                w = mean.get(f"wloss@{k}/T={t}")
                if w is None:
                    row.append("")
                    continue
                claim = t == lengths[-1] and k == ks[-1]
                spread = f" ± {sd[f'wloss@{k}/T={t}']:.3f}" if claim else ""
                row.append(f"{w:.3f}{spread} ({pct(mean[f'wgap@{k}/T={t}'])})")
        rows.append(row)
    base = lengths[0]
    header = ["model"]
    for t in lengths:
        header.append(f"exact, T = {t}" if t == base else f"exact, T = {t} ({t // base}×)")
        header += [f"k = {k}" for k in ks]
    return _table(header, "l" + "r" * (len(header) - 1), rows)


def train_window_table(res: Json) -> str:
    """experiments/seed000/train-through-window: per variant, the loss at each evaluated length (mean ±
    sd over seeds): a window-trained variant's own loss (its windowed decode), a sliding-window
    control's, an exact-trained one's exact loss and, for scalar/hybrid heads, its loss through a
    k = 64 window."""
    lengths = res["spec"]["metrics"]["lengths"]
    base = lengths[0]
    rows = []
    for name, v in res["variants"].items():
        mean, sd = v["mean"], v["sd"]
        trained = any("train_window" in o for o in v["overrides"])
        slide = next((o.split("=", 1)[1] for o in v["overrides"] if "sliding_window" in o), None)
        reads = "its window" if trained else f"the last {slide} keys" if slide else "every key"
        row = [name, reads]
        if not v.get("n"):  # a variant with no finished run yet
            continue
        for t in lengths:
            row.append(f"{mean[f'loss/T={t}']:.3f} ± {sd[f'loss/T={t}']:.3f}")
        for t in lengths:
            w = None if trained else mean.get(f"wloss@64/T={t}")
            row.append("" if w is None else f"{w:.3f} ± {sd[f'wloss@64/T={t}']:.3f}")
        rows.append(row)
    header = ["variant", "reads"] + [f"loss, T = {t}" + ("" if t == base else f" ({t // base}×)") for t in lengths]
    header += [f"exact-trained through k = 64, T = {t}" for t in lengths]
    if not any(cell for row in rows for cell in row[2 + len(lengths):]):  # no exact model was windowed
        header, rows = header[:2 + len(lengths)], [row[:2 + len(lengths)] for row in rows]
    return _table(header, "ll" + "r" * (len(header) - 2), rows)


SELECTORS = (("window", "window"), ("quest", "Quest"), ("learned", "learned"), ("oracle", "oracle"))


def selectors_table(sel: Json, k: int = 64) -> str:
    """benchmarks/key_selectors.py: loss gap (Mass@K) of each selector at K = 64, mean ± sd over the
    models; a gap below 0.005 nats gets a fourth decimal."""
    summary = {(s["T"], s["K"], s["method"]): s for s in sel["summary"]}
    ts = sel["config"]["T"]
    rows = []
    for t in ts:
        label = f"T = {t}: loss gap (Mass@{k})" if t == ts[0] else f"T = {t} ({t // ts[0]}×)"
        cells = [label]
        for method, _ in SELECTORS:
            s = summary[(t, k, method)]
            d = 4 if abs(s["gap"]["mean"]) < 0.005 else 3
            cells.append(f"{_signed(s['gap']['mean'], d)} ± {s['gap']['sd']:.{d}f} ({s['mass']['mean']:.3f})")
        rows.append(cells)
    return _table([f"K = {k}", *(name for _, name in SELECTORS)], "lrrrr", rows)


def train_speed_table(speed: Json) -> str:
    """benchmarks/train_speed.py: training tokens/s (best step) of each variant."""
    def name(v: str) -> str:
        return v.replace("[fallback]", " [fallback]").replace("+", " + ")

    rows = speed["rows"]
    return _table([name(r["variant"]) for r in rows], "r" * len(rows),
                  [[f"{r['tokens_per_s']:,.0f}" for r in rows]])


def train_window_speed_table(speed: Json) -> str:
    """benchmarks/train_speed.py over window-trained variants: tokens/s (best step) of each, and its
    ratio to the exact-trained variant of the same mechanism and kernel (the name before the first
    "+window", with the kernel's suffix kept)."""
    tps = {r["variant"]: r["tokens_per_s"] for r in speed["rows"]}
    rows = []
    for r in speed["rows"]:
        v = r["variant"]
        base = v.split("+window")[0] + ("+cauchy" if v.endswith("+cauchy") and "+window" in v else "")
        ratio = f"{r['tokens_per_s'] / tps[base]:.2f}×" if base != v and base in tps else ""
        rows.append([v.replace("+", " + "), f"{r['tokens_per_s']:,.0f}", ratio])
    return _table(["variant", "tokens/s", "× exact training"], "lrr", rows)


def compile_table(warm: Json, cold: Json) -> str:
    """benchmarks/compile.py: eager and compiled training steps (medians), with the compile time from
    a warm inductor cache (first file) and a cold one (second file)."""
    mechs = [r["mechanism"] for r in warm["rows"]]
    w = {r["mechanism"]: r for r in warm["rows"]}
    c = {r["mechanism"]: r for r in cold["rows"]}
    rows = [
        ["eager step", *(f"{w[m]['eager_ms']:.0f} ms" for m in mechs)],
        ["compiled (inductor) step, speedup",
         *(f"{w[m]['compiled_ms']:.0f} ms, {w[m]['compiled_speedup']:.2f}×" for m in mechs)],
        ["compiled without the in-graph value checks", *(f"{w[m]['unchecked_speedup']:.2f}×" for m in mechs)],
        ["compile time, cache cold / warm",
         *(f"{_sig2(c[m]['compiled_compile_s'])} s / {_sig2(w[m]['compiled_compile_s'])} s" for m in mechs)],
    ]
    return _table(["", *mechs], "l" + "r" * len(mechs), rows)


def selection_reach_table(reach: Json) -> str:
    """benchmarks/selection_reach.py: per run and context length, where the scalar-selected keys lie
    (share a sliding window of the same budget reads too, against chance; median distance) and the
    share of attention they get; means over layers and heads, the layers' range in brackets."""
    rows, seen = [], {}
    for r in reach["rows"]:
        seen.setdefault((r["run"], r["T"]), []).append(r)
    for (run, T), layers in seen.items():
        def cell(key, digits, pct=False):
            vals = [x[key] for x in layers]
            f = (lambda v: f"{100 * v:.0f} %") if pct else (lambda v: f"{v:.{digits}f}")
            return f"{f(sum(vals) / len(vals))} ({f(min(vals))}–{f(max(vals))})"
        k = layers[0]
        rows.append([f"{run.rsplit('/', 1)[-1]} ({k['kernel']}, {k['k']} + {k['local']})", f"{T:,}",
                     cell("in_budget", 3, True), cell("uniform", 3, True), cell("median_distance", 0),
                     cell("selected_mass", 3, True)])
    header = ["model (kernel, k + local)", "context", "selected keys a same-budget SWA also reads", "at chance",
              "median distance t − s", "attention on the selected keys"]
    return _table(header, "lrrrrr", rows)


def sliding_window_table(res: Json) -> str:
    """benchmarks/sliding_window.py: forward + backward time of the sliding window and of full causal
    SDPA by T (medians of interleaved rounds), their ratio and the work ratio 2w/T."""
    rows = [[f"{r['T']:,}", f"{1e3 * r['window_s']:.0f} ms", f"{1e3 * r['full_s']:.0f} ms", f"{r['ratio']:.2f}×",
             f"{r['ideal']:.3f}"] for r in res["rows"]]
    w = res["config"]["window"]
    return _table(["T", f"window w = {w}", "full causal SDPA", "window / full (median)", "2w/T"], "rrrrr", rows)


# --------------------------------------------------------------------------- the registry

B = "benchmarks/results"
TABLES: dict[str, tuple[Callable[..., str], tuple[str, ...]]] = {
    "ops": (ops_table, (f"{B}/ops.json",)),
    "scalar-approx": (scalar_approx_table, (f"{B}/scalar_approx.json",)),
    "decode": (decode_table, (f"{B}/decode.json",)),
    "generate": (generate_table, (f"{B}/generate.json",)),
    "windowed": (windowed_table, ("experiments/windowed/results.json",)),
    "generate-window": (generate_window_table, (f"{B}/generate_train_window.json",)),
    "generate-window-cauchy": (generate_window_table, (f"{B}/generate_train_window_cauchy.json",)),
    "train_window": (train_window_table, ("experiments/seed000/train-through-window/results.json",)),
    "selectors": (selectors_table, (f"{B}/selectors.json",)),
    "train-speed": (train_speed_table, (f"{B}/train_speed.json",)),
    "train-window-speed": (train_window_speed_table, (f"{B}/train_window_speed.json",)),
    "compile": (compile_table, (f"{B}/compile.json", f"{B}/compile_cold.json")),
    "middle6": (middle6_table, ("experiments/seed001/ci-middle6/results.json",)),
    "coverage": (coverage_table, ("experiments/seed001/all-layers/results.json",)),
    "tasks": (tasks_table, (f"{B}/search/tasks_m6kv_2k4k/results.json",)),
    "tasks-prefill": (tasks_table, (f"{B}/search/tasks_m6kv4k_prefill/results.json",)),
    "tasks-prefill-8k": (tasks_table, (f"{B}/search/tasks_m6kv8k_prefill/results.json",)),
    "search-decode": (search_decode_table, (f"{B}/search_decode.json",)),
    "generate-selector": (generate_selector_table, (f"{B}/generate_selector_windowed.json",
                                                    f"{B}/generate_selector_hybrid.json",
                                                    f"{B}/generate_selector_hybrid_norope.json")),
    "train_window_1024": (train_window_table, ("experiments/seed000/train-through-window-1024/results.json",)),
    "train_window_cauchy": (train_window_table, ("experiments/seed000/train-through-window-cauchy/results.json",)),
    "selection-reach": (selection_reach_table, (f"{B}/selection_reach.json",)),
    "sliding-window": (sliding_window_table, (f"{B}/sliding_window.json",)),
    "gpu-speed": (gpu_speed_table, (f"{B}/gpu.json",)),
    "gpu-errors": (gpu_errors_table, (f"{B}/gpu.json",)),
    "gpu-models": (gpu_models_table, (f"{B}/gpu.json",)),
    "decode-speed": (decode_speed_table, (f"{B}/decode_speed.json",)),
}
