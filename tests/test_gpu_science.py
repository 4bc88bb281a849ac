"""The science batch's pieces (benchmarks/gpu_science.py, science_corpus.py, science_state.py) and the
spec it runs (experiments/seed000/window-language-at-scale): the carried corpus is the CPU runs'
corpus and is checked file by file, the run in progress travels as checked parts, the queue puts it
first, and the spec and its README hold the numbers they state. The two batches end to end, on the CPU:
tests/test_gpu_check_smoke.py (heavy)."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

import gpu_science  # noqa: E402
import science_corpus  # noqa: E402
import science_state  # noqa: E402

EXP = ROOT / "experiments" / "seed000" / "window-language-at-scale"
CPU_PARAMS = {"softmax": 836_864, "hybrid": 840_976}  # the quickstart-sized CPU runs (taught-window-language)


@pytest.fixture(scope="module", autouse=True)
def corpus():
    """The corpus folders are not committed (only their manifest): copied here from this Python's stdlib
    as the manifest lists them, as before a device call; another Python's stdlib cannot make them."""
    if not all(f.is_dir() for f in science_corpus.corpus_folders(EXP / "spec.toml")):
        try:
            science_corpus.materialise_corpus(EXP / "corpus")
        except SystemExit as e:
            pytest.skip(f"the corpus cannot be made from this Python: {e}")


def test_the_corpus_is_made_again_from_its_manifest_byte_for_byte(tmp_path):
    """--copy from the manifest alone gives the files the manifest hashes, and nothing else."""
    folder = tmp_path / "corpus"
    folder.mkdir()
    shutil.copy(EXP / "corpus" / "MANIFEST.json", folder / "MANIFEST.json")
    made = science_corpus.materialise_corpus(folder)
    assert made[str(folder / "stdlib")]["files"] == 609 and made[str(folder / "stdlib-tests")]["files"] == 19


def test_the_carried_corpus_is_the_cpu_runs_corpus_and_is_checked():
    """The science spec reads the two committed folders, and they match their manifest file by file."""
    folders = science_corpus.corpus_folders(EXP / "spec.toml")
    assert [f.name for f in folders] == ["stdlib", "stdlib-tests"]
    checked = science_corpus.check_corpus(folders)
    assert checked["experiments/seed000/window-language-at-scale/corpus/stdlib"]["tokens"]["train"] == 9_441_022


@pytest.mark.heavy
def test_the_carried_corpus_reads_as_the_stdlib_corpus_it_was_copied_from():
    """Under Python 3.11.7 (the CPU runs' interpreter) the carried folders hold, split by split, exactly
    the documents of its "stdlib" corpus and of the test split of "stdlib-tests"."""
    from attnlab.data.corpus import load_corpus

    folders = science_corpus.corpus_folders(EXP / "spec.toml")
    if sys.version_info[:3] != (3, 11, 7):
        pytest.skip("the corpus was copied from Python 3.11.7; this interpreter's own stdlib differs")
    for split in ("train", "val", "test"):
        assert load_corpus(str(folders[0]), split) == load_corpus("stdlib", split), split
    assert load_corpus(str(folders[1]), "test") == load_corpus("stdlib-tests", "test")


def test_a_changed_missing_or_extra_corpus_file_stops_the_batch(tmp_path):
    (tmp_path / "c" / "stdlib" / "pkg").mkdir(parents=True)
    (tmp_path / "c" / "stdlib" / "pkg" / "a.py").write_text("x = 1\n")
    manifest = {"folders": {"stdlib": {"files": {"pkg/a.py": science_state.sha256(b"x = 1\n")}, "tokens": {"train": 8}}}}
    (tmp_path / "c" / "MANIFEST.json").write_text(json.dumps(manifest))
    folder = tmp_path / "c" / "stdlib"
    assert science_corpus.check_corpus([folder])[str(folder)]["files"] == 1
    (folder / "pkg" / "a.py").write_text("x = 2\n")
    with pytest.raises(SystemExit, match="1 file\\(s\\) differ"):
        science_corpus.check_corpus([folder])
    (folder / "pkg" / "a.py").write_text("x = 1\n")
    (folder / "b.py").write_text("")
    with pytest.raises(SystemExit, match="1 not in MANIFEST.json"):
        science_corpus.check_corpus([folder])
    shutil.rmtree(folder)
    with pytest.raises(SystemExit, match="1 file\\(s\\) missing"):
        science_corpus.check_corpus([folder])


def _run_folder(root: Path) -> Path:
    run = root / "runs" / "window" / "seed0"
    for step in (2, 4):
        ck = run / "checkpoints" / f"step_{step:06d}"
        ck.mkdir(parents=True)
        (ck / "model.safetensors").write_bytes(bytes(range(256)) * (40 * step))
        (ck / "state.json").write_text(json.dumps({"step": step}))
    (run / "checkpoints" / "latest").write_text("step_000004\n")
    (run / "log.jsonl").write_text('{"kind": "train", "step": 4, "tokens_per_s": 10}\n')
    (run / "config.toml").write_text("[train]\nsteps = 10\n")
    (run / ".attnlab.lock").write_text("")
    return run


