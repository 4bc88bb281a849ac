"""Reading the committed files that docs/quoted_numbers.py quotes, selecting values in them and
formatting them: the lookups every key shares."""

from __future__ import annotations

import fnmatch
import json
import re
from functools import cache
from pathlib import Path

from table_format import MINUS, _sci, _sig2, _signed, _tokens  # docs/table_format.py

ROOT = Path(__file__).resolve().parents[1]


class NumberError(ValueError):
    """A key that names nothing, or a value its file does not hold."""


# --------------------------------------------------------------------------- reading and selecting


@cache
def load(name: str):
    """A committed JSON: a path from the repository root, or NAME for benchmarks/results/NAME.json
    (NAME may hold a folder: search/middle6/results)."""
    path = ROOT / name
    if not path.is_file():
        path = ROOT / f"benchmarks/results/{name}.json"
    if not path.is_file():
        raise NumberError(f"{path.relative_to(ROOT)} does not exist")
    return json.loads(path.read_text(encoding="utf-8"))


def experiment(path: str) -> dict:
    return load(f"experiments/{path}/results.json")


STEP = re.compile(r"([^.\[\]]+)|\[([^\]]*)\]")


def select(data, path: str) -> list:
    """Every value `path` selects in data (see the module's docstring); NumberError where a key or
    a filter matches nothing."""
    found = [data]
    for key, sel in STEP.findall(path):
        nxt = []
        for node in found:
            if key:
                if not isinstance(node, dict) or key not in node:
                    raise NumberError(f"no key {key!r} at {path!r}")
                nxt.append(node[key])
            elif isinstance(node, dict):  # [a*,b]: the values of the keys matching any pattern, in order
                pats = sel.split(",")
                nxt.extend(v for k, v in node.items() if any(fnmatch.fnmatchcase(k, p) for p in pats))
            elif sel == "*":
                nxt.extend(node)
            elif sel.lstrip("-").isdigit():
                nxt.append(node[int(sel)])
            else:
                want = [re.match(r"([^=~]+)([=~])(.*)", part).groups() for part in sel.split(",")]
                hits = [e for e in node if all(str(e.get(k)) == v if op == "=" else v in str(e.get(k))
                                               for k, op, v in want)]
                if not hits:
                    raise NumberError(f"[{sel}] matches nothing at {path!r}")
                nxt.extend(hits)
        found = nxt
    return found


def one(data, path: str):
    values = select(data, path)
    if len(values) != 1:
        raise NumberError(f"{path!r} selects {len(values)} values, not one")
    return values[0]


# --------------------------------------------------------------------------- formatting


def fmt(x, spec: str) -> str:
    """x formatted by spec: a Python format spec or one of the names in the module's docstring."""
    if x is None:
        raise NumberError("the value is missing (None)")
    if m := re.fullmatch(r"x(\d)", spec):
        return f"{x:.{m[1]}f}×"
    if m := re.fullmatch(r"/x(\d)", spec):  # the inverse of a time ratio: how many times faster
        return f"{1 / x:.{m[1]}f}×"
    if m := re.fullmatch(r"\+(\d)", spec):
        return _signed(x, int(m[1]))
    if m := re.fullmatch(r"\+pct(\d)", spec):
        return _signed(100 * x, int(m[1]))
    if m := re.fullmatch(r"pct(\d)", spec):
        return f"{100 * x:.{m[1]}f}"
    if m := re.fullmatch(r"1-pct(\d)", spec):  # the share left: a mass held as the mass missed
        return f"{100 * (1 - x):.{m[1]}f}"
    if spec == "e":  # a learning rate: 1e-4
        mantissa, exp = f"{x:.0e}".split("e")
        return f"{mantissa}e{int(exp)}"
    if spec == "met":  # a target's boolean
        return "meets" if x else "misses"
    if spec == "sig2":
        return _sig2(x)
    if spec == "sci":
        return _sci(x)
    if spec == "tokens":
        return _tokens(int(x))
    if m := re.fullmatch(r"K(\d)", spec):
        return f"{x / 1e3:.{m[1]}f}K"
    if m := re.fullmatch(r"M(\d)", spec):
        return f"{x / 1e6:.{m[1]}f}M"
    if spec == "int":
        return f"{int(x):,}"
    try:
        text = format(x, spec)
    except (TypeError, ValueError) as e:
        raise NumberError(f"format {spec!r}: {e}") from None
    return text.replace("-", MINUS) if isinstance(x, (int, float)) else text


