"""benchmarks/gpu.py's paths, checked on the CPU: each builds its inputs, runs its fast path (Triton
kernels in the interpreter) and its float64 reference, and agrees with it, so the GPU check spends its
time measuring rather than failing on a typo."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("triton")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import gpu  # noqa: E402
from gpu_paths import PATHS  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("name", [n for n in PATHS if n != "sdpa-flash"])
def test_path_runs_and_matches_its_reference(name):
    e, eg, worst = gpu.errors(name, torch.float32, 40, torch.device("cpu"), H=2, D=16)
    assert e < 1e-4 and eg < 1e-3, (e, eg, worst)
