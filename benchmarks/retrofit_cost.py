"""What attention transfer and fine-tuning cost per token on a pretrained model, measured through the
library's own calls (`attnlab.retrofit.transfer_attention` and `finetune`, as `attnlab retrofit` runs
them).

    python benchmarks/retrofit_cost.py                                # SmolLM2-135M, middle six, 5 rounds
    python benchmarks/retrofit_cost.py --model PATH --layers 1 --mechanisms scalar --rounds 2 \\
        --context 32 --contexts 2 --batch 1 --out /tmp/rc.json       # any local HF model folder

After one untimed call of each kind per mechanism (first-call costs: reading the corpus, building
caches), per mechanism each round makes four calls on freshly converted models (the conversion is not
timed): transfer with --transfer-steps S and 3 S steps per layer, fine-tuning (train="new", LoRA
rank --lora, no warm-up) with --finetune-steps F and 3 F steps, each into its own empty folder. A
call's fixed costs (capturing the original model's activations, the perplexity evaluations, folder
writes) are the same for both step counts, so the per-step time is the difference of the two
calls over the extra steps: transfer in seconds per 1K layer-step tokens (one step of one layer
over --contexts x --context tokens), fine-tuning in seconds per 1K training tokens (--batch x
--context per step). The rounds run the mechanisms and calls interleaved; the median over rounds is
reported with every round's value. Peak resident memory of the process is read at the end (it
only grows: the most any call needed). Writes benchmarks/results/retrofit_cost.json.
"""

from __future__ import annotations

import argparse
import resource
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from _interleaved import command, write_json  # noqa: E402

from attnlab.retrofit import FinetuneConfig, TransferConfig, convert, finetune, transfer_attention  # noqa: E402
from attnlab.retrofit.io import load_source, plan_source  # noqa: E402


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2", help="a model spec as `attnlab retrofit --model` takes it")
    ap.add_argument("--layers", default="middle6")
    ap.add_argument("--mechanisms", default="scalar,gla", help="comma-separated retrofit mechanisms")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--transfer-steps", type=int, default=10, help="S: the calls run S and 3 S steps per layer")
    ap.add_argument("--finetune-steps", type=int, default=1, help="F: the calls run F and 3 F steps")
    ap.add_argument("--contexts", type=int, default=8, help="contexts captured for transfer")
    ap.add_argument("--context", type=int, default=256, help="tokens per context (transfer and fine-tuning)")
    ap.add_argument("--batch", type=int, default=2, help="fine-tuning batch (contexts per step)")
    ap.add_argument("--lora", type=int, default=8, help="fine-tuning's LoRA rank (0: none)")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "retrofit_cost.json"))
    a = ap.parse_args(argv)
    for name in ("rounds", "transfer_steps", "finetune_steps", "contexts", "batch"):
        if getattr(a, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(a, name)}")
    mechanisms = [m for m in a.mechanisms.split(",") if m]
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    planned = {m: plan_source(a.model, a.layers, m) for m in mechanisms}  # bad input fails here, before any load
    plans = {m: plan for m, (_, plan) in planned.items()}
    hf, _ = load_source(planned[mechanisms[0]][0])
    S, F = a.transfer_steps, a.finetune_steps
    layer_tokens = a.contexts * a.context / 1e3  # thousands of tokens per layer-step
    train_tokens = a.batch * a.context / 1e3

    def transfer_call(m: str, steps: int, tmp: Path) -> float:
        model = convert(hf, plans[m])
        cfg = TransferConfig(steps=steps, contexts=a.contexts, context=a.context, heldout_contexts=0)
        return timed(lambda: transfer_attention(hf, model, plans[m].layers, cfg, tmp / f"t{m}{steps}"))

    def finetune_call(m: str, steps: int, tmp: Path) -> float:
        model = convert(hf, plans[m])
        cfg = FinetuneConfig(steps=steps, warmup=0, batch=a.batch, context=a.context, contexts=max(a.batch, 8),
                             eval_contexts=1, lora=a.lora)
        return timed(lambda: finetune(model, cfg, tmp / f"f{m}{steps}", progress=False))

    per = {m: {"transfer": [], "finetune": []} for m in mechanisms}
    with tempfile.TemporaryDirectory() as d:  # a warm-up call of each kind: first-call costs (corpus, caches) off the clock
        for m in mechanisms:
            transfer_call(m, S, Path(d))
            finetune_call(m, F, Path(d))
    for r in range(a.rounds):
        for m in mechanisms:
            with tempfile.TemporaryDirectory() as d:
                tmp = Path(d)
                t1, t3 = transfer_call(m, S, tmp), transfer_call(m, 3 * S, tmp)
                f1, f3 = finetune_call(m, F, tmp), finetune_call(m, 3 * F, tmp)
            layers = len(plans[m].layers)
            per[m]["transfer"].append((t3 - t1) / (2 * S * layers * layer_tokens))
            per[m]["finetune"].append((f3 - f1) / (2 * F * train_tokens))
            print(f"round {r + 1}/{a.rounds} {m}: transfer {per[m]['transfer'][-1]:.3f} s per 1K layer-step tokens, "
                  f"fine-tuning {per[m]['finetune'][-1]:.3f} s per 1K tokens", flush=True)
    peak_gb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024 / 1e9  # KiB on Linux
    rows = [{"mechanism": m, "stage": stage, "median_s_per_1k_tokens": round(statistics.median(v), 4),
             "rounds_s_per_1k_tokens": [round(x, 4) for x in v]}
            for m in mechanisms for stage, v in per[m].items()]
    config = {"model": a.model, "layers": a.layers, "rounds": a.rounds, "transfer_steps": [S, 3 * S],
              "finetune_steps": [F, 3 * F], "contexts": a.contexts, "context": a.context, "batch": a.batch,
              "lora": a.lora, "threads": torch.get_num_threads(), "peak_rss_gb": round(peak_gb, 2)}
    write_json(a.out, {"command": command("retrofit_cost.py", argv),
                       "config": config, "rows": rows})


if __name__ == "__main__":
    main()
