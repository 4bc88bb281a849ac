"""The GPU check's test section on the CPU: every outcome, with its failure text, comes back as it
happens, and a test that hangs is failed by the per-test limit, far below the run's (benchmarks/gpu.py: run_cuda_tests)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _gpu_module():
    spec = importlib.util.spec_from_file_location("gpu_check_bench", ROOT / "benchmarks" / "gpu.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("gpu_check_bench", mod)
    spec.loader.exec_module(mod)
    return mod


@pytest.mark.heavy
def test_a_run_cut_short_keeps_its_failures(tmp_path):
    tests = tmp_path / "tests"
    tests.mkdir()
    (tests / "conftest.py").write_text((ROOT / "tests" / "conftest.py").read_text())
    (tests / "test_fake.py").write_text(
        "import time, pytest\n"
        "pytestmark = pytest.mark.fake\n"
        "def test_a_passes():\n    assert 1\n"
        "def test_b_fails():\n    assert 2 + 2 == 5, 'arithmetic broke'\n"
        "def test_c_hangs():\n    time.sleep(600)\n")
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    fake: a test of the stream\n")
    doc = {}
    # per_test: far below the run's limit, and above what a loaded machine takes to set a test up
    _gpu_module().run_cuda_tests(doc, timeout=90, log=tmp_path / "out.tests.log", workers=1, per_test=12,
                                 files=[str(tests / "test_fake.py")], marker="fake")
    t = doc["cuda_tests"]
    assert t["outcomes"] == {"tests/test_fake.py::test_a_passes": "PASSED", "tests/test_fake.py::test_b_fails": "FAILED",
                             "tests/test_fake.py::test_c_hangs": "FAILED"}
    assert "arithmetic broke" in t["failures"]["tests/test_fake.py::test_b_fails"]
    assert "Timeout" in t["failures"]["tests/test_fake.py::test_c_hangs"]  # the per-test limit, not the run's
    assert t["unreported"] == 0 and t["seconds"] < 75
    assert (tmp_path / "out.tests.jsonl").read_text().count("\n") == 3  # each written as it happened
