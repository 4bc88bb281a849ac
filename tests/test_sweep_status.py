"""`attnlab sweep SPEC... --plan`: what a sweep has left, read from its run folders, results.json and a
records folder, with nothing trained or written. The tiny spec of test_sweep_pieces (2 variants x 2
seeds of 4 steps): before any run every run is new and of unknown speed; after a piece trained on
another machine its run is "in records" and the others are timed at its measured speed; a run cut
after its step-2 checkpoint resumes from step 2 at its own logged speed."""

from __future__ import annotations

import json
import shutil

import pytest
from test_sweep_pieces import folder, spec_text, sweep

from attnlab.cli import main
from attnlab.experiments import sweep as sw
from attnlab.experiments.sweep.records import _read, records_file
from attnlab.experiments.sweep.status import spec_records
from attnlab.experiments.sweep.status import fill_from_others, sweep_plan
from attnlab.train import read_log

TOKENS_PER_STEP = 4 * 16  # configs/tiny.toml's batch of 4 x data.seq_len=16


def tree(path):
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*"))


def test_a_plan_before_any_run_writes_nothing(tmp_path, capsys):
    spec = folder(tmp_path / "exp")
    before = tree(tmp_path)
    assert main(["sweep", str(spec), "--plan", "--jobs", "2"]) == 0
    text = capsys.readouterr().out
    assert "4 runs: 4 new" in text and "budget rule: exception: a test" in text
    assert text.count("time left unknown") == 4 and "4 runs of unknown speed not counted" in text
    assert tree(tmp_path) == before  # no runs/, no results.json


def test_a_plan_names_a_spec_below_the_budget_without_refusing_to_show_it(tmp_path):
    spec = folder(tmp_path / "exp", spec_text().replace('below_budget = "a test"\n', ""))
    p = sweep_plan(sw.load_spec(spec))
    assert p["budget"].startswith("refused: variant 'softmax': trains")
    assert all(r["state"] == "new" and r["tokens_per_param"] < 1 for r in p["rows"])


def test_plan_options_are_checked(tmp_path, capsys):
    spec = folder(tmp_path / "exp")
    for extra in (["--only", "softmax/seed0"], ["--report-only"], ["--merge", str(tmp_path)]):
        assert main(["sweep", str(spec), "--plan", *extra]) == 2
        assert "--plan trains nothing" in capsys.readouterr().err
    assert not (tmp_path / "exp" / "runs").exists()


@pytest.mark.heavy
def test_a_plan_times_what_is_left_from_the_runs_measured(tmp_path, capsys):
    here = folder(tmp_path / "here")
    there = folder(tmp_path / "there")  # another machine: trains one piece and keeps only its records
    records = tmp_path / "records"
    assert sweep(there, "--only", "softmax/seed0,softmax/seed1", "--records", str(records)) == 0
    # a report of a sweep in progress names the size of the variants none of whose runs has finished
    res = json.loads((there.parent / "results.json").read_text())["variants"]
    assert res["softmax"]["params_planned"] == res["softmax"]["params"] > 0  # as its runs counted them
    assert res["hybrid"]["n"] == 0 and res["hybrid"]["params"] is None and res["hybrid"]["params_planned"] > 0
    assert f"hybrid {res['hybrid']['params_planned']:,} parameters" in (there.parent / "report.md").read_text()
    spec = sw.load_spec(here)
    assert spec_records(spec, records) == [records_file(sw.load_spec(there), records)]  # written as "there-..."
    recorded = {(r["variant"], r["seed"]): r for r in _read(records_file(sw.load_spec(there), records), spec)["runs"]}
    # the records hold tokens_per_s as measured (the runs were not resumed)
    rate = sorted(recorded[("softmax", s)]["tokens_per_s"] for s in (0, 1))
    median = (rate[0] + rate[1]) / 2

    p = sweep_plan(spec, records=records)
    rows = {(r["variant"], r["seed"]): r for r in p["rows"]}
    assert [rows["softmax", s]["state"] for s in (0, 1)] == ["in records", "in records"]
    for s in (0, 1):
        r = rows["hybrid", s]
        assert r["state"] == "new" and r["rate_from"] == "the spec's runs" and r["rate"] == pytest.approx(median)
        assert r["seconds_left"] == pytest.approx(4 * TOKENS_PER_STEP / median)
    assert p["seconds_left"] == pytest.approx(2 * 4 * TOKENS_PER_STEP / median) and p["unknown"] == 0

    # a run cut after its step-2 checkpoint: it resumes from step 2 at the speed its own log measured
    assert sweep(here, "--only", "hybrid/seed0") == 0
    run = here.parent / "runs" / "hybrid" / "seed0"
    shutil.rmtree(run / "checkpoints" / "step_000004")
    (run / "checkpoints" / "latest").write_text("step_000002\n")
    (run / "summary.json").unlink()
    row = next(r for r in sweep_plan(spec, records=records)["rows"] if (r["variant"], r["seed"]) == ("hybrid", 0))
    logged = [r["tokens_per_s"] for r in read_log(run, "train") if r.get("tokens_per_s")][-1]
    assert (row["state"], row["step"], row["rate_from"]) == ("resume", 2, "its log")
    assert row["seconds_left"] == pytest.approx(2 * TOKENS_PER_STEP / logged)

    # a spec none of whose runs finished borrows the speed of the other specs planned with it
    other = folder(tmp_path / "other")
    plans = fill_from_others([sweep_plan(spec, records=records), sweep_plan(sw.load_spec(other))])
    assert {r["rate_from"] for r in plans[1]["rows"]} == {"other specs' runs"} and plans[1]["unknown"] == 0
    before = tree(tmp_path)
    assert main(["sweep", str(here), str(other), "--plan", "--records", str(records), "--jobs", "2"]) == 0
    out = capsys.readouterr().out
    assert "resume" in out and "in records" in out and "at --jobs 2" in out
    assert tree(tmp_path) == before
