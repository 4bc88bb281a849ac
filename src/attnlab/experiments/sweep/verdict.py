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

An optional [answer] table answers the spec's question from its rules: among the candidate variants
it takes the one with the highest (better = "higher") or lowest mean of `metric` (`metric_of` names
another metric for some of them; equal means: the first listed), and the answer is that variant's
rules, every rule that names it first in `compare` or as its `variant`: **supported** when all of them
are, **not supported** when one is not, else **inconclusive**. While a candidate has fewer finished
runs than the spec has seeds the answer is marked provisional: the choice may still change.
"""


from __future__ import annotations

import math

from attnlab.models.config import ConfigError

from ..report import fmt

RULE_KEYS = ("name", "metric", "better", "compare", "metric_b", "by", "times", "variant", "threshold")
ANSWER_KEYS = ("question", "among", "metric", "metric_of", "better")
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


def _subject(rule: dict) -> str:
    """The variant a rule makes its claim about."""
    return rule["variant"] if "threshold" in rule else rule["compare"][0]


def check_answer(raw, variants: list[str], rules: list[dict], metrics: list[str]) -> dict:
    """The spec's [answer] table, checked (module docstring): every candidate a variant with rules."""
    _need(isinstance(raw, dict), f"answer must be a table, got {raw!r}")
    unknown = sorted(set(raw) - set(ANSWER_KEYS))
    _need(not unknown, f"answer: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(ANSWER_KEYS)}")
    q = raw.get("question")
    _need(isinstance(q, str) and q.strip() != "", f"answer.question must be a non-empty string, got {q!r}")
    among = raw.get("among")
    _need(isinstance(among, list) and among and all(isinstance(x, str) for x in among) and len(set(among)) == len(among),
          f"answer.among must list the candidate variants, each once; got {among!r}")
    judged = {_subject(r) for r in rules}
    for x in among:
        _need(x in variants, f"answer.among: {x!r} is not a variant; variants: {', '.join(variants)}")
        _need(x in judged, f"answer.among: no verdict rule makes a claim about {x!r} (compare = [{x!r}, ...] or "
              f"variant = {x!r}), so choosing it would answer nothing")
    _need(raw.get("better") in ("lower", "higher"), f"answer.better must be 'lower' or 'higher', got {raw.get('better')!r}")
    metric_of = raw.get("metric_of", {})
    _need(isinstance(metric_of, dict), f"answer.metric_of must be a table of variant = metric, got {metric_of!r}")
    for x in metric_of:
        _need(x in among, f"answer.metric_of: {x!r} is not in answer.among ({', '.join(among)})")
    for key, m in [("metric", raw.get("metric")), *((f"metric_of.{x}", m) for x, m in metric_of.items())]:
        _need(m in metrics, f"answer.{key} must be a per-run scalar: one of {', '.join(metrics)}; got {m!r}")
    return {**raw, "metric_of": dict(metric_of)}


def answer(spec_answer: dict, rules: list[dict], judged: list[dict], variants: dict, n_seeds: int) -> dict:
    """[answer] applied: the chosen candidate, its rules' outcomes and the answer (module docstring)."""
    better = spec_answer["better"]
    ranked = []
    for x in spec_answer["among"]:
        m = spec_answer["metric_of"].get(x, spec_answer["metric"])
        s = variants.get(x, {})
        ranked.append({"variant": x, "metric": m, "mean": s.get("mean", {}).get(m), "sd": s.get("sd", {}).get(m),
                       "n": s.get("n", 0)})
    have = [r for r in ranked if r["mean"] is not None]
    sign = 1.0 if better == "higher" else -1.0
    best = max(have, key=lambda r: sign * r["mean"]) if have else None  # max keeps the first of equal means
    waiting = [r["variant"] for r in ranked if r["n"] < n_seeds]
    if best is None:
        outcomes, outcome = [], "inconclusive"
    else:
        outcomes = [{"name": v.get("name"), "outcome": v["outcome"]} for rule, v in zip(rules, judged)
                    if _subject(rule) == best["variant"]]
        seen = {o["outcome"] for o in outcomes}
        outcome = ("not supported" if "not supported" in seen else
                   "supported" if seen == {"supported"} else "inconclusive")
    return {"question": spec_answer["question"], "metric": spec_answer["metric"], "better": better, "candidates": ranked,
            "chosen": None if best is None else best["variant"], "rules": outcomes, "outcome": outcome,
            "provisional": bool(waiting), "waiting": waiting}


