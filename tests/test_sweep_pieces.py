"""A sweep in pieces: `attnlab sweep SPEC --only RUNS --records DIR` on machines that keep nothing (a GPU lent
for one command), `attnlab sweep SPEC --merge DIR...` here. A tiny 2 variants x 2 seeds spec run in two
pieces (the first cut off after one run and run again) equals the same spec run whole: results.json value
for value and report.md line for line, up to timings and the machine; the records are written as each run
finishes; records of another spec, or a run recorded twice differently, are refused naming the file, with
nothing written; the report names the machine that trained each run."""

from __future__ import annotations

import json
import shutil
import sysconfig
from pathlib import Path

import pytest

from attnlab.cli import main
from attnlab.experiments import sweep as sw
from attnlab.experiments.sweep import records as rec
from attnlab.experiments.sweep import runner

ROOT = Path(__file__).resolve().parents[1]
TINY = (ROOT / "configs" / "tiny.toml").as_posix()
CORPUS = (Path(sysconfig.get_paths()["stdlib"]) / "argparse.py").as_posix()
SHARED = ["model.d_model=16", "model.n_heads=2", "data.seq_len=16", f"data.source={CORPUS}", "train.steps=4",
          "train.warmup_steps=0", "train.ckpt_every=2", "train.eval_every=2", "train.log_every=1",
          "train.eval_batches=1", "run.tensorboard=false", "run.threads=1"]
VARIANTS = {"softmax": ["model.attn=softmax"], "hybrid": ["model.attn=hybrid"]}
RUNS = [f"{v}/seed{s}" for v in VARIANTS for s in (0, 1)]
GPU = "NVIDIA H100 80GB HBM3"
TIMINGS = ("wall_seconds", "tokens_per_s", "train_seconds", "train_seconds_logged", "run_minutes")


def spec_text(shared=SHARED) -> str:
    lines = ['title = "Hybrid vs softmax, tiny, in pieces"', 'claim = "hybrid reaches a lower validation loss"',
             'below_budget = "a test"', f'base = "{TINY}"', "seeds = [0, 1]", f"overrides = {json.dumps(shared)}",
             "per_seed = true"]
    for name, ov in VARIANTS.items():
        lines += ["[[variants]]", f'name = "{name}"', f"overrides = {json.dumps(ov)}"]
    lines += ["[metrics]", "loss_at = [16, 32]", "topk_mass = [4]", "max_tokens = 256", "analysis_len = 16"]
    lines += ["[verdict]", 'metric = "val_loss"', 'better = "lower"', 'compare = ["hybrid", "softmax"]']
    return "\n".join(lines) + "\n"


def folder(path: Path, text: str | None = None) -> Path:
    """A fresh machine's copy of the experiment: the spec alone."""
    path.mkdir(parents=True)
    (path / "spec.toml").write_text(text or spec_text())
    return path / "spec.toml"


def sweep(spec: Path, *args) -> int:
    return main(["sweep", str(spec), "--no-progress", *args])


def results(spec: Path) -> dict:
    return json.loads((spec.parent / "results.json").read_text())


def without(value, keys=TIMINGS + ("machine", "machines", "command", "path")):
    """A results dict with what may differ between equivalent sweeps left out (timings, machine, command, paths)."""
    if isinstance(value, dict):
        return {k: without(v, keys) for k, v in value.items() if k not in keys}
    if isinstance(value, list):
        return [without(v, keys) for v in value]
    return value


def only_files(path: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(path.iterdir()) if p.is_file()}


@pytest.fixture(scope="module")
def pieces(tmp_path_factory):
    """The spec run whole, and in two pieces on two fresh machines: the softmax runs (cut off after the
    first run, then run again: the second finishes the piece) and the hybrid runs, each writing records."""
    base = tmp_path_factory.mktemp("pieces")
    whole = folder(base / "whole")
    assert sweep(whole) == 0

    first, r1 = folder(base / "first"), base / "out1"
    spec = sw.load_spec(first)
    calls = []

    def cut_off(job):  # the command's time limit, reached in the second run of the piece
        calls.append(job)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real(job)

    real = runner.execute
    runner.execute = cut_off
    try:
        with pytest.raises(KeyboardInterrupt):
            sw.run(spec, only=["softmax/seed0", "softmax/seed1"], records=r1, progress=False, quiet=True)
    finally:
        runner.execute = real
    cut = json.loads(next(r1.iterdir()).read_text())
    assert sweep(first, "--only", "softmax/seed0,softmax/seed1", "--records", str(r1)) == 0

    second, r2 = folder(base / "second"), base / "out2"
    assert sweep(second, "--only", "hybrid/seed0,hybrid/seed1", "--records", str(r2)) == 0
    return {"base": base, "whole": whole, "r1": r1, "r2": r2, "cut": cut}


