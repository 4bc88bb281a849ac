"""Decode step latency by context length: attnlab's decoders against Hugging Face's static-cache
generate on a same-shaped Llama, in one run.

    python benchmarks/decode_speed.py --out benchmarks/results/decode_speed.json
    python benchmarks/decode_speed.py --contexts 1024,4096 --batches 1,8 --models windowed

Models (random weights: speed does not depend on them): `windowed`, the shape of configs/windowed.toml
(hybrid, Cauchy kernel, trained through 16 scalar-nearest + 32 recent keys; byte vocabulary),
`gpt2-small` (12 layers, d_model 768, 12 heads, softmax, vocabulary 50,257) and `gpt2-small-windowed`
(GPT-2 small's dimensions with the windowed model's attention). The window and learned methods run
on the models trained through a window. Methods:

- `exact`: `LM.make_caches(exact=True)` + `LM.step` (growing KV caches, eager);
- `exact_static`: `StaticDecoder(exact=True)` (buffers of the final length, eager);
- `exact_compiled`: the same decoder's step under torch.compile (CUDA graphs on the GPU);
- `window` (windowed models): its trained window through the sorted cache and the ring (`LM.make_caches()`);
- `window_static` / `window_compiled` (windowed models): the trained window through `StaticDecoder`'s
  static codes (`attnlab.cache.static.window`), eager / compiled; one decoder serves both, as one
  serves exact_static and exact_compiled; on a GPU each layer's choice of keys is one Triton kernel
  (`cache.static.window_kernel`);
- `window_ops_static` / `window_ops_compiled`: the same choice through PyTorch's ops (`window_keys`'
  impl="torch", a chain of launches per layer), beside the kernel in the same run;
- `learned` (windowed models, contexts up to --learned-max): learned key selection, `DecodeSelector`
  with search projections (random: the cost does not depend on them) scored exactly by a matmul and
  a top-K (index="exact", the device route), K = k + w of the window, through the caches (the
  prompt in one pass);
- `learned_static` / `learned_compiled` (windowed models): the same selection through `StaticDecoder`
  (search keys in a static buffer, one matmul and a top-K per step), eager / compiled;
- `hf_static`: `LlamaForCausalLM.generate(cache_implementation="static")` with SDPA on a Llama of the
  same dimensions (the step time from generating 1 and 1 + n tokens after the same prompt), contexts
  up to --max-hf-context.

For each (model, batch, context) every decoder takes the prompt, then `--rounds` interleaved rounds
of `--steps` timed steps each (wall clock, after `--warmup` steps); the median step is reported
(`step_ms`), the mean (`mean_ms`) and `amortised_ms`, what a long generation pays per token: the
mean, or for a static decoder the median plus its merges of sorted codes every `tail` steps over all
of its steps (a merge lands in whichever of the two methods sharing the decoder steps across the
tail, so their means alone would credit one method with every merge).
Writes JSON: top-level `device`, `torch`, `threads`, `bandwidth_gbps` and `bandwidth_source` (the
GPU's data-sheet peak when its name is known, else a copy measured here), `rows` with `model`,
`method`, `batch`, `context`, `step_ms`, `tokens_per_s`, `cudagraph_skips` (compiled steps on CUDA: graphs
Inductor did not capture during the warm-up, its reasons in the log; 0 when the step replays as one
CUDA graph), `bytes_per_step` (what the step must read:
weights, and the cache entries its method reads, `step_bytes` in benchmarks/decode_floor.py), `floor_ms` (those bytes at the
bandwidth: the memory-bandwidth floor) and `x_floor` (step_ms / floor_ms), `ready_s` (seconds to take
the prompt, with --prefill-threads; 0 for the second method of a shared decoder) (or `error`).
`python docs/result_tables.py decode-speed` renders it.

Whether a step stays flat as the context grows is a comparison across contexts, which the default
measures minutes apart, one context after another; `--across-contexts` keeps every context's
decoders at once and interleaves their rounds, and each row gains `x_first_context` (the median over
rounds of the step's ratio to the first context's step in the same round, every round's ratio in
`x_first_context_rounds`), `x_first_context_amortised` (the same over `amortised_ms`) and, for
`window`, `sorted_runs` (the sorted runs a step searches):

    python benchmarks/decode_speed.py --out benchmarks/results/decode_flat.json --models windowed \
        --contexts 1024,4096,16384,65536 --methods window,window_static,window_compiled --steps 64 \
        --rounds 15 --warmup 8 --prefill-threads 2 --across-contexts

    python benchmarks/decode_speed.py --smoke --out /tmp/ds.json   # every method at tiny sizes on the CPU,
                                                                   # compiled steps traced by dynamo only (< 1 min)
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE.parent / "docs"))
sys.path.insert(0, str(HERE))

from _interleaved import command  # noqa: E402
from attnlab.cache.selected import DecodeSelector  # noqa: E402
from attnlab.index.projections import SearchProjections  # noqa: E402
from attnlab.models.config import ModelConfig  # noqa: E402
from attnlab.models.lm import LM  # noqa: E402
from attnlab.models.static_decode import StaticDecoder  # noqa: E402
from gpu_tables import DECODE_METHODS as METHODS  # noqa: E402  (docs/gpu_tables.py: every method, in the table's order)
from decode_floor import HFStatic, bandwidth, hf_step_bytes, step_bytes, sync  # noqa: E402,F401  (benchmarks/decode_floor.py)

MODELS = {
    "windowed": dict(vocab_size=256, d_model=128, n_layers=4, n_heads=4, attn="hybrid",
                     attention=dict(train_window=16, local_window=32, kernel="cauchy")),
    "gpt2-small": dict(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, attn="softmax"),
    "gpt2-small-windowed": dict(vocab_size=50257, d_model=768, n_layers=12, n_heads=12, attn="hybrid",
                                attention=dict(train_window=16, local_window=32, kernel="cauchy")),
}


class Ours:
    """An attnlab decoder after its prompt: `step(tok)` -> logits."""

    def __init__(self, m: LM, method: str, idx: torch.Tensor, total: int):
        B, T = idx.shape
        self.pos, self.m = T, m
        sel = learned_selector(m, idx.device) if method == "learned" else None
        self.caches = m.make_caches(B, exact=method == "exact", selector=sel)
        self.logits = m.prefill(idx, self.caches, last=1)[:, -1]  # an exact-index selector: one pass too
        self.step = self._cache_step

    def _cache_step(self, tok):
        out = self.m.step(tok, self.caches, self.pos)
        self.pos += 1
        return out


def learned_selector(m: LM, dev) -> DecodeSelector:
    """Search projections for every layer (random weights, 32 wide, rope), K = the window's k + w keys."""
    a = m.blocks[0].attn
    proj = SearchProjections(list(range(len(m.blocks))), m.cfg.d_model, d_search=32, groups=a.n_scalar, rope=True)
    return DecodeSelector(proj.to(dev), K=a.config.options.train_window + a.config.options.local_window)


