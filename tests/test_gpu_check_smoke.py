"""The GPU check's schedule on the CPU (`bash benchmarks/gpu_check.sh OUT MINUTES --smoke`): every part
within its cap, a part that overruns killed with its whole process group and the processes it started
outside it, a row past its own cap killed and its part started again from its rows, a check stopped
from outside (as its command's time limit stops it) leaving no process behind, and the same command
run again measuring only what the cut run left. Then the science batch (benchmarks/gpu_science.sh) dry
on the CPU: two batches of a tiny copy of its spec, the run in progress carried between them."""

from __future__ import annotations

import collections
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
MARK = "ATTNLAB_GPU_CHECK"


def _load(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return {}


def _alive(pid: int) -> bool:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"


def _marked(check: str) -> list[int]:
    """Live processes carrying the check's mark in their environment."""
    key, found = f"{MARK}={check}/".encode(), []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            env = Path(f"/proc/{d}/environ").read_bytes()
        except OSError:
            continue
        if any(e.startswith(key) for e in env.split(b"\0")) and _alive(int(d)):
            found.append(int(d))
    return found


def _within_caps(run: dict) -> None:
    for part in run["parts"]:
        if "seconds" in part:  # a part stopped with the check has none
            assert part["seconds"] <= part["cap_s"] + 5, part


@pytest.mark.heavy
def test_smoke_check_caps_kills_and_resumes(tmp_path):
    out = tmp_path / "out"
    cmd = ["bash", "benchmarks/gpu_check.sh", str(out), "3", "--smoke"]
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop(MARK, None)
    with open(tmp_path / "a.log", "w") as log:
        check = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        end = time.time() + 240
        while time.time() < end and check.poll() is None:  # cut while the train part runs its overrunning row
            if (_load(out / "gpu_train.json").get("running") or {}).get("row", {}).get("model") == "overrun":
                break
            time.sleep(0.1)
        assert check.poll() is None, (tmp_path / "a.log").read_text()[-3000:]
        kept = [r for r in _load(out / "gpu_train.json")["rows"] if "error" not in r]
        os.killpg(check.pid, signal.SIGTERM)  # as a time limit stops a command: its whole process group
        assert check.wait(timeout=60) == 143
    first = _load(out / "gpu_check.json")["runs"][0]
    assert first["stopped"] and _marked(first["check"]) == [], first
    parts = {p["part"]: p for p in first["parts"]}
    assert list(parts) == ["tests", "overrun", "train"] and parts["train"]["outcome"].startswith("cut")
    _within_caps(first)

    overrun = parts["overrun"]  # a pytest with two xdist workers, each holding a child in a session of its own
    pids = [[int(x) for x in line.split()] for line in (out / "smoke" / "overrun" / "pids").read_text().splitlines()]
    assert overrun["outcome"] == "killed at its cap of 20 s" and len(pids) == 2
    assert {child for _, _, child in pids} <= set(overrun["swept"])  # out of the group's reach, found by its mark
    assert [p for line in pids for p in line if _alive(p)] == []

    tests = parts["tests"]  # the tests that never passed: each outcome streamed, a hang failed by the per-test limit
    assert tests["outcome"] == "finished"
    streamed = [json.loads(line) for line in (out / "gpu_tests.jsonl").read_text().splitlines()]
    outcomes = {r["test"].split("::")[-1]: r["outcome"] for r in streamed}
    assert outcomes["test_passes"] == "PASSED" and outcomes["test_fails"] == "FAILED"
    assert outcomes["test_hangs"] == "FAILED" and "test_passed_before" not in outcomes

    again = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-2000:]
    second = _load(out / "gpu_check.json")["runs"][1]
    assert _marked(second["check"]) == [] and "stopped" not in second
    _within_caps(second)
    parts = {p["part"]: p for p in second["parts"]}
    assert list(parts) == ["tests", "overrun", "train", "kernels", "decode", "recheck", "errors"], parts
    assert parts["overrun"]["launches"] == 0 and all(p["outcome"] == "finished" for n, p in parts.items()
                                                      if n not in ("tests", "overrun")), parts

    train = _load(out / "gpu_train.json")  # resumed: the cut run's rows kept as they were, none measured twice
    keys = collections.Counter((r["model"], r["T"], r.get("shape")) for r in train["rows"])
    assert max(keys.values()) == 1 and all(r in train["rows"] for r in kept) and kept, keys
    assert train["complete"]["rows"] and {"baseline", "windowed", "trainer"} <= {m for m, _, _ in keys}
    killed = [r for r in train["rows"] if r["model"] == "overrun"]  # the row past its own cap, and a restart after it
    assert killed[0]["error"] == "killed at its cap of 2 s" and parts["train"]["launches"] == 2
    assert [r["model"] for r in parts["train"]["row_kills"]] == ["overrun"]

    tests_run = collections.Counter(json.loads(line)["test"] for line in (out / "gpu_tests.jsonl").read_text().splitlines())
    assert max(tests_run.values()) == 1 and len(tests_run) == 5  # each test once over both runs, recheck included

    kernels = _load(out / "gpu.json")  # part 3 times its paths before anything else spends the part's time
    speed = {r["path"]: r for r in kernels["rows"]}
    assert [r["path"] for r in kernels["rows"]][:2] == ["sdpa-flash", "hybrid-gaussian/triton"]
    assert all(speed[p]["ms"] > 0 and speed[p]["ratio_to_flash"] > 0 for p in ("sdpa-flash", "hybrid-gaussian/triton"))
    assert "error" in speed["gla/fla"] and kernels["complete"] == {"rows": True, "errors": True}
    assert speed["hybrid-gaussian/triton"]["rel_err"] < 1e-4  # the errors part, last, fills the speed rows in
    assert _load(out / "decode_speed_gpu.json")["rows"]


