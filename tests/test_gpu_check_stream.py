"""The GPU check's test section on the CPU: every outcome, with its failure text, comes back as it
happens, a test that hangs is failed by the per-test limit, far below the run's, and the slow fla tests run
last with the time left (benchmarks/gpu_tests.py: run_cuda_tests)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _gpu_module():
    spec = importlib.util.spec_from_file_location("gpu_check_bench", ROOT / "benchmarks" / "gpu_tests.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check_bench", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.heavy
def test_a_run_cut_short_keeps_its_failures(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    for name in ("conftest.py", "triton_first_fit.py"):  # the check's own test set-up
        (tests / name).write_text((ROOT / "tests" / name).read_text())
    (tests / "test_fake.py").write_text(
        "import time, pytest\n"
        "pytestmark = pytest.mark.fake\n"
        "def test_a_passes():\n"  # fla's kernels autotune first-fit in the check's tests
        "    import os, triton_first_fit\n    assert os.environ['ATTNLAB_TRITON_FIRST_FIT'] == 'fla' and triton_first_fit._PATCHED\n"
        "def test_b_fails():\n    assert 2 + 2 == 5, 'arithmetic broke'\n"
        "def test_c_hangs():\n    time.sleep(600)\n"
        "def test_fla_autotunes():\n    time.sleep(14)\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    fake: a test of the stream\n")
    doc = {}
    # per_test: far below the run's limit, and above what a loaded machine takes to set a test up
    _gpu_module().run_cuda_tests(doc, timeout=90, log=tmp_path / "out.tests.log", workers=1, per_test=12,
                                 files=[str(tests / "test_fake.py")], marker="fake")
    t = doc["cuda_tests"]
    assert t["outcomes"] == {"tests/test_fake.py::test_a_passes": "PASSED", "tests/test_fake.py::test_b_fails": "FAILED",
                             "tests/test_fake.py::test_c_hangs": "FAILED", "tests/test_fake.py::test_fla_autotunes": "PASSED"}
    lines = (tmp_path / "out.tests.jsonl").read_text().splitlines()
    assert "test_fla_autotunes" in lines[-1]  # last, beyond the first pass's per-test limit
    assert "arithmetic broke" in t["failures"]["tests/test_fake.py::test_b_fails"]
    assert "Timeout" in t["failures"]["tests/test_fake.py::test_c_hangs"]  # the per-test limit, not the run's
    assert t["unreported"] == 0 and t["unreported_ids"] == [] and t["items"] == 4 and t["seconds"] < 85
    assert len(lines) == 4  # each written once, as it happened


@pytest.mark.heavy
def test_a_run_out_of_time_names_the_tests_it_never_reached(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    for name in ("conftest.py", "triton_first_fit.py"):  # the check's own test set-up
        (tests / name).write_text((ROOT / "tests" / name).read_text())
    (tests / "test_fake.py").write_text("import time\ndef test_a_slow():\n    time.sleep(600)\n"
                                        "def test_fla_never_starts():\n    pass\n")
    doc = {}
    _gpu_module().run_cuda_tests(doc, timeout=30, log=tmp_path / "out.tests.log", workers=1, per_test=600,
                                 files=[str(tests / "test_fake.py")], marker="not nothing")
    t = doc["cuda_tests"]  # the per-test limit stays under the run's: the slow test fails, reported; no time left after it
    assert [o for o in t["outcomes"].items() if o[0].endswith("test_a_slow")][0][1] == "FAILED"
    assert [i.split("::")[-1] for i in t["unreported_ids"]] == ["test_fla_never_starts"] and t["seconds"] < 45
