"""Where the op families' Triton kernels run: why not on a device (`triton_missing`), whether an impl
takes them without an error either way (`triton_route`), and an op's choice, with the errors
impl="triton" raises where they cannot run (`use_triton`). Triton is imported only when asked."""

from __future__ import annotations

import torch


def available(device: torch.device) -> str | None:
    """None when the Triton kernels can run on `device`, else why not (for the error message)."""
    from . import triton_math

    if device.type == "cuda" or (device.type == "cpu" and triton_math.interpreted()):
        return None
    return f"Triton runs on CUDA tensors (or on the CPU under TRITON_INTERPRET=1), got device {device}"


def triton_missing(device: torch.device) -> str | None:
    """Why the Triton kernels cannot run on `device` (None when they can)."""
    try:
        from . import triton_math  # noqa: F401 - imports Triton
    except ImportError:
        return "Triton is not installed (pip install triton; it comes with torch's CUDA builds)"
    return available(device)


def triton_route(impl: str, device: torch.device) -> bool:
    """Whether `impl` runs the Triton kernels on `device` (no error either way): "triton" where they can
    run (CUDA, or the CPU under TRITON_INTERPRET=1), "auto" on CUDA with Triton installed."""
    if impl not in ("auto", "triton") or (impl == "auto" and device.type != "cuda"):
        return False
    return triton_missing(device) is None


def use_triton(impl: str, device: torch.device, window) -> bool:
    """impl="triton" (checked: a clear error where it cannot run), or "auto" on CUDA with Triton there.
    A sliding window keeps the op's banded path: the kernels have none."""
    if impl == "triton":
        if window is not None:
            raise ValueError(f"window must be None with impl='triton' (the kernel has no sliding window; "
                             f"impl='auto' runs it banded), got {window!r}")
        reason = triton_missing(device)
        if reason is not None:
            raise ValueError(f"impl='triton' cannot run: {reason}")
        return True
    return impl == "auto" and window is None and triton_route(impl, device)
