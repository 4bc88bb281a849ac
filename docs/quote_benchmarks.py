"""The figures docs/quoted_numbers.py quotes from the repository (versions and extras from
pyproject.toml and the Makefile) and from the benchmark files under benchmarks/results/ that take
more than one look-up. Each is a key `NAME ARG...` (`BENCHMARKS` maps the names)."""

from __future__ import annotations

import fnmatch
import re
from collections.abc import Callable

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib

from quote_lookup import ROOT, NumberError, fmt, load, span  # docs/quote_lookup.py
from table_format import _sci, _signed, _tokens  # docs/table_format.py


def _pyproject() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))


def _make(var: str) -> str:
    m = re.search(rf"^{var}\s*\?=\s*(\S+)", (ROOT / "Makefile").read_text(encoding="utf-8"), re.M)
    if not m:
        raise NumberError(f"Makefile sets no {var}")
    return m[1]


def _requirement(name: str) -> str:
    dep = next((d for d in _pyproject()["project"]["dependencies"] if re.match(rf"{name}\b", d)), None)
    if dep is None:
        raise NumberError(f"pyproject.toml does not require {name}")
    return dep.split(";")[0].strip()


def _extra(name: str) -> str:
    """An extra's packages as a list: "transformers, datasets, ..." (the names, without versions)."""
    deps = _pyproject()["project"]["optional-dependencies"][name]
    return ", ".join(re.split(r"[<>=!~\[; ]", d, maxsplit=1)[0] for d in deps)


def _cpu_machine() -> str:
    """The machine every CPU benchmark file names ("2 x86_64 CPU cores, torch 2.13.0+cpu"); NumberError
    when the files name different ones (the pages then say which file was measured where)."""
    seen = set()
    for path in sorted((ROOT / "benchmarks" / "results").glob("*.json")):
        data = load(path.stem)
        m, env = data.get("machine") or {}, data.get("environment") or {}
        torch = m.get("torch") or env.get("torch") or data.get("torch")
        if torch is None or "cu" in torch.split("+")[-1]:
            continue
        cores, cpu = m.get("cores") or env.get("cpu_count"), m.get("cpu") or env.get("machine")
        seen.add(("torch", torch))
        if cores is not None:
            seen.add(("cpu", f"{cores} {cpu}"))
    kinds = {k: sorted(v for kk, v in seen if kk == k) for k in ("cpu", "torch")}
    if any(len(v) != 1 for v in kinds.values()):
        raise NumberError(f"the CPU benchmark files name more than one machine: {kinds}")
    return f"{kinds['cpu'][0]} CPU cores, torch {kinds['torch'][0]}"


def _decode_flat(model: str, batch: str, method: str) -> str:
    """The largest decode step of a method over the contexts measured, over its step at the shortest."""
    rows = sorted((r["context"], r["step_ms"]) for r in load("decode_speed")["rows"]
                  if r["model"] == model and str(r["batch"]) == batch and r["method"] == method)
    return fmt(max(ms for _, ms in rows) / rows[0][1], "x2")


def _flat_across(name: str, batch: str, field: str = "x_first_context") -> str:
    """The largest `x_first_context` (a step over the first context's, median of per-round ratios; or
    `field`, such as x_first_context_amortised) of a `decode_speed.py --across-contexts` file at one
    batch size, over every method and context."""
    got = [r[field] for r in load(name)["rows"] if field in r and str(r["batch"]) == batch]
    if not got:
        raise NumberError(f"{name} has no {field} at batch {batch}")
    return fmt(max(got), "x2")


def _retrofit_transfer_min(mechanism: str, steps: str, tokens: str, layers: str) -> str:
    """Minutes of attention transfer at benchmarks/results/retrofit_cost.json's median step cost: `steps`
    steps per layer over `tokens` captured tokens, `layers` layers."""
    rows = [r for r in load("retrofit_cost")["rows"] if r["mechanism"] == mechanism and r["stage"] == "transfer"]
    if len(rows) != 1:
        raise NumberError(f"retrofit_cost has {len(rows)} transfer rows for {mechanism!r}")
    return fmt(rows[0]["median_s_per_1k_tokens"] * int(steps) * int(tokens) / 1e3 * int(layers) / 60, ".0f")


def _sw_over_ideal() -> str:
    """benchmarks/sliding_window.py: the window's time ratio to full attention over the work ratio 2w/T,
    the range over T."""
    return span([r["ratio"] / r["ideal"] for r in load("sliding_window")["rows"]], "x1")


def _gen_held(k: str, n: str) -> str:
    """benchmarks/generate.py: the share of attention the k nearest keys hold at context n, in %
    (1 − the mass left out, mean over layers and heads)."""
    vals = [v for m in load("generate")["mass_out"] if str(m["k"]) == k and str(m["n"]) == n for v in m["mass_out"]]
    if not vals:
        raise NumberError(f"generate.json: no mass_out at k = {k}, n = {n}")
    return fmt(100 * (1 - sum(vals) / len(vals)), ".0f")


