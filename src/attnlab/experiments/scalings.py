"""Seed 003's simulation: what each divisor of q·k does to the scores softmax sees.

    python -m attnlab.experiments.scalings --out experiments/seed003/simulation

The seed's setup: n keys and m = 500 queries of dimension d with independent standard normal
components (n = 32, d = 256 in the seed), every key visible to every query; the raw scores
s_ij = q_i · k_j are divided by a divisor c (attnlab's `softmax_attention` scalings: √d,
ktotal = Σ_j ‖k_j‖, kmean, krms, pnorm with p = 2, n√d) and passed through softmax.

"Preserves the distribution shape" and "avoids vanishing gradients" are defined here, before
any measurement, as four numbers per query row, averaged over the m rows:

- shape_ks: the Kolmogorov-Smirnov distance between the standardized scores z = s / c and the
  standardized weights w = softmax(z) (each shifted to mean 0 and scaled to sd 1 within the row).
  0 means softmax kept the shape (it acted linearly); large means it distorted it (a few
  weights dominate). Standardizing makes the number independent of c's size on its own.
- entropy: the entropy of w over ln n (1 = uniform weights, 0 = one key takes all).
- max_weight: the largest weight times n (1 = uniform, n = one-hot).
- grad_s: the Frobenius norm of the Jacobian of w with respect to the raw scores s,
  ‖(diag(w) − w wᵀ) / c‖_F, times n: what reaches q and k through softmax. This is the
  vanishing-gradient measure; the seed's argument looks only at the softmax input z, so
  grad_z = ‖diag(w) − w wᵀ‖_F · n is reported beside it.

The same is repeated over dimensions, key counts and three distributions (seed open question 1):
normal; heavy-tailed (Student t with 3 degrees of freedom, scaled to unit variance); and skewed
key norms (normal directions, key lengths multiplied by a log-normal factor with σ = 1). Each
setting is drawn with 3 seeds; the report gives mean ± sd over seeds and judges the seed's two
claims at its own setting (normal, d = 256, n = 32) by attnlab's verdict rule.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path

import torch

from ..ops.softmax import SCALES as SCALINGS, _divisor_naive
from ..data.cache import atomic_write_text
from .report import fmt, machine_info, markdown_table, pyplot, save_figure
from .sweep.results import mean_sd
from .sweep.verdict import judge, verdict_lines

DISTRIBUTIONS = ("normal", "heavy_tailed", "skewed_norms")
MEASURES = ("shape_ks", "entropy", "max_weight", "grad_s", "grad_z")
SEED_SETTING = ("normal", 256, 32)  # the seed's own simulation: (distribution, d, n)
DIMS = (16, 64, 256, 1024)
KEYS = (32, 256, 4096)
QUERIES = 500
SEEDS = (0, 1, 2)
P = 2.0  # pnorm's p


def draw(dist: str, m: int, n: int, d: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Queries (m, d) and keys (n, d) in float64 from one of DISTRIBUTIONS."""
    if dist == "normal":
        return torch.randn(m, d, generator=gen, dtype=torch.float64), torch.randn(n, d, generator=gen, dtype=torch.float64)
    if dist == "heavy_tailed":  # Student t, 3 dof: normal / sqrt(chi2_3 / 3), variance 3 -> scaled to 1
        def t3(rows):
            z = torch.randn(rows, d, generator=gen, dtype=torch.float64)
            chi2 = torch.randn(rows, d, 3, generator=gen, dtype=torch.float64).pow(2).sum(-1)
            return z / (chi2 / 3).sqrt() / math.sqrt(3.0)
        return t3(m), t3(n)
    if dist == "skewed_norms":
        q = torch.randn(m, d, generator=gen, dtype=torch.float64)
        k = torch.randn(n, d, generator=gen, dtype=torch.float64)
        factor = torch.exp(torch.randn(n, 1, generator=gen, dtype=torch.float64))  # log-normal, sigma 1
        return q, k * factor / math.exp(0.5)  # E[factor] = e^{1/2}: the mean key length stays ~sqrt(d)
    raise ValueError(f"dist must be one of {DISTRIBUTIONS}, got {dist!r}")