class Static:
    """One `StaticDecoder` after its prompt, stepped eagerly (`step`) or compiled (`compiled`): the two
    share its buffers, so the prompt is prefilled once."""

    def __init__(self, m: LM, kind: str, idx: torch.Tensor, total: int, dev, backend: str = "inductor"):
        sel = learned_selector(m, dev) if kind == "learned" else None
        impl = "torch" if kind == "window_ops" else "auto"  # window_ops: PyTorch's ops choose the keys, not the GPU kernel
        self.dec = StaticDecoder(m, idx.shape[0], total, exact=kind == "exact", selector=sel, window_impl=impl)
        B, H, T = idx.shape[0], m.cfg.n_heads, idx.shape[1]
        chunk = max(16, min(1024, 2**28 // (B * H * T)))  # an exact chunk's scores (B, H, chunk, T) under 1 GiB
        self.logits = self.dec.prefill(idx, chunk=chunk)
        self.eager = self.dec.step_logits
        mode = "reduce-overhead" if dev.type == "cuda" and backend == "inductor" else None
        # dynamic=False: each decoder's buffers have one shape; another decoder's (another context) gets its own
        # graph rather than turning this one dynamic
        self.fast = torch.compile(self.dec.step_logits, fullgraph=True, dynamic=False, mode=mode, backend=backend)
        self.steps, self.merge_s, merge = 0, 0.0, self.dec._merge

        def timed_merge(t, force=False):  # the window's merges every `tail` steps, timed (the prompt's excluded)
            t0, before = time.perf_counter(), list(self.dec.merged)
            merge(t, force)
            if not force and self.dec.merged != before:
                sync(dev)
                self.merge_s += time.perf_counter() - t0
        self.dec._merge = timed_merge

    def stepper(self, compiled: bool):
        def step(tok):
            self.dec._step = self.fast if compiled else self.eager
            self.steps += 1
            return self.dec.step(tok)
        return step

    def merge_ms_per_step(self) -> float:
        """The merges' time over every step the decoder took (both methods that share it): a merge lands
        in whichever method's step crosses the tail, so only the decoder's total divides fairly."""
        return self.merge_s / max(1, self.steps) * 1e3


class Stepper:
    """A method's view of a shared decoder: its own last token, the shared state."""

    def __init__(self, step, logits):
        self.step, self.logits = step, logits


class Prepared:
    """One (model, batch, context)'s decoders after their prompts and warm-up steps."""

    def __init__(self, name: str, B: int, T: int, a, dev, methods, reset: bool = True):
        kw = MODELS[name]
        self.name, self.B, self.T = name, B, T
        total = T + 2 * (a.warmup + a.rounds * a.steps) + 2  # two methods may step one shared decoder
        cfg = ModelConfig(max_seq_len=total, **kw)
        torch.manual_seed(0)
        self.m = m = LM(cfg).to(dev).eval()
        idx = torch.randint(0, cfg.vocab_size, (B, T), generator=torch.Generator().manual_seed(1)).to(dev)
        self.decs, self.errors, self.ready = {}, [], {}
        self.shared = shared = {}  # kind -> the Static decoder its _static and _compiled methods step
        if reset:
            torch._dynamo.reset()  # this configuration's compiled steps only: dynamo keeps a few graphs per function
        for method in methods:
            windowed = method.startswith(("window", "learned"))
            if windowed and ("train_window" not in kw.get("attention", {}) or T > a.window_max) \
                    or method == "learned" and T > a.learned_max:
                continue
            if method == "hf_static" and T > a.max_hf_context:
                continue
            t0 = time.perf_counter()
            torch.set_num_threads(a.prefill_threads)
            try:
                if method == "hf_static":
                    self.decs[method] = HFStatic(cfg, idx, total)
                elif method.endswith(("_static", "_compiled")):
                    kind = method.rsplit("_", 1)[0]  # exact, window or learned: one decoder serves both steps
                    if kind not in shared:
                        shared[kind] = Static(m, kind, idx, total, dev, a.compile_backend)
                    self.decs[method] = Stepper(shared[kind].stepper(method.endswith("compiled")), shared[kind].logits)
                else:
                    self.decs[method] = Ours(m, method, idx, total)
            except Exception as e:  # noqa: BLE001 - the row records what failed
                self.errors.append(dict(model=name, method=method, batch=B, context=T,
                                        error=f"{type(e).__name__}: {e}"[:300]))
            finally:
                torch.set_num_threads(a.threads)
            self.ready[method] = round(time.perf_counter() - t0, 2)  # the prompt (0 for a method sharing a decoder made already)
            print(f"  {name} B={B} T={T} {method}: ready in {self.ready[method]:.1f} s", flush=True)
        from torch._dynamo.utils import counters

        self.skips = {}
        for k, d in self.decs.items():  # warm-up (and, compiled, the compilation)
            if k != "hf_static":
                before = counters["inductor"]["cudagraph_skips"]
                tok = d.logits.argmax(-1, keepdim=True)
                for _ in range(a.warmup):
                    tok = d.step(tok).argmax(-1, keepdim=True)
                d.tok = tok
                self.skips[k] = counters["inductor"]["cudagraph_skips"] - before  # graphs Inductor did not capture
        self.rounds = {k: [] for k in self.decs}  # per method, one list of step times per round

    def time_round(self, a, dev) -> None:
        """One round: `a.steps` timed steps of every method in turn."""
        for k, d in self.decs.items():
            if k == "hf_static":
                self.rounds[k].append([d.time_steps(2 * a.steps)])  # a difference of two runs: more steps
                continue
            ts = []
            for _ in range(a.steps):
                sync(dev)
                t0 = time.perf_counter()
                d.tok = d.step(d.tok).argmax(-1, keepdim=True)
                sync(dev)
                ts.append(time.perf_counter() - t0)
            self.rounds[k].append(ts)

    def rows(self, a, dev) -> list[dict]:
        """A row per method: the median step over every round, the bytes it must read and its floor."""
        rows = list(self.errors)
        B, T, m = self.B, self.T, self.m
        for k, rounds in self.rounds.items():
            ms, mean = (f([t for r in rounds for t in r]) * 1e3 for f in (statistics.median, statistics.mean))
            static = self.shared.get(k.rsplit("_", 1)[0]) if k.endswith(("_static", "_compiled")) else None
            amortised = ms + static.merge_ms_per_step() if static is not None else mean  # what a long run pays a token
            nbytes = hf_step_bytes(self.decs[k].model, B, T) if k == "hf_static" else step_bytes(m, k, B, T)
            floor = nbytes / (a.bandwidth_gbps * 1e9) * 1e3
            rows.append(dict(model=self.name, method=k, batch=B, context=T, step_ms=round(ms, 4), mean_ms=round(mean, 4),
                             amortised_ms=round(amortised, 4),
                             tokens_per_s=round(B / ms * 1e3, 1), bytes_per_step=nbytes, floor_ms=round(floor, 5),
                             x_floor=round(ms / floor, 2), ready_s=self.ready[k],
                             **({"compile_backend": a.compile_backend} if k.endswith("_compiled") else {}),
                             **({"cudagraph_skips": self.skips[k]} if k.endswith("_compiled") and dev.type == "cuda" else {})))
            print(f"  {self.name} B={B} T={T} {k}: {ms:.3f} ms/step, {nbytes / 2**20:.1f} MiB read, "
                  f"floor {floor:.4f} ms (x{ms / floor:.1f})", flush=True)
        return rows


def sorted_runs(prep: Prepared) -> int | None:
    """The sorted runs a `window` step searches now (the index's levels in use, and its buffer when it
    holds keys), the most over layers and rows' shared index; None without a window decoder."""
    from attnlab.cache.sorted import SortedScalarCache

    d = prep.decs.get("window")
    if d is None:
        return None
    counts = [len(c.scalar.index.runs()) + (c.scalar.index.buf_len > 0)
              for c in d.caches if isinstance(getattr(c, "scalar", None), SortedScalarCache)]
    return max(counts) if counts else None


@torch.no_grad()
def measure(name: str, B: int, T: int, a, dev, methods) -> list[dict]:
    prep = Prepared(name, B, T, a, dev, methods)
    for _ in range(a.rounds):  # interleaved rounds: the machine's drift hits every method alike
        prep.time_round(a, dev)
    return prep.rows(a, dev)


@torch.no_grad()
def measure_across(name: str, B: int, contexts: list[int], a, dev, methods) -> list[dict]:
    """Every context's decoders at once, their rounds interleaved across contexts as well as methods,
    so a step's growth with the context is a ratio within each round (`x_first_context`: the median
    over rounds of this round's median step over the first context's, same method), not a comparison
    of runs minutes apart. Compiled steps keep their graphs (no reset between contexts)."""
    torch._dynamo.reset()
    cfg = torch._dynamo.config  # a graph per context and compiled method, each kept
    limit = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, limit, max(getattr(cfg, limit), 2 * len(contexts) * len(methods)))
    preps = [Prepared(name, B, T, a, dev, methods, reset=False) for T in contexts]
    for _ in range(a.rounds):
        for prep in preps:
            prep.time_round(a, dev)
    rows, first = [], preps[0]
    per_prep = [prep.rows(a, dev) for prep in preps]
    first_amortised = {r["method"]: r["amortised_ms"] for r in per_prep[0] if "error" not in r}
    for prep, prep_rows in zip(preps, per_prep):
        runs = sorted_runs(prep)
        for row in prep_rows:
            k = row["method"]
            if "error" not in row and k in first.rounds:
                per_round = [statistics.median(x) / statistics.median(y)
                             for x, y in zip(prep.rounds[k], first.rounds[k])]
                row["x_first_context"] = round(statistics.median(per_round), 4)
                row["x_first_context_rounds"] = [round(r, 4) for r in per_round]
                row["x_first_context_amortised"] = round(row["amortised_ms"] / first_amortised[k], 4)
            if k == "window" and runs is not None:
                row["sorted_runs"] = runs
            rows.append(row)
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "results" / "decode_speed.json"))
    ap.add_argument("--models", default="windowed,gpt2-small")
    ap.add_argument("--contexts", default="1024,4096,16384")
    ap.add_argument("--batches", default="1")
    ap.add_argument("--methods", default="exact,exact_static,exact_compiled,window,window_static,window_compiled,"
                    "learned,learned_static,learned_compiled,hf_static")
    ap.add_argument("--steps", type=int, default=8, help="timed steps per method and round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--window-max", type=int, default=65536, help="longest context the window methods are run at")
    ap.add_argument("--learned-max", type=int, default=8192, help="longest context for learned through the caches")
    ap.add_argument("--max-hf-context", type=int, default=16384, help="longest context for hf_static (it runs the "
                    "prompt again for every measurement)")
    ap.add_argument("--prefill-threads", type=int, default=1, help="torch threads while a prompt is prefilled "
                    "(steps are timed with --threads)")
    ap.add_argument("--max-gpt2-context", type=int, default=4096, help="longest context for the gpt2-small models")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--threads", type=int, default=1, help="torch threads on the CPU")
    ap.add_argument("--note", default="", help="what else ran on the machine, recorded in the JSON")
    ap.add_argument("--keep", action="store_true", help="keep the rows of an existing --out this run does not measure "
                    "again (each marked with the command that measured it)")
    ap.add_argument("--compile-backend", default="inductor", help="torch.compile backend of the *_compiled methods "
                    "('eager': dynamo's graph capture only, no code generation)")
    ap.add_argument("--bandwidth", type=float, default=None, help="GB/s for the floor (default: the GPU's data-sheet "
                    "peak when known, else a copy measured here)")
    ap.add_argument("--across-contexts", action="store_true", help="every context's decoders at once, rounds "
                    "interleaved across contexts: rows gain x_first_context (the step over the first context's, "
                    "median of per-round ratios), x_first_context_amortised and, for window, sorted_runs")
    ap.add_argument("--smoke", action="store_true", help="every method at tiny sizes on the CPU, compiled steps "
                    "through dynamo's eager backend: checks the script runs (under a minute), measures nothing to keep")
    a = ap.parse_args(argv)
    unknown = [x for x in a.methods.split(",") if x and x not in METHODS]
    if unknown:
        raise SystemExit(f"--methods: unknown {unknown}; known: {', '.join(METHODS)}")
    if a.smoke:
        a.device, a.models, a.contexts, a.batches = "cpu", "windowed", "48", "2"
        a.steps, a.rounds, a.warmup, a.compile_backend = 2, 1, 1, "eager"
        a.learned_max = a.window_max = a.max_hf_context = 1 << 20
    dev = torch.device(a.device)
    threads = torch.get_num_threads()
    torch.set_num_threads(a.threads)
    try:
        run(a, dev, argv)
    finally:
        torch.set_num_threads(threads)


