"""Attention transfer: new retrofit layers trained to reproduce the original attention outputs."""

import json

import pytest
import torch

pytest.importorskip("transformers")

import attnlab.hf  # noqa: E402,F401
from attnlab.cli import main  # noqa: E402
from attnlab.retrofit import RetrofitError, TransferConfig, convert, transfer_attention as transfer  # noqa: E402

from test_retrofit import tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def llama():
    return tiny("llama", n_layers=3)


def _params(model, layers):
    return {f"{i}.{k}": v.detach().clone() for i in layers for k, v in model.model.blocks[i].attn.state_dict().items()}


@pytest.mark.parametrize("mech", ["scalar", "gla"])
def test_transfer_lowers_each_layers_error(llama, mech, tmp_path):
    r = convert(llama, "1,2", mech)
    untouched = _params(r, [0])
    rep = transfer(llama, r, [1, 2], TransferConfig(steps=30, contexts=4, context=64), tmp_path / "out")
    assert set(rep["layers"]) == {"1", "2"} and r.transfer_report is rep
    for i, rec in rep["layers"].items():
        assert rec["step"] == 30 and rec["after"] < 0.7 * rec["before"], (i, rec)
        # the val split's contexts, never trained on, measured before and after: here (4 contexts of 64 tokens)
        # a layer can fit its training contexts and do worse on these, which only they show
        assert 0 < rec["heldout_before"] < 10 and 0 < rec["heldout_after"] < 10, (i, rec)
        assert rec["heldout_after"] != rec["after"] and rec["heldout_before"] != rec["before"], (i, rec)
    assert rep["config"]["heldout_contexts"] == 2
    after = _params(r, [0])
    assert all(torch.equal(v, after[k]) for k, v in untouched.items())  # only the chosen layers train
    assert not any(p.requires_grad and p.grad is not None for p in r.parameters())


def test_signal_mid_transfer_saves_and_resume_equals_one_run(llama, tmp_path, monkeypatch):
    """A real SIGINT during step 3 of layer 1: the step finishes, the layer's state is saved,
    Interrupted says where; the rerun ends with exactly the parameters of one uninterrupted run.
    A run cut by `until` resumes to the same parameters too."""
    import os
    import signal

    from attnlab.interrupt import Interrupted

    cfg = TransferConfig(steps=5, contexts=2, context=32)
    one = convert(llama, "1,2", "scalar")
    one_rep = transfer(llama, one, [1, 2], cfg, tmp_path / "one")
    want = _params(one, [1, 2])

    import attnlab.retrofit.transfer as tr
    calls = {"n": 0}
    real = tr._loss

    def signalled(*args):
        if torch.is_grad_enabled():
            calls["n"] += 1
            if calls["n"] == 3:
                os.kill(os.getpid(), signal.SIGINT)
        return real(*args)

    monkeypatch.setattr(tr, "_loss", signalled)
    # the handler runs at the main thread's next bytecode: normally within step 3 (so "after step 3"),
    # on a loaded machine possibly a step or the layer's end later; each must save and resume exactly
    with pytest.raises(Interrupted, match=r"stopped after (step [345] of 5|layer 1)") as info:
        transfer(llama, convert(llama, "1,2", "scalar"), [1, 2], cfg, tmp_path / "two")
    assert info.value.exit_status == 130
    monkeypatch.undo()
    assert (tmp_path / "two" / "transfer" / "layer1.safetensors").is_file()
    two = convert(llama, "1,2", "scalar")
    rep = transfer(llama, two, [1, 2], cfg, tmp_path / "two")
    assert rep["layers"]["1"]["resumed_from"] in (3, 4, 5) and rep["layers"]["2"]["resumed_from"] == 0
    got = _params(two, [1, 2])
    assert all(torch.equal(v, got[k]) for k, v in want.items())
    for i in "12":  # the errors before training come back from the checkpoint, held out included
        assert {k: rep["layers"][i][k] for k in ("before", "after", "heldout_before", "heldout_after")} \
            == {k: one_rep["layers"][i][k] for k in ("before", "after", "heldout_before", "heldout_after")}

    three = convert(llama, "1,2", "scalar")
    part = transfer(llama, three, [1, 2], cfg, tmp_path / "three", until=7)  # layer 1 whole, layer 2 two steps
    assert part["stopped"] == "layer 2 at step 2 of 5"
    three = convert(llama, "1,2", "scalar")
    rep = transfer(llama, three, [1, 2], cfg, tmp_path / "three")
    assert rep["layers"]["2"]["resumed_from"] == 2
    got = _params(three, [1, 2])
    assert all(torch.equal(v, got[k]) for k, v in want.items())

    # the held-out contexts are measured, not trained on: another number of them resumes the same training,
    # its error before unknown (the checkpoint measured other contexts); none at all leaves the keys out
    four = convert(llama, "1,2", "scalar")
    transfer(llama, four, [1, 2], cfg, tmp_path / "four", until=2)
    four = convert(llama, "1,2", "scalar")
    rep = transfer(llama, four, [1, 2], TransferConfig(steps=5, contexts=2, context=32, heldout_contexts=1),
                   tmp_path / "four")
    assert rep["layers"]["1"]["resumed_from"] == 2 and rep["layers"]["1"]["heldout_before"] is None
    assert rep["layers"]["2"]["heldout_before"] is not None
    got = _params(four, [1, 2])
    assert all(torch.equal(v, got[k]) for k, v in want.items())
    none = transfer(llama, convert(llama, "1,2", "scalar"), [1, 2],
                    TransferConfig(steps=1, contexts=2, context=32, heldout_contexts=0), tmp_path / "five")
    assert "heldout_before" not in none["layers"]["1"] and none["config"]["heldout_contexts"] == 0

    with pytest.raises(RetrofitError, match="same options or use another --out"):
        transfer(llama, convert(llama, "1,2", "scalar"), [1, 2], TransferConfig(steps=6, contexts=2, context=32),
                 tmp_path / "three")


