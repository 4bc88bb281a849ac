"""Where a decode step's time goes, and which part of it grows with the context: the same decoders as
benchmarks/decode_speed.py, each step run under torch.profiler, rounds interleaved across contexts
and methods, and every op's self time per step compared between the first and the last context.

    python benchmarks/decode_profile.py --out benchmarks/results/decode_profile.json \
        --batch 8 --contexts 1024,65536 --methods window,window_static,window_compiled

Compiled steps are profiled with Inductor's kernel profiling on (`cpp.enable_kernel_profile`), so each
generated C++ kernel shows by name beside the ops that run outside it. A static decoder's merges of
its sorted codes (every `tail` steps, between steps; with the check every step makes for one) count
as one op, "merge of sorted codes", so
they do not hide among the step's own ops (two methods share one decoder: a merge counts for the
method whose step made it). Writes JSON: `device`,
`torch`, `threads`, `command`, and `rows` with `method`, `context`, `step_ms` (profiled: the profiler's
own cost included), `top` (the ops with the largest self time per step: `op`, `us`, `calls`) and,
for the last context, `growth` (per op, microseconds per step more than at the first context, the
largest first) and `grown_us` (the step's total growth under the profiler); the window_static rows
carry `merge_one_layer_ms`, one layer's merge at the end of the run timed both ways: `extend_codes`,
the decoder's, and `merge_codes`, every key sorted again (with `keys`, the codes merged, and
`new_keys`, those sorted in).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import statistics
import sys
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _interleaved import command  # noqa: E402
from decode_speed import Prepared  # noqa: E402  (benchmarks/decode_speed.py: the decoders, after their prompts)


MERGE = "merge of sorted codes"  # a static decoder's merge every `tail` steps, kept apart from the step's ops


def mark_merges(prep) -> None:
    """Each static decoder's merges as one profiler event (`MERGE`), whose ops are counted apart."""
    for st in prep.shared.values():
        inner = st.dec._merge

        def marked(t, force=False, inner=inner):
            with torch.profiler.record_function(MERGE):
                inner(t, force)
        st.dec._merge = marked


def in_merge(e) -> bool:
    while e is not None:
        if e.name == MERGE:
            return True
        e = e.cpu_parent
    return False


def time_merges(prep, rounds: int = 3) -> dict | None:
    """The first windowed layer's merge of its sorted codes at this context, both ways (median ms of
    `rounds`): `extend_codes` (the decoder's: the keys of one tail sorted in, its temporaries in the
    decoder's scratch buffer) and `merge_codes`
    (every key sorted again, as before it); None without a static window decoder."""
    from attnlab.cache.static import extend_codes, merge_codes

    st = prep.shared.get("window")
    if st is None:
        return None
    dec = st.dec
    state = next(s for s in dec.states.values() if s.scratch_size)  # the first layer with sorted codes
    ks, upto = state.ks, state.merged
    old = max(0, upto - dec.tail)
    base = merge_codes(ks, old)
    times: dict = {"extend_codes": [], "merge_codes": []}
    for _ in range(rounds):
        work = base.clone()
        t0 = time.perf_counter()
        extend_codes(work, ks, old, upto, dec.merge_scratch)
        times["extend_codes"].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        again = merge_codes(ks, upto)
        times["merge_codes"].append(time.perf_counter() - t0)
        assert torch.equal(work, again)
    return {k: round(statistics.median(v) * 1e3, 3) for k, v in times.items()} | {"keys": upto, "new_keys": upto - old}


def profile_steps(d, steps: int) -> tuple[dict, float]:
    """`steps` steps of one decoder under the profiler -> ({op: (self us, calls)}, wall ms per step);
    the ops of merges inside the steps are summed under `MERGE` instead of under their own names."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        t0 = time.perf_counter()
        for _ in range(steps):
            d.tok = d.step(d.tok).argmax(-1, keepdim=True)
        wall = (time.perf_counter() - t0) / steps * 1e3
    got: dict = {}
    for e in prof.events():
        key = MERGE if in_merge(e) else e.key
        us, calls = got.get(key, (0.0, 0))
        got[key] = (us + e.self_cpu_time_total, calls + (key != MERGE or e.name == MERGE))  # merges: one call each
    return got, wall


def same_name(op: str) -> str:
    """One name for the same event in every context's graph: no graph number, hash or frame id."""
    op = re.sub(r"^graph_\d+_", "", op)
    op = re.sub(r"CompiledFxGraph \w+", "CompiledFxGraph", op)
    return re.sub(r"Region: \d+/\d+", "Region", op)


