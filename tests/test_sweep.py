"""`attnlab sweep`: a tiny 2 variants x 2 seeds sweep writes results whose mean ± sd recompute
from the run summaries; the verdict rule at its boundary; an interrupted sweep resumes onto
the uninterrupted results bit for bit; --jobs 2 trains the same runs as --jobs 1; bad specs
are one-line errors (exit 2) that write nothing."""

from __future__ import annotations

import json
import shutil
import statistics
import sysconfig
from pathlib import Path

import pytest

from attnlab.cli import main
from attnlab.experiments.sweep import judge, verdict
from attnlab.experiments.sweep.runs import config_changes, plan
from attnlab.experiments.sweep.spec import load_spec
from attnlab.train.config import read_toml

ROOT = Path(__file__).resolve().parents[1]
TINY = (ROOT / "configs" / "tiny.toml").as_posix()
CORPUS = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").as_posix()  # one file: no walk of the stdlib per process
SHARED = ["model.d_model=16", "model.n_heads=2", "data.seq_len=16", f"data.source={CORPUS}", "train.steps=4",
          "train.warmup_steps=0", "train.ckpt_every=2", "train.eval_every=2", "train.log_every=1",
          "train.eval_batches=1", "run.tensorboard=false", "run.threads=1"]
VARIANTS = {"softmax": ["model.attn=softmax"], "hybrid": ["model.attn=hybrid"]}
SEEDS = [0, 1]
METRICS = {"loss_at": [16, 32], "topk_mass": [4], "max_tokens": 256, "analysis_len": 16}


def spec_text(shared=SHARED, variants=VARIANTS, extra="") -> str:
    lines = ['title = "Hybrid vs softmax, tiny"', 'claim = "hybrid reaches a lower validation loss than softmax"',
             'below_budget = "a test"', f'base = "{TINY}"', f"seeds = {json.dumps(SEEDS)}",
             f"overrides = {json.dumps(shared)}", "per_seed = true",
             extra]
    for name, ov in variants.items():
        lines += ["[[variants]]", f'name = "{name}"', f"overrides = {json.dumps(ov)}"]
    lines += ["[metrics]"] + [f"{k} = {json.dumps(v)}" for k, v in METRICS.items()]
    lines += ["[verdict]", 'metric = "val_loss"', 'better = "lower"', 'compare = ["hybrid", "softmax"]']
    return "\n".join(lines) + "\n"


def sweep(folder: Path, *args, text: str | None = None) -> dict:
    folder.mkdir(parents=True, exist_ok=True)
    spec = folder / "spec.toml"
    if text is not None or not spec.exists():
        spec.write_text(text or spec_text())
    assert main(["sweep", str(spec), "--no-progress", *args]) == 0
    return json.loads((folder / "results.json").read_text())


def per_run(results: dict) -> dict:
    """What must not change between equivalent sweeps: losses, curves, metrics (not timings)."""
    keep = ("params", "steps", "tokens", "val_loss", "val_ppl", "train_loss", "tau", "metrics", "curves")
    return {(r["variant"], r["seed"]): {k: r[k] for k in keep} for r in results["runs"]}


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[Path, dict]:
    out = tmp_path_factory.mktemp("sweep") / "ref"
    return out, sweep(out)


# --------------------------------------------------------------------------- results