@pytest.mark.heavy
def test_records_are_written_as_runs_finish(pieces):
    """A command cut off in its second run leaves the first run's record; the command run again adds the
    second; each records folder holds one small file (no checkpoints) with everything the report needs."""
    cut = pieces["cut"]
    assert [rec.run_name(r) for r in cut["runs"]] == ["softmax/seed0"]
    assert cut["format"] == rec.FORMAT and cut["spec_hash"] == rec.spec_hash(sw.load_spec(pieces["whole"]))
    whole = {rec.run_name(r): r for r in results(pieces["whole"])["runs"]}
    for folder_, names in ((pieces["r1"], RUNS[:2]), (pieces["r2"], RUNS[2:])):
        files = list(folder_.iterdir())
        assert len(files) == 1 and files[0].name.endswith(rec.SUFFIX) and files[0].stat().st_size < 100_000
        body = json.loads(files[0].read_text())
        assert [rec.run_name(r) for r in body["runs"]] == names
        for r in body["runs"]:  # the same numbers as the whole sweep's run: losses, metrics, curves
            assert rec.same_run(r, whole[rec.run_name(r)])
            assert r["curves"]["train"] and r["curves"]["val"] and r["metrics"]["loss@32"] is not None
            assert r["machine"]["torch"] and r["settings"]["train.steps"] == 4 and r["settings"]["run.seed"] == r["seed"]
    assert rec.same_run(cut["runs"][0], whole["softmax/seed0"])


@pytest.mark.heavy
def test_two_pieces_merged_equal_the_sweep_run_whole(pieces, tmp_path, capsys):
    """Merging both pieces' records into a folder holding only the spec gives the whole sweep's results.json
    up to timings and machine, and, given the same timings, the same report.md."""
    merged = folder(tmp_path / "merged")
    assert sweep(merged, "--merge", str(pieces["r1"]), str(pieces["r2"])) == 0
    assert "merge: 4 run(s) from the records" in capsys.readouterr().out
    got, want = results(merged), results(pieces["whole"])
    assert without(got) == without(want)
    assert got["verdict"] == want["verdict"] and not got["missing"] and not (merged.parent / "runs").exists()
    assert got["command"] == f"attnlab sweep {merged.as_posix()}"
    # the report: both folders rebuilt from their results.json alone, timings and machine made equal
    reports = []
    for spec in (merged, pieces["whole"]):
        copy = tmp_path / ("r-" + spec.parent.name)
        copy.mkdir()
        shutil.copy(spec, copy / "spec.toml")
        res = results(spec)
        for r in res["runs"]:
            r.update({k: 1.0 for k in TIMINGS}, machine=want["machine"])
        res["command"] = "attnlab sweep SPEC"
        (copy / "results.json").write_text(json.dumps(res))
        assert sweep(copy / "spec.toml", "--report-only") == 0
        reports.append((copy / "report.md").read_text().replace(copy.as_posix(), "FOLDER"))
    assert reports[0] == reports[1]


