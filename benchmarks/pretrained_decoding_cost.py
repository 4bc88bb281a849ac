"""What one item of the pretrained-decoding comparison costs, per method, and what the whole grid costs.

Runs a few items of experiments/pretrained-decoding/spec.toml at one length through both sides
exactly as the runner does (`attnlab.search.decode_items.run_item` here, the kvpress worker in
.venv-kvpress), with projections of the spec's shapes left at their random initialisation (a cost
is the same for trained and untrained projections; no accuracy is kept), and full attention's
prefill alone at the other lengths. Writes benchmarks/results/pretrained_decoding_cost.json and the
generated experiments/pretrained-decoding/COST.md: seconds per item and method, and the grid's
CPU hours by the stated scaling. Both sides run on `--threads` torch threads (default 1: on a
machine doing other work, threads beyond the idle cores wait on each other and count CPU seconds no
item needs); a JSON measured on another count is measured again. Run it niced on a machine doing
other work and its wall seconds are upper bounds.

    nice -n 10 python benchmarks/pretrained_decoding_cost.py --length 2048 --examples 2
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

from attnlab.data.cache import atomic_write_text
from attnlab.experiments.pretrained_decoding import load_spec
from attnlab.experiments.pretrained_decoding.plan import plan
from attnlab.experiments.pretrained_decoding.runner import kvpress_python, run_presses
from attnlab.experiments.report import machine_info
from attnlab.index.projections import SearchProjections
from attnlab.report_format import markdown_table
from attnlab.search.decode_items import run_item
from attnlab.search.hf_model import load_model, model_dims, resolve_layers, resolve_source, load_hf_config
from attnlab.search.records import Slot, read_records
from attnlab.search.retrieval import resolve_groups

ROOT = Path(__file__).resolve().parents[1]
SPEC = ROOT / "experiments" / "pretrained-decoding" / "spec.toml"
OUT = ROOT / "benchmarks" / "results" / "pretrained_decoding_cost.json"


def pick(items, length: int, examples: int, kinds) -> list[dict]:
    """`examples` task items at `length` alternating between the tasks, then one item of each other kind
    in `kinds` (ppl, time)."""
    tasks = [it for it in items if it["kind"] == "task" and it["length"] == length]
    by_task = {}
    for it in tasks:
        by_task.setdefault(it["task"], []).append(it)
    chosen = [by_task[t][i] for i in range(examples) for t in sorted(by_task)][:examples]
    return chosen + [next(it for it in items if it["kind"] == k and it["length"] == length) for k in kinds if k != "task"]


_PLAN = {}


def plan_cache(spec):
    """The spec's items, planned once (tokenizing the haystacks takes a while)."""
    if "items" not in _PLAN:
        _PLAN["items"] = plan(spec)
    return _PLAN["items"]


def _combos(results: dict) -> dict:
    return {k: (round(sum(v["ms"]) / 1000, 3) if "ms" in v else v["s"]) for k, v in results.items()}


