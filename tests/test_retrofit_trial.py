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


def _two_trials(tmp_path, model_dir, second_transfer):
    """Trials `a` (a control) and `b` (the same control, `second_transfer` added, and a gate) side by side."""
    one = SPEC.split("[[variants]]")[0].replace("seeds = [0, 1]", "seeds = [0]") + '[[variants]]\nname = "control"\n'
    paths = []
    for name, text in (("a", one), ("b", one + second_transfer + GATE)):
        (tmp_path / name).mkdir()
        paths.append(tmp_path / name / "spec.toml")
        paths[-1].write_text(text.format(model=model_dir))
    return paths


GATE = '[[variants]]\nname = "gate"\nretrofit = {{ settings = {{ output_gate = "elementwise" }} }}\n'


def test_a_run_another_trial_did_with_the_same_settings_is_borrowed(tmp_path, model_dir):
    """`borrow` copies a finished run of a trial beside this one when the settings match once unread
    options are dropped (transfer options with no transfer step), under today's rule, same seed; not
    otherwise."""
    from attnlab.experiments.retrofit_runs import PERPLEXITY_RULE, _fingerprint, borrow, same_settings

    a_spec, b_spec = _two_trials(tmp_path, model_dir, "[transfer]\ncontexts = 3\ncontext = 16\n")
    a, b = load_trial(a_spec), load_trial(b_spec)
    ctrl_a, ctrl_b = a.runs[0], next(r for r in b.runs if r.variant == "control")
    fa, fb = _fingerprint(ctrl_a, ctrl_a.eval), _fingerprint(ctrl_b, ctrl_b.eval)
    assert fa != fb and same_settings(fa, fb)  # the transfer options differ, and no transfer step reads them
    moved = json.loads(json.dumps(fb))
    moved["transfer"]["steps"] = 5
    assert not same_settings(fa, moved)
    assert borrow(ctrl_b.folder, fb, 0, tmp_path) is None  # nothing finished yet
    ctrl_a.folder.mkdir(parents=True)
    res = {"variant": "control", "seed": 0, "nll": 1.5, "fingerprint": fa, "perplexity_rule": PERPLEXITY_RULE}
    (ctrl_a.folder / "result.json").write_text(json.dumps(res))
    assert borrow(ctrl_b.folder, fb, 1, tmp_path) is None  # another seed
    gate = next(r for r in b.runs if r.variant == "gate")
    assert borrow(gate.folder, _fingerprint(gate, gate.eval), 0, tmp_path) is None  # other settings
    got = borrow(ctrl_b.folder, fb, 0, tmp_path)
    assert got["nll"] == 1.5 and got["reused_from"] == "a/runs/control/seed0" and got["fingerprint"] == fb
    assert json.loads((ctrl_b.folder / "result.json").read_text()) == got
    assert json.loads((ctrl_b.folder / "fingerprint.json").read_text()) == fb
    (ctrl_b.folder / "result.json").unlink()
    (ctrl_a.folder / "result.json").write_text(json.dumps({**res, "perplexity_rule": "earlier"}))
    assert borrow(ctrl_b.folder, fb, 0, tmp_path) is None  # scored under another rule: redone
    # the original model: the same evaluation, whatever the variants
    orig_a, orig_b = a.out / "runs" / ORIGINAL, b.out / "runs" / ORIGINAL
    orig_a.mkdir(parents=True)
    (orig_a / "result.json").write_text(json.dumps({"variant": ORIGINAL, "seed": None, "nll": 2.0,
                                                    "fingerprint": _fingerprint(None, a.runs[0].eval),
                                                    "perplexity_rule": PERPLEXITY_RULE}))
    assert borrow(orig_b, _fingerprint(None, b.runs[0].eval), None, tmp_path)["reused_from"] == "a/runs/original"


@pytest.mark.heavy
def test_a_trial_reuses_what_a_trial_beside_it_ran(tmp_path, model_dir, capsys):
    """Trial b runs only its gate: its original and control are a's (identical settings), named in its report;
    --no-reuse runs them all."""
    a_spec, b_spec = _two_trials(tmp_path, model_dir, "[transfer]\ncontext = 16\n")
    assert main(["retrofit", "trial", str(a_spec), "--no-progress"]) == 0
    capsys.readouterr()
    assert main(["retrofit", "trial", str(b_spec), "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "3 runs (0 done, 2 copied from identical runs beside it, 1 to run)" in printed, printed
    assert "finished gate/seed0 (1 of 1): nll " in printed
    ra, rb = (json.loads((p.parent / "results.json").read_text())["variants"] for p in (a_spec, b_spec))
    assert rb["control"]["mean"] == ra["control"]["mean"] and rb[ORIGINAL]["mean"] == ra[ORIGINAL]["mean"]
    assert rb["control"]["reused_from"] == ["a/runs/control/seed0"] and "reused_from" not in rb["gate"]
    assert "`a/runs/control/seed0`" in (b_spec.parent / "report.md").read_text()
    shutil.rmtree(b_spec.parent / "runs")
    assert main(["retrofit", "trial", str(b_spec), "--no-progress", "--no-reuse"]) == 0
    again = json.loads((b_spec.parent / "results.json").read_text())["variants"]
    assert "reused_from" not in again["control"]
    assert again["control"]["mean"]["nll"] == pytest.approx(ra["control"]["mean"]["nll"], abs=1e-6)  # the same run
