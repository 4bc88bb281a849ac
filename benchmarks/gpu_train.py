"""Training throughput on a GPU: attnlab's LM per mechanism against a plain PyTorch model of the same shape.

    python benchmarks/gpu_train.py --out benchmarks/results/gpu_train.json

The baseline (`Baseline` below) uses no attnlab code: the same architecture as attnlab's softmax LM
(token embedding tied to the head, pre-norm blocks of RMSNorm, causal attention through SDPA with RoPE,
RMSNorm, SwiGLU), so the two differ only in what attnlab adds around the attention. Every model trains
on random tokens (throughput only) in bf16 autocast (float32 on the CPU) with fused AdamW, compiled where --compile names
it; per model: tokens/s (median step over --steps after --warmup), MFU against --peak-tflops (the
PaLM count: 6 N per token for the N non-embedding parameters, plus 12 L d_model T for attention),
peak memory, and the graphs, graph breaks and recompiles dynamo counted. Rows at T = 1024 (GPT-2 small:
12 layers, d_model 768, 12 heads, batch 8) for every mechanism, at configs/25m.toml's shape (the at-scale
experiment's: 8 layers, d_model 512, 8 heads, byte vocabulary, T = 1024, its batch of 64) for --at-scale
ones, and at T = 8192 (batch 1) for --long ones. The model `trainer` is `attnlab train` itself
(configs/gpt2-small.toml, byte tokenizer, the same batch) timed from its own log rows, beside this
script's step of the same model in the same process (`measure_trainer`: the trainer issue's "within 5 %
of the benchmark"). `vs_baseline`: a row's tokens/s over the baseline's at its length and shape, measured
on the same machine. Writes the JSON after every row (benchmarks/gpu_rows.py): each row under a cap
(--row-cap, --trainer-cap: the GPU check kills a row past it), none started after --seconds, and run
again on the same --out it measures only the rows the file lacks. --smoke drives every row's code
path on the CPU at tiny sizes, eager, with one row that outlives its cap.

    python benchmarks/gpu_train.py --device cpu --models baseline,softmax,hybrid,windowed --cpu-both

is the same comparison on the CPU at the quickstart's shape (interleaved rounds, medians; JSON in
benchmarks/results/train_cpu.json), so the gap is watched between GPU runs. --cpu-shape times other
shapes in the same interleaved rounds, each as NAME:T:BATCH (`--cpu-shape quickstart:256:16,25m:1024:1`),
every row with its per-round medians; the JSON also holds the process's peak resident memory.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from _interleaved import command  # noqa: E402


class _Norm(nn.Module):
    def __init__(self, d: int, eps: float = 1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(d))

    def forward(self, x):
        xf = x.float()
        return (xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight).type_as(x)


class _Block(nn.Module):
    def __init__(self, d: int, heads: int, hidden: int):
        super().__init__()
        self.heads = heads
        self.n1, self.n2 = _Norm(d), _Norm(d)
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.o = nn.Linear(d, d, bias=False)
        self.w1, self.w3 = nn.Linear(d, hidden, bias=False), nn.Linear(d, hidden, bias=False)
        self.w2 = nn.Linear(hidden, d, bias=False)

    def forward(self, x, cos, sin):
        B, T, C = x.shape
        q, k, v = self.qkv(self.n1(x)).view(B, T, 3, self.heads, C // self.heads).permute(2, 0, 3, 1, 4)

        def rope(t):  # rotate halves: (B, H, T, D)
            a, b = t.chunk(2, dim=-1)
            return torch.cat([a * cos - b * sin, a * sin + b * cos], dim=-1)

        y = F.scaled_dot_product_attention(rope(q), rope(k), v, is_causal=True)  # (B, H, T, D)
        x = x + self.o(y.transpose(1, 2).reshape(B, T, C))
        h = self.n2(x)
        return x + self.w2(F.silu(self.w1(h)) * self.w3(h))


class Baseline(nn.Module):
    """A plain PyTorch decoder LM with attnlab's softmax architecture (no attnlab code)."""

    def __init__(self, vocab: int, d: int, layers: int, heads: int, hidden: int, T: int):
        super().__init__()
        self.emb = nn.Embedding(vocab, d)
        self.blocks = nn.ModuleList(_Block(d, heads, hidden) for _ in range(layers))
        self.norm = _Norm(d)
        self.head = nn.Linear(d, vocab, bias=False)
        self.head.weight = self.emb.weight
        D = d // heads
        inv = 1.0 / 10000 ** (torch.arange(0, D, 2).float() / D)
        ang = torch.arange(T).float()[:, None] * inv[None, :]  # (T, D/2)
        self.register_buffer("cos", ang.cos(), persistent=False)
        self.register_buffer("sin", ang.sin(), persistent=False)

    def forward(self, idx, targets):
        x = self.emb(idx)
        T = idx.shape[1]
        cos, sin = self.cos[:T].to(x.dtype), self.sin[:T].to(x.dtype)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        logits = self.head(self.norm(x))
        return logits, F.cross_entropy(logits.float().flatten(0, 1), targets.flatten())


