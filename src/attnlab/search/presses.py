"""kvpress's presses on the items of a decoding comparison: the worker that runs inside .venv-kvpress.

kvpress (NVIDIA) compresses a Hugging Face model's KV cache once, at prefill: `with press(model):
model.model(context, past_key_values=cache)` runs the prompt with full attention and, after each
attention layer, its `forward_hook` replaces that layer's cached keys and values by the ones its
`compress` keeps. The prefill's own hidden states are those of full attention (a layer's output is
computed before its cache is pruned), so one exact prefill serves every press and budget here:
each layer's hook arguments (its input hidden states, position embeddings, cache position) and
output are recorded once, and for each (press, K) the press's own `forward_hook` is called on them
over a fresh cache holding the full keys and values, inside `with press(model)` (which sets what
the presses read from the model). The cache this leaves is the one `with press(model)` leaves,
bit for bit (`self_check`, tested). The tokens after the context (the question, a continuation)
then go through the model over that cache at their own positions, as kvpress's pipeline sends a
question (`position_ids` from the context's length on).

A press keeps K keys per layer and KV head: compression_ratio = 1 - (K + 1/2) / context, which
kvpress's `int(n * (1 - ratio))` turns into K. Run as

    .venv-kvpress/bin/python -m attnlab.search.presses --work WORK.pt --records OUT.jsonl [--minutes M]

it appends one record per item to OUT.jsonl (`records`), skipping items that file already holds.
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import torch

# name -> (kvpress class, its keyword arguments): the presses the comparison runs, at their defaults
PRESSES = {
    "streaming_llm": ("StreamingLLMPress", {"n_sink": 4}),
    "snapkv": ("SnapKVPress", {}),
    "tova": ("TOVAPress", {}),
    "knorm": ("KnormPress", {}),
    "expected_attention": ("ExpectedAttentionPress", {}),
}
FULL = "full"


def available() -> bool:
    try:
        import kvpress  # noqa: F401
    except ImportError:
        return False
    return True


def make_press(name: str, K: int, context: int):
    """The kvpress press `name` keeping K keys of a `context`-token prefill per layer and KV head."""
    import kvpress

    if name not in PRESSES:
        raise ValueError(f"press must be one of {tuple(PRESSES)}, got {name!r}")
    if not 0 < K < context:
        raise ValueError(f"a press keeps 0 < K < context keys; got K={K} for a context of {context}")
    cls, kwargs = PRESSES[name]
    press = getattr(kvpress, cls)(compression_ratio=1.0 - (K + 0.5) / context, **kwargs)
    kept = kvpress.utils.compute_n_kept(context, press.compression_ratio)
    if kept != K:
        raise RuntimeError(f"{cls} at compression_ratio {press.compression_ratio} keeps {kept} keys, not {K}")
    return press


class Prefill:
    """One exact prefill with every attention layer's forward-hook arguments recorded (`replay`)."""

    def __init__(self, model, ids: torch.Tensor):
        from transformers import DynamicCache

        self.model, self.calls = model, {}
        layers = model.model.layers
        hooks = [layer.self_attn.register_forward_hook(self._recorder(i), with_kwargs=True)
                 for i, layer in enumerate(layers)]
        self.cache = DynamicCache()
        try:
            with torch.no_grad():
                model.model(input_ids=ids, past_key_values=self.cache)
        finally:
            for h in hooks:
                h.remove()
        self.length = ids.shape[1]

    def _recorder(self, i: int):
        def hook(module, args, kwargs, output):
            self.calls[i] = (module, dict(kwargs), output)
        return hook

    def full_cache(self):
        """A fresh cache holding the prefill's full keys and values."""
        from transformers import DynamicCache

        cache = DynamicCache()
        for i, layer in enumerate(self.cache.layers):
            cache.update(layer.keys, layer.values, i)
        return cache

    @torch.no_grad()
    def replay(self, press):
        """The cache `with press(model)` would leave after this prefill, from the press's own hook."""
        cache = self.full_cache()
        with press(self.model):
            for i in sorted(self.calls):
                module, kwargs, output = self.calls[i]
                press.forward_hook(module, [], {**kwargs, "past_key_values": cache}, output)
        return cache


@torch.no_grad()
def continue_from(model, cache, ids: torch.Tensor, start: int, keep: int):
    """Logits (1, keep, V) of the last `keep` of the tokens ids (1, n), read over `cache` at positions
    start.. (the context's length, whatever the cache kept)."""
    pos = torch.arange(start, start + ids.shape[1], device=ids.device)[None]
    return model(input_ids=ids, past_key_values=cache, position_ids=pos, logits_to_keep=keep).logits


def _clock(device):
    if device.type != "cuda":
        return time.time
    return lambda: (torch.cuda.synchronize(device), time.time())[1]


def _caches(prefill: Prefill, presses, budgets):
    """(name, make_cache) for full attention and each (press, K)."""
    yield FULL, prefill.full_cache
    for p in presses:
        for K in budgets:
            yield f"{p}@{K}", (lambda p=p, K=K: prefill.replay(make_press(p, K, prefill.length)))


