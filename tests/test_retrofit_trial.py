"""`attnlab retrofit trial`: variants x seeds converted, fine-tuned and evaluated, resumed, reported with verdicts."""

import json
import shutil
import math

import pytest
import torch

pytest.importorskip("transformers")
pytest.importorskip("peft")

import attnlab.hf  # noqa: E402,F401
from attnlab.cli import main  # noqa: E402
from attnlab.experiments.sweep.verdict import OUTCOMES  # noqa: E402
from attnlab.models.config import ConfigError  # noqa: E402
from attnlab.retrofit import FinetuneConfig, convert, finetune, new_parameters  # noqa: E402
from attnlab.retrofit.convert import plan  # noqa: E402
from attnlab.retrofit.finetune import trainable_count  # noqa: E402
from transformers import AutoConfig  # noqa: E402
from attnlab.experiments.retrofit_trial import ORIGINAL, load_trial  # noqa: E402

from test_retrofit import tiny  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

SPEC = """
title = "tiny gate trial"
claim = "the gate lowers the loss"
seeds = [0, 1]
[retrofit]
model = "{model}"
layers = "1,2"
[finetune]
steps = 3
lr = 0.01
context = 32
contexts = 4
batch = 2
eval_contexts = 1
warmup = 1
lora = 2
[eval]
contexts = 2
context = 32
[[variants]]
name = "control"
[[variants]]
name = "gate"
retrofit = {{ settings = {{ output_gate = "elementwise" }} }}
[[variants]]
name = "gate-lr10"
retrofit = {{ settings = {{ output_gate = "elementwise" }} }}
finetune = {{ new_lr_scale = 10.0 }}
[[verdict]]
name = "gate vs control"
metric = "nll"
better = "lower"
compare = ["gate", "control"]
[[verdict]]
name = "sink share falls"
metric = "first_token_share"
metric_b = "first_token_share_before"
better = "lower"
compare = ["gate", "gate"]
"""


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("tiny-llama")
    tiny("llama", n_layers=3).save_pretrained(d)
    return d


def _spec(tmp_path, model_dir, text=SPEC):
    (tmp_path / "exp").mkdir(exist_ok=True)
    path = tmp_path / "exp" / "spec.toml"
    path.write_text(text.format(model=model_dir))
    return path


