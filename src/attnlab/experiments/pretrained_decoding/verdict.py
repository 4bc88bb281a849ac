"""The verdicts of a decoding comparison: binomial intervals on task accuracy, judged per cell.

A cell is (task, length, K): every example of the task at that length, all depths pooled, that full
attention solves (a method can only lose what the model finds; the per-depth tables show the rest).
A method's accuracy in a cell is the share of those examples it solves too, with the 95 % Wilson
score interval. Two kinds of rule, fixed in the spec before any run:

    [[rules]]                        # method beats every method of `against`, by more than the intervals
    kind = "beats"
    method = "learned"
    against = ["streaming_llm", "snapkv", "tova", "knorm", "expected_attention"]

    [[rules]]                        # method is within `margin` of `of` (non-inferiority)
    kind = "within"
    method = "sorted"
    of = "learned"
    margin = 0.1

`beats` in a cell: supported when the method's interval lies above every other's (its lower bound
above their upper bounds), not supported when some other's lies above the method's, inconclusive
otherwise. `within`: the 95 % interval of the difference of the two accuracies (Newcombe's hybrid
score interval, from the two Wilson intervals) has its lower bound above -margin (supported), its
upper bound below -margin (not supported), or neither (inconclusive). At each budget K a rule is
supported when it is in every (task, length) cell, not supported when it is not in some cell, and
inconclusive otherwise; so is the rule over all budgets. Optional `budgets`, `lengths` and `tasks`
restrict a rule's cells; `name` labels it.
"""

from __future__ import annotations

import math

from attnlab.experiments.trial import need

Z = 1.959963984540054  # the 97.5 % normal quantile: two-sided 95 % intervals
KINDS = ("beats", "within")
RULE_KEYS = ("name", "kind", "method", "against", "of", "margin", "budgets", "lengths", "tasks")


def wilson(successes: int, n: int, z: float = Z) -> tuple[float, float]:
    """The Wilson score interval of a binomial proportion; (0, 1) when n is 0."""
    if n == 0:
        return 0.0, 1.0
    p = successes / n
    denom = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / denom
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / denom
    return max(0.0, centre - half), min(1.0, centre + half)


def newcombe(s1: int, n1: int, s2: int, n2: int, z: float = Z) -> tuple[float, float]:
    """Newcombe's hybrid score interval for p1 - p2 (his method 10), from the two Wilson intervals."""
    p1, p2 = (s1 / n1 if n1 else 0.0), (s2 / n2 if n2 else 0.0)
    (l1, u1), (l2, u2) = wilson(s1, n1, z), wilson(s2, n2, z)
    d = p1 - p2
    return d - math.sqrt((p1 - l1) ** 2 + (u2 - p2) ** 2), d + math.sqrt((u1 - p1) ** 2 + (p2 - l2) ** 2)


def check_rule(rule: dict, methods: set, where: str) -> None:
    """ConfigError naming `where` unless `rule` is a well-formed rule over `methods`."""
    unknown = sorted(set(rule) - set(RULE_KEYS))
    need(not unknown, f"{where}: unknown key(s) {', '.join(unknown)}; allowed: {', '.join(RULE_KEYS)}")
    need(rule.get("kind") in KINDS, f"{where}: kind must be one of {KINDS}, got {rule.get('kind')!r}")
    need(rule.get("method") in methods, f"{where}: method must be one of the spec's methods, got {rule.get('method')!r}")
    if rule["kind"] == "beats":
        others = rule.get("against")
        need(isinstance(others, list) and others and all(o in methods for o in others),
             f"{where}: against must be a list of the spec's methods, got {others!r}")
    else:
        need(rule.get("of") in methods, f"{where}: of must be one of the spec's methods, got {rule.get('of')!r}")
        m = rule.get("margin")
        need(isinstance(m, (int, float)) and not isinstance(m, bool) and 0 < m < 1,
             f"{where}: margin must be a number in (0, 1), got {m!r}")
    for k in ("budgets", "lengths", "tasks"):
        v = rule.get(k)
        need(v is None or (isinstance(v, list) and v), f"{where}: {k} must be a non-empty list, got {v!r}")


def cell_outcome(rule: dict, counts: dict) -> tuple[str, str]:
    """(outcome, reason) of a rule in one cell; counts: method -> (solved, n)."""
    s, n = counts[rule["method"]]
    lo, hi = wilson(s, n)
    if n == 0:
        return "inconclusive", "full attention solves no example here"
    if rule["kind"] == "beats":
        others = {o: wilson(*counts[o]) for o in rule["against"]}
        best = max(others, key=lambda o: others[o][1])
        text = f"{rule['method']} {s}/{n} [{lo:.3f}, {hi:.3f}] vs best {best} {counts[best][0]}/{n} " \
               f"[{others[best][0]:.3f}, {others[best][1]:.3f}]"
        if all(lo > u for _, u in others.values()):
            return "supported", text
        if any(lo_o > hi for lo_o, _ in others.values()):
            return "not supported", text
        return "inconclusive", text
    s2, n2 = counts[rule["of"]]
    dlo, dhi = newcombe(s, n, s2, n2)
    text = f"{rule['method']} {s}/{n} - {rule['of']} {s2}/{n2}: difference in [{dlo:+.3f}, {dhi:+.3f}], margin " \
           f"-{rule['margin']:g}"
    if dlo > -rule["margin"]:
        return "supported", text
    if dhi < -rule["margin"]:
        return "not supported", text
    return "inconclusive", text


def combine(outcomes: list[str]) -> str:
    """Supported when every part is, not supported when one is not, inconclusive otherwise."""
    if outcomes and all(o == "supported" for o in outcomes):
        return "supported"
    if "not supported" in outcomes:
        return "not supported"
    return "inconclusive"


def judge(rule: dict, cells: dict, budgets, lengths, tasks) -> dict:
    """Judge a rule over cells: {(task, length, K): {method: (solved, n)}} -> {outcome, by_budget:
    {K: outcome}, cells: [{task, length, K, outcome, reason}]} (cells without every method's
    records are left out and make the budget inconclusive)."""
    budgets = [K for K in budgets if K in rule.get("budgets", budgets)]
    lengths = [L for L in lengths if L in rule.get("lengths", lengths)]
    tasks = [t for t in tasks if t in rule.get("tasks", tasks)]
    names = [rule["method"], *(rule.get("against") or [rule.get("of")])]
    out, by_budget = [], {}
    for K in budgets:
        here = []
        for task in tasks:
            for L in lengths:
                counts = cells.get((task, L, K), {})
                if not all(m in counts for m in names):
                    here.append("inconclusive")
                    out.append({"task": task, "length": L, "K": K, "outcome": "missing", "reason": "not run yet"})
                    continue
                o, why = cell_outcome(rule, counts)
                here.append(o)
                out.append({"task": task, "length": L, "K": K, "outcome": o, "reason": why})
        by_budget[K] = combine(here)
    return {"outcome": combine(list(by_budget.values())), "by_budget": by_budget, "cells": out}
