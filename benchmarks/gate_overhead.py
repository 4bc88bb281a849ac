"""Cost of the post-readout sigmoid gate (seed 002): model latency with and without it.

    python benchmarks/gate_overhead.py                 # MVE and quickstart sizes, 4 bases, 9 rounds
    python benchmarks/gate_overhead.py --rounds 15 --threads 1

For cosFormer, GLA, SSD and softmax, the whole language model (embedding, layers, head) at two
sizes: the seed's minimum viable experiment (2 layers, d_model 64, 4 heads, T = 64, batch 64,
vocabulary 16) and the quickstart (4 layers, d_model 128, 4 heads, T = 256, batch 16, byte
vocabulary). Per base, three models with the same weights elsewhere: no gate, the elementwise
gate and the headwise gate. Timed: the forward pass (no grad) and a training step's
forward + backward, each in interleaved rounds (ungated, elementwise, headwise, ungated, ...);
reported as the median over rounds of the per-round ratio to the ungated model, with the best
beside it. The seed's targets: < 3 % on the forward, < 5 % on the MVE's wall clock.
Writes benchmarks/results/gate_overhead.json.
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
from attnlab.models import LM, ModelConfig  # noqa: E402

BASES = ("cosformer", "gla", "ssd", "softmax")
GATES = ("none", "elementwise", "headwise")
SIZES = {
    "mve": dict(model=dict(d_model=64, n_layers=2, n_heads=4, vocab_size=16), batch=64, T=64),
    "quickstart": dict(model=dict(d_model=128, n_layers=4, n_heads=4, vocab_size=256), batch=16, T=256),
}


def model(size: str, base: str, gate: str) -> LM:
    kw = dict(SIZES[size]["model"], attn=base, max_seq_len=max(SIZES[size]["T"], 64))
    if gate != "none":
        kw["attention"] = {"output_gate": gate}
    torch.manual_seed(0)
    return LM(ModelConfig(**kw))


def cases(size: str, base: str) -> tuple[dict, dict]:
    spec = SIZES[size]
    x = torch.randint(0, spec["model"]["vocab_size"], (spec["batch"], spec["T"]))
    models = {g: model(size, base, g) for g in GATES}
    fwd, train = {}, {}
    for g, m in models.items():
        def f(m=m):
            with torch.no_grad():
                return m(x)

        def t(m=m):
            m.zero_grad(set_to_none=True)
            logits = m(x)
            logits = logits[0] if isinstance(logits, tuple) else logits
            logits.float().logsumexp(-1).mean().backward()
        fwd[g], train[g] = f, t
    return fwd, train


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--rounds", type=int, default=9, help="interleaved rounds (>= 7 for a median worth quoting)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--sizes", default="mve,quickstart")
    p.add_argument("--bases", default=",".join(BASES))
    p.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "gate_overhead.json"))
    args = p.parse_args(argv)
    sizes, bases = args.sizes.split(","), args.bases.split(",")
    for s in sizes:
        if s not in SIZES:
            p.error(f"--sizes: {s!r} is not one of {', '.join(SIZES)}")
    for b in bases:
        if b not in BASES:
            p.error(f"--bases: {b!r} is not one of {', '.join(BASES)}")
    if args.rounds < 1:
        p.error("--rounds must be >= 1")
    torch.set_num_threads(args.threads)
    rows = []
    for size in sizes:
        for base in bases:
            fwd, train = cases(size, base)
            for what, cs in (("forward", fwd), ("fwd+bwd", train)):
                r = ratios(interleaved(cs, args.rounds, reps=3 if size == "mve" else 1), "none")
                for g in GATES[1:]:
                    rows.append({"size": size, "base": base, "gate": g, "pass": what, **r[g],
                                 "baseline_median_s": r["none"]["median_s"]})
                    print(f"{size:10s} {base:9s} {g:11s} {what:7s} median {100 * (r[g]['median_ratio'] - 1):+6.1f}%  "
                          f"best {100 * (r[g]['best_ratio'] - 1):+6.1f}%  ({1e3 * r['none']['median_s']:.1f} ms ungated)",
                          flush=True)
    out = {"rounds": args.rounds, "threads": args.threads, "sizes": {s: SIZES[s] for s in sizes}, "rows": rows}
    write_json(args.out, out)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
