"""Fine-tuning a retrofitted model: only the new parameters train, the loss falls, resume is exact."""

import json

import pytest
import torch

pytest.importorskip("transformers")

import attnlab.hf  # noqa: E402,F401
from attnlab.cli import main  # noqa: E402
from attnlab.retrofit import FinetuneConfig, RetrofitError, convert, finetune, new_parameters  # noqa: E402

from test_retrofit import tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SMALL = dict(context=32, contexts=4, batch=2, eval_contexts=2, warmup=2)


@pytest.fixture(scope="module")
def llama():
    return tiny("llama", n_layers=3)


def _state(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


@pytest.mark.parametrize("mech,settings", [("hybrid", {}), ("softmax", {"output_gate": "elementwise"})],
                         ids=["hybrid", "gated"])
def test_only_new_parameters_change_and_loss_falls(llama, mech, settings, tmp_path):
    r = convert(llama, "1,2", mech, settings)
    before = _state(r)
    new = {f"model.{k}" for k in new_parameters(r.model, r.retrofit_plan)}
    cfg = FinetuneConfig(steps=20, lr=1e-2, **{**SMALL, "batch": 4})  # full batch: the loss is comparable
    rep = finetune(r, cfg, tmp_path / "out", progress=False)
    after = _state(r)
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed and changed <= new, changed - new
    assert all(torch.equal(before[k], after[k]) for k in before if k not in new)  # base weights bit-identical
    assert rep["steps"] == 20 and len(rep["history"]) == 20 and r.finetune_report is rep
    assert rep["loss_end"] < rep["loss_start"] - 0.02, (rep["loss_start"], rep["loss_end"])
    assert rep["perplexity_after"] < rep["perplexity_before"]
    assert all(not p.requires_grad or p.grad is None for p in r.parameters())
    rows = [json.loads(x) for x in (tmp_path / "out" / "finetune" / "log.jsonl").read_text().splitlines()]
    assert [x["step"] for x in rows] == list(range(1, 21)) and "kl" not in rows[0]


def test_kl_term_is_logged_and_finite(llama, tmp_path):
    r = convert(llama, "1", "hybrid")
    rep = finetune(r, FinetuneConfig(steps=3, kl=0.5, **SMALL), tmp_path / "out", original=llama, progress=False)
    kls = [h["kl"] for h in rep["history"]]
    assert len(kls) == 3 and all(isinstance(k, float) and -1e-6 < k < 1e3 for k in kls), kls
    assert abs(kls[0]) < 1e-4  # the exact start: the retrofit computes the original's distribution
    for h in rep["history"]:
        assert h["loss"] == pytest.approx(h["ce"] + 0.5 * h["kl"], rel=1e-6)
    with pytest.raises(RetrofitError, match="needs the original model"):
        finetune(convert(llama, "1", "hybrid"), FinetuneConfig(steps=3, kl=0.5, **SMALL), tmp_path / "o2")


def test_signal_mid_finetune_saves_and_resume_equals_one_run(llama, tmp_path, monkeypatch):
    """A real SIGINT during step 3: the step finishes, the state is saved, Interrupted says where;
    the rerun ends with exactly the parameters of one uninterrupted run (so does a run cut by `until`)."""
    import os
    import signal
    import sys

    from attnlab.interrupt import Interrupted

    ft = sys.modules["attnlab.retrofit.finetune"]  # the module (the package's `finetune` is the function)

    cfg = FinetuneConfig(steps=6, lr=1e-2, **SMALL)
    one = convert(llama, "1,2", "hybrid")
    finetune(one, cfg, tmp_path / "one", progress=False)
    want = _state(one)

    calls = {"n": 0}
    real = ft._losses

    def signalled(*args):
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return real(*args)

    monkeypatch.setattr(ft, "_losses", signalled)
    monkeypatch.setattr(ft, "perplexity", lambda model, ids: 1.0)  # count only the training steps' calls
    with pytest.raises(Interrupted, match="stopped after step [34] of 6") as info:
        finetune(convert(llama, "1,2", "hybrid"), cfg, tmp_path / "two", progress=False)
    assert info.value.exit_status == 130
    monkeypatch.undo()
    two = convert(llama, "1,2", "hybrid")
    rep = finetune(two, cfg, tmp_path / "two", progress=False)
    assert rep["resumed_from"] in (3, 4) and [h["step"] for h in rep["history"]] == list(range(1, 7))
    got = _state(two)
    assert all(torch.equal(v, got[k]) for k, v in want.items())

    part = finetune(convert(llama, "1,2", "hybrid"), cfg, tmp_path / "three", until=2, progress=False)
    assert part["stopped"] == "at step 2 of 6"
    three = convert(llama, "1,2", "hybrid")
    finetune(three, cfg, tmp_path / "three", progress=False)
    got = _state(three)
    assert all(torch.equal(v, got[k]) for k, v in want.items())

    with pytest.raises(RetrofitError, match="same options or use another --out"):
        finetune(convert(llama, "1,2", "hybrid"), FinetuneConfig(steps=7, lr=1e-2, **SMALL), tmp_path / "three",
                 progress=False)


def test_cli_finetune_writes_report(llama, tmp_path, capsys):
    src = tmp_path / "llama"
    llama.save_pretrained(src)
    assert main(["retrofit", "--model", str(src), "--layers", "1,2", "--attn", "hybrid", "--finetune-steps", "4",
                 "--finetune-context", "32", "--finetune-batch", "2", "--finetune-kl", "0.1",
                 "--out", str(tmp_path / "a")]) == 0
    rep = json.loads((tmp_path / "a" / "finetune.json").read_text())
    assert rep["steps"] == 4 and rep["config"]["kl"] == 0.1 and all("kl" in h for h in rep["history"])
    assert {"loss_start", "loss_end", "perplexity_before", "perplexity_after"} <= set(rep)
    assert not (tmp_path / "a" / "finetune").exists()
    assert "finetune: loss" in capsys.readouterr().out


def test_cli_bad_finetune_options_are_one_line_errors(tmp_path, capsys, monkeypatch):
    import attnlab.retrofit as rt

    src = tmp_path / "llama"
    tiny("llama", n_layers=2).save_pretrained(src)

    def no_weights(*a, **k):
        raise AssertionError("weights loaded before the input was checked")

    monkeypatch.setattr(rt, "load_source", no_weights)
    for attn, args, msg in [
        ("hybrid", ["--finetune-steps", "-1"], "--finetune-steps must be an integer >= 0"),
        ("hybrid", ["--finetune-steps", "5", "--finetune-lr", "0"], "--finetune-lr must be a finite number > 0"),
        ("hybrid", ["--finetune-steps", "5", "--finetune-lr", "nan"], "--finetune-lr must be a finite number > 0"),
        ("hybrid", ["--finetune-steps", "5", "--finetune-kl", "-1"], "--finetune-kl must be a finite number >= 0"),
        ("hybrid", ["--finetune-steps", "5", "--finetune-batch", "0"], "--finetune-batch must be an integer >= 1"),
        ("hybrid", ["--finetune-steps", "5", "--finetune-context", "1"], "--finetune-context must be an integer >= 2"),
        ("hybrid", ["--finetune-steps", "5", "--finetune-context", "1000"], "exceeds the model's max_position"),
        ("hybrid", ["--finetune-kl", "0.1"], "given without --finetune-steps"),
        ("softmax", ["--finetune-steps", "5"], "have no new parameters to train"),
    ]:
        capsys.readouterr()
        assert main(["retrofit", "--model", str(src), "--layers", "1", "--attn", attn, *args,
                     "--out", str(tmp_path / "new")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and msg in err and "\n" not in err, err
    assert not (tmp_path / "new").exists()


def test_lora_adapters_train_then_merge_into_the_projections(llama, tmp_path):
    """--finetune-lora: peft LoRA on every layer's q/k/v/o trains beside the new parameters; once finished
    it is merged, so the model has attnlab's plain structure again and the projections moved; stopped
    part-way, the adapters are dropped unmerged (base weights as they were) and the rerun resumes exactly."""
    pytest.importorskip("peft")
    r = convert(llama, "1,2", "softmax", {"output_gate": "elementwise"})
    names, before = set(r.state_dict()), _state(r)
    cfg = FinetuneConfig(steps=6, lr=1e-2, lora=2, **SMALL)
    rep = finetune(r, cfg, tmp_path / "one", progress=False)
    assert any("lora_A" in n for n in rep["trained"]) and set(r.state_dict()) == names  # merged, no adapters left
    assert not torch.equal(before["model.blocks.0.attn.wq.weight"], r.state_dict()["model.blocks.0.attn.wq.weight"])
    assert rep["loss_end"] < rep["loss_start"]
    two = convert(llama, "1,2", "softmax", {"output_gate": "elementwise"})
    part = finetune(two, cfg, tmp_path / "two", progress=False, until=3)
    assert part["stopped"] == "at step 3 of 6" and all(torch.equal(v, two.state_dict()[k]) for k, v in before.items()
                                                      if "gate" not in k)  # unmerged: q/k/v/o untouched
    finetune(two, cfg, tmp_path / "two", progress=False)
    assert all(torch.equal(v, two.state_dict()[k]) for k, v in r.state_dict().items())
    with pytest.raises(RetrofitError, match="--finetune-lora must be an integer >= 0"):
        FinetuneConfig(steps=1, lora=-1).check()


def test_align_term_is_logged_and_refused_without_scalar_heads(llama, tmp_path):
    from attnlab.regularizers import regularization

    r = convert(llama, "1,2", "hybrid")
    ids = torch.randint(3, 90, (2, 32), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():  # the logged term is the regularizer on the LM's own recorded forward
        r.model(ids, record=True)
        want = float(regularization([a.last for a in r.model.attention_layers()], {"align": 1.0})["total"])
    assert want > 0
    rep = finetune(r, FinetuneConfig(steps=3, align=0.5, **SMALL), tmp_path / "out", progress=False)
    for h in rep["history"]:
        assert h["align"] > 0 and h["loss"] == pytest.approx(h["ce"] + 0.5 * h["align"], rel=1e-6)
    gated = convert(llama, "1", "softmax", {"output_gate": "elementwise"})
    with pytest.raises(RetrofitError, match="L_align needs scalar or hybrid heads"):
        finetune(gated, FinetuneConfig(steps=3, align=0.5, **SMALL), tmp_path / "o2", progress=False)
    assert not (tmp_path / "o2").exists()
