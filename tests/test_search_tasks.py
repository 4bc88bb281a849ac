"""Passkey and needle-in-a-haystack scoring for retrieve-then-attend on a tiny random Llama.

The byte-level encoding of the tiny model needs about 250 tokens for the passkey prompt alone, so
the contexts here are 256-288 tokens long."""

import json

import pytest
import torch

import attnlab.search.tasks as tasks
from attnlab.cli import main
from attnlab.data.synthetic import IGNORE
from attnlab.search.hf_model import tiny_model
from attnlab.search.lm import tiny_lm
from attnlab.search.patch import SelectorConfig, substitute
from attnlab.index.projections import SearchProjections
from attnlab.search.retrieval import METHODS
from attnlab.search.tasks import TaskConfig, answer_logits, plan_tasks, run_tasks
from attnlab.testing import rel_rms

LAYERS = "1,4,6"


@pytest.fixture(scope="module")
def lm():
    return tiny_lm("llama")


def small(out, **kw):
    base = dict(model="tiny", tasks=["passkey"], lengths=[256], depths=[0.5], n_examples=1, methods=["full"],
                ks=[16], layer_set=LAYERS, out=str(out))
    return TaskConfig(**{**base, **kw})


def strip_time(rows):
    return [{k: v for k, v in r.items() if k != "seconds"} for r in rows]


class Forwards:
    """Counts forwards of the whole model; raises once `fail_after` of them have run."""

    def __init__(self, model, fail_after=None):
        self.n, self.fail_after = 0, fail_after
        self.handle = model.register_forward_pre_hook(self)

    def __call__(self, module, args):
        if self.fail_after is not None and self.n >= self.fail_after:
            raise KeyboardInterrupt("interrupted by the test")
        self.n += 1

    def remove(self):
        self.handle.remove()


def test_full_attention_accuracy_is_the_models_own_argmax(lm, tmp_path):
    """Against the model's full logits, with labels edited so that one example is solved, one is
    half right and one is as generated; checks answer positions and both accuracies."""
    cfg = small(tmp_path / "out", tasks=["passkey", "needle"], n_examples=3)
    plan = plan_tasks(cfg, lm)
    want = {}
    for (task, length, depth), (inputs, labels) in plan.examples.items():
        assert inputs.shape == labels.shape == (3, 256)
        pos = (labels[0] != IGNORE).nonzero()[:, 0]
        assert len(pos) == 6 and int(pos[-1]) == 255  # " " + 5 digits at the end
        assert torch.equal(inputs[:, pos[:-1] + 1], labels[:, pos[:-1]])  # labels[t] is the token after t
        with torch.no_grad():
            pred = lm.model(input_ids=inputs).logits.argmax(-1)  # (3, 256), full sequence, full logits
        labels[0, pos] = pred[0, pos]  # solved
        labels[1, pos[:3]] = pred[1, pos[:3]]  # at least the first 3 tokens right
        hit = (pred[:, pos] == labels[:, pos])
        want[task] = (int(hit.all(-1).sum()) / 3, int(hit.sum()) / hit.numel())
        assert want[task][0] >= 1 / 3 and want[task][1] >= 0.5
    res = run_tasks(cfg, lm, progress=False, plan=plan)
    assert [(r["task"], r["method"], r["K"], r["n"], r["answer_tokens"]) for r in res["rows"]] == [
        ("passkey", "full", None, 3, 18), ("needle", "full", None, 3, 18)]
    for r in res["rows"]:
        assert (r["accuracy"], r["token_accuracy"]) == want[r["task"]]
    saved = json.loads((tmp_path / "out" / "results.json").read_text())
    assert saved["rows"] == res["rows"] and saved["model"] == "tiny-llama" and saved["layers"] == [1, 4, 6]
    md = (tmp_path / "out" / "results.md").read_text()
    assert "### needle: whole answer right" in md and "| full " in md and "Partial" not in md


