"""Every key selector on the same trained hybrid models: loss gap against exact attention, Mass@K, Recall@K.

    python benchmarks/key_selectors.py [RUN ...] [--K 16,32,64] [--T 256,1024] [--tokens 16384] [--steps 200]

For each run folder (default: the three seeds of experiments/windowed/runs/hybrid) the script
loads the model, trains search projections for the "learned" selector on the training split
(`attnlab.eval.selector_training.train_selector_projections`: one search space per head, a few hundred
steps on batches at the training length; the time is printed), then, on the validation split at
each context length T, measures the exact loss and, for each selector (window, oracle, quest,
learned; `attnlab.eval.selectors.select_keys`) and budget K, the loss with every scalar/hybrid
head reading only its K selected keys (plus the sink), on the same windows of text
(`attnlab.eval.metrics.loss_at_lengths` with one batching), and the selector's Mass@K and
Recall@K over the queries that see more than K keys. The summary is mean ± sd (n - 1) over the
runs per (method, K, T). Writes benchmarks/results/selectors.json and selectors.md.
"""

from __future__ import annotations

import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent

import argparse  # noqa: E402
import math  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402

ROOT = HERE.parent
sys.path.insert(0, str(ROOT / "src"))

from _interleaved import command, write_json  # noqa: E402
from attnlab.data.corpus import load_corpus  # noqa: E402
from attnlab.data.packing import pack_documents, sequential_batches  # noqa: E402
from attnlab.eval.metrics import loss_at_lengths  # noqa: E402
from attnlab.eval.selector_training import train_selector_projections  # noqa: E402
from attnlab.eval.selectors import METHODS, SelectionTally, select_keys  # noqa: E402
from attnlab.train.data import data_tokenizer  # noqa: E402
from attnlab.train.evaluate import load_run  # noqa: E402

RUNS = [f"experiments/windowed/runs/hybrid/seed{s}" for s in range(3)]
RESULTS = ROOT / "benchmarks" / "results"


def ints(text: str) -> list[int]:
    return [int(v) for v in text.split(",") if v.strip()]


def streams(cfg):
    """The run's corpus and tokenizer, as `attnlab.train.evaluate.evaluate` reads them: (train, val)."""
    d = cfg.data
    tok = data_tokenizer(d)
    cache_dir, max_docs = d.cache_dir or None, d.max_docs or None
    return tuple(pack_documents(load_corpus(d.source, split, cache_dir=cache_dir, max_docs=max_docs), tok)
                 for split in ("train", "val"))


def train_learned(model, cfg, train, args) -> tuple[object, float]:
    """Search projections on `args.train_batches` batches of `args.train_batch` sequences of the training
    split at the training length."""
    T = cfg.data.seq_len
    batches = [b.x for b in sequential_batches(train, T, args.train_batch, max_batches=args.train_batches)]
    start = time.perf_counter()
    proj = train_selector_projections(model, batches, args.steps, d_search=args.d_search, seed=args.seed)
    return proj, time.perf_counter() - start


def measure(model, fn, val, T: int, args, method: str | None = None, K: int = 0, proj=None, pass_batch=False,
            cross_doc=True) -> dict:
    """Loss on the first args.tokens target tokens of windows of length T (exact when method is None),
    and with a selector its Mass@K / Recall@K."""
    tally = SelectionTally()
    start = time.perf_counter()
    with torch.no_grad():
        if method is None:
            out = loss_at_lengths(fn, val, [T], batch_size=args.batch, max_tokens=args.tokens, cross_doc=cross_doc,
                                  pass_batch=pass_batch)[T]
        else:
            kw = {"projections": proj} if method == "learned" else {"page": args.page} if method == "quest" else {}
            with select_keys(model, method, K, tally=tally, **kw):
                out = loss_at_lengths(fn, val, [T], batch_size=args.batch, max_tokens=args.tokens,
                                      cross_doc=cross_doc, pass_batch=pass_batch)[T]
    row = {"loss": out["loss"], "tokens": out["tokens"], "seconds": time.perf_counter() - start}
    if method is not None:
        row.update(mass=tally.mass, recall=tally.recall, counted=tally.n)
    return row


def run_one(run: str, args) -> dict:
    cfg, model, state = load_run(ROOT / run if not Path(run).is_absolute() else run)
    train, val = streams(cfg)
    cross_doc = cfg.data.cross_doc
    fn = (lambda x: model(x)[0]) if cross_doc else (lambda b: model(b.x, doc_ids=b.doc_ids)[0])
    common = {"pass_batch": not cross_doc, "cross_doc": cross_doc}
    proj, secs = train_learned(model, cfg, train, args)
    losses = proj.meta["losses"]
    print(f"{run}: learned projections, {args.steps} steps on {args.train_batches} x {args.train_batch} x "
          f"{cfg.data.seq_len} tokens in {secs:.1f} s (loss {losses[0]:.3f} -> {losses[-1]:.3f})", flush=True)
    out = {"checkpoint": state["path"], "step": state["step"], "train_seconds": secs,
           "train_loss_first": losses[0], "train_loss_last": losses[-1], "lengths": {}}
    for T in args.T:
        exact = measure(model, fn, val, T, args, **common)
        rows = {"exact": exact}
        print(f"  T={T}: exact loss {exact['loss']:.4f} on {exact['tokens']} tokens ({exact['seconds']:.1f} s)", flush=True)
        for K in args.K:
            for method in args.methods:
                r = measure(model, fn, val, T, args, method, K, proj, **common)
                if r["tokens"] != exact["tokens"]:
                    raise RuntimeError(f"{method} read {r['tokens']} tokens, the exact loss {exact['tokens']}")
                r["gap"] = r["loss"] - exact["loss"]
                r["gap_pct"] = 100.0 * math.expm1(r["gap"])
                rows[f"{method}@{K}"] = r
                print(f"    K={K:<3} {method:<8} gap {r['gap']:+.4f} nats ({r['gap_pct']:+.2f}% ppl)  "
                      f"mass {r['mass']:.3f}  recall {r['recall']:.3f}  ({r['seconds']:.1f} s)", flush=True)
        out["lengths"][str(T)] = rows
    return out