def _crossover(name: str) -> str:
    """benchmarks/generate.py: the start of the first bucket where the exact step is slower than the
    window's, as tokens ("4K")."""
    rows = load(name)["rows"]
    k = f"k={load(name)['ks'][0]}"
    by = {(r["from"], r["decoder"]): r["step_ms_median"] for r in rows}
    starts = sorted({r["from"] for r in rows})
    first = next((f for f in starts if by[(f, "exact")] > by[(f, k)]), None)
    if first is None:
        raise NumberError(f"{name}: the window's step is never the faster")
    return _tokens(first)


SELECTOR_RUNS = ("generate_selector_windowed", "generate_selector_hybrid")


def _selector_gaps(decoder: str, *ends: str) -> str:
    """benchmarks/generate.py --selector: the range of a decoder's gap to its model's exact decoding over
    both trained hybrids (the window-trained and the exact-trained) in the buckets ending at `ends`."""
    gaps = [r["gap"] for name in SELECTOR_RUNS for r in load(name)["rows"]
            if r["decoder"] == decoder and str(r["to"]) in ends]
    if not gaps:
        raise NumberError(f"no {decoder} rows ending at {ends}")
    return span(gaps, "+2")


def _selector_diff(name: str, end: str, a: str, b: str) -> str:
    """benchmarks/generate.py --selector: decoder a's gap less decoder b's in the bucket ending at `end`."""
    rows = {r["decoder"]: r["gap"] for r in load(name)["rows"] if str(r["to"]) == end}
    return _signed(rows[a] - rows[b], 2)


def _selectors(what: str, *args: str) -> str:
    """benchmarks/key_selectors.py, mean over the models: `gap METHOD T K` (nats, .2f), `mass METHOD T K`,
    `learned-oracle` (the largest gap between learned search and the oracle over every T and K)."""
    summary = {(str(s["T"]), str(s["K"]), s["method"]): s for s in load("selectors")["summary"]}
    if what == "learned-oracle":
        return fmt(max(abs(s["gap"]["mean"] - summary[(t, k, "oracle")]["gap"]["mean"])
                       for (t, k, m), s in summary.items() if m == "learned"), ".2f")
    method, t, k = args
    return fmt(summary[(t, k, method)][what]["mean"], ".2f")


def _reach(run: str, what: str) -> str:
    """benchmarks/selection_reach.py: the share of attention on the selected keys, in %: the range of
    the per-context means over layers ("means"), or of every layer at every context ("layers")."""
    rows = [r for r in load("selection_reach")["rows"] if r["run"] == run]
    if what == "means":
        by_t: dict[int, list[float]] = {}
        for r in rows:
            by_t.setdefault(r["T"], []).append(r["selected_mass"])
        values = [sum(v) / len(v) for v in by_t.values()]
    else:
        values = [r["selected_mass"] for r in rows]
    return span([100 * v for v in values], ".0f")


def _right(name: str, method: str, task: str, length: str, k: str = "256", depth: str = "*") -> str:
    """attnlab search tasks (benchmarks/results/search/NAME): whole answers right, summed over the
    examples, the depths (or at one depth) and the tasks ("*": both); K applies to the selectors."""
    rows = [r for r in load(f"benchmarks/results/search/{name}/results.json")["rows"]
            if r["method"] == method and fnmatch.fnmatchcase(r["task"], task) and str(r["length"]) == length
            and (method == "full" or str(r["K"]) == k) and (depth == "*" or str(r["depth"]) == depth)]
    if not rows:
        raise NumberError(f"search/{name}: no rows for {method} {task} {length} K={k} depth={depth}")
    return str(sum(round(r["accuracy"] * r["n"]) for r in rows))


def _examples(name: str, per: str = "length") -> str:
    """attnlab search tasks: the examples per task and length (depths × examples), per depth ("depth"),
    or per length over every task ("all")."""
    c = load(f"benchmarks/results/search/{name}/results.json")["config"]
    return str(c["n_examples"] * {"length": len(c["depths"]), "depth": 1,
                                  "all": len(c["depths"]) * len(c["tasks"])}[per])


def _search_mass_gap(a: str, b: str, method_a: str, method_b: str) -> str:
    """The largest |Mass@K| difference between two search evaluations' methods over the Ks they share."""
    def masses(name: str, method: str) -> dict:
        return {r["K"]: r["mass"] for r in load(f"benchmarks/results/search/{name}/results.json")["rows"]
                if r["method"] == method}

    ma, mb = masses(a, method_a), masses(b, method_b)
    return fmt(max(abs(ma[k] - mb[k]) for k in ma if k in mb), ".3f")


def _search_target(method: str, n: str, target: str) -> str:
    """benchmarks/search.py: a selector's step over full attention's at context n, over its target."""
    row = next(r for r in load("search_decode")["rows"] if str(r["N"]) == n)
    return fmt(row[f"{method}_x_full"] / float(target), "x1")