@pytest.mark.heavy
def test_every_selector_with_k_at_least_the_length_is_full_attention(lm, tmp_path, monkeypatch):
    plain = [m for m in METHODS if not m.startswith("learned")]
    seen = []
    monkeypatch.setattr(tasks, "substitute", lambda model, layers, sel, proj=None: seen.append(
        (layers, sel.method, sel.K, proj)) or substitute(model, layers, sel, proj))
    cfg = small(tmp_path / "out", lengths=[256, 288], methods=["full", *plain], ks=[288])
    res = run_tasks(cfg, lm, progress=False)
    assert seen == [([1, 4, 6], m, 288, None) for m in plain for _ in (256, 288)]  # one substitution per cell
    full = {(r["length"], r["depth"]): r for r in res["rows"] if r["method"] == "full"}
    assert res["rows"][0]["method"] == "full" and len(res["rows"]) == 2 * (1 + len(plain))
    for r in res["rows"]:
        f = full[r["length"], r["depth"]]
        assert (r["accuracy"], r["token_accuracy"]) == (f["accuracy"], f["token_accuracy"]), r
    inputs, labels = tasks.plan_tasks(small(tmp_path / "fresh"), lm).examples["passkey", 256, 0.5]
    ref, _ = answer_logits(lm.model, inputs, labels)
    for method in plain:
        with substitute(lm.model, [1, 4, 6], SelectorConfig(method, K=256)):
            got, _ = answer_logits(lm.model, inputs, labels)
        assert rel_rms(got, ref) < 1e-5 and torch.equal(got.argmax(-1), ref.argmax(-1)), method


def test_learned_method_runs_on_a_projection_checkpoint(lm, tmp_path, monkeypatch):
    torch.manual_seed(0)
    ckpt = tmp_path / "p.safetensors"
    SearchProjections([1, 4, 6], lm.dims.d_model, 8, meta={"model": "tiny"}).save(ckpt)
    seen = []

    def spy(model, layers, sel, proj=None):
        seen.append((list(layers), sel.method, sel.K, sel.groups, proj is not None))
        return substitute(model, layers, sel, proj)

    monkeypatch.setattr(tasks, "substitute", spy)
    cfg = small(tmp_path / "out", checkpoint=str(ckpt), model=None, methods=["full", "learned"], ks=[8, 256])
    res = run_tasks(cfg, lm, progress=False)
    assert seen == [([1, 4, 6], "learned", 8, 1, True), ([1, 4, 6], "learned", 256, 1, True)]
    full, k8, k256 = res["rows"]
    assert (k256["accuracy"], k256["token_accuracy"]) == (full["accuracy"], full["token_accuracy"])
    assert 0 <= k8["accuracy"] <= 1 and 0 <= k8["token_accuracy"] <= 1 and k8["K"] == 8
    assert len(res["checkpoint_sha256"]) == 64
    inputs, labels = plan_tasks(cfg, lm).examples["passkey", 256, 0.5]
    ref, _ = answer_logits(lm.model, inputs, labels)
    proj, _, _ = SearchProjections.load(ckpt)
    with substitute(lm.model, [1, 4, 6], SelectorConfig("learned", K=8), proj):
        sparse, _ = answer_logits(lm.model, inputs, labels)
    assert rel_rms(sparse, ref) > 1e-4  # K=8 of 256 keys really changes the forward