def test_the_run_in_progress_travels_as_checked_parts(tmp_path):
    """pack keeps the newest checkpoint, the logs and the config (no older checkpoint, no lock), in parts
    of at most the given size; unpack rebuilds the folder byte for byte, and refuses a damaged part."""
    run = _run_folder(tmp_path / "a")
    out = tmp_path / "out"
    out.mkdir()
    state = science_state.pack(run, "window/seed0", out, part_mib=0.02)
    assert state["run"] == "window/seed0" and state["step"] == 4 and state["checkpoint"] == "step_000004"
    assert len(state["parts"]) >= 2 and all(p["bytes"] <= 0.02 * (1 << 20) for p in state["parts"])
    back = tmp_path / "b" / "runs" / "window" / "seed0"
    science_state.unpack(state, out, back)
    kept = sorted(p.relative_to(back).as_posix() for p in back.rglob("*") if p.is_file())
    assert kept == ["checkpoints/latest", "checkpoints/step_000004/model.safetensors",
                    "checkpoints/step_000004/state.json", "config.toml", "log.jsonl"]
    assert all((back / k).read_bytes() == (run / k).read_bytes() for k in kept)
    few = tmp_path / "few"  # more parts than may come back: larger ones
    few.mkdir()
    assert len(science_state.pack(run, "window/seed0", few, part_mib=0.02, max_parts=2)["parts"]) == 2
    part = out / state["parts"][1]["name"]
    part.write_bytes(b"\0" + part.read_bytes()[1:])
    with pytest.raises(SystemExit, match="is damaged"):
        science_state.unpack(state, out, tmp_path / "c")


def test_a_cut_run_whose_state_cannot_travel_is_dropped(tmp_path):
    """carry packs the run, and with --carry-mib smaller than the packed state deletes its parts and says
    so in science.json (nothing in progress); with room enough the parts stay."""
    spec = type("Spec", (), {"run_dir": lambda self, v, s: tmp_path / "a" / "runs" / v / f"seed{s}"})()
    _run_folder(tmp_path / "a")
    for room, kept in ((0.001, False), (1.0, True)):
        out = tmp_path / f"out{room}"
        out.mkdir()
        batch = gpu_science.Batch(out, 1.0, EXP / "spec.toml", tmp_path / "state", 0.02, 0.0, carry_mib=room)
        batch.carry(spec, "window/seed0")
        parts = sorted(p.name for p in out.glob("state.tar.*"))
        assert bool(parts) == kept and (batch.doc["in_progress"] is not None) == kept
        assert ("dropped" in batch.doc) != kept
        if not kept:
            assert batch.doc["dropped"]["run"] == "window/seed0" and batch.doc["dropped"]["step"] == 4


def test_the_next_call_carries_the_wheels_the_corpus_and_the_state():
    assert gpu_science.carried_paths(EXP / "spec.toml", EXP / "state") == [
        ".whl", "experiments/seed000/window-language-at-scale/corpus/stdlib",
        "experiments/seed000/window-language-at-scale/corpus/stdlib-tests",
        "experiments/seed000/window-language-at-scale/state"]


@pytest.mark.heavy
def test_a_window_run_is_passed_over_when_it_can_neither_finish_nor_travel():
    """The shipped kl-window run (121.7M tokens) at a measured 200K tokens/s needs over 600 s: a 300 s batch
    with the room this tree leaves passes it over; an untimed variant starts."""
    import science_fit as fit
    from attnlab.experiments.sweep import load_spec

    spec = load_spec(EXP / "spec.toml")
    c = gpu_science.candidate(spec, "kl-window/seed0", None)
    assert c.tokens_left == 4950 * 96 * 256 and c.state_mib == pytest.approx(12 * 4_041_768 / 2**20)
    room = fit.carry_room(ROOT, gpu_science.carried_paths(EXP / "spec.toml", EXP / "state"))
    assert not fit.decide(c, 300.0, room, {"kl-window": 200_000.0}).start
    assert fit.decide(c, 300.0, room, {}).start
    half = gpu_science.candidate(spec, "kl-window/seed0", {"run": "kl-window/seed0", "step": 4900})
    assert half.tokens_left == 50 * 96 * 256 and fit.decide(half, 300.0, room, {"kl-window": 200_000.0}).start