@pytest.mark.heavy
def test_the_report_names_the_machine_that_trained_each_run(pieces, tmp_path):
    """Records from a GPU machine: results.json lists each machine with its runs, the report names them."""
    gpu = tmp_path / "gpu"
    gpu.mkdir()
    body = json.loads(next(pieces["r2"].iterdir()).read_text())
    for r in body["runs"]:
        r["machine"] = {**r["machine"], "cuda": GPU, "cpus": 16, "platform": "Linux-gpu"}
    (gpu / "hybrid.records.json").write_text(json.dumps(body))
    merged = folder(tmp_path / "merged")
    assert sweep(merged, "--merge", str(pieces["r1"]), str(gpu)) == 0
    res = results(merged)
    by = {g["machine"].get("cuda"): g["runs"] for g in res["machines"]}
    assert by == {None: ["softmax/seed0", "softmax/seed1"], GPU: ["hybrid/seed0", "hybrid/seed1"]}
    assert [r["machine"].get("cuda") for r in res["runs"]] == [None, None, GPU, GPU]
    text = (merged.parent / "report.md").read_text()
    assert "trained on 2 machines (a sweep in pieces): " in text
    assert f"{GPU} (Python" in text and "16 CPUs" in text and "trained hybrid/seed0, hybrid/seed1." in text
    # all on one GPU machine: that one is "machine", named in the report
    only_gpu = folder(tmp_path / "only-gpu")
    assert sweep(only_gpu, "--merge", str(gpu)) == 0
    res = results(only_gpu)
    assert res["machine"]["cuda"] == GPU and "machines" not in res and res["missing"] == ["softmax/seed0", "softmax/seed1"]
    assert "Machine: Python" in (only_gpu.parent / "report.md").read_text() and GPU in (only_gpu.parent / "report.md").read_text()


@pytest.mark.heavy
def test_a_merge_adds_to_the_committed_results_and_is_idempotent(pieces, tmp_path, capsys):
    """Piece by piece into the experiment's folder: the second merge keeps the first's runs; merging the
    same records again rewrites nothing; a later --report-only keeps the merged runs and machine."""
    merged = folder(tmp_path / "merged")
    assert sweep(merged, "--merge", str(pieces["r1"])) == 0
    assert results(merged)["missing"] == ["hybrid/seed0", "hybrid/seed1"]
    assert sweep(merged, "--merge", str(pieces["r2"])) == 0
    full = results(merged)
    assert [rec.run_name(r) for r in full["runs"]] == RUNS and not full["missing"]
    before = only_files(merged.parent)
    capsys.readouterr()
    assert sweep(merged, "--merge", str(pieces["r1"]), str(pieces["r2"])) == 0
    out = capsys.readouterr().out
    assert "already in results.json, the same" in out and "results unchanged" in out
    assert only_files(merged.parent) == before
    assert sweep(merged, "--report-only") == 0
    assert without(results(merged)) == without(full) and results(merged)["machine"] == full["machine"]


def _edited(src: Path, dst: Path, edit) -> Path:
    dst.mkdir(parents=True)
    body = json.loads(next(src.iterdir()).read_text())
    edit(body)
    (dst / "x.records.json").write_text(json.dumps(body))
    return dst / "x.records.json"


