"""The sweep's budget rule (a from-scratch language spec trains >= MIN_TOKENS_PER_PARAM (30) tokens per parameter and its
softmax control measures its repeat gain at the training length, unless the spec says why not),
metrics on the checkpoints of chosen steps (metrics.at_steps), run folders outside the checkout
($ATTNLAB_RUNS / --runs) and several sweeps run as one queue."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from attnlab.cli import main
from attnlab.experiments.sweep import load_spec, plan
from attnlab.experiments.sweep.budget import (MIN_COPY_GAIN, MIN_TOKENS_PER_PARAM, budget_of, check_budget,
                                              is_softmax_control, params_of)
from attnlab.experiments.sweep.runner import run, run_queue
from attnlab.experiments.sweep.spec import RUNS_ENV, metric_names, step_of
from attnlab.models.config import ConfigError
from attnlab.train import load_config

from test_sweep_pieces import SHARED, TINY  # the tiny sweep's shared overrides (4 steps of a 16-wide model)


def write_spec(folder: Path, *, shared=SHARED, variants=("softmax",), extra: str = "", metrics: dict | None = None,
               budget: str | None = "a test") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    lines = ['title = "budget"', 'claim = "none"', f'base = "{TINY}"', "seeds = [0]",
             f"overrides = {json.dumps(shared)}", extra]
    if budget is not None:
        lines.insert(2, f"below_budget = {json.dumps(budget)}")
    for name in variants:
        lines += ["[[variants]]", f'name = "{name}"', f'overrides = ["model.attn={name}"]']
    if metrics:
        lines += ["[metrics]"] + [f"{k} = {json.dumps(v)}" for k, v in metrics.items()]
    (folder / "spec.toml").write_text("\n".join(lines) + "\n")
    return folder / "spec.toml"


def tokens_for(params: int, ratio: float, tokens_per_step: int) -> int:
    return -(-int(ratio * params) // tokens_per_step)


# --------------------------------------------------------------------------- the budget rule


def test_a_language_spec_below_the_budget_is_refused_before_anything_is_written(tmp_path):
    spec = load_spec(write_spec(tmp_path / "exp", budget=None))
    with pytest.raises(ConfigError, match=r"trains 0\.\d+ tokens per parameter .* budget rule .* at least 30: "
                                          r"train\.steps >= [\d,]+ .* below_budget"):
        run(spec, progress=False, quiet=True)
    assert not (tmp_path / "exp" / "runs").exists() and not (tmp_path / "exp" / "results.json").exists()
    # the CLI says the same in one line, exit 2
    assert main(["sweep", str(spec.path), "--no-progress"]) == 2
    assert not (tmp_path / "exp" / "runs").exists()


def test_the_refusal_names_the_steps_that_meet_the_rule(tmp_path):
    spec = load_spec(write_spec(tmp_path / "exp", variants=("hybrid",), budget=None))
    p = plan(spec)[0]
    params, per_step = params_of(p.cfg), p.cfg.train.tokens_per_step
    need = tokens_for(params, MIN_TOKENS_PER_PARAM, per_step)
    with pytest.raises(ConfigError, match=f"train.steps >= {need:,} "):
        check_budget(spec, plan(spec))
    # at exactly that many steps the rule passes (a variant that is no softmax control needs no repeat metric)
    spec = load_spec(write_spec(tmp_path / "ok", shared=SHARED + [f"train.steps={need}"], variants=("hybrid",), budget=None))
    check_budget(spec, plan(spec))
    spec = load_spec(write_spec(tmp_path / "short", shared=SHARED + [f"train.steps={need - 1}"], variants=("hybrid",),
                                budget=None))
    with pytest.raises(ConfigError, match="tokens per parameter"):
        check_budget(spec, plan(spec))


def test_a_softmax_control_must_measure_its_repeat_gain_at_the_training_length(tmp_path):
    params = params_of(load_config(TINY, SHARED + ["model.attn=softmax"]))
    steps = tokens_for(params, MIN_TOKENS_PER_PARAM, load_config(TINY, SHARED).train.tokens_per_step)
    shared = SHARED + [f"train.steps={steps}"]
    spec = load_spec(write_spec(tmp_path / "a", shared=shared, budget=None, metrics={"repeat_lengths": [32]}))
    with pytest.raises(ConfigError, match=r"softmax control: .* metrics\.repeat_lengths must include the training "
                                          r"length data\.seq_len=16"):
        check_budget(spec, plan(spec))
    spec = load_spec(write_spec(tmp_path / "b", shared=shared, budget=None, metrics={"repeat_lengths": [16]}))
    check_budget(spec, plan(spec))


def test_mqar_is_not_language(tmp_path):
    shared = [s for s in SHARED if not s.startswith("data.source")] + ["data.source=mqar", "model.vocab_size=64",
                                                                       "data.seq_len=64"]
    spec = load_spec(write_spec(tmp_path / "mqar", shared=shared, budget=None))
    check_budget(spec, plan(spec))
    assert budget_of(spec, {"variants": {"softmax": {"params": 1, "mean": {}, "sd": {}}}}) is None


def test_what_counts_as_a_softmax_control():
    base = [*SHARED, "model.attn=softmax"]
    assert is_softmax_control(load_config(TINY, base))
    for extra in ("model.attention.sliding_window=8", "model.attention.output_gate=elementwise"):
        assert not is_softmax_control(load_config(TINY, [*base, extra])), extra
    assert not is_softmax_control(load_config(TINY, [*SHARED, "model.attn=hybrid"]))


def test_the_report_says_whether_the_control_copies(tmp_path):
    spec = load_spec(write_spec(tmp_path / "exp", variants=("softmax", "hybrid")))
    metric = "repeat_gain/T=16"
    for gain, copies in ((MIN_COPY_GAIN - 1e-9, False), (MIN_COPY_GAIN, True)):
        b = budget_of(spec, {"variants": {"softmax": {"params": 1000, "mean": {metric: gain}, "sd": {metric: 0.01}},
                                          "hybrid": {"params": 1000, "mean": {}, "sd": {}}}})
        assert b["controls"] == [{"variant": "softmax", "metric": metric, "mean": gain, "sd": 0.01, "copies": copies}]
        ratio = round(4 * 16 * 4 / 1000, 2)  # 4 steps of 4 x 16 tokens over 1,000 parameters
        assert b["tokens_per_param"] == {"softmax": ratio, "hybrid": ratio}
        assert b["meets"] is False and b["below_budget"] == "a test"  # below the bound either way


# --------------------------------------------------------------------------- metrics at steps


def test_metric_names_at_steps():
    m = {"loss_at": [16], "heldout_lengths": [16], "at_steps": [2, 4]}
    assert metric_names(m) == ["loss@16", "heldout/T=16", "loss@16/step=2", "heldout/T=16/step=2",
                               "loss@16/step=4", "heldout/T=16/step=4"]
    assert step_of("heldout/T=16/step=2") == ("heldout/T=16", 2) and step_of("loss@16") == ("loss@16", None)


@pytest.mark.parametrize("steps, extra, message", [
    ([4, 2], [], "increasing steps without repeats"),
    ([2, 6], [], "names step 6, past train.steps=4"),
    ([3], [], r"\[3\] are not checkpoint steps .* train.ckpt_every=2"),
    ([2], ["train.steps=8", "train.keep_checkpoints=2"], "needs the last 4 checkpoints kept; train.keep_checkpoints is 2"),
], ids=["unordered", "past-the-end", "off-checkpoint", "pruned"])
def test_at_steps_that_no_checkpoint_holds_are_refused(tmp_path, steps, extra, message):
    path = write_spec(tmp_path / "exp", shared=SHARED + extra, metrics={"loss_at": [16], "at_steps": steps})
    with pytest.raises(ConfigError, match=message):
        plan(load_spec(path))


@pytest.mark.heavy
def test_metrics_at_steps_are_those_of_each_checkpoint(tmp_path):
    from attnlab.train import evaluate

    path = write_spec(tmp_path / "exp", shared=SHARED + ["train.keep_checkpoints=5"],
                      metrics={"loss_at": [16], "max_tokens": 256, "at_steps": [2, 4]})
    res = run(load_spec(path), progress=False, quiet=True)
    m = res["runs"][0]["metrics"]
    run_dir = tmp_path / "exp" / "runs" / "softmax" / "seed0"
    at2 = evaluate(run_dir, checkpoint=str(run_dir / "checkpoints" / "step_000002"), seq_lens=[16], max_tokens=256,
                   write=False)["loss"]["16"]["loss"]
    assert m["loss@16/step=2"] == at2 and m["loss@16/step=4"] == m["loss@16"] != at2
    report = (tmp_path / "exp" / "report.md").read_text()
    assert "## By training tokens" in report and (tmp_path / "exp" / "by_tokens.png").is_file()
    assert "## Budget" in report and "Below the budget rule" in report and "Stated exception: a test" in report


# --------------------------------------------------------------------------- run folders outside the checkout


def test_run_folders_under_attnlab_runs_outlive_the_checkout(tmp_path, monkeypatch):
    runs = tmp_path / "runs"
    for clone in ("clone-a", "clone-b"):
        (tmp_path / clone / ".git").mkdir(parents=True)
        write_spec(tmp_path / clone / "experiments" / "x")
    monkeypatch.setenv(RUNS_ENV, str(runs))
    a = plan(load_spec(tmp_path / "clone-a" / "experiments" / "x" / "spec.toml"))[0].run_dir
    b = plan(load_spec(tmp_path / "clone-b" / "experiments" / "x" / "spec.toml"))[0].run_dir
    assert a == b == runs.resolve() / "experiments" / "x" / "runs" / "softmax" / "seed0"
    monkeypatch.delenv(RUNS_ENV)
    assert plan(load_spec(tmp_path / "clone-a" / "experiments" / "x" / "spec.toml"))[0].run_dir == (
        tmp_path / "clone-a" / "experiments" / "x" / "runs" / "softmax" / "seed0")


@pytest.mark.heavy
def test_a_queue_of_two_sweeps_with_run_folders_elsewhere(tmp_path, monkeypatch):
    monkeypatch.delenv(RUNS_ENV, raising=False)
    (tmp_path / "repo" / ".git").mkdir(parents=True)
    a, b = write_spec(tmp_path / "repo" / "a"), write_spec(tmp_path / "repo" / "b", variants=("hybrid",))
    assert main(["sweep", str(a), str(b), "--no-progress", "--runs", str(tmp_path / "runs")]) == 0
    assert RUNS_ENV not in os.environ  # --runs holds for its command only
    for name, spec, variant in (("a", a, "softmax"), ("b", b, "hybrid")):
        res = json.loads((spec.parent / "results.json").read_text())
        assert [r["variant"] for r in res["runs"]] == [variant] and res["command"] == f"attnlab sweep {spec}"
        assert (tmp_path / "runs" / name / "runs" / variant / "seed0" / "summary.json").is_file()
        assert not (spec.parent / "runs").exists() and res["runs"][0]["run_dir"] == f"runs/{variant}/seed0"
    # run again: nothing left to train, each report rebuilt from the runs it finds there
    monkeypatch.setenv(RUNS_ENV, str(tmp_path / "runs"))
    assert [len(r["runs"]) for r in run_queue([a, b], progress=False, quiet=True)] == [1, 1]


def test_a_queue_takes_no_option_of_one_sweep(tmp_path, capsys):
    a, b = write_spec(tmp_path / "a"), write_spec(tmp_path / "b")
    for option in (["--out", str(tmp_path / "o")], ["--only", "softmax/seed0"], ["--report-only"]):
        assert main(["sweep", str(a), str(b), *option]) == 2
        assert "takes one spec" in capsys.readouterr().err
    assert not (tmp_path / "a" / "runs").exists() and not (tmp_path / "o").exists()


def test_a_resumed_runs_time_counts_every_process_that_trained_it():
    """A run killed and resumed: the process that finished it trained only its last steps, so its wall time
    understates the run; the log's intervals (tokens over measured tokens/s) count every process once."""
    from attnlab.experiments.sweep.budget import run_seconds
    from attnlab.experiments.sweep.results import logged_train_seconds

    first = [{"kind": "train", "step": s, "tokens": 1000 * s, "tokens_per_s": 100.0} for s in (10, 20, 30)]
    again = [{"kind": "train", "step": s, "tokens": 1000 * s, "tokens_per_s": 50.0} for s in (30, 40)]  # from step 30
    log = first + [{"kind": "eval", "step": 30, "val_loss": 2.0}] + again
    # 10,000 tokens at 100/s (from 0), twice more at 100/s, the repeated step 30 not again, 10,000 at 50/s
    assert logged_train_seconds(log) == pytest.approx(100 + 100 + 100 + 200)
    assert logged_train_seconds([{"kind": "eval", "step": 1}]) is None
    assert run_seconds({"wall_seconds": 60.0, "train_seconds_logged": 500.0, "resumed": True}) == 500.0
    assert run_seconds({"wall_seconds": 560.0, "train_seconds_logged": 500.0}) == 560.0  # + its measurement
    assert run_seconds({"train_seconds": 42.0}) == 42.0  # results from before the log was read
    assert run_seconds({}) is None


