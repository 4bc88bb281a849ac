"""The GPU check's first-fit autotuning (tests/triton_first_fit.py), under Triton's interpreter."""

import pytest
import torch

triton = pytest.importorskip("triton")
import triton.language as tl  # noqa: E402
from triton_first_fit import first_fit  # noqa: E402

RUNS: list[int] = []


def _record(nargs):
    RUNS.append(nargs["BLOCK"])


CONFIGS = [triton.Config({"BLOCK": b}, pre_hook=_record) for b in (8, 16, 32)]


@triton.autotune(configs=CONFIGS, key=["n"])
@triton.jit
def _double(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    tl.store(Y + offs, 2 * tl.load(X + offs, mask=offs < n), mask=offs < n)


@pytest.fixture(autouse=True)
def _bench_by_running(monkeypatch):
    """Triton's benchmarker needs a GPU driver; here a config's "timing" runs it once."""
    from triton.runtime.autotuner import Autotuner

    def bench(self, kernel_call, quantiles):
        kernel_call()
        return [1.0] * len(quantiles)

    monkeypatch.setattr(Autotuner, "do_bench", bench)


def _call(n: int) -> torch.Tensor:
    x = torch.arange(n, dtype=torch.float32)
    y = torch.empty_like(x)
    _double[lambda meta: (triton.cdiv(n, meta["BLOCK"]),)](x, y, n)
    return y


def test_first_fit_runs_only_the_first_config_of_the_named_modules_and_stays_exact():
    RUNS.clear()
    with first_fit((__name__,)):
        assert torch.equal(_call(40), 2 * torch.arange(40.0))
        timed = set(RUNS)
        assert torch.equal(_call(70), 2 * torch.arange(70.0))  # a new key: searched again, first config again
    assert timed == {8}, RUNS
    assert set(RUNS) == {8}


def test_first_fit_passes_over_a_config_that_fails(monkeypatch):
    from triton.runtime.autotuner import Autotuner

    bench = Autotuner._bench

    def first_fails(self, *args, config, **meta):  # the first config out of resources, as Triton scores it
        return [float("inf")] * 3 if config.kwargs["BLOCK"] == 8 else bench(self, *args, config=config, **meta)

    monkeypatch.setattr(Autotuner, "_bench", first_fails)
    RUNS.clear()
    with first_fit((__name__,)):
        assert torch.equal(_call(33), 2 * torch.arange(33.0))
    assert set(RUNS) == {16}


def test_other_modules_keep_full_autotuning():
    RUNS.clear()
    with first_fit(("fla",)):
        _call(50)
    assert set(RUNS) == {8, 16, 32}
