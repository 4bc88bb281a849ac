"""The verdict rules of a sweep: a spec's [verdict] (one rule) or [[verdict]] (several).

Two kinds of rule, both with the same margin, twice the sample sd over seeds:

- compare: "A is better than B in metric M" (B may be judged on another metric, metric_b, e.g. a
  windowed loss against a softmax model's exact loss; then A and B may be the same variant, e.g.
  one model's learned selector against its Quest selector). Supported when A's mean beats B's by more
  than 2 * sqrt(sd_A^2 + sd_B^2), not supported when B's beats A's by more than that, else
  inconclusive.
  Two optional keys make the claim quantitative: `by` (A beats B by more than this amount, e.g. a
  loss drop of ln 1.03 for "3 % lower perplexity") and `times` (B's mean and sd are scaled first,
  e.g. times = 0.5 for "A's sink share is below half of B's"). The margin applies to what is left:
  supported when A beats times * B by more than by + 2 * sqrt(sd_A^2 + (times * sd_B)^2), not
  supported when it falls short of `by` by more than that margin. A negative `by` is a
  non-inferiority margin (A worse than B by less than |by|).
- threshold: "variant A's metric M is below (better = "lower") or above x". Supported when the mean
  is on the right side of x by more than 2 * sd_A, not supported when it is on the wrong side by
  more than that, else inconclusive.

Fewer than 2 finished seeds (no sd) is always inconclusive.
"""


from __future__ import annotations

import math

from attnlab.models.config import ConfigError

from ..report import fmt

RULE_KEYS = ("name", "metric", "better", "compare", "metric_b", "by", "times", "variant", "threshold")
OUTCOMES = ("supported", "not supported", "inconclusive")


def verdict(mean_a, sd_a, mean_b, sd_b, better: str = "lower", by: float = 0.0) -> str:
    """'supported' when A beats B by more than by + 2 * sqrt(sd_a^2 + sd_b^2), 'not supported'
    when A's gain over B falls short of `by` by more than 2 * sqrt(...) (for by = 0: B beats A by
    more than that), else (or when a mean or sd is missing) 'inconclusive'.
    A threshold is a B with sd 0."""
    if better not in ("lower", "higher"):
        raise ValueError(f"better must be 'lower' or 'higher', got {better!r}")
    if None in (mean_a, sd_a, mean_b, sd_b):
        return "inconclusive"
    gain = ((mean_b - mean_a) if better == "lower" else (mean_a - mean_b)) - by  # > 0: A is better by more than `by`
    threshold = 2.0 * math.sqrt(sd_a ** 2 + sd_b ** 2)
    if gain > threshold:
        return "supported"
    if -gain > threshold:
        return "not supported"
    return "inconclusive"


def _need(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def check_rules(raw, variants: list[str], metrics: list[str]) -> list[dict]:
    """The spec's verdict rules, checked: a table is one rule, an array of tables several."""
    rules = [raw] if isinstance(raw, dict) else raw
    _need(isinstance(rules, list) and rules and all(isinstance(r, dict) for r in rules),
          f"verdict must be a table or an array of tables, got {raw!r}")
    out, names = [], set()
    for i, r in enumerate(rules):
        key = "verdict" if isinstance(raw, dict) else f"verdict[{i}]"
        unknown = sorted(set(r) - set(RULE_KEYS))
        _need(not unknown, f"{key}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(RULE_KEYS)}")
        for k in ("metric", "better"):
            _need(k in r, f"{key}.{k} is missing; a verdict needs metric, better and compare (or variant and threshold)")
        for k in ("metric", "metric_b"):
            if k in r:
                _need(r[k] in metrics, f"{key}.{k} must be a per-run scalar: one of {', '.join(metrics)}; got {r[k]!r}")
        _need(r["better"] in ("lower", "higher"), f"{key}.better must be 'lower' or 'higher', got {r['better']!r}")
        if "threshold" in r or "variant" in r:
            _need(not {"compare", "metric_b", "by", "times"} & set(r),
                  f"{key}: give either compare (with metric_b, by, times) or variant and threshold, not both")
            _need(r.get("variant") in variants, f"{key}.variant must name a variant ({', '.join(variants)}); "
                  f"got {r.get('variant')!r}")
            t = r.get("threshold")
            _need(isinstance(t, (int, float)) and not isinstance(t, bool) and math.isfinite(t),
                  f"{key}.threshold must be a finite number, got {t!r}")
        else:
            for k in ("by", "times"):
                if k in r:
                    x = r[k]
                    _need(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)
                          and (x > 0 if k == "times" else True),
                          f"{key}.{k} must be a finite number{' > 0' if k == 'times' else ''}, got {x!r}")
            c = r.get("compare")
            same_ok = r.get("metric_b", r["metric"]) != r["metric"]  # one variant, two of its metrics
            _need(isinstance(c, list) and len(c) == 2 and all(isinstance(x, str) for x in c) and (c[0] != c[1] or same_ok),
                  f"{key}.compare must name two different variants [A, B] (the claim: A is better than B), or one "
                  f"variant twice with a metric_b other than metric; got {c!r}")
            for x in c:
                _need(x in variants, f"{key}.compare: {x!r} is not a variant; variants: {', '.join(variants)}")
        if "name" in r:
            _need(isinstance(r["name"], str) and r["name"] and r["name"] not in names,
                  f"{key}.name must be a non-empty string, unique among the rules; got {r['name']!r}")
            names.add(r["name"])
        out.append(dict(r))
    return out