def test_a_resumed_runs_table_row_times_the_whole_run():
    """The report's train_seconds and tokens/s of a resumed run are over every process that trained it:
    a run of 40,000 tokens whose last process trained 200 s of it, logged 500 s in all, reads 500 s and
    80 tokens/s, not 200 s and that process's rate; a run never resumed reads as it was recorded."""
    from attnlab.experiments.sweep.runs import scalar_of

    resumed = {"metrics": {}, "resumed": True, "tokens": 40_000, "train_seconds": 200.0, "tokens_per_s": 50.0,
               "train_seconds_logged": 500.0}
    assert scalar_of(resumed, "train_seconds") == 500.0
    assert scalar_of(resumed, "tokens_per_s") == pytest.approx(40_000 / 500.0)
    whole = {**resumed, "resumed": False, "train_seconds": 510.0, "tokens_per_s": 78.4}
    assert scalar_of(whole, "train_seconds") == 510.0 and scalar_of(whole, "tokens_per_s") == 78.4
    old = {k: v for k, v in resumed.items() if k != "train_seconds_logged"}  # recorded before the log was read
    assert scalar_of(old, "train_seconds") == 200.0 and scalar_of(old, "tokens_per_s") == 50.0
    assert scalar_of({"metrics": {"loss/T=256": 1.5}, "resumed": True}, "loss/T=256") == 1.5
