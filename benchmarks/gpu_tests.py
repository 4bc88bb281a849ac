"""The GPU check's test part (benchmarks/gpu.py part "tests"): `pytest -m cuda` on a GPU machine, every
outcome and its failure text streamed as it happens, the tests that never reported named."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
LAST = "fla"  # -k expression of the tests run after the rest with the time left: flash-linear-attention's
#               kernels autotune for minutes on each new shape, which starved every other test before
FIRST_FIT = "fla"  # whose autotuned kernels take their first working config in the tests (tests/triton_first_fit.py):
#                    an exactness test needs one config, not the fastest; the speed rows tune fully


def _base_cmd(files: list[str], marker: str) -> list[str]:
    """pytest over `files` (only those with cuda tests: others import packages the machine may lack)."""
    return [sys.executable, "-m", "pytest", "-m", marker, "-p", "no:cacheprovider", "-p", "no:benchmark", *files]


def collect(files: list[str], marker: str, env: dict) -> list[str]:
    """The node ids `pytest -m marker` selects in `files` ([] when collection fails)."""
    p = subprocess.run([*_base_cmd(files, marker), "--collect-only", "-q"], capture_output=True, text=True,
                       env=env, cwd=HERE.parent, timeout=300)
    return [line.strip() for line in p.stdout.splitlines() if "::" in line]


def run_cuda_tests(doc: dict, timeout: float, log: Path, workers: int = 4, per_test: float = 60.0,
                   files: list[str] | None = None, marker: str = "cuda", last: str | None = LAST) -> None:
    """`pytest -m cuda` over the files that hold cuda tests, in two passes within `timeout` seconds: the
    tests not matching `last` (-k), then those that do with the time left. Each pass runs on `workers`
    xdist workers (few enough that compiling kernels does not starve the tests); the first with a
    per-test timeout of `per_test` seconds, the second with the time left. flash-linear-attention's
    autotuned kernels take their first working config (FIRST_FIT; ATTNLAB_TRITON_FIRST_FIT). Output is streamed to `log`;
    each outcome, with its failure text, is written as it happens to <log>.jsonl (tests/conftest.py:
    ATTNLAB_TEST_STREAM) and printed at once: a run cut short keeps every result and traceback it
    reached. doc["cuda_tests"] holds the outcomes, the failures' text and the ids of the tests that
    never reported."""
    t0 = time.time()
    deadline = t0 + timeout
    if files is None:
        files = sorted(str(f) for f in (HERE.parent / "tests").glob("test_*.py") if "mark.cuda" in f.read_text())
    stream = log.with_suffix(".jsonl")
    stream.write_text("")
    env = {**os.environ, "ATTNLAB_TEST_STREAM": str(stream), "PYTHONPATH": os.pathsep.join(
        [str(HERE.parent / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.setdefault("ATTNLAB_TRITON_FIRST_FIT", FIRST_FIT)
    selected = collect(files, marker, env)
    seen: list[dict] = []

    def drain() -> None:  # print each new outcome (failures with their text) as it arrives
        for line in stream.read_text(errors="replace").splitlines()[len(seen):]:
            row = json.loads(line)
            seen.append(row)
            print(f"  {row['outcome']} {row['test']} ({row['when']}, {row['seconds']} s)", flush=True)
            if row.get("failure"):
                print("    " + row["failure"][:3000].replace("\n", "\n    "), flush=True)

    passes = [(f"not ({last})", per_test), (last, None)] if last else [(None, per_test)]
    returncodes = []
    with open(log, "w") as fh:
        for keyword, limit in passes:
            left = deadline - time.time()
            if left < 20:
                print(f"cuda tests -k {keyword!r}: not started ({left:.0f} s left)", flush=True)
                break
            cmd = _base_cmd(files, marker) + ["-v", "-rfE", "--tb=short"] + (["-k", keyword] if keyword else [])
            if importlib.util.find_spec("xdist") and workers > 1:
                cmd += ["-n", str(min(workers, os.cpu_count() or 1))]
            if importlib.util.find_spec("pytest_timeout"):
                cmd += ["--timeout", str(max(1, int(min(limit or left, left - 15))))]
            fh.write(f"$ {' '.join(cmd)}\n")
            fh.flush()
            p = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, text=True, env=env, cwd=HERE.parent)
            rc = None
            while time.time() < deadline:
                try:
                    rc = p.wait(timeout=2)
                    break
                except subprocess.TimeoutExpired:
                    drain()
            if rc is None:
                p.kill()
                p.wait()
            returncodes.append(0 if rc == 5 else rc)  # 5: the pass selected no test
            drain()
    text = log.read_text(errors="replace")
    outcomes, failures = {}, {}
    for row in seen:
        if row["outcome"] in ("FAILED", "ERROR") or row["test"] not in outcomes:
            outcomes[row["test"]] = "ERROR" if row["outcome"] == "FAILED" and row["when"] != "call" else row["outcome"]
        if row.get("failure"):
            failures[row["test"]] = row["failure"]
    unreported = [t for t in selected if t not in outcomes]
    rc = None if None in returncodes or not returncodes else max(returncodes)
    doc["cuda_tests"] = {"returncode": rc, "seconds": round(time.time() - t0, 1), "items": len(selected),
                         "outcomes": outcomes, "failures": failures, "unreported": len(unreported),
                         "unreported_ids": unreported, "log": log.name, "stream": stream.name,
                         "tail": text[-3000:] if rc is None or rc else text[-600:]}
    counts = {o: list(outcomes.values()).count(o) for o in sorted(set(outcomes.values()))}
    print(f"cuda tests: {counts}, {len(unreported)} unreported, rc {rc}, {doc['cuda_tests']['seconds']} s", flush=True)
    for t in unreported:
        print(f"  UNREPORTED {t}", flush=True)