def measure(args, res: dict) -> dict:
    """Measure what `res` (the JSON so far) lacks, writing it after every item: a cut run keeps its rows."""
    spec = load_spec(args.spec)
    items = pick(plan_cache(spec), args.length, args.examples, args.kinds)
    source = resolve_source(spec.model, hub=False)
    dims = model_dims(load_hf_config(source))
    layers = resolve_layers(spec.layer_set, dims.n_layers)
    groups = resolve_groups(spec.groups, dims)
    spec_path = Path(args.spec).resolve()
    res.setdefault("spec", str(spec_path.relative_to(ROOT)) if spec_path.is_relative_to(ROOT) else str(spec_path))
    res.update(settings=spec.settings(), length=args.length, machine=machine_info(),
               grid={f"{k}/{L}": n for (k, L), n in sorted(Counter((it["kind"], it["length"])
                                                                    for it in plan_cache(spec)).items())})
    res.setdefault("rows", [])
    res.setdefault("prefill_s", {})
    done = {(r["side"], r["item"]) for r in res["rows"]}

    def save():
        atomic_write_text(Path(args.out), json.dumps(res, indent=1) + "\n")

    torch.manual_seed(0)
    proj = {name: SearchProjections(layers, dims.d_model, c.d_search, c.tau, rope=c.rope, groups=groups, score=c.score)
            for name, c in spec.train.items()}
    by_method = {m: proj[spec.trained_for(m)] for m in spec.attnlab.methods if spec.trained_for(m)}
    a = spec.attnlab
    knobs = {"page": a.page, "n_sink": a.n_sink, "ring": a.ring, "hnsw_ef_search": a.hnsw_ef_search}
    def attnlab_side():
        todo = [it for it in items if ("attnlab", it["id"]) not in done]
        prefills = [L for L in args.prefill_lengths if str(L) not in res["prefill_s"]]
        if todo or prefills:
            model = load_model(source)
        for L in prefills:
            it = next(i for i in plan_cache(spec) if i["kind"] == "task" and i["length"] == L)
            c1 = time.process_time()
            out = run_item(model, layers, it, ["full"], spec.budgets, groups, {}, knobs)
            res["prefill_s"][str(L)] = {"wall": out["prefill_s"], "cpu_item": round(time.process_time() - c1, 2)}
            save()
            print("prefill", L, res["prefill_s"][str(L)], flush=True)
        for it in todo:
            t1, c1 = time.time(), time.process_time()
            out = run_item(model, layers, it, a.methods, spec.budgets, groups, by_method, knobs)
            res["rows"].append({"item": it["id"], "kind": it["kind"], "side": "attnlab", "seconds": round(time.time() - t1, 2),
                                "cpu_s": round(time.process_time() - c1, 2), "prefill_s": out["prefill_s"],
                                "combos": _combos(out["results"])})
            save()
            print(it["id"], "attnlab", res["rows"][-1]["seconds"], flush=True)

    def presses_side():
        todo = [it for it in items if ("presses", it["id"]) not in done]
        if todo and kvpress_python().is_file():
            with tempfile.TemporaryDirectory() as tmp:
                for it in todo:  # one worker per item: each finished item is kept
                    run_presses(spec, [it], Path(tmp), Slot(None), "cpu", args.threads)
                    r = next(r for r in read_records([Path(tmp)]) if r["item"] == it["id"])
                    res["rows"].append({"item": r["item"], "kind": it["kind"], "side": "presses", "seconds": r["seconds"],
                                        "cpu_s": r.get("cpu_s"), "prefill_s": r["prefill_s"],
                                        "combos": _combos(r["results"])})
                    save()
                    print(it["id"], "presses", r["seconds"], flush=True)

    for side in args.order:
        (presses_side if side == "presses" else attnlab_side)()
    return res


def _total_sentence(side: str, seconds: float, missing: list[str]) -> str:
    if not missing:
        return f"The {side} side takes about {round(seconds / 3600, 1)} CPU hours in all."
    if not seconds:
        return f"The {side} side is not measured yet."
    return (f"What is measured of the {side} side takes {round(seconds / 3600, 1)} CPU hours; not measured yet: "
            f"{', '.join(m.split(' ', 1)[1] for m in missing)}.")


