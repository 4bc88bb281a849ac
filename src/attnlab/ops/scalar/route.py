"""Where the scalar family's Triton kernels run: `triton_missing` (why not on a device) and
`triton_route` (whether an impl takes them), for the public ops (`attention`), windowed attention
(`window`) and the layers. Imports nothing of the kernels until asked."""

from __future__ import annotations

import torch


def triton_missing(device: torch.device) -> str | None:
    """Why the Triton kernel cannot run on `device` (None when it can)."""
    try:
        from .triton_op import available
    except ImportError:
        return "Triton is not installed (pip install triton; it comes with torch's CUDA builds)"
    return available(device)


def triton_route(impl: str, device: torch.device) -> bool:
    """Whether `impl` runs the Triton kernels on `device` (no error either way): "triton" where they can
    run (CUDA, or the CPU under TRITON_INTERPRET=1), "auto" on CUDA with Triton installed."""
    if impl not in ("auto", "triton") or (impl == "auto" and device.type != "cuda"):
        return False
    return triton_missing(device) is None
