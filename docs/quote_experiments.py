"""The figures docs/quoted_numbers.py quotes from the experiments' results.json that take more than
one look-up: differences and ratios of means, verdict outcomes over several rules, counts of seeds,
per-layer extremes, run times. Each is a key `NAME ARG...` (`EXPERIMENTS` maps the names)."""

from __future__ import annotations

import fnmatch
import math
from collections.abc import Callable

from quote_lookup import OPS, NumberError, _count, _mean, _runs, experiment, fmt, span, verdict  # docs/quote_lookup.py
from table_format import _sci, _signed  # docs/table_format.py


def _diff(path: str, a: str, b: str, metric: str, spec: str) -> str:
    """The mean of variant a less variant b's."""
    return fmt(_mean(path, a, metric) - _mean(path, b, metric), spec)


def _mdiff(path: str, variant: str, a: str, b: str, spec: str) -> str:
    """One variant's metric a less its metric b (means)."""
    return fmt(_mean(path, variant, a) - _mean(path, variant, b), spec)


def _msum(path: str, variant: str, a: str, b: str, spec: str) -> str:
    """One variant's metric a plus its metric b (means): an exact loss plus a windowed gap."""
    return fmt(_mean(path, variant, a) + _mean(path, variant, b), spec)


def _mratio(path: str, a: str, b: str, metric: str, spec: str) -> str:
    """The mean of variant a over variant b's."""
    return fmt(_mean(path, a, metric) / _mean(path, b, metric), spec)


def _ppl_pct(path: str, variant: str, metric: str, digits: str) -> str:
    """A loss gap (nats) as a perplexity change in %: 100 (e^gap − 1)."""
    return fmt(100 * math.expm1(_mean(path, variant, metric)), f".{digits}f")


def _ppl_change(path: str, a: str, b: str, metric: str = "val_loss") -> str:
    """How much lower (−) or higher (+) variant a's perplexity is than variant b's, in %, from their
    mean losses (nats): 100 (e^(a − b) − 1); a trial's `ppl` is compared directly."""
    if metric == "ppl":
        return _signed(100 * (_mean(path, a, "ppl") / _mean(path, b, "ppl") - 1), 1)
    return _signed(100 * math.expm1(_mean(path, a, metric) - _mean(path, b, metric)), 0)


def _outcomes(path: str, *patterns: str) -> str:
    """The outcome every verdict rule matching the patterns (fnmatch) shares, or each rule's in order."""
    rules = [v for v in experiment(path).get("verdicts") or []
             if any(fnmatch.fnmatchcase(str(v.get("name")), p) for p in patterns)]
    if not rules:
        raise NumberError(f"experiments/{path}: no verdict matches {patterns}")
    outcomes = [v["outcome"] for v in rules]
    return outcomes[0] if len(set(outcomes)) == 1 else " / ".join(outcomes)


def _verdict_field(path: str, name: str, field: str, spec: str) -> str:
    """A number a verdict rule recorded: its difference, threshold (the 2-sd margin) or margin."""
    return fmt(float(verdict(path, name)[field]), spec)


def _seeds(path: str, variant: str, metric: str, op: str, bound: str) -> str:
    """In how many seeds the metric is below (lt) or above (gt) the bound: "every seed", "1 of 3 seeds"."""
    values = [m[metric] for m in _runs(experiment(path), variant).values()]
    return _count(sum(OPS[op](x, float(bound)) for x in values), len(values))


def _seeds_most(path: str, metric: str, op: str, bound: str, *patterns: str) -> str:
    """The most seeds in which one of the variants matching the patterns has its metric below (lt) or
    above (gt) the bound: "2 of 3 seeds"."""
    res = experiment(path)
    counts = [(sum(OPS[op](m[metric], float(bound)) for m in _runs(res, v).values()), len(_runs(res, v)))
              for v in res["variants"] if any(fnmatch.fnmatchcase(v, p) for p in patterns)]
    if not counts:
        raise NumberError(f"experiments/{path}: no variant matches {patterns}")
    return _count(*max(counts))


