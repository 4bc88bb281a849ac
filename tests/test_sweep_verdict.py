"""The sweep's verdict rules on their own: compare and threshold rules at the boundary of twice the
combined sd, a second variant judged on another metric, a minimum gain (`by`) and a scaled second
variant (`times`)."""

import pytest

from attnlab.experiments.sweep import judge, verdict

SD_A, SD_B = 0.375, 0.5  # exact in binary: 2 * sqrt(sd_a^2 + sd_b^2) = 1.25 exactly


@pytest.mark.parametrize("mean_a, mean_b, better, outcome", [
    (1.0, 2.26, "lower", "supported"),
    (1.0, 2.25, "lower", "inconclusive"),  # difference == 2 x combined sd: does not count
    (2.25, 1.0, "lower", "inconclusive"),
    (2.26, 1.0, "lower", "not supported"),
    (2.26, 1.0, "higher", "supported"),
    (1.0, 2.26, "higher", "not supported"),
    (1.5, 1.0, "lower", "inconclusive"),
], ids=["supported", "boundary", "boundary-reversed", "not-supported", "higher-supported", "higher-not", "small"])
def test_verdict_rule_at_twice_the_combined_sd(mean_a, mean_b, better, outcome):
    assert 2 * (SD_A ** 2 + SD_B ** 2) ** 0.5 == 1.25
    assert verdict(mean_a, SD_A, mean_b, SD_B, better) == outcome


def test_verdict_needs_two_seeds_and_names_its_numbers():
    assert verdict(1.0, None, 9.0, 0.1) == "inconclusive"  # one seed: no sd
    assert verdict(None, 0.1, 9.0, 0.1) == "inconclusive"
    with pytest.raises(ValueError, match="better"):
        verdict(1.0, 0.1, 2.0, 0.1, "smaller")
    variants = {"a": {"mean": {"m": 1.0}, "sd": {"m": SD_A}}, "b": {"mean": {"m": 2.26}, "sd": {"m": SD_B}}}
    got = judge({"metric": "m", "better": "lower", "compare": ["a", "b"]}, variants)
    assert got["outcome"] == "supported" and got["threshold"] == 1.25 and got["difference"] == pytest.approx(-1.26)


@pytest.mark.parametrize("mean, better, outcome", [
    (0.24, "lower", "supported"), (0.25, "lower", "inconclusive"), (1.76, "lower", "not supported"),
    (1.75, "lower", "inconclusive"), (1.76, "higher", "supported"), (0.24, "higher", "not supported"),
], ids=["below", "boundary", "above", "boundary-above", "higher-supported", "higher-not"])
def test_threshold_rule_at_twice_the_sd(mean, better, outcome):
    variants = {"a": {"mean": {"m": mean}, "sd": {"m": SD_A}}}  # 2 sd = 0.75 around the threshold 1.0
    got = judge({"metric": "m", "better": better, "variant": "a", "threshold": 1.0}, variants)
    assert got["outcome"] == outcome and got["margin"] == 0.75 and got["kind"] == "threshold"
    assert judge({"metric": "m", "better": "lower", "variant": "a", "threshold": 9.0},
                 {"a": {"mean": {"m": 1.0}, "sd": {"m": None}}})["outcome"] == "inconclusive"  # one seed


def test_compare_rule_judges_b_on_its_own_metric():
    variants = {"a": {"mean": {"w": 1.0, "m": 5.0}, "sd": {"w": SD_A, "m": 0.0}},
                "b": {"mean": {"m": 2.26, "w": None}, "sd": {"m": SD_B, "w": None}}}
    got = judge({"metric": "w", "metric_b": "m", "better": "lower", "compare": ["a", "b"]}, variants)
    assert got["outcome"] == "supported" and got["mean"] == [1.0, 2.26] and "b m" in got["reason"]
    assert judge({"metric": "w", "better": "lower", "compare": ["a", "b"]}, variants)["outcome"] == "inconclusive"


@pytest.mark.parametrize("mean_a, by, outcome", [
    (0.0, 1.0, "supported"),        # gain 2.26 - by 1.0 = 1.26 > 1.25
    (0.01, 1.0, "inconclusive"),    # 1.25 left: on the boundary, does not count
    (1.0, 0.0, "supported"),        # by = 0 is the plain rule
    (1.0, 1.0, "inconclusive"),     # gain 1.26 is above by, but not by the margin
    (2.0, 1.5, "inconclusive"),     # gain 0.26 falls short of 1.5 by 1.24: within the margin
    (2.1, 1.5, "not supported"),    # short by 1.34
], ids=["beyond-by", "by-boundary", "by-zero", "above-by-within-margin", "short-within", "short-beyond"])
def test_compare_rule_by_a_minimum_gain(mean_a, by, outcome):
    variants = {"a": {"mean": {"m": mean_a}, "sd": {"m": SD_A}}, "b": {"mean": {"m": 2.26}, "sd": {"m": SD_B}}}
    got = judge({"metric": "m", "better": "lower", "compare": ["a", "b"], "by": by}, variants)
    assert got["outcome"] == verdict(mean_a, SD_A, 2.26, SD_B, "lower", by) == outcome
    assert got["by"] == by and (by == 0) == ("+ 2·sqrt" not in got["reason"])


def test_compare_rule_times_scales_b_and_its_sd():
    # claim: a's share is below half of b's. b = 4.0 ± 1.0 scaled to 2.0 ± 0.5; a = 0.74 ± 0.375
    variants = {"a": {"mean": {"s": 0.74}, "sd": {"s": SD_A}}, "b": {"mean": {"s": 4.0}, "sd": {"s": 1.0}}}
    got = judge({"metric": "s", "better": "lower", "compare": ["a", "b"], "times": 0.5}, variants)
    assert got["mean"] == [0.74, 2.0] and got["sd"] == [SD_A, 0.5] and got["threshold"] == 1.25
    assert got["outcome"] == "supported" and "0.5 × b" in got["reason"]
    variants["a"]["mean"]["s"] = 0.76  # 1.24 below half of b: within the margin
    assert judge({"metric": "s", "better": "lower", "compare": ["a", "b"], "times": 0.5}, variants)["outcome"] == "inconclusive"
    from attnlab.experiments.sweep.verdict import claim_text, rule_text
    rule = {"metric": "s", "better": "lower", "compare": ["a", "b"], "times": 0.5, "by": 0.1}
    assert claim_text(rule) == "a is better than 0.5 × b in s by more than 0.1000, lower is better"
    text = "\n".join(rule_text([rule]))
    assert "(t·sd_B)²" in text and "by more than x" in text and "*A is better than B*:" not in text


def test_one_variant_against_itself_on_another_metric():
    from attnlab.experiments.sweep.verdict import check_rules

    rule = {"metric": "learned/mass@64", "metric_b": "quest/mass@64", "better": "higher", "compare": ["m", "m"]}
    assert check_rules(rule, ["m"], ["learned/mass@64", "quest/mass@64"])
    stats = {"m": {"mean": {"learned/mass@64": 0.92, "quest/mass@64": 0.78},
                   "sd": {"learned/mass@64": 0.01, "quest/mass@64": 0.02}}}
    assert judge(rule, stats)["outcome"] == "supported"
    with pytest.raises(ValueError, match="one variant twice with a metric_b"):
        check_rules({**rule, "metric_b": "learned/mass@64"}, ["m"], ["learned/mass@64"])