def divisor(k: torch.Tensor, scale: str) -> torch.Tensor:
    """c for n keys all visible to every query, from attnlab's own divisor code (a scalar tensor)."""
    n = k.shape[0]
    visible = torch.ones(1, n, dtype=torch.bool)
    return _divisor_naive(k[None, None], visible, scale, P).reshape(())


def _standardize(x: torch.Tensor) -> torch.Tensor:
    sd = x.std(-1, keepdim=True)
    return (x - x.mean(-1, keepdim=True)) / torch.where(sd > 0, sd, torch.ones_like(sd))


def ks_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Two-sample Kolmogorov-Smirnov distance per row of a and b (m, n): max |F_a − F_b|."""
    n = a.shape[-1]
    both = torch.cat([a, b], dim=-1).sort(-1).values  # (m, 2n) evaluation points
    fa = torch.searchsorted(a.sort(-1).values.contiguous(), both.contiguous(), right=True) / n
    fb = torch.searchsorted(b.sort(-1).values.contiguous(), both.contiguous(), right=True) / n
    return (fa - fb).abs().amax(-1)


def measure(q: torch.Tensor, k: torch.Tensor, scale: str) -> dict[str, float]:
    """The MEASURES of one (queries, keys, scaling), each the mean over query rows."""
    n = k.shape[0]
    c = divisor(k, scale)
    z = (q @ k.T) / c  # (m, n) softmax input
    w = torch.softmax(z, dim=-1)
    # ||diag(w) - w w^T||_F^2 = sum w^2 - 2 sum w^3 + (sum w^2)^2
    s2, s3 = w.pow(2).sum(-1), w.pow(3).sum(-1)
    jac = (s2 - 2 * s3 + s2 * s2).clamp_min(0).sqrt()  # (m,)
    ent = -(w * torch.log(w.clamp_min(1e-300))).sum(-1) / math.log(n)
    return {
        "shape_ks": ks_distance(_standardize(z), _standardize(w)).mean().item(),
        "entropy": ent.mean().item(),
        "max_weight": (w.amax(-1) * n).mean().item(),
        "grad_z": (jac * n).mean().item(),
        "grad_s": (jac * n / c).mean().item(),
        "divisor": c.item(),
    }


def simulate(dims=DIMS, keys=KEYS, dists=DISTRIBUTIONS, seeds=SEEDS, queries: int = QUERIES, progress: bool = True) -> list[dict]:
    """One row per (distribution, d, n, scaling, seed): the measures of the module docstring (shape_ks,
    entropy, max_weight, grad_s, grad_z) and the divisor, each a mean over the `queries` query rows.

    dims, keys, dists, seeds: the grid (the seed's own setting, normal / d = 256 / n = 32, is always
    included when "normal" is); progress: a bar on stderr."""
    rows = []
    settings = [(dist, d, n) for dist in dists for d in dims for n in keys]
    if SEED_SETTING[0] in dists and SEED_SETTING not in settings:
        settings.insert(0, SEED_SETTING)
    bar = None
    if progress:
        from tqdm import tqdm
        bar = tqdm(total=len(settings) * len(seeds), desc="simulation", file=sys.stderr)
    for dist, d, n in settings:
        for seed in seeds:
            gen = torch.Generator().manual_seed(seed)
            q, k = draw(dist, queries, n, d, gen)
            for scale in SCALINGS:
                rows.append({"dist": dist, "d": d, "n": n, "scale": scale, "seed": seed, **measure(q, k, scale)})
            if bar:
                bar.update()
    if bar:
        bar.close()
    return rows


def summarize(rows: list[dict]) -> dict:
    """{(dist, d, n, scale) as 'dist/d/n/scale': {measure: [mean, sd]}}."""
    groups: dict[str, list[dict]] = {}
    for r in rows:
        groups.setdefault(f"{r['dist']}/{r['d']}/{r['n']}/{r['scale']}", []).append(r)
    out = {}
    for key, rs in groups.items():
        out[key] = {measure: list(mean_sd([r[measure] for r in rs])[:2]) for measure in (*MEASURES, "divisor")}
    return out


RULES = [  # the seed's claims at its own setting, decided by the sweep's verdict rule
    {"name": "ktotal preserves the shape better", "metric": "shape_ks", "better": "lower", "compare": ["ktotal", "sqrt_d"]},
    {"name": "ktotal avoids vanishing gradients (w.r.t. the scores q·k)", "metric": "grad_s", "better": "higher",
     "compare": ["ktotal", "sqrt_d"]},
    {"name": "ktotal avoids vanishing gradients (w.r.t. the softmax input)", "metric": "grad_z", "better": "higher",
     "compare": ["ktotal", "sqrt_d"]},
]


def verdicts(summary: dict) -> list[dict]:
    """The seed's claims (RULES) judged at its own setting by the sweep's verdict rule, from the
    output of `summarize`; one verdict dict (outcome, reason, numbers) per rule."""
    dist, d, n = SEED_SETTING
    variants = {s: {"mean": {measure: summary[f"{dist}/{d}/{n}/{s}"][measure][0] for measure in MEASURES},
                    "sd": {measure: summary[f"{dist}/{d}/{n}/{s}"][measure][1] for measure in MEASURES}} for s in SCALINGS}
    return [judge(rule, variants) for rule in RULES]


def _cell(pair) -> str:
    mean, sd = pair
    return fmt(mean, 3) if sd is None else f"{fmt(mean, 3)} ± {sd:.2g}"


def report(results: dict, out: Path) -> str:
    """The markdown report of a `run` result: the claims, the measures, the seed's setting, the
    verdicts and every setting's table. Returns the text (`run` writes it to out/report.md)."""
    summary = results["summary"]
    dist, d, n = SEED_SETTING
    lines = ["# Seed 003, simulation: what each divisor of q·k does to softmax", "",
             "*Generated by `python -m attnlab.experiments.scalings` (`--report-only` rebuilds it from results.json); do not edit it.*", "",
             "**Claims.** Dividing q·k by the sum of the key lengths (ktotal) instead of √d preserves the shape of the "
             "score distribution through softmax better and avoids vanishing gradients (arXiv 2311.09406).", "",
             __doc__.split("\n\n", 2)[2].split("\n\nThe same is")[0], "",
             f"Scale: {QUERIES} queries per setting, seeds {', '.join(map(str, results['seeds']))}; dimensions "
             f"{', '.join(map(str, results['dims']))}; key counts {', '.join(map(str, results['keys']))}; distributions "
             f"{', '.join(results['dists'])} (normal; Student t with 3 dof scaled to unit variance; normal directions "
             "with log-normal (σ = 1) key lengths). Mean ± sd over seeds.", "",
             f"## The seed's setting: normal, d = {d}, n = {n}", ""]
    rows = [[s] + [_cell(summary[f"{dist}/{d}/{n}/{s}"][measure]) for measure in (*MEASURES, "divisor")] for s in SCALINGS]
    lines += [markdown_table(["scaling", *MEASURES, "divisor c"], rows), ""]
    lines += verdict_lines(RULES, results["verdicts"], "Verdicts (at the seed's setting)")
    lines += ["## Across dimensions, key counts and distributions", "",
              "shape_ks and grad_s per setting (mean over seeds); rows are (distribution, d, n).", ""]
    for measure in ("shape_ks", "grad_s", "entropy"):
        rows = []
        for dist_ in results["dists"]:
            for d_ in results["dims"]:
                for n_ in results["keys"]:
                    rows.append([dist_, d_, n_] + [fmt(summary[f"{dist_}/{d_}/{n_}/{s}"][measure][0], 3) for s in SCALINGS])
        lines += [f"### {measure}", "", markdown_table(["distribution", "d", "n", *SCALINGS], rows), ""]
    wins = {measure: sum(summary[f"{a}/{b}/{c}/ktotal"][measure][0] < summary[f"{a}/{b}/{c}/sqrt_d"][measure][0]
                   for a in results["dists"] for b in results["dims"] for c in results["keys"])
            for measure in ("shape_ks", "grad_s")}
    total = len(results["dists"]) * len(results["dims"]) * len(results["keys"])
    lines += [f"ktotal has the lower shape_ks (better kept shape) than √d in {wins['shape_ks']} of {total} settings, "
              f"and the lower grad_s (smaller gradient reaching q·k) in {wins['grad_s']} of {total}.", "",
              "![simulation](simulation.png)", "", f"Machine: {results['machine']}.", ""]
    return "\n".join(lines)