def _paired(path: str, a: str, b: str, metric: str, op: str) -> str:
    """In how many seeds variant a's metric is below (lt) or above (gt) variant b's, seed by seed."""
    ra, rb = _runs(experiment(path), a), _runs(experiment(path), b)
    seeds = sorted(set(ra) & set(rb))
    return _count(sum(OPS[op](ra[s][metric], rb[s][metric]) for s in seeds), len(seeds))


def _seed_diffs(path: str, a: str, b: str, metric: str, spec: str) -> str:
    """The range over seeds of variant b's metric less variant a's, seed by seed."""
    ra, rb = _runs(experiment(path), a), _runs(experiment(path), b)
    return span([rb[s][metric] - ra[s][metric] for s in sorted(set(ra) & set(rb))], spec)


def _seed_mdiffs(path: str, variant: str, a: str, b: str, spec: str) -> str:
    """The range over seeds of one variant's metric a less its metric b, seed by seed."""
    runs = _runs(experiment(path), variant)
    return span([m[a] - m[b] for m in runs.values()], spec)


def _tau(path: str, *variants: str) -> str:
    """A sweep's τ at the end of training: the mean over layers (of the mean over heads and seeds),
    the range over the variants named (patterns)."""
    v = experiment(path)["variants"]
    taus = [sum(t) / len(t) for name, x in v.items() if any(fnmatch.fnmatchcase(name, p) for p in variants)
            for t in [[y for y in x["tau"] if y is not None]] if t]
    if not taus:
        raise NumberError(f"experiments/{path}: no τ for {variants}")
    return span(taus, ".2f" if len(taus) > 1 else ".3f")


def _windowed_sharp_cost() -> str:
    """experiments/windowed: what a sharp initial τ costs the hybrid in validation loss (the range over
    the sharp variants, nats)."""
    v = experiment("windowed")["variants"]
    return span([x["mean"]["val_loss"] - v["hybrid"]["mean"]["val_loss"] for n, x in v.items()
                 if n.startswith("hybrid-sharp")], ".2f")


def _mqar_stuck(path: str, what: str, recalls: str, reaches: str) -> str:
    """Over the runs that reach the pairs (some layer's region mass at least `reaches`) yet do not
    recall (mqar_accuracy at most `recalls`), without a decode window: the largest region mass
    ("region", .1f) or share of queries whose value some head reads ("reach", in %)."""
    best = []
    for r in experiment(path)["runs"]:
        m = r["metrics"]
        regions = [x for k, x in m.items() if k.startswith("mqar_region_mass@") and "/" not in k and x is not None]
        if m.get("mqar_accuracy") is None or not regions or max(regions) < float(reaches) \
                or m["mqar_accuracy"] > float(recalls):
            continue
        key = "mqar_region_mass@" if what == "region" else "mqar_value_reach@"
        best += [x for k, x in m.items() if k.startswith(key) and "/" not in k and x is not None]
    if not best:
        raise NumberError(f"experiments/{path}: no run reaches the pairs without recalling")
    return fmt(max(best), ".1f") if what == "region" else fmt(100 * max(best), ".0f")


def _value_share(path: str, layer: str) -> str:
    """The range over variants of the queried value's share of the weight on all values at the MQAR
    queries in one layer ("L0"), without a decode window (mean over seeds)."""
    shares = [v["mean"].get(f"mqar_value_share@{layer}") for v in experiment(path)["variants"].values()]
    return span([x for x in shares if x is not None], ".2f")


def _sim(what: str, measure: str) -> str:
    """Seed 003's simulation, over every (distribution, d, n) setting: `wins MEASURE` (in how many
    ktotal is lower than √d: "36 of 36"), `ratio MEASURE` (√d's over ktotal's, the range: "32× to 3.9e4×")."""
    res = experiment("seed003/simulation")
    settings = [(a, b, c) for a in res["dists"] for b in res["dims"] for c in res["keys"]]
    pairs = [(res["summary"][f"{a}/{b}/{c}/ktotal"][measure][0], res["summary"][f"{a}/{b}/{c}/sqrt_d"][measure][0])
             for a, b, c in settings]
    if what == "wins":
        return f"{sum(k < d for k, d in pairs)} of {len(pairs)}"
    ratios = [d / k for k, d in pairs]
    return f"{min(ratios):.0f}× to {_sci(max(ratios))}×"


