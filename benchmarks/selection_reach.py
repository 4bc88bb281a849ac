"""Where the keys of a model trained through the scalar window lie, by position: retrieval from
anywhere in the context, or a local window under another name?

    python benchmarks/selection_reach.py --run runs/windowed/hybrid --lengths 256,1024,4096

For each run (a model trained with `model.attention.train_window = k`, `local_window = w`) and
each context length T, the run's layers read `--batches` x `--batch-size` sequences of T tokens of
held-out text (the run's validation split); for every window-trained layer and head,
`attnlab.eval.metrics.selection_reach` measures the k keys each query selects by scalar distance
(beyond its last w): the share of them that a sliding window of the same k + w keys would read as
well ("in budget"), that share at chance (k keys drawn uniformly from the same candidates), and
their median distance t − s in positions; and the share of each query's attention that goes to
those selected keys rather than to its local window ("mass on selected", from the layer's own
windowed weights, on the first sequence of each batch). Writes JSON (mean over heads per layer and
per head) and prints a table.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics

import torch

HERE = os.path.dirname(os.path.abspath(__file__))


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", nargs="+", required=True, help="run folders of models trained through the scalar window")
    p.add_argument("--lengths", default="256,1024,4096", help="comma-separated context lengths")
    p.add_argument("--batches", type=int, default=2, help="batches per length")
    p.add_argument("--batch-size", type=int, default=4, help="sequences per batch")
    p.add_argument("--split", default="val", choices=("val", "test"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=os.path.join(HERE, "results", "selection_reach.json"))
    args = p.parse_args(argv)
    args.lengths = [int(x) for x in args.lengths.split(",")]
    if any(L < 2 for L in args.lengths) or args.batches < 1 or args.batch_size < 1:
        p.error("--lengths must be >= 2, --batches and --batch-size >= 1")
    for run in args.run:
        if not os.path.isfile(os.path.join(run, "config.toml")):
            p.error(f"--run {run!r} is not a run folder (no config.toml)")
    return args


@torch.no_grad()
def selected_mass(layer, x: torch.Tensor, local: int) -> list[float]:
    """Per head, the mean share of a query's windowed attention on keys older than its local window
    (the scalar-selected ones), over the queries that have such keys: x (1, T, C), the layer's input."""
    w = layer.attention_weights(x).float()  # (1, H, T, T + n_prefix): the window's own weights
    n_prefix = w.shape[-1] - w.shape[-2]
    T = w.shape[-2]
    t = torch.arange(T)
    older = (t[None, :] <= t[:, None] - local)  # (T, T)
    rows = t >= local  # queries with a key older than their local window
    mass = (w[..., n_prefix:] * older).sum(-1)[..., rows]  # (1, H, rows)
    return mass.mean((0, 2)).tolist()


def reach_of_run(run: str, lengths: list[int], batches: int, batch_size: int, split: str) -> list[dict]:
    from attnlab.data.corpus import load_corpus
    from attnlab.data.packing import pack_documents, sequential_batches
    from attnlab.eval.metrics import selection_reach
    from attnlab.train import load_run
    from attnlab.train.data import data_tokenizer

    cfg, model, _ = load_run(run)
    layers = [(i, blk.attn) for i, blk in enumerate(model.blocks)
              if getattr(blk.attn.config, "train_window", None) is not None]
    if not layers:
        raise SystemExit(f"--run {run!r}: no layer was trained through the scalar window (model.attention.train_window)")
    d = cfg.data
    stream = pack_documents(load_corpus(d.source, split, cache_dir=d.cache_dir or None, max_docs=d.max_docs or None),
                            data_tokenizer(d))
    rows = []
    for T in lengths:
        per_layer = {i: {"in_budget": [], "uniform": [], "median_distance": [], "selected_mass": []} for i, _ in layers}
        for batch in sequential_batches(stream, T, batch_size, max_batches=batches):
            inputs = {}
            hooks = [layer.register_forward_pre_hook(lambda mod, args, i=i: inputs.__setitem__(i, args[0]))
                     for i, layer in layers]
            try:
                with torch.no_grad():
                    model(batch.x, record=True)
            finally:
                for h in hooks:
                    h.remove()
            for i, layer in layers:
                rec, c = layer.last, layer.config
                r = selection_reach(rec.qs.detach(), rec.ks.detach(), c.options.train_window, local=c.options.local_window,
                                    n_prefix=rec.n_prefix or 0)
                for key, values in r.items():
                    per_layer[i][key].append(values)
                per_layer[i]["selected_mass"].append(selected_mass(layer, inputs[i][:1], c.options.local_window))
        for i, layer in layers:
            stats = {key: [statistics.fmean(col) for col in zip(*vals)] for key, vals in per_layer[i].items()}
            rows.append({
                "run": run, "T": T, "layer": i, "mechanism": layer.mechanism, "kernel": layer.config.options.kernel,
                "k": layer.config.options.train_window, "local": layer.config.options.local_window,
                "budget": layer.config.options.train_window + layer.config.options.local_window,
                **{f"{key}_heads": v for key, v in stats.items()},
                **{key: statistics.fmean(v) for key, v in stats.items()},
            })
    return rows


def main(argv=None) -> None:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    rows = [r for run in args.run for r in reach_of_run(run, args.lengths, args.batches, args.batch_size, args.split)]
    out = {
        "config": {"runs": args.run, "lengths": args.lengths, "batches": args.batches, "batch_size": args.batch_size,
                   "split": args.split},
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "threads": args.threads},
        "rows": rows,
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(out, f, indent=2)
    print(f"{'run':40s} {'T':>6s} {'layer':>5s} {'in budget':>9s} {'chance':>7s} {'median t-s':>10s} {'mass':>6s}")
    for r in rows:
        print(f"{r['run'][-40:]:40s} {r['T']:6d} {r['layer']:5d} {r['in_budget']:9.3f} {r['uniform']:7.3f} "
              f"{r['median_distance']:10.1f} {r['selected_mass']:6.3f}")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