def mean_sd(values: list[float]) -> dict:
    return {"mean": statistics.fmean(values), "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
            "n": len(values)}


def summarise(per_run: dict, args) -> list[dict]:
    rows = []
    for T in args.T:
        for K in args.K:
            for method in args.methods:
                cells = [r["lengths"][str(T)][f"{method}@{K}"] for r in per_run.values()]
                rows.append({"T": T, "K": K, "method": method,
                             **{key: mean_sd([c[key] for c in cells]) for key in ("gap", "gap_pct", "mass", "recall")}})
    return rows


def fmt(cell: dict, digits: int) -> str:
    return f"{cell['mean']:.{digits}f} ± {cell['sd']:.{digits}f}"


def markdown(result: dict) -> str:
    cfg = result["config"]
    runs = result["runs"]
    lines = [
        "# Key selectors on the trained hybrid model",
        "",
        f"*Generated by `benchmarks/key_selectors.py` ({result['command']}); rerun it to rebuild this file, do not edit it.*",
        "",
        f"Models: {', '.join(f'`{r}`' for r in runs)} (mean ± sd over the {len(runs)} models, sd with n - 1).",
        f"Every scalar/hybrid head reads, per query, only the K keys its selector keeps (plus the sink); "
        f"the loss gap is that loss minus the exact loss on the same {cfg['tokens']} validation tokens per length "
        f"(batches of {cfg['batch']}), in nats and as % perplexity. Mass@K: the exact attention's weight on "
        f"the keys kept; Recall@K: the share of the K highest-weight keys kept; both over every (query, head) "
        f"of every layer whose query sees more than K keys.",
        f"Quest pages of {cfg['page']} keys. Learned: search projections with one {cfg['d_search']}-dim search "
        f"space per head, {cfg['steps']} steps on {cfg['train_batches']} batches of {cfg['train_batch']} training "
        f"sequences at the training length (seed {cfg['seed']}); training took "
        + ", ".join(f"{r['train_seconds']:.0f} s" for r in runs.values()) + ".",
        "",
        "| T | K | method | loss gap (nats) | ppl gap (%) | Mass@K | Recall@K |",
        "|---:|---:|:---|---:|---:|---:|---:|",
    ]
    for row in result["summary"]:
        lines.append(f"| {row['T']} | {row['K']} | {row['method']} | {fmt(row['gap'], 4)} | {fmt(row['gap_pct'], 2)} | "
                     f"{fmt(row['mass'], 3)} | {fmt(row['recall'], 3)} |")
    exact = {T: mean_sd([r["lengths"][str(T)]["exact"]["loss"] for r in runs.values()]) for T in cfg["T"]}
    lines += ["", "Exact loss: " + "; ".join(f"T={T}: {fmt(v, 4)}" for T, v in exact.items()) + ".",
              f"Whole script: {result['seconds']:.0f} s.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("runs", nargs="*", default=RUNS, help="run folders (default: the three hybrid seeds)")
    p.add_argument("--K", type=ints, default=[16, 32, 64], help="comma-separated key budgets")
    p.add_argument("--T", type=ints, default=[256, 1024], help="comma-separated context lengths")
    p.add_argument("--methods", default=",".join(METHODS), help=f"comma-separated, of {', '.join(METHODS)}")
    p.add_argument("--tokens", type=int, default=16384, help="validation target tokens per length")
    p.add_argument("--batch", type=int, default=8, help="sequences per evaluation batch")
    p.add_argument("--page", type=int, default=16, help="Quest page size")
    p.add_argument("--steps", type=int, default=200, help="training steps of the learned projections")
    p.add_argument("--train-batches", type=int, default=16, help="training batches (each run through the model once)")
    p.add_argument("--train-batch", type=int, default=4, help="sequences per training batch")
    p.add_argument("--d-search", type=int, default=32, help="search dims per head")
    p.add_argument("--seed", type=int, default=0, help="seed of the projections' initialisation")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=str(RESULTS / "selectors.json"))
    args = p.parse_args(argv)
    args.methods = [m for m in args.methods.split(",") if m]
    for m in args.methods:
        if m not in METHODS:
            p.error(f"--methods: {m!r} is not one of {', '.join(METHODS)}")
    torch.set_num_threads(args.threads)
    start = time.perf_counter()
    per_run = {run: run_one(run, args) for run in args.runs}
    result = {
        "command": command("key_selectors.py", argv),
        "config": {k: getattr(args, k) for k in ("K", "T", "methods", "tokens", "batch", "page", "steps", "train_batches",
                                                   "train_batch", "d_search", "seed", "threads")},
        "runs": per_run,
        "summary": summarise(per_run, args),
        "seconds": time.perf_counter() - start,
    }
    write_json(args.out, result)
    md = Path(args.out).with_suffix(".md")
    md.write_text(markdown(result))
    print(f"wrote {md}")
    print(markdown(result))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