def test_interrupted_run_resumes_and_a_finished_one_does_no_forward(lm, tmp_path):
    cfg = small(tmp_path / "out", depths=[0.1, 0.9], methods=["full", "streaming"])  # 4 cells of 1 example
    hook = Forwards(lm.model, fail_after=2)
    try:
        with pytest.raises(KeyboardInterrupt):
            run_tasks(cfg, lm, progress=False)
    finally:
        hook.remove()
    part = json.loads((tmp_path / "out" / "results.json").read_text())
    assert len(part["rows"]) == 2 and "Partial: 2 of 4 cells" in (tmp_path / "out" / "results.md").read_text()
    hook = Forwards(lm.model)
    try:
        rest = run_tasks(cfg, lm, progress=False)
        assert hook.n == 2 and rest["rows"][:2] == part["rows"]
        again = run_tasks(cfg, lm, progress=False)
        assert hook.n == 2 and again["rows"] == rest["rows"]  # nothing left to run
    finally:
        hook.remove()
    one = run_tasks(small(tmp_path / "one", depths=[0.1, 0.9], methods=["full", "streaming"]), lm, progress=False)
    assert strip_time(one["rows"]) == strip_time(rest["rows"])
    before = (tmp_path / "out" / "results.json").read_text()
    with pytest.raises(ValueError, match=r"out=.*different configuration \(differs in: depths\)"):
        run_tasks(small(tmp_path / "out", depths=[0.5], methods=["full", "streaming"]), lm, progress=False)
    with pytest.raises(ValueError, match=r"out=.*differs in: ks"):
        run_tasks(small(tmp_path / "out", depths=[0.1, 0.9], methods=["full", "streaming"], ks=[8]), lm)
    assert (tmp_path / "out" / "results.json").read_text() == before


BAD_FIELDS = [
    (dict(tasks=["qa"]), "tasks"), (dict(tasks=[]), "tasks"), (dict(lengths=[0]), "lengths"),
    (dict(lengths=[256, 256]), "lengths"), (dict(lengths=[256.0]), "lengths"), (dict(depths=[1.5]), "depths"),
    (dict(depths=[float("nan")]), "depths"), (dict(depths=[True]), "depths"), (dict(n_examples=0), "n_examples"),
    (dict(methods=["bogus"]), "methods"), (dict(methods=[]), "methods"), (dict(ks=[0]), "ks"),
    (dict(layer_set=""), "layer_set"), (dict(layer_set="1,x"), "layer_set"), (dict(layer_set="2,2"), "layer_set"),
    (dict(groups=0), "groups"), (dict(seed=-1), "seed"), (dict(digits=0), "digits"), (dict(out=""), "out"),
    (dict(methods=["learned"]), "checkpoint"), (dict(model=None), "model"),
]


@pytest.mark.parametrize("kw, name", BAD_FIELDS, ids=[f"{n}-{i}" for i, (_, n) in enumerate(BAD_FIELDS)])
def test_bad_config_field_is_named(kw, name, tmp_path):
    with pytest.raises(ValueError, match=rf"^{name}\b"):
        small(**{"out": tmp_path / "out", **kw})
    assert not (tmp_path / "out").exists()


def test_what_needs_the_model_is_checked_before_any_forward(lm, tmp_path):
    torch.manual_seed(0)
    SearchProjections([4], lm.dims.d_model, 8, meta={"model": "tiny"}).save(tmp_path / "p4.safetensors")
    (tmp_path / "short.txt").write_text("a few words of text")
    learned = dict(checkpoint=str(tmp_path / "p4.safetensors"), methods=["learned"])
    cases = [
        (dict(lengths=[8192]), r"^lengths: 8192 exceeds the model's max_position_embeddings=4096"),
        (dict(lengths=[200]), r"^lengths: length must be >= \d+ to hold"),
        (dict(layer_set="0,8"), r"^layer_set='0,8': layer index 8 is out of range"),
        (dict(layer_set="middle6", **learned), r"^layer_set='middle6' needs projections for layers \[1, 2, 3, 5, 6\]"),
        (dict(layer_set="4", groups=2, **learned), r"^groups=2 gives 2 candidate sets.*groups=1"),
        (dict(groups=3), r"^groups gives 3 groups for 4 heads"),
        (dict(checkpoint=str(tmp_path / "none.safetensors")), r"^checkpoint=.*does not exist"),
        (dict(tasks=["needle"], corpus=str(tmp_path / "short.txt"), split="all"), r"^corpus=.* 19 tokens of haystack"),
    ]
    hook = Forwards(lm.model)
    try:
        for kw, match in cases:
            with pytest.raises(ValueError, match=match):
                run_tasks(small(tmp_path / "out", **kw), lm, progress=False)
            assert not (tmp_path / "out").exists()
        assert hook.n == 0
    finally:
        hook.remove()


