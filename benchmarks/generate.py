"""Decode a trained model token by token at long context: the sorted scalar cache (window k)
against exact KV-cache decoding, speed and loss side by side, in one run.

    python benchmarks/generate.py --run experiments/seed000/exp3-regularizers/runs/none/seed0
    python benchmarks/generate.py --run RUN --tokens 65536 --ks 16,64,256

One text of --tokens tokens (the run's validation split, documents concatenated) is fed to the
model one token at a time, through every decoder in lockstep: at each position t the exact
decoder and each windowed decoder (`LM.make_caches(window=k)`: scalar/hybrid layers read their k
nearest keys from `SortedScalarCache`, other layers decode exactly) take their step t, so their
timings share the machine's conditions. Per decoder and position: the wall time of the step
(`perf_counter`, one torch thread) and the negative log-likelihood of the next token. Reported
per context bucket [L/2, L) for L in powers of two: the median step latency and the mean NLL,
and the windowed NLL minus the exact NLL on the same tokens (loss gap, nats/token). At each
bucket's last position, the attention mass each window k leaves out per scalar head, measured
with `attnlab.cache.window_error` on the model's own queries and cached keys (the widest
decoder's step; its latency at those few positions includes the probe, the median does not
notice). Writes JSON and a PNG with latency, loss gap and mass left out against context length.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
SELECTORS = ("learned", "learned-hnsw", "learned-ivf", "quest")


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--run", required=True, help="a trained run folder (config.toml + checkpoints) with scalar or hybrid layers")
    p.add_argument("--tokens", type=int, default=65536, help="tokens to decode (the longest context)")
    p.add_argument("--ks", type=str, default="16,64,256", help="comma-separated windows of the sorted cache")
    p.add_argument("--split", default="val", choices=("val", "test"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--out", default=None, help="JSON path (PNG beside it); default benchmarks/results/generate.json")
    p.add_argument("--selector", nargs="*", default=[], choices=SELECTORS,
                   help="also decode through key selection, K keys: search projections trained on the run "
                        "(--selector-steps) with an exact index (learned), FAISS HNSW (learned-hnsw) or FAISS IVF "
                        "(learned-ivf: --ivf-nprobe of --ivf-nlist lists, learned at 16 keys per list), or Quest's "
                        "pages of the layers' own keys (quest, page 16)")
    p.add_argument("--selector-rope", choices=("on", "off"), default="on",
                   help="whether the search projections rotate their vectors by position (RoPE in search space)")
    p.add_argument("--ivf-nlist", type=int, default=32, help="learned-ivf: lists per layer and head")
    p.add_argument("--ivf-nprobe", type=int, default=4, help="learned-ivf: lists a step scores")
    p.add_argument("--K", type=int, default=64, help="keys per head and step of --selector")
    p.add_argument("--selector-steps", type=int, default=200, help="training steps of the search projections")
    p.add_argument("--selector-batches", type=int, default=16,
                   help="training-split sequences (of the run's context) the projections are distilled on")
    p.add_argument("--softmax-run", default=None,
                   help="a run with the same tokenizer decoded exactly on the same tokens (gap_softmax: the loss "
                        "of each decoder minus this model's)")
    args = p.parse_args(argv)
    try:
        args.ks = [int(x) for x in args.ks.split(",")]
    except ValueError:
        p.error(f"--ks must be comma-separated integers, got {args.ks!r}")
    if args.tokens < 2 or any(k < 1 for k in args.ks):
        p.error("--tokens must be >= 2 and every --ks window >= 1")
    if args.K < 1 or args.selector_steps < 0 or args.selector_batches < 1:
        p.error("--K and --selector-batches must be >= 1 and --selector-steps >= 0")
    if not 1 <= args.ivf_nprobe <= args.ivf_nlist:
        p.error(f"--ivf-nprobe must be between 1 and --ivf-nlist ({args.ivf_nlist}), got {args.ivf_nprobe}")
    if args.softmax_run is not None and not os.path.isfile(os.path.join(args.softmax_run, "config.toml")):
        p.error(f"--softmax-run {args.softmax_run!r} is not a run folder (no config.toml)")
    if not os.path.isfile(os.path.join(args.run, "config.toml")):
        p.error(f"--run {args.run!r} is not a run folder (no config.toml)")
    args.out = args.out or os.path.join(HERE, "results", "generate.json")
    return args


def long_text(cfg, n: int, split: str) -> torch.Tensor:
    """(1, n + 1) tokens of the run's corpus split, documents concatenated."""
    from attnlab.data.corpus import load_corpus
    from attnlab.data.packing import pack_documents
    from attnlab.train.data import data_tokenizer

    d = cfg.data
    stream = pack_documents(load_corpus(d.source, split, cache_dir=d.cache_dir or None), data_tokenizer(d))
    ids = torch.as_tensor(stream.tokens[: n + 1], dtype=torch.long)
    if ids.numel() < n + 1:
        raise SystemExit(f"error: the {split} split holds {ids.numel()} tokens; --tokens {n} needs {n + 1}")
    return ids[None]


