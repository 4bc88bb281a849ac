"""The seed-002 MVE under the learning-rate protocol: the final spec trains each variant at the rate
the learning-rate sweep chose on validation sequences (its highest val_accuracy), read here from the
sweep's committed results."""

import json
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SWEEP = ROOT / "experiments" / "seed002" / "mve-lr-sweep"
FINAL = ROOT / "experiments" / "seed002" / "mve-best-lr"


def chosen_rates() -> dict[str, float]:
    results = json.loads((SWEEP / "results.json").read_text())
    best = {}
    for name, v in results["variants"].items():
        family, lr = name.rsplit("-lr", 1)
        acc = v["mean"]["val_accuracy"]
        if family not in best or acc > best[family][1]:
            best[family] = (float(lr), acc)
    return {family: lr for family, (lr, _) in best.items()}


def test_final_spec_trains_each_variant_at_its_chosen_rate():
    rates = chosen_rates()
    assert set(rates) == {"ungated", "gated", "headwise"}
    spec = tomllib.loads((FINAL / "spec.toml").read_text())
    got = {}
    for v in spec["variants"]:
        lrs = [float(o.split("=", 1)[1]) for o in v["overrides"] if o.startswith("train.lr=")]
        got[v["name"]] = lrs[0] if lrs else None
    assert got == rates
    sweep = tomllib.loads((SWEEP / "spec.toml").read_text())
    assert spec["base"] == sweep["base"]  # the same protocol: model, data, steps, early stopping
    assert not set(spec["seeds"]) & set(sweep["seeds"])  # the chosen rates are judged on other seeds
