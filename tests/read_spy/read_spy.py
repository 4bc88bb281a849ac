"""The value-read spy shared by the no-host-sync tests: in-process (tests/test_no_host_sync.py) and in
torchrun's workers (tests/read_spy/sitecustomize.py, for DDP and FSDP2).

`install(patch)` makes every `.item()`, `float()`, `int()`, `bool()`, `.nonzero()` and `.tolist()` of a
tensor called from package code (decided by module name, never by path) append (name, module, line)
to the returned list while `on[0]` is true, and makes the value checks run the way they run on a GPU
(device-side asserts inside `async_value_checks`, a read outside it). `patch(obj, name, value)` sets
an attribute (pytest's monkeypatch.setattr, or setattr in a worker)."""

from __future__ import annotations

import sys

import torch

READS = ("item", "__float__", "__int__", "__bool__", "nonzero", "tolist")
HOST_SIDE = ("attnlab.data",)  # builds batches on the host, before they reach the device


def install(patch) -> tuple[list, list]:
    from attnlab import checks

    real_mode = checks.value_check_mode

    def as_on_a_gpu(x):  # what value_check_mode answers for a tensor on an accelerator
        if torch.compiler.is_compiling():
            return real_mode(x)
        return "assert" if getattr(checks._async, "depth", 0) > 0 else "eager"

    patch(checks, "value_check_mode", as_on_a_gpu)
    seen, on = [], [False]

    def spy(real, name):
        def read(self, *a, **k):
            frame = sys._getframe(1)
            module = frame.f_globals.get("__name__", "")
            if on[0] and module.split(".")[0] == "attnlab" and not module.startswith(HOST_SIDE):
                seen.append((name, module, frame.f_lineno))
            return real(self, *a, **k)
        return read

    for name in READS:
        patch(torch.Tensor, name, spy(getattr(torch.Tensor, name), name))
    return seen, on