SHAPE = dict(vocab=50304, d_model=768, n_layers=12, n_heads=12)
SHAPE_25M = dict(vocab=257, d_model=512, n_layers=8, n_heads=8)  # configs/25m.toml: 25.4M parameters, bytes


def build(name: str, T: int, shape: dict = SHAPE) -> nn.Module:
    """The model of row `name`: "baseline", a mechanism, or "windowed" (configs/windowed.toml's attention)."""
    from attnlab.models import LM, ModelConfig

    hidden = 16 * math.ceil(8 * shape["d_model"] / 3 / 16)  # attnlab's SwiGLU width (model.d_ff = 0)
    if name == "baseline":
        return Baseline(shape["vocab"], shape["d_model"], shape["n_layers"], shape["n_heads"], hidden, T)
    attention = {}
    attn = name
    if name == "windowed":
        attn, attention = "hybrid", dict(train_window=16, local_window=32, kernel="cauchy")
    return LM(ModelConfig(vocab_size=shape["vocab"], d_model=shape["d_model"], n_layers=shape["n_layers"],
                          n_heads=shape["n_heads"], attn=attn, attention=attention, max_seq_len=T))


def flops_per_token(model: nn.Module, shape: dict, T: int) -> float:
    """PaLM's count: 6 N (N: parameters outside the embedding) + 12 L d_model T."""
    emb = shape["vocab"] * shape["d_model"]
    n = sum(p.numel() for p in model.parameters()) - emb
    return 6 * n + 12 * shape["n_layers"] * shape["d_model"] * T


def _dynamo_counts() -> dict:
    from torch._dynamo.utils import counters

    breaks = sum(counters["graph_break"].values())
    frames = counters["frames"].get("ok", 0)
    return {"graphs": counters["stats"].get("unique_graphs", 0), "breaks": breaks,
            "recompiles": max(0, frames - 1 - breaks)}  # frames compiled beyond the first and its resumptions


