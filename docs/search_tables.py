"""The results tables of learned search on SmolLM2 (docs/result_tables.py registers them): the
K-sweep over training seeds, the coverage frontier, the long-context tasks and the decode step."""

from __future__ import annotations

from table_format import _sig2, _signed, _table, _tokens  # docs/table_format.py

Json = dict


def middle6_table(res: Json) -> str:
    """experiments/seed001/ci-middle6: perplexity gap and Mass@K per K, mean ± sd over training
    seeds; the oracle and Quest do not depend on the projections (sd 0) and show one value."""
    v = res["variants"]["m6kv"]
    ks = res["eval"]["m6kv"]["ks"]

    def cell(method: str, metric: str, k: int) -> str:
        key = f"{method}/{metric}@{k}"
        mean, sd = v["mean"][key], v["sd"][key]
        text = f"{_signed(mean, 3)} %" if metric == "gap" else f"{mean:.4f}"
        if sd > 0:
            text += f" ± {sd:.3f}" if metric == "gap" else f" ± {sd:.4f}"
        return text

    rows = []
    for method, label in (("learned", "learned (exact top-K)"), ("oracle", "oracle top-K"), ("quest", "Quest")):
        rows.append([f"{label}: PPL gap", *(cell(method, "gap", k) for k in ks)])
        rows.append([f"{label}: Mass@K", *(cell(method, "mass", k) for k in ks)])
    return _table(["6 middle layers, K keys per KV head", *(f"K={k}" for k in ks)], "l" + "r" * len(ks), rows)


def coverage_table(res: Json) -> str:
    """experiments/seed001/all-layers: the perplexity gap of learned search with nested sets of
    substituted layers (one training seed)."""
    v = res["variants"]["all30"]
    cov, ks = v["coverage"], res["eval"]["all30"]["ks"]
    rows = [[name, f"{n} of {cov['n_layers']}", *(f"{_signed(v['mean'][f'{name}:learned/gap@{k}'], 3)} %" for k in ks)]
            for name, n in cov["sets"].items()]
    return _table(["substituted layers", "layers", *(f"K = {k}: gap" for k in ks)], "lr" + "r" * len(ks), rows)


TASK_METHODS = (("learned", "learned"), ("quest", "Quest"), ("streaming", "StreamingLLM"))


def tasks_table(res: Json) -> str:
    """attnlab search tasks: whole answers right per task and length, summed over depths and
    examples; one cell per K for the selectors."""
    cfg = res["config"]
    right: dict[tuple, int] = {}
    for r in res["rows"]:
        key = (r["method"], r["K"], r["task"], r["length"])
        right[key] = right.get(key, 0) + round(r["accuracy"] * r["n"])
    cols = [(task, n) for task in cfg["tasks"] for n in cfg["lengths"]]
    rows = [["full attention", *(str(right[("full", None, t, n)]) for t, n in cols)]]
    for method, label in [(m, label) for m, label in TASK_METHODS if m in cfg["methods"]]:
        ks = " / ".join(str(k) for k in cfg["ks"])
        rows.append([f"{label}, K = {ks}",
                     *(" / ".join(str(right[(method, k, t, n)]) for k in cfg["ks"]) for t, n in cols)])
    return _table(["", *(f"{t} {_tokens(n)}" for t, n in cols)], "l" + "r" * len(cols), rows)


def search_decode_table(res: Json) -> str:
    """benchmarks/search.py: one decode step per layer, each selector as a multiple of full
    attention's time (recall of the exact top-K on the benchmark's random vectors for the
    approximate indexes), the largest insertion cost as a share of its own step, and the index
    memory beside the KV cache."""
    def mb(x: float) -> str:
        return f"{x:.1f}" if x < 10 else f"{x:.0f}"

    labels = {"learned_exact": "learned, exact", "learned_exact16": "exact, fp16 keys",
              "learned_hnsw": "learned, HNSW (recall)", "learned_hnsw16": "HNSW, fp16 graph (recall)",
              "learned_ivf": "learned, IVF (recall)", "native_hnsw": "native, HNSW", "quest": "Quest"}
    methods = [m for m in labels if f"{m}_x_full" in res["rows"][0]]  # older runs lack the fp16 graph
    memory = [m for m in ("learned_exact", "learned_exact16", "learned_hnsw", "learned_hnsw16", "learned_ivf")
              if f"{m}_mb" in res["rows"][0]]
    names = {"learned_exact": "exact", "learned_exact16": "fp16", "learned_hnsw": "HNSW",
             "learned_hnsw16": "HNSW fp16", "learned_ivf": "IVF"}
    rows = []
    for r in res["rows"]:
        full = r["full_ms"]
        cells = [f"{_sig2(r[f'{m}_x_full'])}×" + (f" ({r[f'{m}_recall']:.2f})" if f"{m}_recall" in r and m != "learned_exact16"
                                                   else "") for m in methods]
        add = max(methods, key=lambda m: r[f"{m}_add_ms"] / r[f"{m}_ms"])
        rows.append([f"{r['N']:,}", f"{full:.{1 if full >= 10 else 2}f} ms", *cells,
                     f"{100 * r[f'{add}_add_ms'] / r[f'{add}_ms']:.0f} % ({add.replace('_', ' ')})",
                     " / ".join(mb(r[f"{m}_mb"]) for m in memory) + f" MB, {r['kv_cache_mb']:.0f} MB"])
    header = ["context", "full attention", *(labels[m] for m in methods), "largest insertion / step",
              f"index memory ({' / '.join(names[m] for m in memory)}) beside a KV cache of"]
    return _table(header, "rr" + "r" * len(methods) + "rl", rows)
