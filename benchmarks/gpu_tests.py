"""The GPU check's cuda tests: `pytest -m cuda` on a GPU machine, every outcome and its failure text
streamed as it happens, the tests that never reported named.

    python benchmarks/gpu_tests.py --out OUT/gpu_tests.json --seconds 90                  # part "tests"
    python benchmarks/gpu_tests.py --out OUT/gpu_tests.json --seconds 60 --part recheck   # part "recheck"

Part "tests" runs the cuda tests that have never passed on a GPU (no PASSED outcome in the test streams
and JSONs under --history, the committed logs of earlier checks); part "recheck" runs those that have,
for regressions, after everything else. Both stream to OUT/gpu_tests.jsonl and log pytest's output to
OUT/gpu_tests.log; run again on the same OUT (a cut run), a part runs only the tests the stream lacks.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from _interleaved import command  # noqa: E402
from gpu_proc import kill_group, spawn  # noqa: E402
from gpu_rows import load, save  # noqa: E402

T0 = time.time()  # --seconds count from here when run as a script (its imports included)
HISTORY = HERE / "results" / "gpu_logs"
LAST = "fla"  # -k expression of the tests run after the rest with the time left: flash-linear-attention's
#               kernels autotune for minutes on each new shape, which starved every other test before
FIRST_FIT = "fla"  # whose autotuned kernels take their first working config in the tests (tests/triton_first_fit.py):
#                    an exactness test needs one config, not the fastest


def _base_cmd(files: list[str], marker: str, drop=()) -> list[str]:
    """pytest over `files` (only those with cuda tests: others import packages the machine may lack)."""
    cmd = [sys.executable, "-m", "pytest", "-m", marker, "-p", "no:cacheprovider", "-p", "no:benchmark", *files]
    return cmd + [a for t in sorted(drop) for a in ("--deselect", t)]


def _ids(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if "::" in line and not line.startswith(("ERROR", "FAILED"))]


def _env(**extra) -> dict:
    return {**os.environ, **extra, "PYTHONPATH": os.pathsep.join(
        [str(HERE.parent / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}


def _lines(path: Path) -> list[str]:
    """The complete lines of a file another process appends to (a line being written is left for later)."""
    return [line for line in path.read_text(errors="replace").split("\n")[:-1] if line.strip()]


def collect(files: list[str], marker: str, env: dict, drop=()) -> list[str]:
    """The node ids `pytest -m marker` selects in `files`, less `drop` ([] when collection fails)."""
    p = subprocess.run([*_base_cmd(files, marker, drop), "--collect-only", "-q"], capture_output=True, text=True,
                       env=env, cwd=HERE.parent, timeout=300)
    return _ids(p.stdout)


def passed_on_gpu(history: Path) -> set[str]:
    """The tests with a PASSED outcome in any test stream (*.jsonl) or check JSON (`cuda_tests`,
    `recheck`) under `history`."""
    passed = set()
    for f in sorted(Path(history).rglob("*.jsonl")):
        for line in f.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if row.get("outcome") == "PASSED" and row.get("when", "call") == "call":
                passed.add(row["test"])
    for f in sorted(Path(history).rglob("*.json")):
        doc = load(f) or {}
        for key in ("cuda_tests", "recheck"):
            passed |= {t for t, o in ((doc.get(key) or {}).get("outcomes") or {}).items() if o == "PASSED"}
    return passed


def run_cuda_tests(doc: dict, timeout: float, log: Path, workers: int = 4, per_test: float = 60.0,
                   files: list[str] | None = None, marker: str = "cuda", last: str | None = LAST, drop=(),
                   key: str = "cuda_tests", selected: list[str] | None = None, min_pass_s: float = 20.0) -> None:
    """`pytest -m cuda` over the files that hold cuda tests, less the ids in `drop`, in two passes within
    `timeout` seconds: the tests not matching `last` (-k) with a per-test limit of `per_test` seconds,
    then those that do with a limit of half the time (flash-linear-attention's: they compile for
    minutes; their autotuned kernels take their first working config, FIRST_FIT). Each pass runs on
    `workers` xdist workers (few enough that compiling kernels does not starve the tests), in a session
    of its own, killed as a whole (workers included) at the deadline. pytest's output goes to `log`;
    each outcome, with its failure text, is appended as it happens to <log>.jsonl (tests/conftest.py:
    ATTNLAB_TEST_STREAM) and printed at once, so a run cut short keeps every result and traceback it
    reached; the tests the stream already holds (an earlier, cut run on the same files) are not run
    again. A pass is not started with less than `min_pass_s` seconds left. doc[key] holds the outcomes,
    the failures' text and the ids of the tests that never reported (of `selected`, the ids the run
    covers; when not given, every test is collected beside the first pass, into doc["collected"])."""
    t0 = time.time()
    deadline = t0 + timeout
    if files is None:
        files = sorted(str(f) for f in (HERE.parent / "tests").glob("test_*.py") if "mark.cuda" in f.read_text())
    stream = log.with_suffix(".jsonl")
    stream.touch()
    env = _env(ATTNLAB_TEST_STREAM=str(stream))
    env.setdefault("ATTNLAB_TRITON_FIRST_FIT", FIRST_FIT)
    seen = [json.loads(line) for line in _lines(stream)]
    before = {r["test"] for r in seen}
    listing = tempfile.TemporaryFile()
    lister = None if selected is not None else spawn(  # beside the first pass: the ids of the tests never reported
        [*_base_cmd(files, marker), "--collect-only", "-q"], env, timeout, stdout=listing,
        stderr=subprocess.DEVNULL, cwd=HERE.parent)

    def drain() -> None:  # print each new outcome (failures with their text) as it arrives
        for line in _lines(stream)[len(seen):]:
            row = json.loads(line)
            seen.append(row)
            print(f"  {row['outcome']} {row['test']} ({row['when']}, {row['seconds']} s)", flush=True)
            if row.get("failure"):
                print("    " + row["failure"][:3000].replace("\n", "\n    "), flush=True)

    passes = [(f"not ({last})", per_test), (last, max(per_test, timeout / 2))] if last else [(None, per_test)]
    returncodes = []
    with open(log, "a") as fh:
        for keyword, limit in passes:
            left = deadline - time.time()
            if left < min_pass_s:
                print(f"cuda tests -k {keyword!r}: not started ({left:.0f} s left)", flush=True)
                returncodes.append(None)
                break
            cmd = _base_cmd(files, marker, set(drop) | before) + ["-v", "-rfE", "--tb=short"]
            cmd += ["-k", keyword] if keyword else []
            if workers > 1:
                cmd += ["-n", str(min(workers, os.cpu_count() or 1))]
            cmd += ["--timeout", str(max(1, int(min(limit, left - min(15.0, left / 2)))))]  # reported before the kill
            fh.write(f"$ {shlex.join(cmd)}\n")
            fh.flush()
            p = spawn(cmd, env, left, stdout=fh, stderr=subprocess.STDOUT, text=True, cwd=HERE.parent)
            rc = None
            while time.time() < deadline:
                try:
                    rc = p.wait(timeout=1)
                    break
                except subprocess.TimeoutExpired:
                    drain()
            if rc is None:
                kill_group(p.pid)
                p.wait()
            returncodes.append(0 if rc == 5 else rc)  # 5: the pass selected no test
            drain()
    if lister is not None:
        if lister.poll() is None:
            kill_group(lister.pid)
        lister.wait()
        listing.seek(0)
        doc["collected"] = _ids(listing.read().decode(errors="replace"))
        selected = [t for t in doc["collected"] if t not in set(drop)]
    chosen = set(selected)
    text = log.read_text(errors="replace")
    outcomes, failures = {}, {}
    for row in seen:
        if chosen and row["test"] not in chosen:
            continue
        if row["outcome"] in ("FAILED", "ERROR") or row["test"] not in outcomes:
            outcomes[row["test"]] = "ERROR" if row["outcome"] == "FAILED" and row["when"] != "call" else row["outcome"]
        if row.get("failure"):
            failures[row["test"]] = row["failure"]
    unreported = [t for t in selected if t not in outcomes]
    rc = None if None in returncodes or not returncodes else max(returncodes)
    doc[key] = {"returncode": rc, "seconds": round(time.time() - t0, 1), "items": len(selected),
                "outcomes": outcomes, "failures": failures, "unreported": len(unreported),
                "unreported_ids": unreported, "kept_from_earlier": len(before & set(outcomes)),
                "log": log.name, "stream": stream.name, "tail": text[-3000:] if rc is None or rc else text[-600:]}
    counts = {o: list(outcomes.values()).count(o) for o in sorted(set(outcomes.values()))}
    print(f"cuda tests: {counts}, {len(unreported)} unreported, rc {rc}, {doc[key]['seconds']} s", flush=True)
    for t in unreported:
        print(f"  UNREPORTED {t}", flush=True)


SMOKE_TESTS = '''import os, time, pytest
pytestmark = pytest.mark.smoke
def test_passes():
    assert os.environ["ATTNLAB_TRITON_FIRST_FIT"] == "fla"
def test_fails():
    assert 2 + 2 == 5, "arithmetic broke"
def test_hangs():  # failed by the per-test limit, well inside the part's
    time.sleep(600)
def test_fla_runs_last():
    pass
def test_passed_before():  # in the smoke history: the recheck part runs it
    pass
'''


def smoke_files(folder: Path) -> tuple[list[str], Path]:
    """The smoke mode's stand-in for the cuda tests (a test that passes, fails, hangs, one of the last
    pass, one that passed before) with the check's test set-up, and a history naming the one that passed."""
    tests = folder / "tests"
    tests.mkdir(parents=True, exist_ok=True)
    for name in ("conftest.py", "triton_first_fit.py"):
        (tests / name).write_text((HERE.parent / "tests" / name).read_text())
    (tests / "test_smoke.py").write_text(SMOKE_TESTS)
    (folder / "pytest.ini").write_text("[pytest]\nmarkers =\n    smoke: the GPU check's smoke mode\n")
    history = folder / "history"
    history.mkdir(exist_ok=True)
    (history / "smoke.tests.jsonl").write_text(json.dumps(
        {"test": "tests/test_smoke.py::test_passed_before", "when": "call", "outcome": "PASSED", "seconds": 0.0}) + "\n")
    return [str(tests / "test_smoke.py")], history


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", required=True, help="the JSON; pytest's log and the stream go beside it (.log, .jsonl)")
    ap.add_argument("--part", choices=("tests", "recheck"), default="tests",
                    help="tests: those never passed on a GPU; recheck: those that have")
    ap.add_argument("--seconds", type=float, default=150.0, help="the part's time, its start included")
    ap.add_argument("--per-test", type=float, default=40.0, help="per-test limit of the first pass")
    ap.add_argument("--workers", type=int, default=4)
    ap.add_argument("--history", default=str(HISTORY), help="the committed logs of earlier checks")
    ap.add_argument("--smoke", action="store_true", help="stand-in tests on the CPU (benchmarks/gpu_check.py --smoke)")
    a = ap.parse_args(argv)
    if a.seconds <= 0 or a.per_test <= 0:
        raise SystemExit(f"--seconds and --per-test must be > 0, got {a.seconds} and {a.per_test}")
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    files, marker, history = None, "cuda", Path(a.history)
    if a.smoke:
        files, history = smoke_files(out.parent / "smoke")
        marker, a.workers = "smoke", 1
    if not history.is_dir():
        raise SystemExit(f"--history: {history} is not a folder")
    passed = passed_on_gpu(history)
    files = files or sorted(str(f) for f in (HERE.parent / "tests").glob("test_*.py") if "mark.cuda" in f.read_text())
    selected = None
    key, drop, last = ("cuda_tests", passed, LAST) if a.part == "tests" else ("recheck", set(), None)
    doc = load(out) or {}
    if a.part == "recheck":  # every test but those that never passed (collected by part "tests", or here)
        found = doc.get("collected") or collect(files, marker, _env())
        selected, drop = [t for t in found if t in passed], {t for t in found if t not in passed}
    doc.update(command=command("gpu_tests.py", argv),
               history=str(history), passed_before=len(passed))
    start = T0 if argv is None else time.time()
    run_cuda_tests(doc, timeout=start + a.seconds - 2 - time.time(), log=out.with_suffix(".log"), workers=a.workers,
                   per_test=a.per_test, files=files, marker=marker, last=last, drop=drop, key=key, selected=selected,
                   min_pass_s=3.0 if a.smoke else 20.0)
    doc.setdefault("complete", {})[key] = doc[key]["unreported"] == 0 and doc[key]["returncode"] in (0, 1)
    save(out, doc)


if __name__ == "__main__":
    main()
