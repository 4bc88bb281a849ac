"""Whether a static decoder should keep each layer's q, k, v weights stacked (`StaticDecoder._sync_qkv`):
the compiled decode step with the stacks against the same step stacking the weights at every token, per
model shape, in one process.

    python benchmarks/decode_stack.py --out benchmarks/results/decode_stack.json

Shapes: `gpt2-small` (12 layers, d_model 768, softmax, exact step over a 1,024-position buffer after a
512-token prompt: 2.4 MB of q/k/v weights a layer) and `windowed` (configs/windowed.toml's model, its
trained window over a 4,096-position buffer after a 3,000-token prompt: 0.2 MB a layer). Random weights
(the time does not depend on them), batch 1, float32, torch.compile's default mode (CUDA graphs on a GPU,
as `StaticDecoder(compile=True)`). Per shape both decoders are compiled and warmed, then `--rounds`
interleaved rounds of `--steps` steps each; the median ms per step of each and the ratio stacked / unstacked.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from _interleaved import command  # noqa: E402
from attnlab.models import LM, ModelConfig  # noqa: E402
from attnlab.models.static_decode import StaticDecoder  # noqa: E402

SHAPES = {
    "gpt2-small": (dict(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, attn="softmax", max_seq_len=1100),
                   1024, 512, True),
    "windowed": (dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4, attn="hybrid", max_seq_len=4200,
                      attention=dict(train_window=16, local_window=32, kernel="cauchy")), 4096, 3000, False),
}


def _sync(dev) -> None:
    if dev.type == "cuda":
        torch.cuda.synchronize()


def measure(shape: str, steps: int, rounds: int, dev) -> dict:
    kw, max_len, prompt, exact = SHAPES[shape]
    torch.manual_seed(0)
    m = LM(ModelConfig(**kw)).to(dev).eval()
    idx = torch.randint(0, kw["vocab_size"], (1, prompt), generator=torch.Generator().manual_seed(1)).to(dev)
    decs = {}
    for kind in ("stacked", "unstacked"):
        d = StaticDecoder(m, 1, max_len, compile=True, exact=exact)
        if kind == "unstacked":  # vectors() stacks wq, wk, wv at every call, as the forward does
            d.fused = [False] * len(d.fused)
        tok = d.prefill(idx).argmax(-1, keepdim=True)
        for _ in range(3):
            tok = d.step(tok).argmax(-1, keepdim=True)
        decs[kind] = [d, tok]
    times = {k: [] for k in decs}
    for _ in range(rounds):
        for k, dt in decs.items():
            _sync(dev)
            t0 = time.perf_counter()
            for _ in range(steps):
                dt[1] = dt[0].step(dt[1]).argmax(-1, keepdim=True)
            _sync(dev)
            times[k].append((time.perf_counter() - t0) / steps * 1e3)
    med = {k: statistics.median(v) for k, v in times.items()}
    qkv = sum(p.numel() * p.element_size() for n in ("wq", "wk", "wv") for p in getattr(m.blocks[0].attn, n).parameters())
    return {"shape": shape, "qkv_bytes_per_layer": qkv, "stacked_ms": round(med["stacked"], 3),
            "unstacked_ms": round(med["unstacked"], 3), "ratio": round(med["stacked"] / med["unstacked"], 3),
            "round_ms": {k: [round(t, 3) for t in v] for k, v in times.items()}}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "results" / "decode_stack.json"))
    ap.add_argument("--shapes", default="gpt2-small,windowed")
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=9)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args(argv)
    shapes = [s for s in a.shapes.split(",") if s]
    unknown = [s for s in shapes if s not in SHAPES]
    if unknown:
        raise SystemExit(f"--shapes: unknown {unknown}; known: {', '.join(SHAPES)}")
    torch.set_num_threads(a.threads)
    dev = torch.device(a.device)
    doc = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else f"cpu: {platform.machine()}",
           "torch": torch.__version__, "threads": a.threads,
           "command": command("decode_stack.py", argv),
           "rows": []}
    for s in shapes:
        row = measure(s, a.steps, a.rounds, dev)
        doc["rows"].append(row)
        print(f"  {s}: stacked {row['stacked_ms']} ms, unstacked {row['unstacked_ms']} ms ({row['ratio']}x)", flush=True)
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}")


if __name__ == "__main__":
    main()