def merge(into: dict, got: dict) -> None:
    for op, (us, calls) in got.items():
        op = same_name(op)
        a, b = into.get(op, (0.0, 0))
        into[op] = (a + us, b + calls)


@torch.no_grad()
def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE / "results" / "decode_profile.json"))
    ap.add_argument("--model", default="windowed")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--contexts", default="1024,65536")
    ap.add_argument("--methods", default="window,window_static,window_compiled")
    ap.add_argument("--steps", type=int, default=32, help="profiled steps per method, context and round")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--prefill-threads", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--top", type=int, default=12, help="ops listed per row")
    a = ap.parse_args(argv)
    contexts = [int(x) for x in a.contexts.split(",") if x]
    methods = [x for x in a.methods.split(",") if x]
    if len(contexts) < 2:
        raise SystemExit("--contexts: give at least two (the growth is the last over the first)")
    # what Prepared reads beside these (decode_speed.py's defaults: every context allowed, inductor)
    a.window_max = a.learned_max = a.max_hf_context = 1 << 30
    a.compile_backend = "inductor"
    import torch._inductor.config as inductor_config

    inductor_config.cpp.enable_kernel_profile = True  # each generated kernel a named event
    torch.set_num_threads(a.threads)
    torch._dynamo.reset()
    cfg = torch._dynamo.config
    limit = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
    setattr(cfg, limit, max(getattr(cfg, limit), 2 * len(contexts) * len(methods)))
    a.rounds_total, a.rounds = a.rounds, a.rounds + 1  # Prepared sizes the buffers by rounds x steps
    preps = [Prepared(a.model, a.batch, T, a, torch.device("cpu"), methods, reset=False) for T in contexts]
    for prep in preps:
        mark_merges(prep)
    ops = {(T, k): {} for T in contexts for k in methods}
    walls = {(T, k): [] for T in contexts for k in methods}
    for _ in range(a.rounds_total):
        for prep in preps:
            for k, d in prep.decs.items():
                got, wall = profile_steps(d, a.steps)
                merge(ops[(prep.T, k)], got)
                walls[(prep.T, k)].append(wall)
    n = a.rounds_total * a.steps
    merges = {prep.T: time_merges(prep) for prep in preps}
    for T, got in merges.items():
        print(f"merge at T={T} (one layer): {got}", flush=True)
    rows = []
    for T in contexts:
        for k in methods:
            if not walls[(T, k)]:
                continue
            per = {op: (us / n, calls / n) for op, (us, calls) in ops[(T, k)].items()}
            top = sorted(per.items(), key=lambda kv: -kv[1][0])[: a.top]
            row = dict(method=k, context=T, step_ms=round(sorted(walls[(T, k)])[len(walls[(T, k)]) // 2], 4),
                       top=[dict(op=op, us=round(us, 2), calls=round(c, 2)) for op, (us, c) in top])
            if T == contexts[-1]:
                first = {op: us / n for op, (us, _) in ops[(contexts[0], k)].items()}
                last = {op: us / n for op, (us, _) in ops[(T, k)].items()}
                grow = {op: last.get(op, 0.0) - first.get(op, 0.0) for op in {*first, *last}}
                row["growth"] = [dict(op=op, us=round(g, 2)) for op, g in sorted(grow.items(), key=lambda kv: -kv[1])[: a.top]]
                row["grown_us"] = round(sum(last.values()) - sum(first.values()), 2)
            if k == "window_static":
                row["merge_one_layer_ms"] = merges[T]
            rows.append(row)
            print(f"{k} T={T}: {row['step_ms']:.3f} ms/step profiled; top: "
                  + ", ".join(f"{t['op']} {t['us']:.0f} us" for t in row["top"][:5]), flush=True)
            if "growth" in row:
                print(f"  grew {row['grown_us']:.0f} us/step from T={contexts[0]}: "
                      + ", ".join(f"{g['op']} +{g['us']:.0f}" for g in row["growth"][:5]), flush=True)
    doc = {"device": f"cpu: {platform.processor() or platform.machine()}", "torch": torch.__version__,
           "threads": torch.get_num_threads(), "batch": a.batch, "model": a.model,
           "command": command("decode_profile.py", argv),
           "rows": rows}
    out = Path(a.out)
    tmp = out.with_suffix(".tmp")
    tmp.write_text(json.dumps(doc, indent=1) + "\n")
    os.replace(tmp, out)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