@pytest.mark.heavy
def test_trial_runs_reports_and_resumes(tmp_path, model_dir, capsys):
    spec = _spec(tmp_path, model_dir)
    assert main(["retrofit", "trial", str(spec), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "gate vs control:" in printed and "wrote" in printed
    res = json.loads((spec.parent / "results.json").read_text())
    assert set(res["variants"]) == {ORIGINAL, "control", "gate", "gate-lr10"}
    for v in ("control", "gate", "gate-lr10"):
        st = res["variants"][v]
        assert st["seeds"] == [0, 1] and st["sd"]["nll"] is not None
        assert st["mean"]["nll"] == pytest.approx(torch.tensor(st["mean"]["ppl"]).log().item(), rel=1e-2)
        assert st["mean"]["first_token_share_before"] is not None
    assert res["variants"]["control"]["mean"]["gate_low"] is None  # no gate in the control's layers
    assert res["variants"]["gate"]["mean"]["gate_low"] is not None
    orig = res["variants"][ORIGINAL]
    assert orig["mean"]["ppl_gap"] == 0.0 and orig["sd"]["ppl"] == 0.0
    original = json.loads((spec.parent / "runs" / ORIGINAL / "result.json").read_text())
    assert original["ppl"] == pytest.approx(original["ppl_original_hf"], rel=1e-5)  # softmax conversion = the model
    # the control fine-tunes (LoRA) and so moves away from the original; a 10x rate moves the gate further
    assert res["variants"]["control"]["mean"]["ppl"] != pytest.approx(orig["mean"]["ppl"], rel=1e-6)
    assert res["variants"]["gate-lr10"]["mean"]["new_change_rms"] > 3 * res["variants"]["gate"]["mean"]["new_change_rms"]
    assert [v["outcome"] for v in res["verdicts"]] and all(v["outcome"] in OUTCOMES for v in res["verdicts"])
    # what each run trained, LoRA included, recorded and counted from the plan alone (no weights) alike
    hf_config = AutoConfig.from_pretrained(model_dir)
    for run in load_trial(spec).runs:
        recorded = json.loads((run.folder / "result.json").read_text())["trainable_params"]
        r = run.retrofit
        assert recorded == trainable_count(plan(hf_config, r.layers, r.attn, r.settings), run.finetune), run.variant
    gate = res["variants"]["gate"]["mean"]["trainable_params"]
    assert gate - res["variants"]["control"]["mean"]["trainable_params"] == 2 * 64 * 64  # two gates of d x d
    report = (spec.parent / "report.md").read_text()
    assert "attnlab retrofit trial" in report and "first_token_share per layer" in report and "gate vs control" in report
    assert "3 steps × 2 × 32 tokens = 192 tokens" in report
    # a second call trains nothing: every result.json stays as it was
    stamps = {p: p.stat().st_mtime_ns for p in spec.parent.rglob("result.json")}
    assert len(stamps) == 7
    assert main(["retrofit", "trial", str(spec), "--no-progress"]) == 0
    assert stamps == {p: p.stat().st_mtime_ns for p in spec.parent.rglob("result.json")}
    assert main(["retrofit", "trial", str(spec), "--report-only"]) == 0
    # a fresh clone has spec.toml and results.json, not runs/: --report-only keeps every recorded result
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in ("spec.toml", "results.json"):
        shutil.copy(spec.parent / name, clone / name)
    assert main(["retrofit", "trial", str(clone / "spec.toml"), "--report-only"]) == 0
    again = json.loads((clone / "results.json").read_text())
    assert again["variants"] == res["variants"] and again["per_layer"] == res["per_layer"]
    assert [v["outcome"] for v in again["verdicts"]] == [v["outcome"] for v in res["verdicts"]]
    # results measured with another setup are not kept: the spec's variant changed under them
    (clone / "spec.toml").write_text((clone / "spec.toml").read_text().replace("lora = 2\n", "lora = 4\n", 1))
    assert main(["retrofit", "trial", str(clone / "spec.toml"), "--report-only"]) == 0
    changed = json.loads((clone / "results.json").read_text())["variants"]
    assert all(not st["seeds"] for v, st in changed.items() if v != ORIGINAL)


BAD = {
    "unknown key(s) bogus": ("title =", "bogus = 1\ntitle ="),
    "finetune.bogus": ("lora = 2\n", "lora = 2\nbogus = 1\n"),
    "unique": ('name = "gate"\n', 'name = "control"\n'),
    "owned key finetune.seed": ("lora = 2\n", "lora = 2\nseed = 3\n"),
    "every variant must be evaluated the same way": ('name = "control"\n', 'name = "control"\neval = {{ context = 16 }}\n'),
    "layers": ('layers = "1,2"', 'layers = "7"'),
    "metric must be a per-run scalar": ('metric = "nll"', 'metric = "loss"'),
}


@pytest.mark.parametrize("match", list(BAD))
def test_bad_spec_is_one_error_naming_the_key(tmp_path, model_dir, match):
    old, new = BAD[match]
    text = SPEC.replace(old, new, 1)
    spec = _spec(tmp_path, model_dir, text)
    with pytest.raises(ConfigError, match=match.replace("(", r"\(").replace(")", r"\)")):
        load_trial(spec)
    assert main(["retrofit", "trial", str(spec)]) == 2
    assert sorted(p.name for p in spec.parent.iterdir()) == ["spec.toml"]  # nothing written


def test_cli_refuses_options_beside_a_trial(tmp_path, model_dir, capsys):
    spec = _spec(tmp_path, model_dir)
    assert main(["retrofit", "trial", str(spec), "--attn", "hybrid"]) == 2
    assert "--attn" in capsys.readouterr().err
    assert main(["retrofit", "trial"]) == 2
    assert main(["retrofit", "--attn", "hybrid"]) == 2  # the single retrofit still needs --out
    assert main(["retrofit", "trial", str(tmp_path / "missing.toml")]) == 2
    assert sorted(p.name for p in spec.parent.iterdir()) == ["spec.toml"]


def test_new_lr_scale_moves_only_the_new_parameters_faster(model_dir, tmp_path):
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir)
    moved = {}
    for scale in (1.0, 10.0):
        r = convert(hf, "1,2", "softmax", {"output_gate": "elementwise"})
        new = new_parameters(r.model, r.retrofit_plan)
        start = {k: p.detach().clone() for k, p in new.items()}
        base = {k: v.detach().clone() for k, v in r.state_dict().items()}
        cfg = FinetuneConfig(steps=4, lr=1e-3, warmup=0, context=32, contexts=4, batch=2, eval_contexts=1,
                             new_lr_scale=scale)
        finetune(r, cfg, tmp_path / f"s{scale}", progress=False)
        moved[scale] = max(float((p.detach() - start[k]).abs().max()) for k, p in new.items())
        names = {f"model.{k}" for k in new}
        assert all(torch.equal(v, r.state_dict()[k]) for k, v in base.items() if k not in names)
    # Adam moves each parameter by about lr per step: ten times the rate, about ten times the distance
    assert 5 * moved[1.0] < moved[10.0] < 15 * moved[1.0], moved


@pytest.mark.heavy
def test_decode_metrics_and_align_in_a_trial(tmp_path, model_dir):
    """[eval] windows: the windowed and learned-selection losses beside the exact one, their gaps, a
    control without scalar layers reporting the exact loss only; finetune.align trains with L_align."""
    text = SPEC.split("[[variants]]")[0].replace("[eval]", "[eval]\nwindows = [4]\nwindow_lengths = [24]\n"
                                                 "window_contexts = 2\nlearned_steps = 2\nlearned_context = 16\n"
                                                 "learned_contexts = 2")
    text = text.replace("seeds = [0, 1]", "seeds = [0]") + '''
[[variants]]
name = "control"
[[variants]]
name = "hybrid-align"
retrofit = {{ attn = "scalar" }}
transfer = {{ steps = 2, contexts = 2, context = 16 }}
finetune = {{ align = 0.1 }}
[[verdict]]
metric = "gap:window4@24"
better = "lower"
compare = ["hybrid-align", "hybrid-align"]
metric_b = "gap:learned4@24"
'''
    spec = _spec(tmp_path, model_dir, text)
    assert main(["retrofit", "trial", str(spec), "--no-progress"]) == 0
    res = json.loads((spec.parent / "results.json").read_text())
    hyb, ctl = res["variants"]["hybrid-align"]["mean"], res["variants"]["control"]["mean"]
    for name in ("exact@24", "window4@24", "learned4@24"):
        assert hyb[name] is not None and hyb[name] > 0
    assert hyb["gap:window4@24"] == pytest.approx(100 * math.expm1(hyb["window4@24"] - hyb["exact@24"]))
    assert ctl["exact@24"] is not None and ctl["window4@24"] is None and ctl["gap:window4@24"] is None
    log = (spec.parent / "runs" / "hybrid-align" / "seed0" / "finetune" / "log.jsonl").read_text()
    assert '"align"' in log
    assert "Decoding through key selection" in (spec.parent / "report.md").read_text()
    assert json.loads((spec.parent / "runs" / "hybrid-align" / "seed0" / "result.json").read_text())["transfer"]
    assert not list(spec.parent.rglob("decode.partial*"))  # a finished run keeps only its result.json
    # a hybrid retrofit (its learned scalar gain at 0, the exact start) is windowed through that gain
    spec.write_text(spec.read_text().replace('attn = "scalar"', 'attn = "hybrid"').replace("steps = 2, ", "steps = 0, "))
    assert main(["retrofit", "trial", str(spec), "--no-progress"]) == 0
    hyb = json.loads((spec.parent / "results.json").read_text())["variants"]["hybrid-align"]["mean"]
    assert hyb["window4@24"] is not None and hyb["learned4@24"] is not None


@pytest.mark.heavy
def test_jobs_run_side_by_side_and_match_one_at_a_time(tmp_path, model_dir, capsys):
    """--jobs 2: the runs in two worker processes, each on its own copy of the model, give the
    results of the runs made one after another in this process."""
    text = SPEC.replace("seeds = [0, 1]", "seeds = [0]").split("[[variants]]\nname = \"gate-lr10\"")[0]
    text += '[[verdict]]\nmetric = "nll"\nbetter = "lower"\ncompare = ["gate", "control"]\n'
    for name in ("one", "two"):
        (tmp_path / name).mkdir()
    one, two = _spec(tmp_path / "one", model_dir, text), _spec(tmp_path / "two", model_dir, text)
    assert main(["retrofit", "trial", str(one), "--no-progress"]) == 0
    assert main(["retrofit", "trial", str(two), "--no-progress", "--jobs", "2"]) == 0
    runs = sorted(p.relative_to(one.parent) for p in one.parent.rglob("result.json"))
    assert len(runs) == 3  # the original, control and gate
    for rel in runs:
        a, b = (json.loads((s.parent / rel).read_text()) for s in (one, two))
        assert b["nll"] == pytest.approx(a["nll"], rel=1e-5, abs=1e-6), rel
        assert b["first_token_share_all"] == pytest.approx(a["first_token_share_all"], rel=1e-4), rel
    capsys.readouterr()
    assert main(["retrofit", "trial", str(two), "--jobs", "0"]) == 2
    assert "--jobs must be an int >= 1" in capsys.readouterr().err
    assert main(["retrofit", "--attn", "hybrid", "--out", str(tmp_path / "x"), "--jobs", "2"]) == 2
    assert not (tmp_path / "x").exists()


def test_perplexities_under_different_rules_are_not_compared():
    """A rule comparing perplexities of runs scored under different perplexity rules (or a variant whose
    seeds mix them, mid-rerun) is inconclusive and says why; attention statistics are compared as usual."""
    from attnlab.experiments.retrofit_report import _same_rule

    stats = {"a": {"earlier_rule": True, "seeds": [0, 1]}, "b": {"seeds": [0, 1]},
             "c": {"earlier_rule": True, "mixed_rule": True, "seeds": [0, 1]}, "d": {"seeds": [0]}, "e": {"seeds": []}}
    supported = {"outcome": "supported", "reason": "a 1.0 vs b 2.0"}
    got = _same_rule({"metric": "nll", "compare": ["a", "b"]}, supported, stats)
    assert got["outcome"] == "inconclusive" and "a earlier, b current" in got["reason"] and "a 1.0" in got["reason"]
    assert _same_rule({"metric": "ppl", "compare": ["c", "a"]}, supported, stats)["outcome"] == "inconclusive"
    assert _same_rule({"metric": "nll", "compare": ["b", "d"]}, supported, stats) == supported
    assert _same_rule({"metric": "first_token_share", "compare": ["a", "b"]}, supported, stats) == supported
    assert _same_rule({"metric": "nll", "compare": ["a", "e"]}, supported, stats) == supported  # e: nothing ran