def _refused(spec: Path, args: list[str], words: list[str], capsys) -> None:
    before = only_files(spec.parent)
    assert sweep(spec, *args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    for w in words:
        assert w in err[0], (w, err[0])
    assert only_files(spec.parent) == before  # nothing written


@pytest.mark.heavy
def test_records_of_another_spec_are_refused_naming_the_file(pieces, tmp_path, capsys):
    merged = folder(tmp_path / "merged", spec_text([s for s in SHARED if s != "train.steps=4"] + ["train.steps=6"]))
    r1 = next(pieces["r1"].iterdir())
    _refused(merged, ["--merge", str(pieces["r1"])], [str(r1), "another spec", "spec hash"], capsys)
    # the same shared settings but a variant trained otherwise (the spec changed since): its settings named
    other = folder(tmp_path / "other", spec_text().replace('"model.attn=hybrid"', '"model.attn=hybrid", "model.attention.tau_init=0.2"'))
    r2 = next(pieces["r2"].iterdir())
    _refused(other, ["--merge", str(r2)], [str(r2), "hybrid/seed0", "other settings", "tau_init"], capsys)
    # a run the spec does not have
    odd = _edited(pieces["r1"], tmp_path / "odd", lambda b: b["runs"][0].update(variant="gla"))
    _refused(folder(tmp_path / "m3"), ["--merge", str(odd)], [str(odd), "gla/seed0", "no run of"], capsys)
    # damaged or foreign files, an empty folder, a path that is not there
    bad = tmp_path / "bad.records.json"
    bad.write_text('{"format": "attnlab sweep records", "runs": [')
    _refused(folder(tmp_path / "m4"), ["--merge", str(bad)], [str(bad), "not JSON"], capsys)
    (tmp_path / "empty").mkdir()
    _refused(folder(tmp_path / "m5"), ["--merge", str(tmp_path / "empty")], ["holds no records file"], capsys)
    _refused(folder(tmp_path / "m6"), ["--merge", str(tmp_path / "nowhere")], ["nowhere", "does not exist"], capsys)
    cut = _edited(pieces["r1"], tmp_path / "cut", lambda b: b["runs"][0].pop("curves"))
    _refused(folder(tmp_path / "m7"), ["--merge", str(cut)], [str(cut), "lacks curves"], capsys)


@pytest.mark.heavy
def test_a_run_recorded_twice_differently_is_refused_unless_replace_says_which_wins(pieces, tmp_path, capsys):
    def retrained(b):  # the same run trained again, on a machine whose numbers differ a little (a GPU)
        b["runs"][0]["val_loss"] += 1e-3
        b["runs"][0]["wall_seconds"] = 1.0
    again = _edited(pieces["r1"], tmp_path / "again", retrained)
    same = _edited(pieces["r1"], tmp_path / "same", lambda b: b["runs"][0].update(wall_seconds=9.0, machine={"x": 1}))
    merged = folder(tmp_path / "merged")
    r1 = next(pieces["r1"].iterdir())
    _refused(merged, ["--merge", str(pieces["r1"]), str(again)], ["softmax/seed0", "recorded differently", str(r1),
                                                                    str(again)], capsys)
    assert sweep(merged, "--merge", str(pieces["r1"]), str(same)) == 0  # the same up to timings and machine: fine
    first = results(merged)
    _refused(merged, ["--merge", str(again)], ["softmax/seed0", str(again), "--replace"], capsys)
    assert sweep(merged, "--merge", str(again), "--replace") == 0
    assert "replaces the one results.json held" in capsys.readouterr().out
    now = {rec.run_name(r): r for r in results(merged)["runs"]}
    assert now["softmax/seed0"]["val_loss"] == first["runs"][0]["val_loss"] + 1e-3
    assert now["softmax/seed1"] == first["runs"][1]


@pytest.mark.heavy
def test_a_local_run_folder_wins_only_when_it_holds_the_same_run(pieces, tmp_path, capsys):
    """The whole sweep's folder already holds finished runs: the same records merge (the folders stand for
    them); a different record of a run whose folder is here is refused naming the folder."""
    out = tmp_path / "whole"
    shutil.copytree(pieces["whole"].parent, out)
    assert sweep(out / "spec.toml", "--merge", str(pieces["r1"])) == 0
    assert "its run folder here holds the same run" in capsys.readouterr().out
    again = _edited(pieces["r1"], tmp_path / "again", lambda b: b["runs"][0].update(val_loss=0.5))
    _refused(out / "spec.toml", ["--merge", str(again), "--replace"],
             [str(out / "runs" / "softmax" / "seed0"), "differs from the record", str(again)], capsys)


@pytest.mark.parametrize("args,words", [
    (["--merge", "X", "--only", "softmax/seed0"], ["--merge trains nothing", "--only"]),
    (["--merge", "X", "--records", "Y"], ["--merge trains nothing", "--records"]),
    (["--merge", "X", "--report-only"], ["--merge trains nothing", "--report-only"]),
    (["--merge", "X", "--jobs", "2"], ["--merge trains nothing", "--jobs"]),
    (["--replace"], ["--replace", "needs --merge"]),
    (["--records", "Y", "--report-only"], ["--records with --report-only"]),
], ids=["merge-only", "merge-records", "merge-report-only", "merge-jobs", "replace-alone", "records-report-only"])
def test_bad_piece_options_are_one_line_errors(args, words, tmp_path, capsys):
    _refused(folder(tmp_path / "f"), args, words, capsys)


@pytest.mark.heavy
def test_a_records_target_that_cannot_take_this_spec_is_refused_before_training(pieces, tmp_path, capsys):
    spec = folder(tmp_path / "f")
    afile = tmp_path / "afile"
    afile.write_text("x")
    _refused(spec, ["--only", "softmax/seed0", "--records", str(afile)], ["--records", "is a file"], capsys)
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    target = rec.records_file(sw.load_spec(spec), foreign)
    target.write_text("{")
    _refused(spec, ["--only", "softmax/seed0", "--records", str(foreign)], [str(target), "not JSON"], capsys)
    assert not (spec.parent / "runs").exists()