def prepare(name: str, T: int, batch: int, warmup: int, compile_it: bool, device, shape: dict = SHAPE):
    """The model of row `name` with its optimizer, warmed up: returns (step, info); step() runs one
    training step and waits for the device; info holds the warm-up time, parameters and, compiled, the
    graphs, breaks and recompiles dynamo counted over the warm-up steps."""
    torch.manual_seed(0)
    torch._dynamo.reset()
    from torch._dynamo.utils import counters

    counters.clear()
    model = build(name, T, shape).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=device.type == "cuda" or None)
    if compile_it and device.type == "cpu":  # the CPU kernels load before tracing, or the graph never uses them
        from attnlab.ops import _ext

        _ext.library()
    step_model = torch.compile(model) if compile_it else model
    idx = torch.randint(0, shape["vocab"], (batch, T + 1), device=device)
    # bf16 autocast on a GPU (as in training there); float32 on the CPU, where bf16 matmuls are emulated
    amp = torch.autocast(device.type, dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def step():
        with amp:
            _, loss = step_model(idx[:, :-1], idx[:, 1:])
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        sync()

    t0 = time.perf_counter()
    for _ in range(warmup):
        step()
    info = {"warmup_s": round(time.perf_counter() - t0, 1), "params": sum(p.numel() for p in model.parameters()),
            "flops_per_token": flops_per_token(model, shape, T)}
    if compile_it:
        info.update(_dynamo_counts())
    return step, info


def time_steps(step, steps: int) -> list[float]:
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return times


def measure(name: str, T: int, batch: int, steps: int, warmup: int, compile_it: bool, device, shape: dict = SHAPE,
            peak_tflops: float = 989.0) -> dict:
    step, info = prepare(name, T, batch, warmup, compile_it, device, shape)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    ms = 1e3 * statistics.median(time_steps(step, steps))
    tps = batch * T / (ms / 1e3)
    return {"model": name, "T": T, "batch": batch, "compiled": compile_it, "ms": round(ms, 3),
            "tokens_per_s": round(tps), "mfu": tps * info.pop("flops_per_token") / (peak_tflops * 1e12),
            "peak_bytes": torch.cuda.max_memory_allocated() if device.type == "cuda" else None, **info}


def measure_trainer(T: int, batch: int, steps: int, warmup: int, compile_it: bool, device, shape: dict = SHAPE,
                    peak_tflops: float = 989.0, log_every: int = 5) -> dict:
    """`attnlab train` itself (configs/gpt2-small.toml at `shape` with the byte tokenizer, batch `batch`, no
    gradient accumulation, bf16 autocast on a GPU) against this script's step of the same model in the same
    process: the trainer's tokens/s is the median of its log rows (each the wall time of `log_every` steps,
    the log row's one wait on the device included) after the first `warmup` steps' rows (the compile), the
    benchmark's `measure("softmax")` at the byte vocabulary. vs_benchmark: the trainer's over the
    benchmark's (the trainer issue's target: >= 0.95; evaluation and checkpoints run at the end only, as
    they are amortised over a real run's steps)."""
    import csv
    import tempfile

    from attnlab.data.tokenizer import BYTE_VOCAB_SIZE
    from attnlab.train import train

    bshape = dict(shape, vocab=BYTE_VOCAB_SIZE)
    bench = measure("softmax", T, batch, steps, warmup, compile_it, device, bshape, peak_tflops)
    first = log_every * -(-warmup // log_every)  # the rows up to here hold the compile
    total = first + log_every * max(2, -(-steps // log_every))
    with tempfile.TemporaryDirectory() as out:
        overrides = [f"model.d_model={shape['d_model']}", f"model.n_layers={shape['n_layers']}",
                     f"model.n_heads={shape['n_heads']}", "model.attn=softmax", "data.tokenizer=byte",
                     f"data.seq_len={T}", f"train.batch_size={batch}", "train.grad_accum=1", f"train.steps={total}",
                     "train.warmup_steps=1", f"train.log_every={log_every}", "train.eval_every=0", "train.eval_batches=2",
                     "train.ckpt_every=0", f"train.compile={str(compile_it).lower()}",
                     f"train.dtype={'bfloat16' if device.type == 'cuda' else 'float32'}", f"run.device={device.type}",
                     f"run.out_dir={out}", "run.name=trainer", "run.progress=false"]
        train(str(HERE.parent / "configs" / "gpt2-small.toml"), overrides)
        with open(Path(out) / "trainer" / "train.csv") as fh:
            logged = [(int(r["step"]), float(r["tokens_per_s"])) for r in csv.DictReader(fh)]
    kept = [tps for step, tps in logged if step > first]
    tps = statistics.median(kept)
    return {"model": "trainer", "T": T, "batch": batch, "vocab": BYTE_VOCAB_SIZE, "tokens_per_s": round(tps),
            "benchmark_tokens_per_s": bench["tokens_per_s"], "vs_benchmark": round(tps / bench["tokens_per_s"], 3),
            "log_tokens_per_s": [round(t) for _, t in logged], "log_every": log_every,
            "benchmark": {k: bench[k] for k in ("ms", "mfu", "peak_bytes", "warmup_s", "graphs", "breaks", "recompiles")
                          if k in bench}}


CPU_SHAPE = dict(vocab=256, d_model=128, n_layers=4, n_heads=4)  # the quickstart's model
CPU_SHAPES = {"quickstart": CPU_SHAPE, "25m": SHAPE_25M}


SMOKE_SHAPE = dict(vocab=64, d_model=32, n_layers=2, n_heads=4)  # --smoke: every row's code path on the CPU in seconds


def plan(a) -> list[dict]:
    """The rows in order: --models at T = 1024 (batch 8), --at-scale at configs/25m.toml's shape (batch 64),
    --long at T = 8192 (batch 1); under --smoke the same rows at tiny sizes, and after the first two a
    row that outlives its cap (the check's test of its row caps)."""
    T, long, b, b25 = (32, 64, 2, 2) if a.smoke else (1024, 8192, 8, 64)
    rows = ([dict(model=m, T=T, batch=b) for m in a.models.split(",") if m]
            + [dict(model=m, T=T, batch=b25, shape="25m") for m in a.at_scale.split(",") if m]
            + [dict(model=m, T=long, batch=1) for m in a.long.split(",") if m])
    for r in rows:
        r["cap"] = a.trainer_cap if r["model"] == "trainer" else a.row_cap
    if a.smoke:
        rows.insert(2, dict(model="overrun", T=0, batch=0, cap=2.0, overrun=True))
    return rows


def _show(label: str, row) -> None:
    if isinstance(row, str) or "error" in row:
        print(f"  {label}: {row if isinstance(row, str) else row['error']}", flush=True)
    elif row["model"] == "trainer":
        print(f"  {label}: {row['tokens_per_s']:,} tok/s, {row['vs_benchmark']}x the benchmark's step of the same "
              f"model ({row['benchmark_tokens_per_s']:,} tok/s)", flush=True)
    else:
        print(f"  {label}: {row['tokens_per_s']:,} tok/s ({row.get('vs_baseline')}x the baseline), MFU {row['mfu']:.1%}, "
              f"{row['ms']} ms, graphs {row.get('graphs')}, breaks {row.get('breaks')}, recompiles "
              f"{row.get('recompiles')}, warm-up {row['warmup_s']} s", flush=True)


def main(argv=None) -> None:
    t0 = time.time()
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=None, help="default benchmarks/results/gpu_train.json (cuda), train_cpu.json (cpu)")
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--models", default="baseline,softmax,trainer,hybrid,scalar,goat,goat_hybrid,principled,gla,ssd,"
                                        "cosformer,windowed", help="mechanisms, baseline, windowed (configs/windowed.toml's "
                    "attention) and trainer (`attnlab train` against this script's step of the same model)")
    ap.add_argument("--long", default="baseline,softmax,hybrid,scalar,windowed,gla", help="models also timed at T = 8192")
    ap.add_argument("--at-scale", default="softmax", help="models also timed at configs/25m.toml's shape (T = 1024, "
                                                          "batch 64)")
    ap.add_argument("--compile", default="all", help="models run under torch.compile ('all', or names)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=5, help="cpu: interleaved rounds")
    ap.add_argument("--cpu-T", type=int, default=256)
    ap.add_argument("--cpu-batch", type=int, default=8)
    ap.add_argument("--cpu-both", action="store_true", help="cpu: every model compiled and eager")
    ap.add_argument("--cpu-shape", default="quickstart",
                    help=f"cpu: the shapes timed, NAME or NAME:T:BATCH comma-separated, NAME in {sorted(CPU_SHAPES)}")
    ap.add_argument("--peak-tflops", type=float, default=989.0, help="the GPU's dense bf16 peak (H100 SXM: 989)")
    ap.add_argument("--seconds", type=float, default=420.0, help="start no new row after this long (the check's "
                    "cap of the part)")
    ap.add_argument("--row-cap", type=float, default=60.0, help="seconds a row may take, its compile included")
    ap.add_argument("--trainer-cap", type=float, default=100.0, help="seconds the trainer row may take (two compiles)")
    ap.add_argument("--smoke", action="store_true", help="every row's code path on the CPU at tiny sizes, eager "
                    "(benchmarks/gpu_check.py --smoke)")
    a = ap.parse_args(argv)
    if min(a.seconds, a.row_cap, a.trainer_cap) <= 0:
        raise SystemExit(f"--seconds, --row-cap and --trainer-cap must be > 0, got {a.seconds}, {a.row_cap}, {a.trainer_cap}")
    if a.device == "cpu" and not a.smoke:
        from gpu_train_cpu import cpu_comparison

        a.out = a.out or str(HERE / "results" / "train_cpu.json")
        return cpu_comparison(a, argv)
    if not a.smoke and not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_train.py needs a CUDA GPU (or --device cpu)")
    from gpu_rows import MACHINE, RowFile

    dev = torch.device("cpu" if a.smoke else "cuda")
    shapes = {None: SMOKE_SHAPE if a.smoke else SHAPE, "25m": SMOKE_SHAPE if a.smoke else SHAPE_25M}
    if a.smoke:
        a.steps, a.warmup, a.compile = 2, 1, "none"
    torch.backends.cuda.matmul.allow_tf32 = True
    out = Path(a.out or HERE / "results" / "gpu_train.json")
    rows = RowFile(out, {"device": torch.cuda.get_device_name() if dev.type == "cuda" else "cpu", "torch": torch.__version__,
                         "shape": shapes[None], "shape_25m": shapes["25m"], "peak_tflops": a.peak_tflops,
                         "command": command("gpu_train.py", argv)},
                   fields=("model", "T", "shape"))
    compiled = set(f"{a.models},{a.at_scale},{a.long}".split(",")) if a.compile == "all" else set(a.compile.split(","))

    def run(spec: dict) -> dict:
        shape, label = shapes[spec.get("shape")], {"shape": spec["shape"]} if spec.get("shape") else {}
        try:
            if spec["model"] == "trainer":
                return {**measure_trainer(spec["T"], spec["batch"], a.steps, a.warmup, not a.smoke, dev, shape,
                                          a.peak_tflops, log_every=1 if a.smoke else 5), **label}
            row = {**measure(spec["model"], spec["T"], spec["batch"], a.steps, a.warmup, spec["model"] in compiled, dev,
                             shape, a.peak_tflops), **label}
        finally:
            if dev.type == "cuda":
                torch.cuda.empty_cache()
        base = [r for r in rows.doc["rows"] if r["model"] == "baseline" and r["T"] == row["T"] and r.get("shape") ==
                row.get("shape") and r.get("machine") == MACHINE and r.get("tokens_per_s")]
        row["vs_baseline"] = (1.0 if row["model"] == "baseline" else
                              round(row["tokens_per_s"] / base[-1]["tokens_per_s"], 3) if base else None)
        return row

    rows.run(plan(a), run, deadline=t0 + a.seconds - 2, show=_show, min_s=3.0 if a.smoke else 20.0)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