def _number(text: str) -> float:
    return float(re.sub(r"[^\d.eE+-]", "", text.replace(MINUS, "-")) or "nan")


def span(values, spec: str) -> str:
    """The range of values as formatted, smaller first ("0.60–0.70×", "+0.44 to +0.49"), or one value
    when both ends agree."""
    lo, hi = fmt(min(values), spec), fmt(max(values), spec)
    if _number(lo) > _number(hi):  # a decreasing format (1-pct, /x)
        lo, hi = hi, lo
    if lo == hi:
        return lo
    if lo[0] in "+" + MINUS:  # signed: "+0.44 to +0.49"
        return f"{lo} to {hi}"
    if lo.endswith("×") and hi.endswith("×"):
        lo = lo[:-1]
    return f"{lo}–{hi}"


# --------------------------------------------------------------------------- experiments


def _runs(res: dict, variant: str) -> dict:
    """{seed: {metric: value}} of a variant: a sweep's run records, or a trial's per-seed metrics."""
    v = res["variants"][variant]
    if "runs" in v:  # search and retrofit trials
        return {int(s): m for s, m in v["runs"].items()}
    return {r["seed"]: {**{k: x for k, x in r.items() if not isinstance(x, (dict, list))}, **r["metrics"]}
            for r in res["runs"] if r["variant"] == variant}


EXP_FMT = re.compile(r"(?P<sign>\+?)(?P<pct>pct)?(?P<d>\d)?(?P<kind>pm|m|sd|seeds)(?P<d2>\d)?")


def exp_value(path: str, variant: str, metric: str, spec: str) -> str:
    res = experiment(path)
    if variant not in res["variants"]:
        raise NumberError(f"experiments/{path}: no variant {variant!r}; it has {', '.join(res['variants'])}")
    m = EXP_FMT.fullmatch(spec)
    if not m or (m["d"] is None) == (m["d2"] is None):
        raise NumberError(f"format {spec!r}: pm3, m3, sd3, seeds3, +m3, +pm3, pct1m or pct1pm")
    d = int(m["d"] or m["d2"])
    scale = 100 if m["pct"] else 1
    plain = f",.{d}f" if d == 0 else f".{d}f"  # whole numbers with thousands separators: 23,789
    num = (lambda x: _signed(scale * x, d)) if m["sign"] else (lambda x: fmt(scale * x, plain))
    v = res["variants"][variant]
    mean, sd = v["mean"].get(metric), v["sd"].get(metric)
    if m["kind"] == "seeds":
        runs = _runs(res, variant)
        return ", ".join(num(runs[s][metric]) for s in sorted(runs))
    if mean is None:
        raise NumberError(f"experiments/{path}: {variant} has no {metric!r}")
    if m["kind"] == "m":
        return num(mean)
    sd_text = fmt(scale * sd, plain) if sd is not None else None
    if m["kind"] == "sd":
        if sd_text is None:
            raise NumberError(f"experiments/{path}: {variant} {metric} has no sd (one seed)")
        return sd_text
    return num(mean) if sd_text is None else f"{num(mean)} ± {sd_text}"


def verdict(path: str, name: str) -> dict:
    """The verdict rule NAME of an experiment (or, for a rule without a name, its index: "0")."""
    res = experiment(path)
    rules = res.get("verdicts") or []
    if name.isdigit() and int(name) < len(rules) and rules[int(name)].get("name") is None:
        return rules[int(name)]
    hits = [v for v in rules if v.get("name") == name]
    if len(hits) != 1:
        names = "; ".join(str(v.get("name")) for v in res.get("verdicts") or [])
        raise NumberError(f"experiments/{path}: {len(hits)} verdicts named {name!r}; its verdicts: {names}")
    return hits[0]


def _mean(path: str, variant: str, metric: str) -> float:
    v = experiment(path)["variants"][variant]["mean"].get(metric)
    if v is None:
        raise NumberError(f"experiments/{path}: {variant} has no {metric!r}")
    return v


def _count(hits: int, n: int) -> str:
    return "every seed" if hits == n else "no seed" if hits == 0 else f"{hits} of {n} seeds"


OPS = {"lt": lambda a, b: a < b, "gt": lambda a, b: a > b}