def test_status_prints_what_the_next_batch_would_start_and_pass_over(tmp_path, capsys):
    """`status` on a copy of the spec with a run in progress (window/seed0, packed at step 4) and one
    batch's speeds: each run left in queue order with science_fit's plan for a 6-minute batch (330 s to
    the cap) and 20 MiB of room: the window run finishes (121.6M tokens at 1M tokens/s, 217 s), kl-window
    (703 s at 200K tokens/s, a 46.3 MiB state) is passed over, the untimed swa48 starts and is taken to
    use the rest, and nothing starts after it (under the 75 s a start needs)."""
    folder = tmp_path / "science"
    folder.mkdir()
    shutil.copy(EXP / "spec.toml", folder / "spec.toml")
    (folder / "batches.json").write_text(json.dumps([{"runs": [
        {"run": "window/seed0", "tokens_per_s": 1_000_000}, {"run": "kl-window/seed0", "tokens_per_s": 200_000}]}]))
    state_dir = folder / "state"
    state_dir.mkdir()
    state = science_state.pack(_run_folder(tmp_path / "a"), "window/seed0", state_dir, part_mib=1.0)
    (state_dir / science_state.STATE_JSON).write_text(json.dumps(state))
    assert gpu_science.main(["status", "--spec", str(folder / "spec.toml"), "--state", str(state_dir),
                             "--carry-mib", "20"]) == 0
    late = "not started, 0 s to the cap (a run needs 75 s to start)"
    assert capsys.readouterr().out.splitlines() == [
        f"{folder / 'spec.toml'}: 12 run(s) left; window/seed0 in progress at step 4",
        "a batch of 6 min (330 s to the cap, 20.0 MiB for a cut run's state, speeds from 1 batch(es) in "
        "batches.json) would:",
        "  start window/seed0: finishes: 217 s of the 330 s left",
        "  pass  kl-window/seed0: not started: it needs 703 s, 113 s are left, and its 46.3 MiB state cannot "
        "travel in the 20.0 MiB the next call has room for",
        "  start swa48/seed0: no batch has timed swa48: this one measures it (cut, its 46.0 MiB state cannot "
        "travel in 20.0 MiB: it starts again)",
        *(f"  pass  {run}: {late}" for run in ("softmax/seed0", "kl-window/seed1", "window/seed1", "swa48/seed1",
                                               "softmax/seed1", "kl-window/seed2", "window/seed2", "swa48/seed2",
                                               "softmax/seed2"))]


def test_the_queue_puts_the_run_in_progress_first_then_seed_by_seed():
    from attnlab.experiments.sweep import load_spec

    spec = load_spec(EXP / "spec.toml")
    fresh = gpu_science.queue(spec, None)
    assert fresh[:5] == ["kl-window/seed0", "window/seed0", "swa48/seed0", "softmax/seed0", "kl-window/seed1"]
    assert len(fresh) == 12
    carried = gpu_science.queue(spec, {"run": "swa48/seed1"})
    assert carried[0] == "swa48/seed1" and sorted(carried) == sorted(fresh)


@pytest.mark.heavy
def test_the_science_spec_meets_its_stated_scale_and_the_budget_rule():
    """At least 4x the CPU runs' parameters, at least the budget rule's tokens per parameter for every
    run, 3 seeds, rules against SWA-48 and softmax for both windows; the README states the parameters,
    the tokens and the per-step bounds that the committed GPU measurements give (5/12 of the measured
    GPT-2-small step)."""
    from attnlab.experiments.sweep import load_spec, plan
    from attnlab.experiments.sweep.budget import MIN_TOKENS_PER_PARAM, check_budget, params_of, tokens_per_param

    spec = load_spec(EXP / "spec.toml")
    plans = plan(spec)
    check_budget(spec, plans)
    assert len(spec.seeds) >= 3 and not spec.below_budget
    readme = (EXP / "README.md").read_text()
    for p in plans:
        n = params_of(p.cfg)
        base = CPU_PARAMS["softmax" if p.cfg.model.attn == "softmax" else "hybrid"]
        assert n >= 4 * base and tokens_per_param(p.cfg, n) >= MIN_TOKENS_PER_PARAM, (p.variant, n)
        assert f"{n:,}" in readme
    tokens = plans[0].cfg.train.steps * plans[0].cfg.train.tokens_per_step
    assert f"{tokens:,}" in readme
    for window in ("kl-window", "window"):
        against = {tuple(r["compare"]) for r in spec.verdicts if r["compare"][0] == window}
        assert {(window, "swa48"), (window, "softmax")} <= against
    h100 = {r["model"]: r["ms"] for r in json.loads((ROOT / "benchmarks/results/gpu_train.json").read_text())["rows"]
            if r.get("T") == 1024}
    layers = plans[0].cfg.model.n_layers / 12
    bounds = {"window": h100["windowed"], "kl-window": h100["windowed"] + h100["hybrid"], "swa48": h100["hybrid"],
              "softmax": h100["softmax"]}
    for variant, ms in bounds.items():
        assert f"{ms * layers:.2f} ms" in readme, variant
