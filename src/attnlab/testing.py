"""Helpers for comparing a fast path with its naive reference (used by the tests; public for users' own checks)."""

from __future__ import annotations

import dataclasses
import zlib
from typing import Any, Callable, Sequence

import torch


def rel_rms(a: torch.Tensor, b: torch.Tensor, floor: float = 0.0) -> float:
    """Relative RMS error ||a - b|| / ||b|| in float64 (0 when both are zero); `floor` bounds the
    reference's RMS from below (a gradient that is exactly zero, such as every score's with one
    visible key, is then compared at that scale instead of dividing by nothing)."""
    a64, b64 = a.detach().double().cpu(), b.detach().double().cpu()
    den = max(b64.pow(2).mean().sqrt().item(), floor)
    num = (a64 - b64).pow(2).mean().sqrt().item()
    return num / den if den > 0 else num


def output_tensors(out: Any, name: str = "out") -> dict[str, torch.Tensor]:
    """The tensors of a function's output, by the names `compare_fwd_bwd` reports them under.

    A tensor is `name` ("out"). In a tuple or list, element 0 keeps `name` and element i > 0
    is `name` + str(i) ("out1", "out2", ...), so a function returning (o, state) reports o as
    "out" as a single-output function would. Inside those, nested tuples and lists add
    "[j]", dataclass fields ".field" and dict entries "[key]" ("out1.kv", "out1[0]").
    Anything else (None, Python numbers, strings) holds no tensor and is left out."""
    found: dict[str, torch.Tensor] = {}

    def walk(x, key, top):
        if isinstance(x, torch.Tensor):
            found[key] = x
        elif isinstance(x, (tuple, list)):
            for i, item in enumerate(x):
                walk(item, (key if i == 0 else f"{key}{i}") if top else f"{key}[{i}]", False)
        elif dataclasses.is_dataclass(x) and not isinstance(x, type):
            for f in dataclasses.fields(x):
                walk(getattr(x, f.name), f"{key}.{f.name}", False)
        elif isinstance(x, dict):
            for k, item in x.items():
                walk(item, f"{key}[{k}]", False)

    walk(out, name, True)
    return found


def _cotangent_seed(seed: int, key: str) -> int:
    """"out" draws from `seed` itself (as a single-output call always did); other names mix in
    a stable hash of the name."""
    return seed if key == "out" else (seed * 1_000_003 + zlib.crc32(key.encode())) % 2**63


def _error(a: torch.Tensor | None, b: torch.Tensor | None) -> float:
    """rel_rms for floating tensors of one shape; 0 / inf (equal or not) for other dtypes;
    inf when one is missing or the shapes differ (nothing is broadcast)."""
    if a is None or b is None or a.shape != b.shape:
        return float("inf")
    if a.is_floating_point() and b.is_floating_point():
        return rel_rms(a, b)
    return 0.0 if torch.equal(a.detach().cpu(), b.detach().cpu()) else float("inf")


def compare_fwd_bwd(
    fn_a: Callable[..., Any],
    fn_b: Callable[..., Any],
    inputs: Sequence[Any],
    *,
    seed: int = 0,
) -> dict[str, float]:
    """Run fn_a and fn_b on fresh leaf copies of `inputs` (non-tensors are passed as they are),
    backprop the same random cotangents, and return the relative RMS error of fn_a against
    fn_b for every output tensor and for each input's gradient.

    Outputs: a tensor, or tuples / lists / dataclasses / dicts of them, named as
    `output_tensors` says: "out" for a single tensor or a tuple's element 0, "out1", "out2",
    ... for the other elements, "out1.kv" for a field of a dataclass element. Floating tensors
    are compared by `rel_rms`; other dtypes (integer, bool) must be equal (0.0, else inf). A
    tensor present in one output only, or with another shape, gives inf; non-tensor values are
    not compared. Every floating output tensor that requires grad gets its own standard-normal
    cotangent, from a generator seeded by `seed` and its name (so both functions get the same
    ones, whatever else they return), and all are backpropagated together: an input's gradient
    sums what flows through every output. Gradients: keys "grad0", "grad1", ... by input
    position; inputs that do not require grad are skipped; a gradient on one side only gives inf."""
    def run(fn):
        leaves = [x.detach().clone().requires_grad_(x.requires_grad) if isinstance(x, torch.Tensor) else x for x in inputs]
        outs = output_tensors(fn(*leaves))
        tensors, cots = [], []
        for key, t in outs.items():
            if t.is_floating_point() and t.requires_grad:
                g = torch.Generator().manual_seed(_cotangent_seed(seed, key))
                tensors.append(t)
                cots.append(torch.randn(t.shape, generator=g, dtype=torch.float64).to(device=t.device, dtype=t.dtype))
        if tensors:
            torch.autograd.backward(tensors, cots)
        grads = [x.grad if isinstance(x, torch.Tensor) and x.requires_grad else None for x in leaves]
        return outs, grads

    outs_a, grads_a = run(fn_a)
    outs_b, grads_b = run(fn_b)
    errs = {key: _error(outs_a.get(key), outs_b.get(key)) for key in {**outs_a, **outs_b}}
    for i, (ga, gb) in enumerate(zip(grads_a, grads_b)):
        if gb is None and ga is None:
            continue
        errs[f"grad{i}"] = _error(ga, gb)
    return errs


class LargestTensor:
    """Records the largest tensor (in elements) any torch op produces inside the block, so a test
    can check that a fast path never materialises, say, a T x T matrix or keys for every head.

    >>> with LargestTensor() as seen:
    ...     scalar_attention(qs, ks, v, tau)
    >>> seen.numel < T * T
    """

    def __init__(self):
        from torch.utils._python_dispatch import TorchDispatchMode

        outer = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                out = func(*args, **(kwargs or {}))
                for t in out if isinstance(out, (tuple, list)) else (out,):
                    if isinstance(t, torch.Tensor):
                        outer.numel = max(outer.numel, t.numel())
                return out

        self.numel = 0
        self._mode = _Mode()

    def __enter__(self) -> "LargestTensor":
        self._mode.__enter__()
        return self

    def __exit__(self, *exc) -> None:
        self._mode.__exit__(*exc)


# Document lengths the packed-sequence (cu_seqlens) tests pack into one row: one document, a lone
# token, a 63-token one, empty documents between others, and many short ones around a long one.
PACKED_LENGTHS = {
    "one": [70],
    "len1": [1],
    "len63": [63],
    "awkward": [5, 1, 0, 63, 9],
    "many": [3, 0, 1, 17, 1, 1, 40, 9, 0, 2, 1, 30],
}


def cu_offsets(lengths: list[int]) -> list[int]:
    """cu_seqlens of documents of these lengths packed in order: [0, n0, n0 + n1, ...]."""
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    return cu
