"""One training step of the learned selector's search losses (`attnlab.index.projections`) three
ways, in one process: the teacher's targets built in the step (`search_losses`, as a caller with a
new teacher each step does); built once and reused (`search_targets` + `search_losses_from`, as
`train_selector_projections` does: its teacher is fixed); and the latter with its two log-sum-exps
taken by `torch.logsumexp` (`plain_lse`, here only) instead of the library's, which holds every
exponent above `exp_floor` (eager exp on a CPU is slower per element where it underflows).

    python benchmarks/search_losses.py --out benchmarks/results/search_losses.json

Shape: one layer of the retrofit trials' hybrid selector (9 heads, unit search vectors of width 32
as `SearchProjections` makes them, tau 0.05, k_pos 16), a batch of 2 contexts of T tokens
(B * H = 18 rows), float32, forward and backward of L_NCE + L_KL. Interleaved rounds
(`_interleaved`): per T the median seconds of each route and its median per-round ratio to the
cached route; the largest difference of the losses and gradients between routes, and against the
query-by-query reference (`impl="naive"`) at T <= 256.
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
from attnlab.index.projections import search_losses, search_losses_from, search_targets  # noqa: E402

TAU, K_POS = 0.05, 16


def plain_lse(qs, ks, t, tau):
    """`search_losses_from` with `torch.logsumexp` for its two log-sum-exps."""
    z = (qs @ ks.transpose(1, 2)) / tau
    neg = torch.finfo(z.dtype).min
    lse_all = torch.logsumexp(z.masked_fill(~t.allowed, neg), dim=-1)
    lse_pos = torch.logsumexp(z.gather(-1, t.pos).masked_fill(~t.pos_ok, neg), dim=-1)
    nce = torch.where(t.has, lse_all - lse_pos, torch.zeros_like(lse_all)).mean()
    kl = t.ent - (qs * (t.a @ ks)).sum(-1) / tau + torch.where(t.mass > 0, lse_all * t.mass, torch.zeros_like(lse_all))
    return nce, kl.mean()


def case(T: int, rows: int = 18, d: int = 32):
    g = torch.Generator().manual_seed(T)
    unit = lambda: torch.nn.functional.normalize(torch.randn(rows, T, d, generator=g), dim=-1)  # noqa: E731
    qs, ks = unit(), unit()
    allowed = torch.ones(T, T, dtype=torch.bool).tril().expand(rows, T, T)
    teacher = torch.softmax(torch.randn(rows, T, T, generator=g).masked_fill(~allowed, float("-inf")), -1)
    targets = search_targets(teacher, allowed, K_POS)

    def step(loss_fn):
        q, k = qs.clone().requires_grad_(), ks.clone().requires_grad_()
        nce, kl = loss_fn(q, k)
        (nce + kl).backward()
        return torch.stack([nce.detach(), kl.detach()]), q.grad, k.grad

    fns = {"in_step": lambda: step(lambda q, k: search_losses(q, k, teacher, allowed, TAU, K_POS)),
           "cached": lambda: step(lambda q, k: search_losses_from(q, k, targets, TAU)),
           "plain_lse": lambda: step(lambda q, k: plain_lse(q, k, targets, TAU))}
    naive = (lambda: step(lambda q, k: search_losses(q, k, teacher, allowed, TAU, K_POS, impl="naive"))) if T <= 256 else None
    return fns, naive


def _diff(a, b) -> float:
    return max((x - y).abs().max().item() for x, y in zip(a, b))


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", default="256,512,1024")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--out", default=str(HERE / "results" / "search_losses.json"))
    a = ap.parse_args(argv)
    out_rows = []
    for T in (int(x) for x in a.T.split(",")):
        fns, naive = case(T)
        ref = fns["in_step"]()
        row = {"T": T, "max_abs_diff": max(_diff(ref, fns[name]()) for name in ("cached", "plain_lse")),
               "max_abs_diff_naive": _diff(ref, naive()) if naive else None, "rounds": a.rounds}
        r = ratios(interleaved(fns, a.rounds), "cached")
        for name in fns:
            row[f"{name}_s"], row[f"{name}_ratio"] = r[name]["median_s"], r[name]["median_ratio"]
        out_rows.append(row)
        print(f"T {T:5d}: cached {row['cached_s'] * 1e3:.1f} ms; targets in the step {row['in_step_ratio']:.2f}x, "
              f"torch.logsumexp {row['plain_lse_ratio']:.2f}x; max |diff| {row['max_abs_diff']:.1e}", flush=True)
    write_json(a.out, {"threads": torch.get_num_threads(),
                       "command": command("search_losses.py", argv), "rows": out_rows})


if __name__ == "__main__":
    main()