def answer_lines(a: dict | None) -> list[str]:
    """The report's Answer section."""
    if not a:
        return []
    word = "highest" if a["better"] == "higher" else "lowest"
    lines = ["## Answer", "", f"**{a['question']}**", ""]
    ranked = sorted((r for r in a["candidates"] if r["mean"] is not None),
                    key=lambda r: r["mean"], reverse=a["better"] == "higher")
    if a["chosen"] is None:
        lines += ["No candidate has a finished run yet: **inconclusive**.", ""]
    else:
        c = next(r for r in ranked if r["variant"] == a["chosen"])
        sd = "" if c["sd"] is None else f" ± {fmt(c['sd'])}"
        lines += [f"The candidate with the {word} mean is **{c['variant']}**: {c['metric']} {fmt(c['mean'])}{sd} "
                  f"over {c['n']} seed{'s' if c['n'] != 1 else ''}. Its rules: "
                  + "; ".join(f"{o['name'] or 'unnamed'}: {o['outcome']}" for o in a["rules"]) + ".", "",
                  f"Answer: **{a['outcome']}**"
                  + (f" (provisional: {', '.join(a['waiting'])} still short of the spec's seeds, so the choice may "
                     f"change)" if a["provisional"] else "") + ".", ""]
    lines += [f"Candidates by mean {a['metric']}, best first: "
              + ", ".join(f"{r['variant']} {fmt(r['mean'])}" + ("" if r["metric"] == a["metric"] else f" ({r['metric']})")
                          for r in ranked)
              + (f"; no result yet: {', '.join(r['variant'] for r in a['candidates'] if r['mean'] is None)}"
                 if len(ranked) < len(a["candidates"]) else "") + ".", "",
              f"Rule: the candidate with the {word} mean answers; the answer is **supported** when every rule "
              f"about it is supported, **not supported** when one is not, **inconclusive** otherwise.", ""]
    return lines


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


def claim_text(rule: dict) -> str:
    """The rule's claim in a few words: "A is better than B in M, lower is better"."""
    m, better = rule["metric"], rule["better"]
    if "threshold" in rule:
        side = "below" if better == "lower" else "above"
        return f"{rule['variant']}'s {m} is {side} {fmt(rule['threshold'])}"
    a, b = rule["compare"]
    mb = rule.get("metric_b", m)
    by, times = rule.get("by", 0), rule.get("times", 1)
    scaled = f"{times:g} × " if times != 1 else ""
    margin = f" by more than {fmt(by)}" if by else ""
    if a == b:  # one variant, two metrics
        return f"{a}'s {m} is better than {scaled}its {mb}{margin}, {better} is better"
    against = f" against {b}'s {mb}" if mb != m else ""
    return f"{a} is better than {scaled}{b} in {m}{against}{margin}, {better} is better"


def rule_text(rules: list[dict]) -> list[str]:
    """How the report's rules are judged, each kind that occurs among `rules` stated once."""
    kinds = {"threshold" if "threshold" in r else ("by" if r.get("by") else "plain") for r in rules}
    out = []
    if "plain" in kinds:
        out.append("- *A is better than B*: **supported** when A's mean is better than B's by more than twice the "
                   "combined sd, 2·sqrt(sd_A² + sd_B²); **not supported** when B's is better by more than that; "
                   "**inconclusive** otherwise.")
    if "by" in kinds:
        out.append("- *A is better than B by more than x*: **supported** when A's gain over B exceeds x plus the "
                   "margin 2·sqrt(sd_A² + sd_B²); **not supported** when it falls short of x by more than that "
                   "margin; **inconclusive** otherwise (a negative x is a non-inferiority margin: A may be worse "
                   "than B by less than |x|).")
    if any(r.get("times", 1) != 1 for r in rules):
        out.append("- *t × B*: B's mean and sd are multiplied by t first, so the margin is "
                   "2·sqrt(sd_A² + (t·sd_B)²).")
    if "threshold" in kinds:
        out.append("- *A's metric is below (or above) x*: **supported** when A's mean is on the claimed side of x "
                   "by more than twice its sd; **not supported** when it is on the other side by more than that; "
                   "**inconclusive** otherwise.")
    return out + ["", "sd is the sample sd over seeds; a variant with fewer than 2 finished seeds leaves every rule "
                      "about it inconclusive."]


def verdict_lines(rules: list[dict], judged: list[dict], title: str = "Verdict") -> list[str]:
    """The report's Verdict section: one line per rule, then how rules are judged, once."""
    if not judged:
        return []
    lines = [f"## {title}", ""]
    for rule, v in zip(rules, judged):
        label = f"{v['name']} ({claim_text(rule)})" if v.get("name") else claim_text(rule)
        lines += [f"- {label}: **{v['outcome']}**: {v['reason']}."]
    return lines + ["", "How a rule is judged:", ""] + rule_text(rules) + [""]