def _dry_spec(folder: Path) -> Path:
    """The science spec at a CPU dry run's size: the same variants, corpus and kinds of metric, a tiny
    model, eager, its first run 6 steps long and every other one too long to finish in a batch."""
    import tomllib

    raw = tomllib.loads((ROOT / "experiments/seed000/window-language-at-scale/spec.toml").read_text())
    raw["base"]["model"] = {"d_model": 32, "n_layers": 1, "n_heads": 4}
    raw["base"]["data"].update(seq_len=64, max_docs=40)
    raw["base"]["train"] = {"steps": 100000, "batch_size": 2, "lr": 1e-3, "warmup_steps": 2, "eval_every": 0,
                            "eval_batches": 1, "log_every": 20, "ckpt_every": 400, "keep_checkpoints": 1}
    raw["base"]["run"] = {"device": "cpu", "threads": 1, "tensorboard": False}
    raw["below_budget"] = "a dry run of the science batch's code path on the CPU"
    raw["metrics"] = {"split": "test", "lengths": [64], "max_tokens": 256, "heldout": raw["metrics"]["heldout"],
                      "heldout_lengths": [64], "repeat_lengths": [64], "repeat_span": 8, "repeat_probes": 4}
    raw["verdict"] = [{"name": "(h1) kl-window vs swa48", "metric": "heldout/T=64", "better": "lower",
                       "compare": ["kl-window", "swa48"]}]
    raw.pop("answer")
    raw["variants"][0]["overrides"].append("train.steps=6")

    def toml(v):
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, (int, float)):
            return repr(v)
        if isinstance(v, str):
            return json.dumps(v)
        if isinstance(v, list):
            return "[" + ", ".join(map(toml, v)) + "]"
        return "{ " + ", ".join(f"{k} = {toml(x)}" for k, x in v.items()) + " }"

    lines = [f"{k} = {toml(v)}" for k, v in raw.items() if k not in ("base", "variants", "metrics", "verdict")]
    lines += ["[base]"] + [f"{k} = {toml(v)}" for k, v in raw["base"].items()]
    lines += ["[metrics]"] + [f"{k} = {toml(v)}" for k, v in raw["metrics"].items()]
    for v in raw["variants"]:
        lines += ["[[variants]]"] + [f"{k} = {toml(x)}" for k, x in v.items()]
    for v in raw["verdict"]:
        lines += ["[[verdict]]"] + [f"{k} = {toml(x)}" for k, x in v.items()]
    folder.mkdir(parents=True)
    (folder / "spec.toml").write_text("\n".join(lines) + "\n")
    return folder / "spec.toml"


