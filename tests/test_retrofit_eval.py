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


def test_an_interrupted_decode_evaluation_keeps_what_it_measured(llama, tmp_path, monkeypatch):
    """partial=: each decode loss is written as soon as it is measured; a rerun with the same config
    measures only the missing ones and reports what an uninterrupted evaluation reports."""
    import sys

    ev = sys.modules["attnlab.retrofit.evaluate"]  # the package exports a function of the same name

    cfg = EvalConfig(contexts=1, context=32, windows=[4], window_lengths=[24, 32], window_contexts=1,
                     learned_steps=2, learned_context=16, learned_contexts=2)
    model = convert(llama, "1,2", "scalar")
    whole = evaluate_retrofit(model, cfg)["decode"]
    assert list(whole) == cfg.decode_names() and len(whole) == 6
    path = tmp_path / "decode.partial.json"
    real, calls = ev.perplexity, []

    def flaky(m, ids):
        calls.append(ids.input_ids.shape[1])
        if len(calls) == 1 + 4:  # the held-out perplexity, then three decode losses, then stop
            raise KeyboardInterrupt("stopped by the test")
        return real(m, ids)

    monkeypatch.setattr(ev, "perplexity", flaky)
    with pytest.raises(KeyboardInterrupt):
        evaluate_retrofit(model, cfg, partial=path)
    kept = json.loads(path.read_text())["decode"]
    assert list(kept) == cfg.decode_names()[:3]
    calls.clear()
    monkeypatch.setattr(ev, "perplexity", lambda m, ids: calls.append(ids.input_ids.shape[1]) or real(m, ids))
    again = evaluate_retrofit(model, cfg, partial=path)["decode"]
    assert len(calls) == 1 + 3  # the held-out perplexity and the three missing losses
    assert again == pytest.approx(whole, rel=1e-5)
    other = EvalConfig(**{**vars(cfg), "window_contexts": 2})  # another config ignores the file
    calls.clear()
    evaluate_retrofit(model, other, partial=path)
    assert len(calls) == 1 + 6


def test_a_resumed_evaluation_reads_the_selector_it_trained(llama, tmp_path, monkeypatch):
    """partial=: the learned selector's search projections are kept beside the partial file as soon
    as they are trained; a rerun with the same config reads them (it trains nothing) and reports
    exactly what an uninterrupted evaluation reports; another config trains its own."""
    import sys

    import attnlab.eval.selector_training as st
    from attnlab.retrofit.evaluate import selector_path

    ev = sys.modules["attnlab.retrofit.evaluate"]
    cfg = EvalConfig(contexts=1, context=32, windows=[4], window_lengths=[24], window_contexts=1,
                     learned_steps=3, learned_context=16, learned_contexts=2)
    model = convert(llama, "1,2", "scalar")
    whole = evaluate_retrofit(model, cfg)["decode"]
    path = tmp_path / "decode.partial.json"
    real, calls = ev.perplexity, []

    def flaky(m, ids):
        calls.append(1)
        if len(calls) == 1 + 3:  # the held-out perplexity, exact@24, window4@24, then stop in learned4@24
            raise KeyboardInterrupt("stopped by the test")
        return real(m, ids)

    monkeypatch.setattr(ev, "perplexity", flaky)
    with pytest.raises(KeyboardInterrupt):
        evaluate_retrofit(model, cfg, partial=path)
    assert selector_path(path).is_file() and list(json.loads(path.read_text())["decode"]) == ["exact@24", "window4@24"]
    monkeypatch.setattr(ev, "perplexity", real)
    trained = st.train_selector_projections
    monkeypatch.setattr(st, "train_selector_projections",
                        lambda *a, **k: (_ for _ in ()).throw(AssertionError("trained again")))
    assert evaluate_retrofit(model, cfg, partial=path)["decode"] == whole  # the same projections, bit for bit
    other = EvalConfig(**{**vars(cfg), "learned_steps": 2})
    with pytest.raises(AssertionError, match="trained again"):
        evaluate_retrofit(model, other, partial=tmp_path / "other.partial.json")
    selector_path(tmp_path / "other.partial.json").write_bytes(selector_path(path).read_bytes())
    monkeypatch.setattr(st, "train_selector_projections", trained)
    evaluate_retrofit(model, other, partial=tmp_path / "other.partial.json")  # another config: not read
    assert selector_path(tmp_path / "other.partial.json").read_bytes() != selector_path(path).read_bytes()


def test_a_signal_stops_the_evaluation_after_the_loss_it_is_measuring(llama, tmp_path, monkeypatch):
    """Under interrupt.graceful (a trial's run), SIGINT lets the decode loss in progress finish and be
    kept, then stops the evaluation with Interrupted."""
    import os
    import signal
    import sys

    from attnlab import interrupt

    ev = sys.modules["attnlab.retrofit.evaluate"]
    cfg = EvalConfig(contexts=1, context=32, windows=[4], window_lengths=[24], window_contexts=1)
    model = convert(llama, "1", "scalar")
    path = tmp_path / "decode.partial.json"
    real, calls = ev.perplexity, []

    def signalled(m, ids):
        calls.append(1)
        if len(calls) == 2:  # during the first decode loss
            os.kill(os.getpid(), signal.SIGINT)
        return real(m, ids)

    monkeypatch.setattr(ev, "perplexity", signalled)
    with pytest.raises(interrupt.Interrupted, match="evaluation stopped after exact@24"):
        with interrupt.graceful():
            evaluate_retrofit(model, cfg, partial=path)
    assert list(json.loads(path.read_text())["decode"]) == ["exact@24"]