def run(a, dev, argv) -> None:
    if a.bandwidth is None:
        a.bandwidth_gbps, source = bandwidth(dev)
    else:
        a.bandwidth_gbps, source = a.bandwidth, "given (--bandwidth)"
    print(f"bandwidth for the floor: {a.bandwidth_gbps} GB/s ({source})", flush=True)
    if dev.type == "cuda":  # why Inductor would not capture a compiled step as a CUDA graph, in the log
        torch._logging.set_logs(cudagraphs=True)
    doc = {"device": torch.cuda.get_device_name() if dev.type == "cuda" else f"cpu: {platform.processor() or platform.machine()}",
           "torch": torch.__version__, "threads": torch.get_num_threads(),
           "bandwidth_gbps": a.bandwidth_gbps, "bandwidth_source": source,
           "command": command("decode_speed.py", argv),
           "note": a.note, "rows": []}
    methods = [x for x in a.methods.split(",") if x]
    out = Path(a.out)
    kept = []
    if a.keep and out.exists():
        old = json.loads(out.read_text())
        kept = [{**r, "command": r.get("command", old.get("command"))} for r in old["rows"]]
    for name in a.models.split(","):
        for B in (int(x) for x in a.batches.split(",")):
            contexts = [T for T in (int(x) for x in a.contexts.split(","))
                        if not (name.startswith("gpt2-small") and T > a.max_gpt2_context)]
            for group in ([contexts] if a.across_contexts else [[T] for T in contexts]):
                doc["rows"] += (measure_across(name, B, group, a, dev, methods) if a.across_contexts
                                else measure(name, B, group[0], a, dev, methods))
                done = {(r["model"], r["method"], r["batch"], r["context"]) for r in doc["rows"]}
                rows = [r for r in kept if (r["model"], r["method"], r["batch"], r["context"]) not in done] + doc["rows"]
                tmp = out.with_suffix(".tmp")
                tmp.write_text(json.dumps({**doc, "rows": rows}, indent=1) + "\n")
                os.replace(tmp, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