def buckets(n: int) -> list[tuple[int, int]]:
    """[L/2, L) for L = 256, 512, ... up to n (the last one ends at n)."""
    out, L = [(0, min(128, n))], 256
    while L // 2 < n:
        out.append((L // 2, min(L, n)))
        L *= 2
    return out


class MassProbe:
    """At chosen positions, measure with `window_error` how much attention mass each window k leaves
    out, for the trained model's own scalar queries against its cached keys (the error report of
    benchmarks/decode.py, with trained keys instead of uniform ones). Wraps the scalar step of
    the windowed layers while the probed decoder steps; reads the cache before the step appends."""

    def __init__(self, model, ks: list[int], positions: set[int]):
        from attnlab.eval.window import windowed_layers

        self.ks, self.positions, self.rows, self.pos = ks, positions, [], None
        for i, layer in enumerate(windowed_layers(model)):
            layer.scalar_step = self._wrap(layer, i, layer.scalar_step)

    def _wrap(self, layer, index, step):
        from attnlab.cache.window_error import window_error

        def probed(p, cache):
            out = step(p, cache)  # appends this token first: the window sees it, as decoding does
            if self.pos in self.positions and cache.window is not None:
                q = layer.score_vectors(p)[0]
                q_t = q[:, :, 0] if q is not None else None
                tau = p.tau if p.tau.dim() == 1 else p.tau[..., 0]
                for k in self.ks:
                    err = window_error(cache.scalar, p.qs[..., 0], tau, q=q_t, window=k)
                    self.rows.append({"n": self.pos + 1, "layer": index, "k": k,
                                      "mass_out": err.mass_out.flatten().tolist()})
            return out

        return probed


@torch.no_grad()
def decode(model, ids: torch.Tensor, ks: list[int], extra: dict | None = None) -> dict:
    """extra: name -> (model, caches) of further decoders (selectors, another model)."""
    n = ids.shape[1] - 1
    extra = extra or {}
    names = ["exact"] + [f"k={k}" for k in ks] + list(extra)
    caches = {"exact": model.make_caches(1, exact=True)} | {f"k={k}": model.make_caches(1, window=k) for k in ks}
    caches |= {m: c for m, (_, c) in extra.items()}
    models = {m: extra[m][0] if m in extra else model for m in names}
    nll = {m: torch.empty(n) for m in names}
    wall = {m: torch.empty(n) for m in names}
    probe = MassProbe(model, ks, {hi - 1 for _, hi in buckets(n)})
    for t in tqdm(range(n), desc="decode", mininterval=5):
        x_t, y_t = ids[:, t : t + 1], ids[0, t + 1]
        for m in names:
            probe.pos = t if m == f"k={ks[-1]}" else None  # probe through the widest window's caches, untimed below
            t0 = time.perf_counter()
            logits = models[m].step(x_t, caches[m], pos=t)
            wall[m][t] = time.perf_counter() - t0
            nll[m][t] = F.cross_entropy(logits.float(), y_t[None])
    return {"nll": nll, "wall": wall, "names": names, "mass_out": probe.rows}


def summarize(res: dict, n: int) -> list[dict]:
    rows = []
    exact, soft = res["nll"]["exact"], res["nll"].get("softmax")
    for lo, hi in buckets(n):
        for m in res["names"]:
            nll = res["nll"][m][lo:hi]
            rows.append({"from": lo, "to": hi, "decoder": m, "nll": nll.mean().item(),
                         "gap": (nll - exact[lo:hi]).mean().item(),
                         **({"gap_softmax": (nll - soft[lo:hi]).mean().item()} if soft is not None else {}),
                         "step_ms_median": statistics.median((res["wall"][m][lo:hi] * 1e3).tolist())})
    return rows


def selector_decoders(args, cfg, model) -> tuple[dict, dict]:
    """The --selector decoders (name -> (model, caches)) and how their projections were trained."""
    from attnlab.cache.selected import DecodeSelector

    out, info = {}, {"K": args.K} if args.selector else {}
    learned = [n for n in args.selector if n != "quest"]
    if learned:
        from attnlab.data.corpus import load_corpus
        from attnlab.data.packing import pack_documents, sequential_batches
        from attnlab.eval.selector_training import train_selector_projections
        from attnlab.train.data import data_tokenizer

        d = cfg.data
        stream = pack_documents(load_corpus(d.source, "train", cache_dir=d.cache_dir or None), data_tokenizer(d))
        batches = [b.x for b in sequential_batches(stream, d.seq_len, 8, max_batches=max(1, args.selector_batches // 8))]
        t0 = time.perf_counter()
        proj = train_selector_projections(model, batches, args.selector_steps, rope=args.selector_rope == "on")
        info.update(steps=args.selector_steps, sequences=sum(len(b) for b in batches), seq_len=d.seq_len,
                    rope=args.selector_rope == "on",
                    train_seconds=time.perf_counter() - t0)
        if "learned-ivf" in learned:
            info.update(ivf_nlist=args.ivf_nlist, ivf_nprobe=args.ivf_nprobe)
        for name in learned:
            index = {"learned": "exact", "learned-hnsw": "hnsw", "learned-ivf": "ivf"}[name]
            sel = DecodeSelector(proj, args.K, index=index, ivf_nlist=args.ivf_nlist, ivf_nprobe=args.ivf_nprobe)
            out[f"{name}@{args.K}"] = (model, model.make_caches(1, selector=sel))
    if "quest" in args.selector:  # pages of the layers' own keys: no projections to train
        out[f"quest@{args.K}"] = (model, model.make_caches(1, selector=DecodeSelector(None, args.K, index="quest")))
    return out, info


def plot(result: dict, path: str) -> None:
    from attnlab.experiments.report import pyplot, save_figure

    plt = pyplot()
    fig, (a, b, c) = plt.subplots(1, 3, figsize=(16, 4), dpi=120)
    for i, k in enumerate(result["ks"]):
        pts = {}
        for r in result["mass_out"]:
            if r["k"] == k:
                pts.setdefault(r["n"], []).extend(r["mass_out"])
        xs = sorted(pts)
        c.plot(xs, [statistics.fmean(pts[x]) for x in xs], marker="o", ms=3, color=f"C{i + 1}", label=f"k={k}")
    c.set_xscale("log", base=2)
    c.set_xlabel("context n")
    c.set_ylabel("attention mass outside the window")
    c.set_title("mass left out, mean over scalar heads and layers", fontsize=9)
    c.grid(alpha=0.3)
    c.legend(fontsize=8)
    for i, m in enumerate(result["decoders"]):
        rows = [r for r in result["rows"] if r["decoder"] == m]
        xs = [r["to"] for r in rows]
        a.plot(xs, [r["step_ms_median"] for r in rows], marker="o", ms=3, color=f"C{i}", label=m)
        if m != "exact":
            b.plot(xs, [r["gap"] for r in rows], marker="o", ms=3, color=f"C{i}", label=m)
    for ax in (a, b):
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context (tokens decoded so far; bucket end)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    a.set_yscale("log")
    a.set_ylabel("ms per decode step (median)")
    a.set_title("decode step latency, batch 1, one thread", fontsize=9)
    b.axhline(0, color="k", lw=0.8)
    b.set_ylabel("windowed − exact NLL (nats/token)")
    b.set_title("loss of windowed decoding on the same tokens", fontsize=9)
    fig.suptitle(f"{result['run']} ({', '.join(result['attn'])})", fontsize=9)
    save_figure(fig, path)


def main(argv=None):
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    from attnlab.train.evaluate import load_run

    cfg, model, state = load_run(args.run)
    if not any(getattr(blk.attn, "sorted_decode", False) and blk.attn.n_scalar for blk in model.blocks):
        raise SystemExit(f"error: --run {args.run!r} has no layer that decodes through the sorted scalar cache "
                         f"(model.attn={cfg.model.layer_attn})")
    ids = long_text(cfg, args.tokens, args.split)
    extra, selector_info = selector_decoders(args, cfg, model)
    if args.softmax_run is not None:
        scfg, smodel, _ = load_run(args.softmax_run)
        if (scfg.data.tokenizer, scfg.data.source, scfg.model.vocab_size) != (cfg.data.tokenizer, cfg.data.source,
                                                                           cfg.model.vocab_size):
            raise SystemExit(f"error: --softmax-run {args.softmax_run!r} reads other tokens (tokenizer, source or vocabulary)")
        extra["softmax"] = (smodel, smodel.make_caches(1))
    t0 = time.perf_counter()
    res = decode(model, ids, args.ks, extra)
    n = args.tokens
    result = {
        "run": args.run, "checkpoint": state["path"], "attn": cfg.model.layer_attn, "train_seq_len": cfg.data.seq_len,
        "tokens": n, "split": args.split, "ks": args.ks, "decoders": res["names"],
        "overall": {m: {"nll": res["nll"][m].mean().item(), "gap": (res["nll"][m] - res["nll"]["exact"]).mean().item(),
                        "step_ms_median": statistics.median((res["wall"][m] * 1e3).tolist())} for m in res["names"]},
        "rows": summarize(res, n), "mass_out": res["mass_out"], "seconds": time.perf_counter() - t0,
        "selector": selector_info, "softmax_run": args.softmax_run,
        "machine": {"python": platform.python_version(), "torch": torch.__version__, "platform": platform.platform(),
                    "threads": torch.get_num_threads()},
    }
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=2)
    plot(result, os.path.splitext(args.out)[0] + ".png")
    for r in result["rows"]:
        if r["to"] & (r["to"] - 1) == 0 or r["to"] == n:
            print(f"[{r['from']:>6}, {r['to']:>6})  {r['decoder']:>6}  nll {r['nll']:.4f}  gap {r['gap']:+.4f}  "
                  f"{r['step_ms_median']:.2f} ms/step")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
