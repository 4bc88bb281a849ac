"""The two routes a key selector's keys can take through one layer's op (`windowed_attention`): as a
mask over the dense T x T scores (keep_fn) or as indices read by the selected-keys path (an
`IndexedKeep`), for the window and learned rules of `attnlab.eval.selectors`, in one process.

    python benchmarks/selector_route.py --out benchmarks/results/selector_route.json

Shape: one hybrid layer of SmolLM2-135M as the retrofit trials convert it (9 query heads over 3
key/value heads, head width 64, a sink: T + 1 op positions), batch 1, float32, no gradient, T 2,048
and 8,192, K 64 and 256, random inputs (the time does not depend on them). Search vectors of width
32 for the learned rule. Interleaved rounds (`_interleaved`): per (rule, K, T) the median seconds of
each route and the median per-round ratio mask / indices; the largest output difference as well.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "src"))
sys.path.insert(0, str(HERE))

from _interleaved import command, interleaved, ratios, write_json  # noqa: E402
from attnlab.index.keep import IndexedKeep, learned_indices, learned_keep  # noqa: E402
from attnlab.ops import window_indices, window_mask, windowed_attention  # noqa: E402


def case(rule: str, K: int, T: int):
    g = torch.Generator().manual_seed(T + K)
    B, H, G, D, n = 1, 9, 3, 64, T + 1
    q, k, v = torch.randn(B, H, n, D, generator=g), torch.randn(B, G, n, D, generator=g), torch.randn(B, G, n, D, generator=g)
    qs, ks = torch.randn(B, H, n, generator=g), torch.randn(B, H, n, generator=g)
    if rule == "window":
        mask = lambda a, b, logits: window_mask(qs[..., a:b], ks[..., :b], K, n_prefix=1)  # noqa: E731
        indices = lambda: window_indices(qs, ks, K, n_prefix=1)  # noqa: E731
    else:
        sq, sk = torch.randn(B, H, n, 32, generator=g), torch.randn(B, H, n, 32, generator=g)
        sq[:, :, 0] = sk[:, :, 0] = 0  # the sink's position, as the selector pads it
        mask, indices = learned_keep(sq, sk, K, 1), lambda: learned_indices(sq, sk, K, 1)

    def run(keep):
        with torch.no_grad():
            return windowed_attention(qs, ks, v, 0.5, None, q=q, k=k, n_prefix=1, keep_fn=keep, kernel="cauchy")

    return {"mask": lambda: run(mask), "indices": lambda: run(IndexedKeep(mask, indices))}


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", default="2048,8192")
    ap.add_argument("--K", default="64,256")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--out", default=str(HERE / "results" / "selector_route.json"))
    a = ap.parse_args(argv)
    rows = []
    for T in (int(x) for x in a.T.split(",")):
        for K in (int(x) for x in a.K.split(",")):
            for rule in ("window", "learned"):
                fns = case(rule, K, T)
                diff = (fns["mask"]() - fns["indices"]()).abs().max().item()
                r = ratios(interleaved(fns, a.rounds, warmup=0), "indices")
                rows.append({"rule": rule, "K": K, "T": T, "mask_s": r["mask"]["median_s"],
                             "indices_s": r["indices"]["median_s"], "median_ratio": r["mask"]["median_ratio"],
                             "max_abs_diff": diff, "rounds": a.rounds})
                print(f"{rule:8s} K {K:4d} T {T:5d}: mask {rows[-1]['mask_s']:.2f} s, indices "
                      f"{rows[-1]['indices_s']:.2f} s ({rows[-1]['median_ratio']:.1f}x), max |diff| {diff:.1e}", flush=True)
    write_json(a.out, {"threads": torch.get_num_threads(),
                       "command": command("selector_route.py", argv), "rows": rows})


if __name__ == "__main__":
    main()