def _search_insert() -> str:
    """benchmarks/search.py: the largest insertion cost as a share of its own selector's step, with
    the selector and context: "14 % (learned_hnsw16, 128K)"."""
    best = max(((r[f"{m[:-7]}_add_ms"] / r[f"{m[:-7]}_ms"], m[:-7], r["N"]) for r in load("search_decode")["rows"]
                for m in r if m.endswith("_x_full") and f"{m[:-7]}_add_ms" in r), key=lambda t: t[0])
    return f"{100 * best[0]:.0f} % ({best[1]}, {_tokens(best[2])})"


def _gpu_error(dtype: str) -> str:
    """benchmarks/gpu.py: the largest error against float64 (output or worst gradient) of the Triton
    kernels in the file's own run."""
    errs = [e for e in load("gpu")["errors"]
            if e["dtype"] == dtype and e["path"].endswith("/triton") and "from" not in e]
    return _sci(max(max(e["rel_err"], e["rel_err_grad"]) for e in errs))


def _gpu_speedup(slow: str, fast: str) -> str:
    """benchmarks/gpu.py: how many times faster path `fast` is than path `slow` (fwd + bwd ms), the
    range over the lengths both were timed at."""
    rows = load("gpu")["rows"]
    ms = {(r["path"], r["T"]): r["ms"] for r in rows if r.get("ms") is not None}
    ts = sorted(t for p, t in ms if p == slow and (fast, t) in ms)
    if not ts:
        raise NumberError(f"gpu.json: {slow} and {fast} share no length")
    return span([ms[(slow, t)] / ms[(fast, t)] for t in ts], ".0f")


def _gpu_dot(what: str) -> str:
    """benchmarks/gpu.py's tuning: scalar heads on the dot-product kernel (zero vectors) against their
    own kernel, at the tuning's length: "new" / "old" ms (mean of the timings), "speedup"."""
    t = load("gpu")["tuning"]["scalar_dot_ms"]
    new, old = sum(t["True"]) / len(t["True"]), sum(t["False"]) / len(t["False"])
    return {"new": f"{new:.1f}", "old": f"{old:.1f}", "speedup": fmt(old / new, "x1")}[what]


def _train_window_speed(what: str, *args: str) -> str:
    """benchmarks/train_speed.py over window-trained variants: `ratio A B` (A's tokens/s over B's), or
    `gaussian` (the range of a Gaussian window's tokens/s over its exact-trained mechanism's)."""
    tps = {r["variant"]: r["tokens_per_s"] for r in load("train_window_speed")["rows"]}
    if what == "ratio":
        return fmt(tps[args[0]] / tps[args[1]], "x2")
    ratios = [x / tps[v.split("+window")[0]] for v, x in tps.items() if "+window" in v and "cauchy" not in v]
    return span(ratios, "x2")


def _compile(what: str) -> str:
    """benchmarks/compile.py: `gain` (what compiling saves per step, the range in %), `speedups` (each
    mechanism's compiled speedup)."""
    rows = load("compile")["rows"]
    if what == "gain":
        return span([100 * (r["compiled_speedup"] - 1) for r in rows], ".0f")
    return ", ".join(f"{r['mechanism']} {r['compiled_speedup']:.2f}×" for r in rows)


def _gate_overhead(size: str, base: str, gate: str, what: str) -> str:
    """benchmarks/gate_overhead.py: what a gate adds to the time of a forward ("forward") or training
    step ("fwd+bwd") at a size ("mve", "quickstart"), in % (medians of the per-round ratios); the
    range over the bases and gates matching the patterns."""
    ratios = [r["median_ratio"] for r in load("gate_overhead")["rows"] if r["size"] == size and r["pass"] == what
              and fnmatch.fnmatchcase(r["base"], base) and fnmatch.fnmatchcase(r["gate"], gate)]
    if not ratios:
        raise NumberError(f"gate_overhead.json: no {size} {base} {gate} {what} rows")
    return span([100 * (x - 1) for x in ratios], "+1")


BENCHMARKS: dict[str, Callable[..., str]] = {
    "search-target": _search_target,
    "search-insert": _search_insert,
    "selector-gaps": _selector_gaps,
    "selector-diff": _selector_diff,
    "crossover": _crossover,
    "examples": _examples,
    "search-mass-gap": _search_mass_gap,
    "sw-over-ideal": _sw_over_ideal,
    "selectors": _selectors,
    "tws": _train_window_speed,
    "compile": _compile,
    "gpu-speedup": _gpu_speedup,
    "gpu-dot": _gpu_dot,
    "gen-held": _gen_held,
    "cpu-machine": _cpu_machine,
    "gate-overhead": _gate_overhead,
    "decode-flat": _decode_flat,
    "flat-across": _flat_across,
    "retrofit-transfer-min": _retrofit_transfer_min,
    "reach": _reach,
    "right": _right,
    "gpu-error": _gpu_error,
    "python": lambda: _pyproject()["project"]["requires-python"].replace(">=", "≥ "),
    "torch": lambda: _requirement("torch"),
    "torch.dev": lambda: _make("TORCH_SPEC"),
    "torch.compat": lambda: _make("COMPAT_TORCH").split("==")[1].rsplit(".0", 1)[0],
    "extra": _extra,
    "make": _make,
    "make.torch": lambda key: f"make test TORCH_SPEC='{BENCHMARKS[key]()}'",
}
