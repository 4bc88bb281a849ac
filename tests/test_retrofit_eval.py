"""Evaluating a retrofitted model: held-out perplexity against the original's (equal for an exact start),
and per layer the first-token share, learned sink share, ground-state mass and gate values."""

import json

import pytest

pytest.importorskip("transformers")

import attnlab.hf  # noqa: E402,F401
from attnlab.cli import main  # noqa: E402
from attnlab.retrofit import EvalConfig, RetrofitError, convert, evaluate_retrofit  # noqa: E402

from test_retrofit import tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = EvalConfig(contexts=2, context=32)


@pytest.fixture(scope="module")
def llama():
    return tiny("llama", n_layers=3)


def test_exact_start_has_the_original_perplexity_and_per_layer_statistics(llama):
    r = convert(llama, "1", "softmax", {"output_gate": "elementwise"})
    rep = evaluate_retrofit(r, SMALL, original=llama)
    assert abs(rep["perplexity_gap"]) < 1e-5 and r.eval_report is rep
    rows = {row["layer"]: row for row in rep["layers"]}
    assert [rows[i]["replaced"] for i in range(3)] == [False, True, False]
    assert all(0.0 <= row["first_token_share"] <= 1.0 for row in rows.values())
    assert rows[1]["gate_low"] == 0.0 and "gate_low" not in rows[0]  # the gate starts at 1: no value below 0.1
    p = convert(llama, "2", "principled")
    rows = {row["layer"]: row for row in evaluate_retrofit(p, SMALL)["layers"]}
    assert 0.0 <= rows[2]["ground_weight"] < 1e-4  # principled starts next to its softmax limit


def test_cli_writes_eval_json_and_checks_its_options_first(llama, tmp_path, capsys, monkeypatch):
    src = tmp_path / "llama"
    llama.save_pretrained(src)
    assert main(["retrofit", "--model", str(src), "--layers", "1", "--attn", "hybrid", "--eval-contexts", "2",
                 "--eval-context", "32", "--out", str(tmp_path / "a")]) == 0
    rep = json.loads((tmp_path / "a" / "eval.json").read_text())
    assert abs(rep["perplexity_gap"]) < 1e-5 and len(rep["layers"]) == 3
    assert "eval: held-out perplexity" in capsys.readouterr().out
    import attnlab.retrofit as rt

    monkeypatch.setattr(rt, "load_source", lambda *a, **k: (_ for _ in ()).throw(AssertionError("weights loaded")))
    for args, msg in [(["--eval-contexts", "-1"], "--eval-contexts must be an integer >= 1"),
                      (["--eval-context", "32"], "--eval-context given without --eval-contexts"),
                      (["--eval-contexts", "2", "--eval-context", "1000"], "exceeds the model's max_position")]:
        assert main(["retrofit", "--model", str(src), "--layers", "1", "--attn", "hybrid", *args,
                     "--out", str(tmp_path / "b")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.count("\n") == 0 and msg in err, err
    with pytest.raises(RetrofitError, match="--eval-analysis-contexts"):
        EvalConfig(contexts=1, analysis_contexts=2).check()