def plot(results: dict, path: Path) -> Path:
    """shape_ks, grad_s and entropy against d for every scaling, one row of panels per distribution,
    written to `path` (PNG); returns the path."""
    plt = pyplot()
    summary = results["summary"]
    fig, axes = plt.subplots(len(results["dists"]), 3, figsize=(13, 3.2 * len(results["dists"])), dpi=110, squeeze=False)
    n_ref = results["keys"][0]
    for row, dist in zip(axes, results["dists"]):
        for ax, measure in zip(row, ("shape_ks", "grad_s", "entropy")):
            for i, s in enumerate(SCALINGS):
                ys = [summary[f"{dist}/{d}/{n_ref}/{s}"][measure][0] for d in results["dims"]]
                ax.plot(results["dims"], ys, marker="o", ms=3, color=f"C{i}", label=s)
            ax.set_xscale("log", base=2)
            if measure == "grad_s":
                ax.set_yscale("log")
            ax.set_title(f"{measure}, {dist}, n = {n_ref}", fontsize=9)
            ax.set_xlabel("dimension d")
            ax.grid(alpha=0.3)
        row[0].legend(fontsize=7)
    return save_figure(fig, path)


def run(out: str | os.PathLike, *, dims=DIMS, keys=KEYS, dists=DISTRIBUTIONS, seeds=SEEDS, progress: bool = True,
        report_only: bool = False) -> dict:
    """Simulate the grid, judge the claims and write out/results.json, out/simulation.png and
    out/report.md (created if needed); returns the results dict (grid, rows, summary, verdicts,
    machine). report_only: simulate nothing, rebuild report.md and simulation.png from out/results.json."""
    out = Path(out)
    if report_only:
        if not (out / "results.json").is_file():
            raise FileNotFoundError(f"--report-only: no results.json in {out} (run the simulation first)")
        results = json.loads((out / "results.json").read_text())
        plot(results, out / "simulation.png")
        atomic_write_text(out / "report.md", report(results, out) + "\n")
        return results
    torch.set_num_threads(max(1, torch.get_num_threads()))
    rows = simulate(dims, keys, dists, seeds, progress=progress)
    summary = summarize(rows)
    results = {"dims": list(dims), "keys": list(keys), "dists": list(dists), "seeds": list(seeds), "queries": QUERIES,
               "scalings": list(SCALINGS), "p": P, "rows": rows, "summary": summary, "machine": machine_info(None)}
    results["verdicts"] = verdicts(summary)
    out.mkdir(parents=True, exist_ok=True)
    atomic_write_text(out / "results.json", json.dumps(results, indent=1) + "\n")
    plot(results, out / "simulation.png")
    atomic_write_text(out / "report.md", report(results, out) + "\n")
    return results


def main(argv=None) -> int:
    """`python -m attnlab.experiments.scalings [--out DIR] [--no-progress] [--report-only]`: `run`, then
    one line per verdict. Returns the exit status (0)."""
    p = argparse.ArgumentParser(description="Seed 003's simulation of the q·k scalings (results.json, report.md, simulation.png)")
    p.add_argument("--out", default="experiments/seed003/simulation", help="output folder")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--report-only", action="store_true", help="rebuild report.md and simulation.png from results.json")
    args = p.parse_args(argv)
    res = run(args.out, progress=not args.no_progress, report_only=args.report_only)
    for v, rule in zip(res["verdicts"], RULES):
        print(f"{rule['name']}: {v['outcome']} ({v['reason']})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