def judge(rule: dict, variants: dict) -> dict:
    """One rule applied to the per-variant statistics, with its numbers and a sentence."""
    m, better = rule["metric"], rule["better"]

    def stat(variant, metric):
        s = variants.get(variant, {})
        return s.get("mean", {}).get(metric), s.get("sd", {}).get(metric)

    if "threshold" in rule:
        a, x = rule["variant"], float(rule["threshold"])
        ma, da = stat(a, m)
        outcome = verdict(ma, da, x, 0.0, better)
        margin = 2.0 * da if da is not None else None
        if ma is None:
            why = f"{m} is missing for {a}"
        elif da is None:
            why = f"fewer than 2 finished seeds for {a}, so no sd"
        else:
            why = f"{a} {m} {fmt(ma)} ± {fmt(da)} vs the threshold {fmt(x)}: difference {fmt(ma - x)}, margin 2·sd = {fmt(margin)}"
        return {"name": rule.get("name"), "kind": "threshold", "metric": m, "better": better, "variant": a,
                "threshold": x, "mean": ma, "sd": da, "difference": None if ma is None else ma - x,
                "margin": margin, "outcome": outcome, "reason": why}
    a, b = rule["compare"]
    mb_name = rule.get("metric_b", m)
    by, times = float(rule.get("by", 0.0)), float(rule.get("times", 1.0))
    ma, da = stat(a, m)
    mb, db = stat(b, mb_name)
    mb, db = (None if mb is None else times * mb), (None if db is None else times * db)
    outcome = verdict(ma, da, mb, db, better, by)
    threshold = 2.0 * math.sqrt(da ** 2 + db ** 2) if None not in (da, db) else None
    diff = ma - mb if None not in (ma, mb) else None
    label_b = b if mb_name == m else f"{b} {mb_name}"
    if times != 1.0:
        label_b = f"{times:g} × {label_b}"
    if None in (ma, mb):
        why = f"{m if ma is None else mb_name} is missing for {a if ma is None else b}"
    elif threshold is None:
        why = "fewer than 2 finished seeds for a variant, so no sd"
    else:
        need = f"{fmt(by)} + " if by else ""
        why = (f"{a} {fmt(ma)} ± {fmt(da)} vs {label_b} {fmt(mb)} ± {fmt(db)}: difference {fmt(diff)}, "
               f"threshold {need}2·sqrt(sd_a² + sd_b²) = {fmt(by + threshold)}")
    return {"name": rule.get("name"), "kind": "compare", "metric": m, "metric_b": mb_name, "better": better,
            "by": by, "times": times,
            "compare": [a, b], "mean": [ma, mb], "sd": [da, db], "difference": diff, "threshold": threshold,
            "outcome": outcome, "reason": why}


def rule_text(rule: dict) -> str:
    """The rule in words, as the report states it."""
    m, better = rule["metric"], rule["better"]
    worse = "higher" if better == "lower" else "lower"
    if "threshold" in rule:
        a, x = rule["variant"], rule["threshold"]
        side = "below" if better == "lower" else "above"
        return (f"the claim ({a}'s {m} is {side} {fmt(x)}) is **supported** when {a}'s mean {m} is {side} {fmt(x)} by "
                f"more than twice its sd over seeds; **not supported** when it is on the other side by more than that; "
                f"**inconclusive** otherwise, and with fewer than 2 finished seeds.")
    a, b = rule["compare"]
    mb = rule.get("metric_b", m)
    by, times = rule.get("by", 0), rule.get("times", 1)
    theirs, against = (f"{b}'s", "") if mb == m else (f"{b}'s mean {mb}", f" against {b}'s {mb}")
    scaled = f"{times:g} × " if times != 1 else ""
    sd_b = f"({times:g}·sd_{b})²" if times != 1 else f"sd_{b}²"
    if by:
        return (f"the claim ({a} is better than {scaled}{b} in {m}{against} by more than {fmt(by)}, {better} is better) "
                f"is **supported** when {a}'s mean {m} is {better} than {scaled}{theirs} by more than {fmt(by)} plus "
                f"twice the combined sd, 2·sqrt(sd_{a}² + {sd_b}) (sample sd over seeds); **not supported** when its "
                f"gain falls short of {fmt(by)} by more than that margin; **inconclusive** otherwise, and when a variant "
                f"has fewer than 2 finished seeds.")
    return (f"the claim ({a} is better than {scaled}{b} in {m}{against}, "
            f"{better} is better) is **supported** when {a}'s mean {m} is {better} than {scaled}{theirs} by more than "
            f"twice the combined sd, 2·sqrt(sd_{a}² + {sd_b}) (sample sd over seeds); **not supported** when it is "
            f"{worse} by more than that; **inconclusive** otherwise, and when a variant has fewer than 2 finished seeds.")


def verdict_lines(rules: list[dict], judged: list[dict]) -> list[str]:
    """The report's Verdict section."""
    if not judged:
        return []
    lines = ["## Verdict", ""]
    for rule, v in zip(rules, judged):
        label = f"{v['name']}: " if v.get("name") else ""
        lines += [f"{label}**{v['outcome']}**: {v['reason']}.", "", "Rule: " + rule_text(rule), ""]
    return lines