@torch.no_grad()
def run_item(model, item: dict, presses, budgets) -> dict:
    """Every press at every budget (and full attention) on one item: {"prefill_s", "results"} with the
    fields `decode_items.run_item` gives (task: solved/hit/asked; ppl: nll/tokens; time: ms, in
    `rounds` rounds with the order rotated, as `decode_items.timed_steps` does)."""
    from .decode_items import nll, score_answer

    device = next(model.parameters()).device
    clock = _clock(device)
    ids = torch.as_tensor(item["ids"]).long()[None].to(device)
    split = item["split"]
    t0 = clock()
    prefill = Prefill(model, ids[:, :split])
    out = {"prefill_s": round(clock() - t0, 4), "results": {}}
    todo = list(_caches(prefill, presses, budgets))
    if item["kind"] == "time":
        rounds = item.get("rounds", 3)
        for r in range(rounds):
            for name, make in todo[r % len(todo):] + todo[:r % len(todo)]:
                cache = make()
                res = out["results"].setdefault(name, {"ms": [], "kept": cache.layers[0].keys.shape[2]})
                for s in range(item["steps"]):
                    t2 = clock()
                    continue_from(model, cache, ids[:, split + s:split + s + 1], split + s, 1)
                    res["ms"].append(round(1000 * (clock() - t2), 3))
        return out
    labels = torch.as_tensor(item["labels"]).long()
    judge = score_answer if item["kind"] == "task" else nll
    for name, make in todo:
        t1 = clock()
        logits = continue_from(model, make(), ids[:, split:], split, labels.numel())[0]
        out["results"][name] = {**judge(logits, labels), "s": round(clock() - t1, 4)}
    return out


@torch.no_grad()
def self_check(model, ids: torch.Tensor, budgets) -> dict:
    """For every press and budget: whether the replayed cache equals, bit for bit, the cache that
    `with press(model): model.model(ids, past_key_values=cache)` leaves; and the kept length."""
    from transformers import DynamicCache

    prefill = Prefill(model, ids)
    report = {}
    for p in PRESSES:
        for K in budgets:
            press = make_press(p, K, ids.shape[1])
            direct = DynamicCache()
            with press(model):
                model.model(input_ids=ids, past_key_values=direct)
            replayed = prefill.replay(make_press(p, K, ids.shape[1]))
            same = all(torch.equal(a.keys, b.keys) and torch.equal(a.values, b.values)
                       for a, b in zip(direct.layers, replayed.layers))
            report[f"{p}@{K}"] = {"equal": same, "kept": [layer.keys.shape[2] for layer in replayed.layers]}
    return report


def main(argv=None) -> int:
    from .hf_model import load_model, resolve_dtype, resolve_source
    from .hf_model import resolve_device
    from .records import Slot, append_record, load_work, read_records

    ap = argparse.ArgumentParser(prog="python -m attnlab.search.presses", description=__doc__.split("\n\n")[0])
    ap.add_argument("--work", required=True, help="the work file the runner wrote (items, presses, budgets, model)")
    ap.add_argument("--records", required=True, help="JSONL file the records are appended to")
    ap.add_argument("--minutes", type=float, default=None, help="start no item that would end past this")
    ap.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    ap.add_argument("--self-check", action="store_true", help="compare replayed caches with kvpress's own (JSON)")
    a = ap.parse_args(argv)
    if a.threads is not None and a.threads < 1:
        ap.error(f"--threads must be >= 1, got {a.threads}")
    if not available():
        print("kvpress is not installed in this environment (run `make kvpress-env`)", file=sys.stderr)
        return 3
    if a.threads is not None:
        torch.set_num_threads(a.threads)
    work = load_work(a.work)
    device = resolve_device(work.get("device", "auto"))
    model = load_model(resolve_source(work["model"]), resolve_dtype(work.get("dtype", "float32")), device)
    if a.self_check:
        ids = torch.as_tensor(work["items"][0]["ids"]).long()[None].to(device)
        print(json.dumps(self_check(model, ids[:, : work["items"][0]["split"]], work["budgets"])))
        return 0
    sha = {it["id"]: it.get("sha") for it in work["items"]}
    done = {r["item"] for r in read_records([a.records])
            if r["side"] == "presses" and r.get("settings") == work["settings"] and r.get("sha") == sha.get(r["item"])}
    slot = Slot(a.minutes)
    for item in work["items"]:
        key = (item["kind"], item["split"])
        if item["id"] in done:
            continue
        if not slot.fits(key):
            print(f"stopped before {item['id']}: the next item would pass --minutes {a.minutes}", file=sys.stderr)
            break
        t0, c0 = time.time(), time.process_time()
        res = run_item(model, item, work["presses"], work["budgets"])
        append_record(a.records, {"item": item["id"], "side": "presses", "settings": work["settings"],
                                  "sha": item.get("sha"), "seconds": round(time.time() - t0, 3),
                                  "cpu_s": round(time.process_time() - c0, 3), "device": str(device),
                                  "torch": torch.__version__, "threads": torch.get_num_threads(), **res})
        slot.done(key, time.time() - t0)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
