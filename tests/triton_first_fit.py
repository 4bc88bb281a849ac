"""First-fit autotuning for exactness tests: ATTNLAB_TRITON_FIRST_FIT=fla (module prefixes, comma-separated)
makes every `triton.autotune` kernel defined under those modules take the first of its configs that
compiles and runs, instead of timing them all.

A test of outputs and gradients needs one working config, not the fastest: flash-linear-attention's
kernels time a dozen or more configs on every new shape, several minutes of compiling per step on an
H100, which left its cuda tests unreported in the GPU check's time (`benchmarks/gpu_tests.py` sets the
variable for its test passes; its speed rows run in processes of their own, fully tuned). A config that
fails to compile or exceeds the device's resources (Triton's autotuner scores it inf) is passed over as
Triton passes it over, so the choice works wherever one of the configs does."""

from __future__ import annotations

import contextlib
import os

_PATCHED = False


def prefixes() -> tuple[str, ...]:
    return tuple(p.strip() for p in os.environ.get("ATTNLAB_TRITON_FIRST_FIT", "").split(",") if p.strip())


def _ours(tuner, mods: tuple[str, ...]) -> bool:
    module = getattr(getattr(tuner, "base_fn", None), "__module__", "") or ""
    return any(module == m or module.startswith(m + ".") for m in mods)


def install() -> bool:
    """Patch Triton's Autotuner for the kernels of the variable's prefixes, for the rest of the process.
    Returns whether a patch is in place."""
    global _PATCHED
    if not _PATCHED and prefixes():
        _patch(prefixes())
        _PATCHED = True
    return _PATCHED


@contextlib.contextmanager
def first_fit(mods: tuple[str, ...]):
    """The patch for the kernels of `mods`, undone on leaving."""
    from triton.runtime.autotuner import Autotuner

    saved = Autotuner._bench, Autotuner.run
    _patch(mods)
    try:
        yield
    finally:
        Autotuner._bench, Autotuner.run = saved


def _patch(mods: tuple[str, ...]) -> None:
    from triton.runtime.autotuner import Autotuner

    bench, run = Autotuner._bench, Autotuner.run

    def first_fit_bench(self, *args, config, **meta):
        if not _ours(self, mods):
            return bench(self, *args, config=config, **meta)
        if getattr(self, "_first_fit_found", False):
            return [float("inf")] * 3  # a working config was found: the rest are not compiled
        timing = bench(self, *args, config=config, **meta)
        self._first_fit_found = timing[0] != float("inf")
        return [0.0] * 3 if self._first_fit_found else timing

    def first_fit_run(self, *args, **kwargs):
        self._first_fit_found = False  # per call: a new key searches again from the first config
        return run(self, *args, **kwargs)

    Autotuner._bench, Autotuner.run = first_fit_bench, first_fit_run