def one_line_error(argv, capsys, tmp_path, monkeypatch) -> str:
    monkeypatch.chdir(tmp_path)
    before = sorted(tmp_path.rglob("*"))
    code = main(argv)
    err = capsys.readouterr().err
    lines = err.strip().splitlines()
    assert code == 2 and len(lines) == 1 and lines[0].startswith("error: attnlab search tasks: "), err
    assert sorted(tmp_path.rglob("*")) == before, "something was written before the error"
    return lines[0]


@pytest.mark.parametrize("argv, words", [
    (["--model", "x", "--lengths", "0"], ["--lengths", "[0]"]),
    (["--model", "x", "--depths", "0.5,nan"], ["--depths", "nan"]),
    (["--model", "x", "--methods", "full,bogus"], ["--methods", "bogus"]),
    (["--model", "x", "--tasks", "passkey,qa"], ["--tasks", "qa"]),
    (["--model", "x"], ["--checkpoint", "learned"]),  # the default methods include learned
    (["--model", "x", "--methods", "full", "--layer-set", "a,b"], ["--layer-set", "a,b"]),
    (["--model", "x", "--methods", "full", "--n-examples", "0"], ["--n-examples"]),
], ids=["lengths", "depths-nan", "methods", "tasks", "learned-without-checkpoint", "layer-set", "n-examples"])
def test_cli_bad_option_is_one_line_and_writes_nothing(argv, words, tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(tasks, "plan_tasks", lambda *a, **k: pytest.fail("planned despite a bad option"))
    line = one_line_error(["search", "tasks", *argv, "--out", str(tmp_path / "o")], capsys, tmp_path, monkeypatch)
    for word in words:
        assert word in line, f"{word!r} not in {line!r}"


def test_cli_checks_the_model_config_before_weights(tmp_path, capsys, monkeypatch):
    tiny_model("llama", n_layers=2).config.save_pretrained(tmp_path / "m")  # a config, no weights or tokenizer
    monkeypatch.setattr(tasks, "load_model", lambda *a, **k: pytest.fail("weights loaded despite a bad option"))
    common = ["search", "tasks", "--model", str(tmp_path / "m"), "--methods", "full", "--out", str(tmp_path / "o")]
    line = one_line_error([*common, "--lengths", "1024,8192"], capsys, tmp_path, monkeypatch)
    assert "--lengths: 8192 exceeds the model's max_position_embeddings=4096" in line
    line = one_line_error([*common, "--lengths", "1024", "--layer-set", "0,2"], capsys, tmp_path, monkeypatch)
    assert "--layer-set='0,2': layer index 2 is out of range" in line


def test_cli_options_become_the_config():
    import argparse

    from attnlab.cli.search_commands import add_search_commands, tasks_config

    parser = argparse.ArgumentParser()
    add_search_commands(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["search", "tasks", "--checkpoint", "p.safetensors", "--tasks", "needle", "--lengths",
                              "2048,4096", "--depths", "0,0.5,1", "--methods", "full,learned,quest", "--ks", "64",
                              "--layer-set", "12,13", "--groups", "kv", "--n-examples", "2", "--out", "r"])
    cfg = tasks_config(args)
    assert (cfg.tasks, cfg.lengths, cfg.depths, cfg.methods, cfg.ks, cfg.layer_set, cfg.groups, cfg.n_examples) == (
        ["needle"], [2048, 4096], [0.0, 0.5, 1.0], ["full", "learned", "quest"], [64], "12,13", "kv", 2)
    assert cfg.model is None and cfg.corpus == "stdlib" and cfg.out == "r"
    assert cfg.combos() == [("full", None), ("learned", 64), ("quest", 64)]