def _train_steps(run_dir: Path) -> list[int]:
    rows = [json.loads(x) for x in (run_dir / "log.jsonl").read_text().splitlines() if x.strip()]
    return [r["step"] for r in rows if r.get("kind") == "train"]


@pytest.mark.heavy
def test_science_batches_dry_run_checkpoint_carry_and_resume(tmp_path):
    """Two science batches on the CPU, as two slots on fresh GPU machines would run them: the first
    checks the corpus, finishes its first run (its record comes back) and is cut in the second, whose
    checkpoint comes back in parts; `absorb` merges the record and keeps the parts; the second batch,
    on a machine without the run folder, restores it from the parts and trains on from its step. What
    comes back each time is at most 8 files, each under 16 MiB."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import gpu_science

    corpus = ROOT / "experiments/seed000/window-language-at-scale/corpus"
    if not (corpus / "stdlib").is_dir():  # not committed: made as before a device call (corpus --copy)
        try:
            gpu_science.materialise_corpus(corpus)
        except SystemExit as e:
            pytest.skip(f"the corpus cannot be made from this Python: {e}")
    spec = _dry_spec(tmp_path / "science")
    state, runs = tmp_path / "science" / "state", tmp_path / "science" / "runs"
    env = {**os.environ, "PYTHON": sys.executable}
    env.pop("ATTNLAB_RUNS", None)

    def batch(out: Path, minutes: str) -> dict:
        cmd = ["bash", "benchmarks/gpu_science.sh", str(out), minutes, "--spec", str(spec), "--state", str(state),
               "--part-mib", "0.15", "--min-start", "5"]
        p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=400)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]
        files = [f for f in out.iterdir() if f.is_file()]
        assert len(files) <= 8 and all(f.stat().st_size < 16 << 20 for f in files), files
        doc = json.loads((out / "science.json").read_text())
        assert sorted(doc["files"]) == sorted(f.name for f in files) and "science.log" in doc["files"]
        assert doc["corpus"]["experiments/seed000/window-language-at-scale/corpus/stdlib"]["files"] == 609
        return doc

    def absorb(out: Path) -> None:
        shutil.rmtree(runs)  # the lent machine keeps nothing: only what came back reaches here
        p = subprocess.run([sys.executable, "benchmarks/gpu_science.py", "absorb", str(out), "--spec", str(spec),
                            "--state", str(state)], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-2000:]

    first = batch(tmp_path / "out1", "2.5")
    outcomes = [(r["run"], r["outcome"]) for r in first["runs"]]
    assert outcomes == [("kl-window/seed0", "finished"), ("window/seed0", "stopped")], first["runs"]
    carried = first["in_progress"]
    assert carried["run"] == "window/seed0" and carried["step"] > 0 and len(carried["parts"]) >= 2
    records = json.loads(next((tmp_path / "out1").glob("*.records.json")).read_text())
    assert [(r["variant"], r["seed"]) for r in records["runs"]] == [("kl-window", 0)]
    absorb(tmp_path / "out1")
    results = json.loads((spec.parent / "results.json").read_text())
    assert [(r["variant"], r["seed"]) for r in results["runs"]] == [("kl-window", 0)]
    assert json.loads((state / "state.json").read_text())["step"] == carried["step"]

    second = batch(tmp_path / "out2", "1.5")  # a fresh machine: the run folder only from the parts
    assert second["restored"]["run"] == "window/seed0" and second["restored"]["step"] == carried["step"]
    assert [(r["run"], r["outcome"]) for r in second["runs"]] == [("window/seed0", "stopped")]
    steps = _train_steps(runs / "window" / "seed0")
    assert steps == sorted(set(steps)) and min(steps) <= carried["step"] < max(steps)  # trained on from the step
    assert second["in_progress"]["step"] > carried["step"]
    absorb(tmp_path / "out2")
    assert json.loads((state / "state.json").read_text())["step"] == second["in_progress"]["step"]
    ledger = json.loads((spec.parent / "batches.json").read_text())
    assert [b["in_progress"] for b in ledger] == ["window/seed0", "window/seed0"]
