"""Approximate scalar attention on a trained model's own scalar queries, keys and τ.

    python benchmarks/scalar_approx_trained.py --run experiments/windowed/runs/scalar/seed0 --T 1024,4096

The synthetic cases of benchmarks/scalar_approx.py bracket what a model might do (keys spread over
the scalar axis, or clustered). This script asks what a trained model does: it runs the model on a
validation text of length T, takes every scalar layer's recorded qs, ks, τ and values, and reports
per layer which route `scalar_attention_approx` takes (sorted runs of width W, or the exact fused
path when the runs would cover more than T/4 keys), forward + backward time against the exact
fused path (median of interleaved rounds) and the relative error of its output against the exact
formula in float64. Writes benchmarks/results/scalar_approx_trained.json.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _interleaved import interleaved, ratios, write_json  # noqa: E402
from attnlab.ops import approx_plan, scalar_attention, scalar_attention_approx  # noqa: E402
from attnlab.testing import rel_rms  # noqa: E402


def layer_inputs(run: str, T: int) -> list[tuple]:
    """(qs, ks, vs, tau) of every scalar layer of the run's model on T validation tokens."""
    from attnlab.data.corpus import load_corpus
    from attnlab.data.packing import pack_documents
    from attnlab.train.data import data_tokenizer
    from attnlab.train.evaluate import load_run

    cfg, model, _ = load_run(run)
    stream = pack_documents(load_corpus(cfg.data.source, "val", cache_dir=cfg.data.cache_dir or None), data_tokenizer(cfg.data))
    x = torch.as_tensor(stream.tokens[:T], dtype=torch.long)[None]
    if x.shape[1] < T:
        raise SystemExit(f"error: the validation split holds {x.shape[1]} tokens, --T {T} needs {T}")
    with torch.no_grad():
        model.eval()(x, record=True)
    out = []
    for blk in model.blocks:
        rec = blk.attn.last
        if rec is not None and rec.heads.vs is not None and rec.n_prefix == 0:
            h = rec.heads
            out.append((h.qs.detach(), h.ks.detach(), h.vs.detach(), h.tau.detach()))
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a trained run folder with pure scalar layers (no sink)")
    p.add_argument("--T", default="1024,4096", help="comma-separated sequence lengths")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "scalar_approx_trained.json"))
    args = p.parse_args(argv)
    if not (Path(args.run) / "config.toml").is_file():
        p.error(f"--run {args.run!r} is not a run folder (no config.toml)")
    try:
        Ts = [int(t) for t in args.T.split(",")]
    except ValueError:
        p.error(f"--T must be comma-separated integers, got {args.T!r}")
    if args.rounds < 1 or any(t < 2 for t in Ts):
        p.error("--rounds must be >= 1 and every --T >= 2")
    torch.set_num_threads(1)
    rows = []
    for T in Ts:
        layers = layer_inputs(args.run, T)
        if not layers:
            p.error(f"--run {args.run!r} has no pure scalar layer without a sink")
        for i, (qs, ks, vs, tau) in enumerate(layers):
            plan = approx_plan(qs, ks, tau)
            leaves = [x.clone().requires_grad_() for x in (qs, ks, vs)]

            def run(fn):
                def step():
                    out = fn(*leaves, tau)
                    out.square().sum().backward()
                return step

            times = interleaved({"exact": run(lambda a, b, c, t: scalar_attention(a, b, c, t, impl="fast")),
                                 "approx": run(scalar_attention_approx)}, args.rounds)
            r = ratios(times, "exact")
            with torch.no_grad():
                ref = scalar_attention(qs.double(), ks.double(), vs.double(), tau.double(), impl="fast")
                err = rel_rms(scalar_attention_approx(qs, ks, vs, tau).double(), ref)
            route = "sorted runs" if plan["window"] <= plan["max_window"] else "exact fused"
            spread = (ks.amax(-1) - ks.amin(-1)).mean().item()
            rows.append({"T": T, "layer": i, "route": route, "window": plan["window"], "max_window": plan["max_window"],
                         "key_range": spread, "tau_mean": tau.float().mean().item(),
                         "approx_over_exact_median": r["approx"]["median_ratio"], "exact_ms": 1e3 * r["exact"]["median_s"],
                         "output_rel_err": err})
            print(f"T={T:6d} layer {i}: {route:11s} W={plan['window']:5d} (cap {plan['max_window']}), key range "
                  f"{spread:.3g}, mean tau {rows[-1]['tau_mean']:.3g}: approx/exact {r['approx']['median_ratio']:.2f}x, "
                  f"output error {err:.2e}", flush=True)
    write_json(args.out, {"run": args.run, "rounds": args.rounds, "rows": rows})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