@pytest.mark.heavy
def test_sweep_writes_results_report_and_plots(reference):
    out, res = reference
    assert sorted((r["variant"], r["seed"]) for r in res["runs"]) == sorted((v, s) for v in VARIANTS for s in SEEDS)
    assert res["missing"] == [] and res["machine"]["torch"] and res["command"].startswith("attnlab sweep ")
    for v in VARIANTS:
        summaries = [json.loads((out / "runs" / v / f"seed{s}" / "summary.json").read_text()) for s in SEEDS]
        records = [json.loads((out / "runs" / v / f"seed{s}" / "sweep.json").read_text()) for s in SEEDS]
        stats = res["variants"][v]
        for key in ("val_loss", "val_ppl", "train_loss"):
            values = [s[key] for s in summaries]
            assert stats["mean"][key] == pytest.approx(statistics.fmean(values), rel=1e-12)
            assert stats["sd"][key] == pytest.approx(statistics.stdev(values), rel=1e-12)
        loss32 = [r["metrics"]["loss@32"] for r in records]
        assert stats["mean"]["loss@32"] == pytest.approx(statistics.fmean(loss32), rel=1e-12)
        assert stats["sd"]["loss@32"] == pytest.approx(statistics.stdev(loss32), rel=1e-12)
        assert stats["n"] == 2 and stats["tokens_per_run"] == 4 * 4 * 16 and stats["params"] == summaries[0]["params"]
        for s, run in zip(SEEDS, sorted((r for r in res["runs"] if r["variant"] == v), key=lambda r: r["seed"])):
            assert run["curves"]["train"] == [[r["step"], r["loss"]] for r in summaries[s]["history"]["train"]]
    assert res["variants"]["softmax"]["mean"]["topk_mass@4"] is None  # no scalar heads
    assert 0 < res["variants"]["hybrid"]["mean"]["topk_mass@4"] <= 1
    v = res["variants"]
    expect = verdict(v["hybrid"]["mean"]["val_loss"], v["hybrid"]["sd"]["val_loss"],
                     v["softmax"]["mean"]["val_loss"], v["softmax"]["sd"]["val_loss"], "lower")
    assert res["verdict"]["outcome"] == expect
    report = (out / "report.md").read_text()
    for words in ("# Hybrid vs softmax, tiny", "**Claim.** hybrid reaches", "Model size", "256 training tokens",
                  "±", "## Verdict", f"**{expect}**", "twice the combined sd", "## Per seed", "loss_curves.png",
                  "metrics.png", "topk_mass@4"):
        assert words in report, words
    for png in ("loss_curves.png", "metrics.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_several_rules_each_reach_the_report(tmp_path):
    rules = ('[[verdict]]\nname = "first"\nmetric = "val_loss"\nbetter = "lower"\ncompare = ["hybrid", "softmax"]\n'
             '[[verdict]]\nname = "bound"\nmetric = "loss@16"\nbetter = "lower"\nvariant = "hybrid"\nthreshold = 100.0\n')
    text = spec_text().split("[verdict]")[0] + rules
    spec = load_spec(_write(tmp_path, text))
    assert [r.get("name") for r in spec.verdicts] == ["first", "bound"] and spec.verdict["name"] == "first"
    from attnlab.experiments.sweep.verdict import verdict_lines
    judged = [judge(r, {"hybrid": {"mean": {"val_loss": 1.0, "loss@16": 2.0}, "sd": {"val_loss": 0.1, "loss@16": 0.1}},
                        "softmax": {"mean": {"val_loss": 3.0}, "sd": {"val_loss": 0.1}}}) for r in spec.verdicts]
    text = "\n".join(verdict_lines(spec.verdicts, judged))
    assert [v["outcome"] for v in judged] == ["supported", "supported"]
    assert "- first (hybrid is better than softmax in val_loss, lower is better): **supported**" in text
    assert "- bound (hybrid's loss@16 is below 100" in text and text.count("How a rule is judged") == 1


ANSWER = '[answer]\nquestion = "Is hybrid better?"\namong = ["hybrid"]\nmetric = "val_loss"\nbetter = "lower"\n'


def test_answer_takes_the_best_candidate_by_its_rules(tmp_path):
    """[answer]: the candidate with the best mean (metric_of for some), answered by every rule about it."""
    rules = "".join(f'[[verdict]]\nname = "{v} vs softmax"\nmetric = "{m}"\nbetter = "lower"\ncompare = ["{v}", "softmax"]\n'
                    f'metric_b = "val_loss"\n' for v, m in (("hybrid", "val_loss"), ("gla", "loss@16")))
    rules += '[[verdict]]\nname = "gla bound"\nmetric = "val_loss"\nbetter = "lower"\nvariant = "gla"\nthreshold = 2.0\n'
    answer = ('[answer]\nquestion = "Does a window win?"\namong = ["hybrid", "gla"]\nmetric = "val_loss"\n'
              'metric_of = { gla = "loss@16" }\nbetter = "lower"\n')
    variants = {"softmax": ["model.attn=softmax"], "hybrid": ["model.attn=hybrid"], "gla": ["model.attn=gla"]}
    spec = load_spec(_write(tmp_path, spec_text(variants=variants).split("[verdict]")[0] + rules + answer))
    from attnlab.experiments.sweep.verdict import answer as answer_of, answer_lines

    def stats(hybrid, gla, gla_val=1.0, n=2):
        return {"softmax": {"mean": {"val_loss": 3.0}, "sd": {"val_loss": 0.1}, "n": 2},
                "hybrid": {"mean": {"val_loss": hybrid}, "sd": {"val_loss": 0.1}, "n": 2},
                "gla": {"mean": {"loss@16": gla, "val_loss": gla_val}, "sd": {"loss@16": 0.1, "val_loss": 0.1}, "n": n}}

    def run(variants):
        judged = [judge(r, variants) for r in spec.verdicts]
        return answer_of(spec.answer, spec.verdicts, judged, variants, 2)

    a = run(stats(hybrid=1.0, gla=2.0))  # hybrid's 1.0 beats gla's loss@16 of 2.0 (gla's val_loss is not its metric)
    assert a["chosen"] == "hybrid" and a["outcome"] == "supported" and not a["provisional"]
    assert [r["name"] for r in a["rules"]] == ["hybrid vs softmax"]
    a = run(stats(hybrid=2.9, gla=1.0))  # gla: beats softmax, and its val_loss 1.0 is below 2.0
    assert a["chosen"] == "gla" and [r["outcome"] for r in a["rules"]] == ["supported", "supported"]
    assert a["outcome"] == "supported"
    a = run(stats(hybrid=2.9, gla=1.0, gla_val=2.1))  # its bound is inconclusive: so is the answer
    assert a["chosen"] == "gla" and a["outcome"] == "inconclusive"
    a = run(stats(hybrid=2.9, gla=1.0, gla_val=2.5))  # its bound fails: not supported
    assert a["outcome"] == "not supported"
    a = run(stats(hybrid=1.0, gla=1.0))  # equal means: the first listed
    assert a["chosen"] == "hybrid"
    a = run(stats(hybrid=2.9, gla=1.0, n=1))  # gla short of the seeds: provisional
    assert a["provisional"] and a["waiting"] == ["gla"]
    text = "\n".join(answer_lines(a))
    assert "Does a window win?" in text and "**gla**: loss@16 1" in text and "provisional: gla" in text
    assert "hybrid 2.900" in text and "gla 1.000 (loss@16)" in text and "over 1 seed." in text
    none = run({"softmax": stats(1, 1)["softmax"]})
    assert none["chosen"] is None and none["outcome"] == "inconclusive" and "No candidate" in "\n".join(answer_lines(none))


def _write(folder: Path, text: str) -> Path:
    (folder / "spec.toml").write_text(text)
    return folder / "spec.toml"


# --------------------------------------------------------------------------- resume, report-only, jobs


def _truncate_log(run: Path, last_step: int) -> None:
    rows = [line for line in (run / "log.jsonl").read_text().splitlines() if json.loads(line)["step"] <= last_step]
    (run / "log.jsonl").write_text("".join(r + "\n" for r in rows))


@pytest.mark.heavy
def test_interrupted_sweep_resumes_onto_the_uninterrupted_results(reference, tmp_path, capsys):
    ref_out, ref = reference
    out = tmp_path / "killed"
    shutil.copytree(ref_out, out)
    for name in ("results.json", "report.md", "loss_curves.png", "metrics.png"):
        (out / name).unlink()
    runs = out / "runs"
    # killed at step 3, one step past its checkpoint at step 2: no summary, the newest checkpoint is step 2
    hy = runs / "hybrid" / "seed1"
    (hy / "summary.json").unlink()
    (hy / "sweep.json").unlink()
    shutil.rmtree(hy / "checkpoints" / "step_000004")
    (hy / "checkpoints" / "latest").write_text("step_000002\n")
    _truncate_log(hy, 3)
    # killed after one step, before its first checkpoint: a restart
    sm = runs / "softmax" / "seed0"
    for name in ("summary.json", "sweep.json"):
        (sm / name).unlink()
    shutil.rmtree(sm / "checkpoints")
    _truncate_log(sm, 1)
    # never started
    shutil.rmtree(runs / "softmax" / "seed1")
    # finished training, killed before its metrics were written
    (runs / "hybrid" / "seed0" / "sweep.json").unlink()

    res = sweep(out)
    assert "4 runs (1 evaluate, 1 resume, 1 restart, 1 new)" in capsys.readouterr().out
    assert per_run(res) == per_run(ref)  # bit for bit: losses, curves, metrics
    for v in VARIANTS:
        assert res["variants"][v]["mean"]["val_loss"] == ref["variants"][v]["mean"]["val_loss"]
        assert res["variants"][v]["sd"]["val_loss"] == ref["variants"][v]["sd"]["val_loss"]
    assert res["verdict"] == ref["verdict"]
    resumed = {(r["variant"], r["seed"]): r["resumed"] for r in res["runs"]}
    assert resumed[("hybrid", 1)] and not resumed[("softmax", 0)]

    # --report-only rebuilds the same results without training
    before = {p: p.stat().st_mtime_ns for p in runs.rglob("summary.json")}
    (out / "results.json").unlink()
    again = sweep(out, "--report-only")
    assert per_run(again) == per_run(res) and {p: p.stat().st_mtime_ns for p in runs.rglob("summary.json")} == before

    # a spec changed under finished runs is refused, naming the folder and the key
    spec = out / "spec.toml"
    spec.write_text(spec_text(shared=[s for s in SHARED if s != "train.eval_batches=1"] + ["train.eval_batches=2"]))
    assert main(["sweep", str(spec), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.eval_batches" in err[0] and "another config" in err[0]


@pytest.mark.heavy
def test_two_jobs_train_the_same_runs_as_one(reference, tmp_path):
    _, ref = reference
    res = sweep(tmp_path / "jobs2", "--jobs", "2")
    assert per_run(res) == per_run(ref)


# --------------------------------------------------------------------------- bad input


def files_under(folder: Path) -> list[str]:
    return sorted(str(p.relative_to(folder)) for p in folder.rglob("*"))


BAD = [
    ("unknown-key", spec_text(extra='colour = "red"'), ["colour", "allowed"]),
    ("variant-key", spec_text().replace('name = "hybrid"', 'name = "hybrid"\nmodel = "x"'), ["variants[1].model"]),
    ("rejected-override", spec_text(variants={"softmax": [], "hybrid": ["model.attn=nope"]}),
     ["variant 'hybrid'", "model.attn", "nope"]),
    ("bad-value", spec_text(variants={"softmax": [], "hybrid": ["train.lr=-1"]}), ["variant 'hybrid'", "train.lr"]),
    ("unknown-config-key", spec_text(variants={"softmax": [], "hybrid": ["train.stepz=3"]}),
     ["variant 'hybrid'", "train.stepz"]),
    ("shape", spec_text(variants={"softmax": [], "hybrid": ["model.n_heads=3"]}), ["variant 'hybrid'", "n_heads"]),
    ("duplicate", spec_text().replace('name = "hybrid"', 'name = "softmax"'), ["duplicate", "'softmax'"]),
    ("no-seeds", spec_text().replace("seeds = [0, 1]", "seeds = []"), ["seeds", "at least one"]),
    ("owned", spec_text(variants={"softmax": [], "hybrid": ["run.seed=3"]}), ["run.seed", "set by the sweep"]),
    ("not-override", spec_text(variants={"softmax": [], "hybrid": ["model.attn"]}), ["model.attn", "section.key=value"]),
    ("verdict-variant", spec_text(variants={"hybrid": ["model.attn=hybrid"], "other": []}), ["verdict.compare", "softmax"]),
    ("verdict-metric", spec_text().replace('metric = "val_loss"', 'metric = "loss@64"'), ["verdict.metric", "loss@64"]),
    ("verdict-both", spec_text().replace('compare = ["hybrid", "softmax"]', 'compare = ["hybrid", "softmax"]\nthreshold = 1.0'),
     ["verdict", "either compare"]),
    ("verdict-threshold", spec_text().replace('compare = ["hybrid", "softmax"]', 'variant = "hybrid"\nthreshold = "low"'),
     ["verdict.threshold", "finite number"]),
    ("verdict-metric-b", spec_text().replace('compare = ["hybrid", "softmax"]', 'compare = ["hybrid", "softmax"]\nmetric_b = "x"'),
     ["verdict.metric_b", "'x'"]),
    ("verdict-by", spec_text().replace('compare = ["hybrid", "softmax"]', 'compare = ["hybrid", "softmax"]\nby = "x"'),
     ["verdict.by", "finite number"]),
    ("verdict-times", spec_text().replace('compare = ["hybrid", "softmax"]', 'compare = ["hybrid", "softmax"]\ntimes = 0'),
     ["verdict.times", "> 0"]),
    ("verdict-by-threshold", spec_text().replace('compare = ["hybrid", "softmax"]', 'variant = "hybrid"\nthreshold = 1.0\nby = 0.1'),
     ["verdict", "either compare"]),
    ("answer-no-rule", spec_text() + ANSWER.replace('"hybrid"]', '"hybrid", "softmax"]'), ["answer.among", "'softmax'",
                                                                                        "no verdict rule"]),
    ("answer-variant", spec_text() + ANSWER.replace('"hybrid"]', '"hybrid", "gla"]'), ["answer.among", "'gla'"]),
    ("answer-metric", spec_text() + ANSWER.replace('metric = "val_loss"', 'metric = "loss@99"'), ["answer.metric", "loss@99"]),
    ("answer-metric-of", spec_text() + ANSWER + 'metric_of = { softmax = "val_loss" }\n', ["answer.metric_of", "'softmax'"]),
    ("answer-question", spec_text() + ANSWER.replace('question = "Is hybrid better?"', 'question = ""'), ["answer.question"]),
    ("answer-key", spec_text() + ANSWER + "pick = 1\n", ["answer", "unknown key", "pick"]),
    ("metrics-compress", spec_text().replace("[metrics]", "[metrics]\ncompress = [0.01]"), ["metrics.compress", "windowed_loss"]),
    ("metrics-compress-value", spec_text().replace("[metrics]", "[metrics]\nwindowed_loss = [4]\ncompress = [-1]"),
     ["metrics.compress", "spans"]),
    ("metrics-key", spec_text().replace("[metrics]", "[metrics]\ntopk = [8]"), ["metrics.topk"]),
    ("base-missing", spec_text().replace(TINY, "nowhere.toml"), ["base", "nowhere.toml"]),
    ("not-toml", "title = \n", ["not valid TOML"]),
]


@pytest.mark.parametrize("text, words", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_spec_is_one_line_error_and_writes_nothing(text, words, tmp_path, capsys):
    spec = tmp_path / "spec.toml"
    spec.write_text(text)
    before = files_under(tmp_path)
    assert main(["sweep", str(spec), "--no-progress"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("error: "), err
    for word in words:
        assert word in err[0], f"{word!r} not in {err[0]!r}"
    assert files_under(tmp_path) == before, "something was written before the error"


@pytest.mark.parametrize("argv, word", [
    (["sweep", "missing.toml"], "does not exist"),
    (["sweep", "SPEC", "--jobs", "0"], "--jobs"),
    (["sweep", "SPEC", "--report-only"], "no finished runs"),
], ids=["missing-spec", "jobs-0", "report-only-nothing"])
def test_bad_command_line_is_one_line_error(argv, word, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "SPEC").write_text(spec_text())
    before = files_under(tmp_path)
    assert main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and word in err[0], err
    assert files_under(tmp_path) == before


def test_help_names_the_options(capsys):
    with pytest.raises(SystemExit):
        main(["sweep", "--help"])
    text = capsys.readouterr().out
    for word in ("--jobs", "--report-only", "--out", "runs/<variant>/seed<k>", "experiments/README.md"):
        assert word in text


def test_the_readme_spec_loads(tmp_path):
    """The spec format documented in experiments/README.md is the one load_spec reads."""
    from attnlab.experiments.sweep import load_spec, metric_names

    text = (ROOT / "experiments" / "README.md").read_text().split("```toml\n")[1].split("```")[0]
    spec_path = tmp_path / "spec.toml"
    spec_path.write_text(text.replace('"../../../configs/tiny.toml"', f'"{TINY}"'))
    spec = load_spec(spec_path)
    assert [v.name for v in spec.variants] == ["softmax", "hybrid"] and spec.out == tmp_path / "results"
    assert "loss@512" in metric_names(spec.metrics) and spec.verdict["compare"] == ["hybrid", "softmax"]


def test_tau_trajectory_is_the_mean_over_scalar_layers():
    from attnlab.experiments.sweep.results import _mean_tau

    row = {"kind": "train", "step": 10, "layers": [{"mechanism": "softmax"}, {"mechanism": "hybrid", "tau_mean": 0.2},
                                                    {"mechanism": "scalar", "tau_mean": 0.4}]}
    assert _mean_tau(row) == pytest.approx(0.3)
    assert _mean_tau({"kind": "train", "layers": [{"mechanism": "softmax"}]}) is None


# --------------------------------------------------------------------------- more metrics later

MORE = {**METRICS, "alignment": True, "windowed_loss": [2, 64], "budgets": [8], "lengths": [16, 32],
        "learned_sink_share": True}


def _with_metrics(metrics: dict) -> str:
    text = spec_text()
    head, _, rest = text.partition("[metrics]")
    verdict = rest[rest.index("[verdict]"):]
    return head + "[metrics]\n" + "".join(f"{k} = {json.dumps(v)}\n" for k, v in metrics.items()) + verdict


@pytest.mark.heavy
def test_more_metrics_reevaluate_without_training(reference, tmp_path):
    ref_out, ref = reference
    out = tmp_path / "more"
    shutil.copytree(ref_out, out)
    (out / "spec.toml").write_text(_with_metrics(MORE))
    states = {p.state for p in plan(load_spec(out / "spec.toml"))}
    assert states == {"evaluate"}
    before = {v: [(out / "runs" / v / f"seed{s}" / "summary.json").read_text() for s in SEEDS] for v in VARIANTS}
    res = sweep(out)
    assert before == {v: [(out / "runs" / v / f"seed{s}" / "summary.json").read_text() for s in SEEDS] for v in VARIANTS}
    h, sm = res["variants"]["hybrid"], res["variants"]["softmax"]
    assert h["mean"]["val_loss"] == ref["variants"]["hybrid"]["mean"]["val_loss"]
    # a window as large as the context is exact attention; a window of 2 changes the loss
    assert abs(h["mean"]["wgap@64"]) < 1e-5 and h["mean"]["wgap@2"] != 0
    assert sm["mean"]["wgap@2"] is None and sm["mean"]["align_top"] is None
    assert h["mean"]["wgap@64/M=8"] > 0 and h["mean"]["wgap@64/M=8/T=32"] > 0  # 8 keys per head: a real cost
    for T in (16, 32):
        losses = [r["metrics"][f"loss/T={T}"] for r in res["runs"] if r["variant"] == "hybrid"]
        assert h["mean"][f"loss/T={T}"] == pytest.approx(statistics.fmean(losses))
        assert 0 < h["mean"][f"topk_mass@4/T={T}"] <= 1
    assert h["mean"]["miss_slope@4"] is not None
    assert 0 < h["mean"]["align_ratio"] and h["mean"]["align_top"] == pytest.approx(h["mean"]["align_d10"], rel=1e-6)
    assert h["mean"].get("learned_sink_share") is None  # no sink in this model: not a column
    report = (out / "report.md").read_text()
    for words in ("## By context length", "## Alignment profile", "lengths.png", "alignment.png", "wgap@2", "decile 10"):
        assert words in report, words
    assert "loss/T=16 |" not in report.split("## By context length")[0]  # profiles stay out of the main table
    for png in ("lengths.png", "alignment.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.heavy
def test_run_folder_from_before_an_option_existed_matches(reference, tmp_path):
    ref_out, _ = reference
    out = tmp_path / "old"
    shutil.copytree(ref_out, out)
    run = out / "runs" / "hybrid" / "seed0"
    text = (run / "config.toml").read_text()
    assert "spread_start" in text
    (run / "config.toml").write_text("\n".join(line for line in text.splitlines() if not line.startswith("spread_start")) + "\n")
    spec = load_spec(out / "spec.toml")
    cfg = next(p.cfg for p in plan(spec) if p.variant == "hybrid" and p.seed == 0)
    assert "spread_start" not in str(read_toml(run / "config.toml"))
    assert config_changes(run, cfg) == []


def test_windowed_loss_by_length_derived_from_loss_and_gap():
    from attnlab.experiments.sweep.results import _with_derived

    got = _with_derived({"loss/T=64": 2.0, "wgap@8/T=64": 0.25, "wloss@8/T=64": None, "wloss@8/T=128": None,
                         "loss/T=128": None, "wgap@8/T=128": 0.5, "wloss@4/T=64": 1.0})
    assert got["wloss@8/T=64"] == 2.25 and got["wloss@8/T=128"] is None and got["wloss@4/T=64"] == 1.0


@pytest.mark.heavy
def test_recorded_runs_stand_for_absent_run_folders(reference, tmp_path):
    """A fresh clone holds results.json, not the run folders: --report-only rebuilds the same results,
    and a spec given a new variant trains only that one; a variant whose overrides changed trains again."""
    out, res = reference
    clone = tmp_path / "clone"
    clone.mkdir()
    for name in ("spec.toml", "results.json"):
        shutil.copy(out / name, clone / name)
    again = sweep(clone, "--report-only")
    assert per_run(again) == per_run(res) and again["verdict"] == res["verdict"]
    from attnlab.experiments.report import shown_path

    assert f"rebuild it with `attnlab sweep {shown_path(clone / 'spec.toml')} --report-only`" in (clone / "report.md").read_text()
    # a rebuild trains nothing: the report keeps the command that trained the runs and their machine
    assert again["command"] == res["command"] and again["machine"] == res["machine"]
    assert f"Command: `{res['command']}`" in (clone / "report.md").read_text()
    more = {**VARIANTS, "swa": ["model.attn=softmax", "model.attention.sliding_window=4"]}
    states = {(p.variant, p.seed): p.state for p in plan(load_spec(_write(clone, spec_text(variants=more))))}
    assert states == {**{(v, s): "recorded" for v in VARIANTS for s in SEEDS}, **{("swa", s): "new" for s in SEEDS}}
    grown = sweep(clone)
    assert sorted(p.name for p in (clone / "runs").iterdir()) == ["swa"]
    assert {k: v for k, v in per_run(grown).items() if k[0] != "swa"} == per_run(res)
    changed = {**more, "hybrid": ["model.attn=hybrid", "model.attention.tau_init=0.2"]}
    states = {(p.variant, p.seed): p.state for p in plan(load_spec(_write(clone, spec_text(variants=changed))))}
    assert states[("hybrid", 0)] == "new" and states[("softmax", 0)] == "recorded" and states[("swa", 0)] == "done"


@pytest.mark.heavy
def test_a_sweep_run_in_pieces_equals_it_run_whole(reference, tmp_path, capsys):
    """A sweep in two pieces on two machines (a GPU lease each, say): the first piece trains the softmax
    runs; only the spec and its results.json travel on (run folders stay behind, as on a fresh machine);
    the second piece trains the hybrid runs. The results equal the whole sweep's, run for run."""
    out, res = reference
    first, second = tmp_path / "first", tmp_path / "second"
    sweep(first, "--only", "softmax/seed0,softmax/seed1")
    assert sorted(p.name for p in (first / "runs").iterdir()) == ["softmax"]
    second.mkdir()
    for name in ("spec.toml", "results.json"):
        shutil.copy(first / name, second / name)
    merged = sweep(second, "--only", "hybrid/seed0,hybrid/seed1")
    assert sorted(p.name for p in (second / "runs").iterdir()) == ["hybrid"]
    assert per_run(merged) == per_run(res) and merged["verdict"] == res["verdict"] and not merged["missing"]
    assert main(["sweep", str(second / "spec.toml"), "--no-progress", "--only", "gla/seed0"]) == 2
    assert "--only names runs the spec does not have: gla/seed0" in capsys.readouterr().err


COMMITTED = sorted(p for p in (ROOT / "experiments").rglob("spec.toml")
                   if "runs" not in p.relative_to(ROOT).parts and (p.parent / "results.json").is_file()
                   and "variants" in read_toml(p) and "base" in read_toml(p))


@pytest.mark.slow
@pytest.mark.parametrize("spec", COMMITTED, ids=[p.parent.relative_to(ROOT).as_posix() for p in COMMITTED])
def test_every_committed_report_rebuilds_from_its_results(spec, tmp_path):
    """On a fresh clone (no run folders) `attnlab sweep SPEC --report-only` rebuilds every committed
    sweep report from its results.json alone, with the same runs and verdicts."""
    folder = tmp_path / spec.parent.relative_to(ROOT)
    shutil.copytree(spec.parent, folder, ignore=shutil.ignore_patterns("runs"))
    base = read_toml(spec).get("base")
    if isinstance(base, str):  # a base config path relative to the spec: give the copy the same file
        target = (folder / base).resolve()
        target.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy((spec.parent / base).resolve(), target)
    before = json.loads((spec.parent / "results.json").read_text())
    assert main(["sweep", str(folder / "spec.toml"), "--report-only", "--no-progress"]) == 0
    after = json.loads((folder / "results.json").read_text())
    assert sorted((r["variant"], r["seed"]) for r in after["runs"]) == sorted((r["variant"], r["seed"]) for r in before["runs"])
    assert [v["outcome"] for v in after["verdicts"]] == [v["outcome"] for v in before.get("verdicts", [])] or not before.get("verdicts")


@pytest.mark.heavy
def test_a_finished_sweep_run_again_rewrites_nothing(reference, tmp_path, capsys):
    """Reproducing a finished spec trains nothing: results.json and report.md are written again with the
    same bytes (so a hand edit would not survive), the plots are left untouched, and the machine and
    command that trained the runs are kept."""
    ref_out, _ = reference
    out = tmp_path / "again"
    shutil.copytree(ref_out, out)
    sweep(out)  # the copy names its own folder: this first rerun records that
    files = ("results.json", "report.md", "loss_curves.png", "metrics.png")
    before = {n: ((out / n).read_bytes(), (out / n).stat().st_mtime_ns) for n in files}
    recorded = json.loads((out / "results.json").read_text())
    capsys.readouterr()
    sweep(out)
    assert "results unchanged" in capsys.readouterr().out
    assert {n: (out / n).read_bytes() for n in files} == {n: b for n, (b, _) in before.items()}
    assert {n: (out / n).stat().st_mtime_ns for n in files[2:]} == {n: before[n][1] for n in files[2:]}
    assert json.loads((out / "results.json").read_text())["machine"] == recorded["machine"]
