"""The GPU check's schedule on the CPU (`bash benchmarks/gpu_check.sh OUT MINUTES --smoke`): every part
within its cap, a part that overruns killed with its whole process group and the processes it started
outside it, a row past its own cap killed and its part started again from its rows, a check stopped
from outside (as its command's time limit stops it) leaving no process behind, and the same command
run again measuring only what the cut run left."""

from __future__ import annotations

import collections
import json
import os
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
    assert overrun["outcome"] == "killed at its cap of 6 s" and len(pids) == 2
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