def cost_markdown(res: dict) -> str:
    """COST.md: measured seconds per item and method, and the grid's CPU hours scaled by the cost of a
    full-attention item at each length."""
    L0 = res["length"]
    m = res["machine"]
    lines = ["# What the comparison costs", "",
             f"*Generated by `python benchmarks/pretrained_decoding_cost.py` from `{OUT.relative_to(ROOT)}`; do not "
             "edit it.*", "",
             f"Measured on {m['platform']} ({m['cpus']} CPUs, {m['torch_threads']} torch threads), niced beside other "
             f"work, at {L0} tokens: per item, each side's prefill once and then every (method, K) after it, in wall "
             "seconds (what each method took) and the item's CPU seconds (the process's, all threads: the cost on an "
             "idle machine of as many cores).", ""]
    per = {}
    for r in res["rows"]:
        per.setdefault((r["side"], r["kind"]), []).append(r)
    table = []
    for (side, kind), rs in sorted(per.items()):
        methods = sorted({n.split("@")[0] for r in rs for n in r["combos"]})
        for meth in methods:
            s = sum(v for r in rs for n, v in r["combos"].items() if n.split("@")[0] == meth) / len(rs)
            table.append([side, kind, meth, round(s, 2), None])
        table.append([side, kind, "prefill", round(sum(r["prefill_s"] for r in rs) / len(rs), 2), None])
        table.append([side, kind, "**the item**", round(sum(r["seconds"] for r in rs) / len(rs), 2),
                      round(sum(r["cpu_s"] or 0 for r in rs) / len(rs), 2)])
    lines += [f"Items measured: {', '.join(sorted({r['item'] for r in res['rows']}))}.", "",
              markdown_table(["side", "item", "method (all its budgets)", "wall s per item", "CPU s per item"], table),
              ""]
    pre = {int(k): v["cpu_item"] for k, v in res["prefill_s"].items()}
    if L0 not in pre:
        return "\n".join(lines + ["(full attention's item at the measured length is not measured yet)", ""])
    lines += ["A full-attention item (its prefill and the question) by length, in CPU seconds: the factor each item's "
              "cost is scaled by below (selection and presses grow with the context as well, mostly no faster):", "",
              markdown_table(["length", "CPU s", "x the measured length"],
                             [[L, round(p, 2), round(p / pre[L0], 2)] for L, p in sorted(pre.items())]), ""]
    item_s = {(side, kind): sum(r["cpu_s"] or 0 for r in rs) / len(rs) for (side, kind), rs in per.items()}
    total, rows, missing = {"attnlab": 0.0, "presses": 0.0}, [], set()
    for key, n in res["grid"].items():
        kind, L = key.split("/")
        for side in ("attnlab", "presses"):
            if (side, kind) not in item_s or int(L) not in pre:
                missing.add(f"{side} {kind} at {L}")
                continue
            s = n * item_s[side, kind] * pre[int(L)] / pre[L0]
            total[side] += s
            rows.append([kind, int(L), n, side, round(s / 3600, 2)])
    lines += ["The grid, items x CPU seconds per item x the length's factor:", "",
              markdown_table(["item", "length", "items", "side", "CPU hours"], rows), "",
              " ".join(_total_sentence(side, total[side], [x for x in sorted(missing) if x.startswith(side)])
                       for side in ("attnlab", "presses")) + " "
              "On the GPU machine the prefill and the attention run on the GPU while FAISS's HNSW graph and the "
              "sorted index stay on its 16 CPU cores; its seconds per item are measured by the first batch "
              "(`--minutes 6` starts no item past the limit), and the grid then takes items x those seconds / 360 "
              "batches of six minutes.", ""]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spec", default=str(SPEC))
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--examples", type=int, default=2)
    ap.add_argument("--out", default=str(OUT))
    ap.add_argument("--kinds", default="task,ppl,time", help="the kinds of item measured (comma list)")
    ap.add_argument("--prefill-lengths", default="2048,4096,8192", help="lengths whose full-attention item is measured")
    ap.add_argument("--order", default="presses,attnlab", help="which side is measured first")
    ap.add_argument("--threads", type=int, default=1,
                    help="torch threads of both sides (default 1: more threads than idle cores spin and inflate the "
                         "CPU seconds; a JSON measured on another count is measured again)")
    ap.add_argument("--markdown-only", action="store_true", help="rewrite COST.md from the committed JSON")
    args = ap.parse_args(argv)
    if args.threads < 1:
        ap.error(f"--threads must be >= 1, got {args.threads}")
    args.kinds, args.order = args.kinds.split(","), args.order.split(",")
    args.prefill_lengths = [int(x) for x in args.prefill_lengths.split(",") if x]
    out = Path(args.out)
    res = json.loads(out.read_text()) if out.is_file() else {}  # resumes: measures only what is missing
    if not args.markdown_only:
        if res and res.get("machine", {}).get("torch_threads") != args.threads:
            print(f"{out} was measured on {res.get('machine', {}).get('torch_threads')} threads, not {args.threads}: "
                  "measured again", flush=True)
            res = {}
        torch.set_num_threads(args.threads)
        res = measure(args, res)
    atomic_write_text(Path(args.spec).parent / "COST.md", cost_markdown(res))
    print(cost_markdown(res))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
