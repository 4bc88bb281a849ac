"""The retrieval-beyond-window experiment under the learning-rate protocol: the final spec trains each
variant at the rate the sweep chose on validation sequences (its highest val_accuracy), read here
from the sweep's committed results; and the task keeps every pair out of every window's reach."""

import json
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
EXP = ROOT / "experiments" / "seed000" / "retrieval-beyond-window"
SWEEP, FINAL = EXP / "lr-sweep", EXP / "best-lr"


def _overrides(variant: dict) -> dict[str, str]:
    return dict(o.split("=", 1) for o in variant["overrides"])


def chosen_rates() -> dict[str, float]:
    results = json.loads((SWEEP / "results.json").read_text())
    best = {}
    for name, v in results["variants"].items():
        family, lr = name.rsplit("-lr", 1)
        acc = v["mean"].get("val_accuracy")
        if acc is not None and (family not in best or acc > best[family][1]):
            best[family] = (float(lr), acc)
    return {family: lr for family, (lr, _) in best.items()}


def test_every_pair_lies_beyond_every_window():
    sweep = tomllib.loads((SWEEP / "spec.toml").read_text())
    data = sweep["base"]["data"]
    assert data["seq_len"] >= 512
    budgets = {}
    for v in sweep["variants"]:
        o = _overrides(v)
        window = int(o.get("model.attention.sliding_window", 0)) or (
            int(o.get("model.attention.train_window", 0)) + int(o.get("model.attention.local_window", 0)))
        budgets[v["name"].rsplit("-lr", 1)[0]] = window
    windowed = {name: b for name, b in budgets.items() if b}
    assert set(windowed.values()) == {32}  # one key budget for every windowed variant
    assert data["mqar_min_gap"] > max(windowed.values())
    # each family at the same rates, on one seed the final runs do not use
    rates = {}
    for v in sweep["variants"]:
        family, lr = v["name"].rsplit("-lr", 1)
        assert float(_overrides(v)["train.lr"]) == float(lr)
        rates.setdefault(family, set()).add(float(lr))
    assert all(r == {1e-3, 3e-3} for r in rates.values())


def test_final_spec_trains_each_variant_at_its_chosen_rate():
    if not (SWEEP / "results.json").is_file() or not (FINAL / "spec.toml").is_file():
        pytest.skip("the learning-rate sweep has not finished: no results.json or best-lr spec yet")
    rates = chosen_rates()
    spec = tomllib.loads((FINAL / "spec.toml").read_text())
    got = {v["name"]: float(_overrides(v)["train.lr"]) for v in spec["variants"]}
    assert got == {name: rates[name] for name in got}  # every final variant at its sweep's best rate
    sweep = tomllib.loads((SWEEP / "spec.toml").read_text())
    assert spec["base"] == sweep["base"]  # the same protocol: model, data, steps, early stopping
    assert not set(spec["seeds"]) & set(sweep["seeds"])  # the chosen rates are judged on other seeds
    families = {v["name"].rsplit("-lr", 1)[0]: {k: x for k, x in _overrides(v).items() if k != "train.lr"}
                for v in sweep["variants"]}
    for v in spec["variants"]:  # the same mechanism as in the sweep
        assert {k: x for k, x in _overrides(v).items() if k != "train.lr"} == families[v["name"]]


TEMPLATE = FINAL / "spec.template.toml"


def _without_lr(spec: dict) -> dict:
    out = dict(spec)
    out["variants"] = [{**v, "overrides": [o for o in v["overrides"] if not o.startswith("train.lr=")]}
                       for v in spec["variants"]]
    return out


def test_the_rules_were_written_before_the_runs():
    """The final spec is its template (written with the rules before any run) with the chosen rates filled in."""
    template = tomllib.loads(TEMPLATE.read_text())
    sweep = tomllib.loads((SWEEP / "spec.toml").read_text())
    assert template["base"] == sweep["base"] and not set(template["seeds"]) & set(sweep["seeds"])
    assert len(template["seeds"]) >= 3
    names = [v["name"] for v in template["variants"]]
    assert names == list(dict.fromkeys(v["name"].rsplit("-lr", 1)[0] for v in sweep["variants"]))
    windowed = [n for n in names if n not in ("softmax", "swa32")]
    for n in windowed:  # (a) and (b) at 1x and 4x for every window variant
        mine = [r for r in template["verdict"] if r["compare"][0] == n]
        assert sorted((r["compare"][1], r["metric"].split("/")[0], r.get("by")) for r in mine) == sorted(
            [("softmax", "mqar_accuracy", -0.1), ("softmax", "mqar_accuracy@4x", -0.1),
             ("swa32", "mqar_accuracy", None), ("swa32", "mqar_accuracy@4x", None)])
    if (FINAL / "spec.toml").is_file():
        spec = tomllib.loads((FINAL / "spec.toml").read_text())
        assert _without_lr(spec) == _without_lr(template)