def _layer_mass(path: str, variant: str, key: str, layers: str) -> str:
    """A search trial's per-layer Mass@K (coverage.per_layer_mass[key]): the range over the layers
    listed ("0,1,2"), or over every other layer ("other:0,1,2")."""
    mass = experiment(path)["variants"][variant]["coverage"]["per_layer_mass"][key]
    other = layers.startswith("other:")
    chosen = set(layers.removeprefix("other:").split(","))
    return span([x for layer, x in mass.items() if (layer in chosen) != other], ".2f")


def _layer_max(path: str, variant: str, key: str, spec: str) -> str:
    """A retrofit trial's per-layer statistic (mean over seeds): its largest value over the layers."""
    values = [x for x in experiment(path)["per_layer"][variant][key] if x is not None]
    return fmt(max(values), spec)


def _trial_minutes(path: str) -> str:
    """The wall time of the runs a retrofit trial ran itself, summed, in minutes: the unchanged model's
    one evaluation once (results.json repeats it for every seed), and no run copied from another trial
    (its variant's reused_from names the source folder, ".../seed<k>" for one seed, else all of them)."""
    total = 0.0
    for name, v in experiment(path)["variants"].items():
        copied = {p.rsplit("/seed", 1)[1] if "/seed" in p else "*" for p in v.get("reused_from", [])}
        runs = list(v["runs"].items())[:1] if name == "original" else v["runs"].items()
        total += sum(m["wall_s"] for seed, m in runs if "*" not in copied and str(seed) not in copied)
    return f"{total / 60:.0f} min"


def _run_times(path: str, pattern: str, unit: str) -> str:
    """The range of the wall time of one run (s or min) over the variants matching pattern (the
    unchanged model's evaluation only when named)."""
    runs = [m["wall_s"] for name, v in experiment(path)["variants"].items()
            if fnmatch.fnmatchcase(name, pattern) and (name != "original" or pattern == name)
            for m in v["runs"].values()]
    return span([x / (60 if unit == "min" else 1) for x in runs], ".0f")


def _sweep_minutes(path: str) -> str:
    """A sweep's runs' wall time (their wall_seconds, or train_seconds), summed, in minutes."""
    runs = experiment(path)["runs"]
    return f"{sum(r.get('wall_seconds') or r['train_seconds'] for r in runs) / 60:.0f} min"


def _sweep_run_minutes(path: str, *patterns: str) -> str:
    """The range of one run's wall time (minutes) over the variants matching the patterns."""
    runs = [r.get("wall_seconds") or r["train_seconds"] for r in experiment(path)["runs"]
            if any(fnmatch.fnmatchcase(r["variant"], p) for p in patterns)]
    return span([x / 60 for x in runs], ".0f")


EXPERIMENTS: dict[str, Callable[..., str]] = {
    "seeds-most": _seeds_most,
    "verdict-field": _verdict_field,
    "mqar-stuck": _mqar_stuck,
    "value-share": _value_share,
    "sweep-run-time": _sweep_run_minutes,
    "tau": _tau,
    "mdiff": _mdiff,
    "msum": _msum,
    "layer-mass": _layer_mass,
    "windowed-sharp-cost": _windowed_sharp_cost,
    "diff": _diff,
    "pplpct": _ppl_pct,
    "verdicts": _outcomes,
    "seeds": _seeds,
    "paired": _paired,
    "seed-diffs": _seed_diffs,
    "seed-mdiffs": _seed_mdiffs,
    "mratio": _mratio,
    "sim": _sim,
    "layer-max": _layer_max,
    "ppl-change": _ppl_change,
    "trial-time": _trial_minutes,
    "run-time": _run_times,
    "sweep-time": _sweep_minutes,
    "runs": lambda path: str(len(experiment(path)["runs"])),
}
