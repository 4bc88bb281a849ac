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
of the benchmark"). Writes the JSON after every row.

    python benchmarks/gpu_train.py --device cpu --models baseline,softmax,hybrid,windowed --cpu-both

is the same comparison on the CPU at the quickstart's shape (interleaved rounds, medians; JSON in
benchmarks/results/train_cpu.json), so the gap is watched between GPU runs. --cpu-shape times other
shapes in the same interleaved rounds, each as NAME:T:BATCH (`--cpu-shape quickstart:256:16,25m:1024:1`),
every row with its per-round medians; the JSON also holds the process's peak resident memory.
"""

from __future__ import annotations

import argparse
import contextlib
import json
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


def _cpu_shapes(spec: str, T: int, batch: int) -> list[tuple[str, int, int]]:
    """--cpu-shape: NAME or NAME:T:BATCH, comma-separated, NAME in CPU_SHAPES (a bare NAME takes --cpu-T
    and --cpu-batch)."""
    out = []
    for part in spec.split(","):
        name, *rest = part.split(":")
        if name not in CPU_SHAPES or len(rest) not in (0, 2):
            raise SystemExit(f"--cpu-shape: {part!r} is not NAME or NAME:T:BATCH with NAME in {sorted(CPU_SHAPES)}")
        out.append((name, int(rest[0]), int(rest[1])) if rest else (name, T, batch))
    return out


def cpu_comparison(a, argv) -> None:
    """The same comparison on the CPU at the quickstart's shape: every model prepared (compiled where
    asked) first, then `--rounds` interleaved rounds of `--steps` steps each; per model the median step
    over all rounds, and its ratio to the baseline of the same kind (compiled or eager) as the median
    of the per-round ratios."""
    import resource

    dev = torch.device("cpu")
    shapes = _cpu_shapes(a.cpu_shape, a.cpu_T, a.cpu_batch)
    names = [m for m in a.models.split(",") if m]
    kinds = [(m, c, s) for s in shapes for m in names
             for c in ((True, False) if a.cpu_both else (m in a.compile.split(",") or a.compile == "all",))]
    prepared = {}
    for k in kinds:
        m, c, (s, T, batch) = k
        prepared[k] = prepare(m, T, batch, a.warmup, c, dev, CPU_SHAPES[s])
        print(f"  prepared {m} ({'compiled' if c else 'eager'}, {s}): warm-up {prepared[k][1]['warmup_s']} s",
              flush=True)
    per_round = {k: [] for k in kinds}
    for r in range(a.rounds):
        for k in kinds:
            per_round[k].append(statistics.median(time_steps(prepared[k][0], a.steps)))
    rows = []
    for (m, c, (s, T, batch)), meds in per_round.items():
        base = per_round.get(("baseline", c, (s, T, batch)))
        info = dict(prepared[(m, c, (s, T, batch))][1])
        info.pop("flops_per_token")
        ms = 1e3 * statistics.median(meds)
        rows.append({"model": m, "compiled": c, "shape": s, "T": T, "batch": batch, "ms": round(ms, 3),
                     "tokens_per_s": round(batch * T / (ms / 1e3)),
                     "vs_baseline": None if base is None else round(statistics.median(
                         [b / x for b, x in zip(base, meds)]), 3),
                     "round_ms": [round(1e3 * x, 3) for x in meds], **info})
        print(f"  {m} ({'compiled' if c else 'eager'}, {s}): {rows[-1]['tokens_per_s']:,} tok/s, "
              f"{rows[-1]['vs_baseline']}x the baseline", flush=True)
    doc = {"device": "cpu", "torch": torch.__version__, "threads": torch.get_num_threads(),
           "shape": CPU_SHAPES[shapes[0][0]] if len(shapes) == 1 else {s: CPU_SHAPES[s] for s, _, _ in shapes},
           "max_rss_bytes": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,  # Linux: KiB
           "rounds": a.rounds, "steps_per_round": a.steps,
           "command": "python benchmarks/gpu_train.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "rows": rows}
    Path(a.out).write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out}")


def main(argv=None) -> None:
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
    ap.add_argument("--minutes", type=float, default=7.0, help="start no new row after this long")
    a = ap.parse_args(argv)
    if a.device == "cpu":
        a.out = a.out or str(HERE / "results" / "train_cpu.json")
        return cpu_comparison(a, argv)
    if not torch.cuda.is_available():
        raise SystemExit("benchmarks/gpu_train.py needs a CUDA GPU (or --device cpu)")
    dev = torch.device("cuda")
    torch.backends.cuda.matmul.allow_tf32 = True
    out = Path(a.out or HERE / "results" / "gpu_train.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shape": SHAPE, "shape_25m": SHAPE_25M,
           "command": "python benchmarks/gpu_train.py " + " ".join(argv if argv is not None else sys.argv[1:]),
           "peak_tflops": a.peak_tflops, "rows": []}
    deadline = time.time() + 60 * a.minutes
    compiled = set(f"{a.models},{a.at_scale},{a.long}".split(",")) if a.compile == "all" else set(a.compile.split(","))
    plan = ([(m, 1024, 8, SHAPE) for m in a.models.split(",") if m]
            + [(m, 1024, 64, SHAPE_25M) for m in a.at_scale.split(",") if m]
            + [(m, 8192, 1, SHAPE) for m in a.long.split(",") if m])
    for name, T, batch, shape in plan:
        label = {"shape": "25m"} if shape is SHAPE_25M else {}
        if time.time() > deadline:
            doc["rows"].append({"model": name, "T": T, **label, "error": "skipped: out of time"})
            continue
        try:
            if name == "trainer":
                row = {**measure_trainer(T, batch, a.steps, a.warmup, True, dev, shape, a.peak_tflops), **label}
            else:
                row = {**measure(name, T, batch, a.steps, a.warmup, name in compiled, dev, shape, a.peak_tflops), **label}
        except Exception as e:  # noqa: BLE001 - the row records what failed
            msg = str(e) if len(str(e)) <= 1500 else f"{str(e)[:500]} [...] {str(e)[-1000:]}"  # the cause is last
            row = {"model": name, "T": T, **label, "error": f"{type(e).__name__}: {msg}"}
        torch.cuda.empty_cache()
        doc["rows"].append(row)
        print(f"  {name} T={T}{' (25m)' if label else ''}: "
              + (row["error"] if "error" in row else
                 f"{row['tokens_per_s']:,} tok/s, {row['vs_benchmark']}x the benchmark's step of the same model "
                 f"({row['benchmark_tokens_per_s']:,} tok/s)" if name == "trainer" else
                 f"{row['tokens_per_s']:,} tok/s, MFU {row['mfu']:.1%}, {row['ms']} ms, graphs "
                 f"{row.get('graphs')}, breaks {row.get('breaks')}, recompiles {row.get('recompiles')}"), flush=True)
        out.write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
