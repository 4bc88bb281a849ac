"""Every committed retrofit trial compares each variant's held-out loss with a control that trains as
many parameters: where a variant trains more than 10 % above the rank-8 control (its new parameters
plus LoRA, `trainable_count`), a control within 10 % of its count exists and a rule on nll compares
the two. Counted from SmolLM2-135M's config alone (no weights)."""

import functools
from pathlib import Path

import pytest

pytest.importorskip("transformers")

from attnlab.experiments.retrofit_trial import load_trial  # noqa: E402
from attnlab.retrofit.convert import RetrofitError, plan  # noqa: E402
from attnlab.retrofit.finetune import trainable_count  # noqa: E402

@functools.lru_cache(maxsize=None)
def hf_config(model: str):
    """The model's HF config, read once per model (reading a GGUF's metadata takes seconds)."""
    from attnlab.retrofit.io import _source
    from attnlab.search.hf_model import load_hf_config

    try:
        return load_hf_config(_source(model), use=None)
    except (OSError, ValueError) as e:
        raise RetrofitError(str(e)) from None


SPECS = sorted((Path(__file__).resolve().parents[1] / "experiments" / "retrofit").glob("*/spec.toml"))


@pytest.mark.heavy
@pytest.mark.parametrize("spec", SPECS, ids=[p.parent.name for p in SPECS])
def test_each_variant_has_a_control_of_its_size(spec):
    trial = load_trial(spec)
    runs = {r.variant: r for r in trial.runs}
    try:
        counts = {v: trainable_count(plan(hf_config(r.retrofit.model), r.retrofit.layers, r.retrofit.attn,
                                          r.retrofit.settings), r.finetune) for v, r in runs.items()}
    except RetrofitError as e:
        pytest.skip(f"the trial's model config is not here: {e}")
    controls = {v for v, r in runs.items() if r.retrofit.attn == "softmax" and not r.retrofit.settings}
    assert "control" in controls and counts["control"] > 0
    compared = {tuple(rule["compare"]) for rule in trial.rules if rule.get("metric") == "nll" and "compare" in rule}
    for v, n in counts.items():
        if v in controls or n <= 1.1 * counts["control"]:
            continue
        matched = [c for c in controls if abs(counts[c] - n) <= 0.1 * n]
        assert matched, f"{v} trains {n:,} parameters; no control within 10 %: { {c: counts[c] for c in controls} }"
        assert any((v, c) in compared for c in matched), f"no nll rule compares {v} with {matched}"
