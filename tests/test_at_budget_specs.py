"""The reruns at the budget rule's scale (experiments/*/at-budget/spec.toml) ask the questions their
earlier specs asked: the same rules, unchanged; every variant a rule compares is trained; every run
at least MIN_TOKENS_PER_PARAM tokens per parameter, on the same steps and seeds; the earlier results named so the
report shows both verdicts; the softmax control's repeat gain measured at the training length."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RERUNS = ["seed000/exp1-hybrid-baseline", "seed004/claims", "seed002/gate-every-base", "seed003/training",
          "seed000/train-through-window-cauchy"]


def _rules(spec: dict) -> list[dict]:
    rules = spec.get("verdict", [])
    return [rules] if isinstance(rules, dict) else rules


@pytest.mark.parametrize("name", RERUNS)
def test_a_rerun_keeps_its_earlier_rules_and_the_variants_they_compare(name):
    old = tomllib.loads((ROOT / "experiments" / name / "spec.toml").read_text())
    new = tomllib.loads((ROOT / "experiments" / name / "at-budget" / "spec.toml").read_text())
    assert _rules(new) == _rules(old)  # every rule, in order, field for field
    assert new.get("answer") == old.get("answer")
    variants = {v["name"]: v for v in new["variants"]}
    earlier = {v["name"]: v for v in old["variants"]}
    compared = {n for r in _rules(new) for n in r.get("compare", [])} | set((new.get("answer") or {}).get("among", []))
    assert compared <= set(variants)
    for v in variants.values():  # the variants trained again are the earlier ones, unchanged
        assert v["overrides"] == earlier[v["name"]]["overrides"]
    assert new["seeds"] == old["seeds"] == [0, 1, 2]
    assert new["earlier"] == "../results.json"
    assert (ROOT / "experiments" / name / "results.json").is_file()
    assert new["metrics"]["repeat_lengths"]  # the control's copy check (the runner names the length)


@pytest.mark.parametrize("name", RERUNS)
def test_a_rerun_meets_the_budget_rule_on_one_schedule(name, tmp_path):
    from attnlab.experiments.sweep import load_spec, plan
    from attnlab.experiments.sweep.budget import MIN_TOKENS_PER_PARAM, check_budget, params_of, tokens_per_param

    spec = load_spec(ROOT / "experiments" / name / "at-budget" / "spec.toml")
    plans = plan(spec, tmp_path)
    check_budget(spec, plans)  # raises ConfigError below the rule or without the control's repeat metric
    assert not spec.below_budget
    assert min(tokens_per_param(p.cfg, params_of(p.cfg)) for p in plans) >= MIN_TOKENS_PER_PARAM
    assert len({(p.cfg.train.steps, p.cfg.train.batch_size, p.cfg.data.seq_len) for p in plans}) == 1