def test_cli_transfer_writes_report_and_resumes(llama, tmp_path, capsys):
    from safetensors.torch import load_file

    src = tmp_path / "llama"
    llama.save_pretrained(src)
    common = ["retrofit", "--model", str(src), "--layers", "1,2", "--attn", "scalar", "--transfer-steps", "12",
              "--transfer-contexts", "2", "--transfer-context", "32"]
    assert main([*common, "--out", str(tmp_path / "a")]) == 0
    rep = json.loads((tmp_path / "a" / "transfer.json").read_text())
    assert all(r["after"] < r["before"] for r in rep["layers"].values())
    assert not (tmp_path / "a" / "transfer").exists()
    assert "layer 1: relative error" in (out := capsys.readouterr().out) and "; held out " in out

    # an interrupted transfer left in OUT/transfer/: the same command resumes it, to the same weights
    from attnlab.retrofit import load_source, plan_source

    source, _ = plan_source(str(src), "1,2", "scalar")
    hf, _ = load_source(source)
    transfer(hf, convert(hf, [1, 2], "scalar"), [1, 2], TransferConfig(steps=12, contexts=2, context=32),
             tmp_path / "b", until=5)
    assert main(["retrofit", "--model", str(src), "--layers", "1,2", "--attn", "scalar", "--out",
                 str(tmp_path / "b")]) == 2  # without --transfer-steps a leftover transfer/ is not empty
    assert "interrupted transfer" in capsys.readouterr().err
    assert main([*common, "--out", str(tmp_path / "b")]) == 0
    a, b = (load_file(str(tmp_path / x / "model.safetensors")) for x in "ab")
    assert all(torch.equal(v, b[k]) for k, v in a.items())


def test_cli_bad_transfer_options_are_one_line_errors(tmp_path, capsys, monkeypatch):
    import attnlab.retrofit as rt

    src = tmp_path / "llama"
    tiny("llama", n_layers=2).save_pretrained(src)

    def no_weights(*a, **k):
        raise AssertionError("weights loaded before the input was checked")

    monkeypatch.setattr(rt, "load_source", no_weights)
    for args, msg in [
        (["--transfer-steps", "-1"], "--transfer-steps must be an integer >= 0"),
        (["--transfer-steps", "5", "--transfer-lr", "0"], "--transfer-lr must be a finite number > 0"),
        (["--transfer-steps", "5", "--transfer-lr", "nan"], "--transfer-lr must be a finite number > 0"),
        (["--transfer-steps", "5", "--transfer-contexts", "0"], "--transfer-contexts must be an integer >= 1"),
        (["--transfer-steps", "5", "--transfer-context", "1"], "--transfer-context must be an integer >= 2"),
        (["--transfer-steps", "5", "--transfer-context", "1000"], "exceeds the model's max_position_embeddings"),
        (["--transfer-contexts", "4"], "given without --transfer-steps"),
        (["--transfer-steps", "5", "--transfer-heldout-contexts", "-1"],
         "--transfer-heldout-contexts must be an integer >= 0"),
        (["--transfer-heldout-contexts", "0"], "--transfer-heldout-contexts given without --transfer-steps"),
    ]:
        capsys.readouterr()
        assert main(["retrofit", "--model", str(src), "--layers", "1", "--attn", "scalar", *args,
                     "--out", str(tmp_path / "new")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and msg in err and "\n" not in err, err
    assert not (tmp_path / "new").exists()


def test_retrofit_cost_benchmark_runs(llama, tmp_path):
    """benchmarks/retrofit_cost.py on a local model folder: a row per mechanism and stage with each
    round's per-1K-token time (the difference of two calls) and its median, the settings beside them."""
    import importlib.util
    import statistics
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    spec = importlib.util.spec_from_file_location("retrofit_cost", root / "benchmarks" / "retrofit_cost.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    llama.save_pretrained(tmp_path / "llama")
    out = tmp_path / "rc.json"
    mod.main(["--model", str(tmp_path / "llama"), "--layers", "1", "--mechanisms", "scalar", "--rounds", "2",
              "--context", "16", "--contexts", "1", "--batch", "1", "--lora", "2", "--out", str(out)])
    doc = json.loads(out.read_text())
    assert doc["config"]["transfer_steps"] == [10, 30] and doc["config"]["peak_rss_gb"] > 0
    assert [(r["mechanism"], r["stage"]) for r in doc["rows"]] == [("scalar", "transfer"), ("scalar", "finetune")]
    for r in doc["rows"]:
        assert len(r["rounds_s_per_1k_tokens"]) == 2
        assert r["median_s_per_1k_tokens"] == pytest.approx(statistics.median(r["rounds_s_per_1k_tokens"]), abs=1e-4)
    with pytest.raises(SystemExit):
        mod.main(["--model", str(tmp_path / "llama"), "--rounds", "0", "--out", str(tmp_path / "no.json")])
    assert not (tmp_path / "no.json").exists()
