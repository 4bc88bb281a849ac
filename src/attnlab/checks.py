"""Argument checks shared by every part of attnlab (ops, layers, caches, search): errors name the
argument, what it got and what it needs. Public, so code built on attnlab can check the same way."""

from __future__ import annotations

import math
import threading
from contextlib import contextmanager
from typing import Iterable, Sequence

import torch

IMPLS = ("auto", "naive", "fast")
TRITON_IMPLS = (*IMPLS, "triton")  # ops with a Triton kernel (the scalar family) take "triton" too
FLA_IMPLS = (*IMPLS, "fla")  # gla and ssd take "fla" too: flash-linear-attention's chunked kernels


def check_impl(impl: str, allowed: tuple = IMPLS) -> str:
    if impl not in allowed:
        raise ValueError(f"impl must be one of {allowed}, got {impl!r}")
    return impl


def check_choice(name: str, value, allowed: Iterable) -> None:
    allowed = tuple(allowed)
    if value not in allowed:
        raise ValueError(f"{name} must be one of {allowed}, got {value!r}")


def check_tensor(name: str, x, ndim: int | Sequence[int]) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    dims = (ndim,) if isinstance(ndim, int) else tuple(ndim)
    if x.dim() not in dims:
        raise ValueError(f"{name} must have {' or '.join(map(str, dims))} dims, got shape {tuple(x.shape)}")
    return x


def check_same(name_a: str, a: int, name_b: str, b: int, what: str) -> None:
    if a != b:
        raise ValueError(f"{name_a} and {name_b} must agree in {what}: got {a} and {b}")


class NotAnIntError(TypeError, ValueError):
    """Another type where an int is needed: a TypeError, and a ValueError too, so that callers
    reporting bad settings by catching ValueError (config loaders, the CLI) report it alike."""


def check_int(name: str, value, low: int = 1) -> int:
    """An int (never a bool) >= low: NotAnIntError (a TypeError and a ValueError) for another
    type, ValueError below `low`. Returns it."""
    need = "a positive int" if low == 1 else f"an int >= {low}"
    if isinstance(value, bool) or not isinstance(value, int):
        raise NotAnIntError(f"{name} must be {need}, got {value!r} ({type(value).__name__})")
    if value < low:
        raise ValueError(f"{name} must be {need}, got {value!r}")
    return value


def check_int_list(name: str, values, low: int = 1) -> list[int]:
    """A non-empty list of distinct ints >= low (ValueError naming `name`; NotAnIntError for a non-int)."""
    need = "positive ints" if low == 1 else f"ints >= {low}"
    msg = f"{name} must be a non-empty list of distinct {need}, got {values!r}"
    if not isinstance(values, (list, tuple)) or not values:
        raise ValueError(msg)
    for v in values:
        try:
            check_int(name, v, low)
        except NotAnIntError:
            raise NotAnIntError(msg) from None
        except ValueError:
            raise ValueError(msg) from None
    if len(set(values)) != len(values):
        raise ValueError(msg)
    return list(values)


def check_name_list(name: str, values, allowed: tuple) -> list[str]:
    """A non-empty list of distinct names from `allowed` (ValueError naming `name`)."""
    if (not isinstance(values, (list, tuple)) or not values or len(set(values)) != len(values)
            or any(v not in allowed for v in values)):
        raise ValueError(f"{name} must be a non-empty list of distinct names from {allowed}, got {values!r}")
    return list(values)


def check_groups(n_heads: int, n_groups, name: str = "v") -> int:
    """H query/key heads read G groups (value groups, KV heads, candidate sets): G an int with
    G <= H and H % G == 0, each group serving H / G consecutive heads. Returns G."""
    if isinstance(n_groups, bool) or not isinstance(n_groups, int) or not 1 <= n_groups <= n_heads or n_heads % n_groups:
        raise ValueError(
            f"{name} gives {n_groups!r} groups for {n_heads} heads: the number of groups must be a positive divisor "
            f"of the {n_heads} query heads (the number of heads H must be divisible by the number of value groups G)"
        )
    return n_groups


def broadcast_param(name: str, value, B: int, H: int, T: int, like: torch.Tensor) -> torch.Tensor:
    """A float, (H,) or (B, H, T) parameter as a tensor broadcastable to (B, H, T)."""
    if isinstance(value, (int, float)):
        return torch.tensor(float(value), dtype=like.dtype, device=like.device).view(1, 1, 1)
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a float or a tensor, got {type(value).__name__}")
    if value.dim() == 0:
        return value.view(1, 1, 1)
    if value.dim() == 1:
        if value.shape[0] != H:
            raise ValueError(f"{name} of shape (H,) must have H={H} entries, got shape {tuple(value.shape)}")
        return value.view(1, H, 1)
    if value.dim() == 3:
        if tuple(value.shape) != (B, H, T):
            raise ValueError(f"{name} of shape (B, H, T) must be {(B, H, T)}, got {tuple(value.shape)}")
        return value
    raise ValueError(f"{name} must be a float, (H,) or (B, H, T), got shape {tuple(value.shape)}")


_async = threading.local()  # .depth: how many `async_value_checks()` blocks this thread is in
COMPILED_VALUE_CHECKS = True  # read while torch.compile traces: False leaves the value checks out of compiled graphs
# True while torch.compile traces the layers of a model that checks its values once at its boundary
# (`model_boundary`): the per-layer and per-op checks stay out of that graph. A module global, not a
# thread-local: dynamo reads it as a guarded constant on every torch the project supports.
_AT_BOUNDARY = False


@contextmanager
def async_value_checks():
    """Inside this block (in this thread), value checks of tensors on an accelerator are device-side
    asserts (`torch._assert_async`), queued with the work instead of a host sync per check: a
    training step (`attnlab.models.LM.forward`) keeps every check without stalling the device at
    each layer. A failed one stops the process with a device-side assert, not a ValueError.
    CPU tensors are checked as everywhere else (reading a CPU value costs no sync)."""
    _async.depth = getattr(_async, "depth", 0) + 1
    try:
        yield
    finally:
        _async.depth -= 1


_trusted = threading.local()  # .ids: the tensors (by id) whose values `trusted()` says were checked already


@contextmanager
def trusted(*tensors: torch.Tensor):
    """Inside this block (in this thread), `check_finite` skips these tensors: their values were checked
    where they entered, as a decode cache checks each token once at append (`attnlab.cache.KVCache`),
    so a step does not read the whole cache again. Only for the objects given, while the block holds
    them (their ids cannot be reused meanwhile). Under torch.compile it changes nothing (`id()` of a
    tensor breaks the graph on older torch): there the checks are asserts or off (`value_check_mode`)."""
    if torch.compiler.is_compiling():
        yield
        return
    before = getattr(_trusted, "ids", frozenset())
    _trusted.ids = before | {id(t) for t in tensors}
    try:
        yield
    finally:
        _trusted.ids = before


def set_model_boundary(on: bool) -> bool:
    """While torch.compile traces a model's layers (`attnlab.models.LM`): on=True leaves the value checks
    of its layers and ops out of the graph, because the model asserts once, at its boundary, that its
    parameters and its output are finite (`check_output_finite`). Returns the previous setting, which
    the caller restores. Plain global assignments, so that dynamo traces them without a break on the
    oldest torch the project supports (a context manager or `id()` of a tensor breaks there)."""
    global _AT_BOUNDARY
    before = _AT_BOUNDARY
    _AT_BOUNDARY = on
    return before


def value_check_mode(x: torch.Tensor) -> str:
    """How a value check of x runs here: "eager" (read the value, raise ValueError), "assert" (an
    in-graph or device-side assert, no host sync: while torch.compile traces, and on an accelerator
    inside `async_value_checks()`), or "off" (traced with COMPILED_VALUE_CHECKS False)."""
    if torch.compiler.is_compiling():
        return "assert" if COMPILED_VALUE_CHECKS and not _AT_BOUNDARY else "off"
    if x.device.type != "cpu" and getattr(_async, "depth", 0) > 0:
        return "assert"
    return "eager"


def assert_values(ok: torch.Tensor, message: str) -> None:
    """`torch._assert_async(ok, message)`: traceable by torch.compile without a graph break; on the
    CPU it raises RuntimeError(message) when ok is False, on an accelerator it is a device-side
    assert (no host sync)."""
    torch._assert_async(ok, message)


def check_finite(name: str, value) -> None:
    """NaN or +-inf anywhere in a float or floating tensor raises ValueError naming `name`.

    attnlab's input policy: non-finite inputs are rejected before any work, never propagated
    (a NaN key would otherwise reach earlier rows through 0 * NaN in a masked matmul).

    Under torch.compile a ValueError would need the value on the host (a graph break, and a sync on
    an accelerator), so there the check is an assert inside the graph (`value_check_mode`): the
    compiled call raises RuntimeError("<name> must be finite ...") on the CPU, a device-side assert
    on an accelerator. Python floats are always checked eagerly."""
    if isinstance(value, torch.Tensor):
        if not (value.is_floating_point() or value.is_complex()) or value.numel() == 0:
            return
        if not torch.compiler.is_compiling() and id(value) in getattr(_trusted, "ids", ()):  # no id() in a graph
            return
        mode = value_check_mode(value)
        if mode != "eager":
            if mode == "assert":
                assert_values(torch.isfinite(value.detach()).all(), f"{name} must be finite (checked in a compiled graph)")
            return
        x = value.detach()
        # A few values (decode steps, per-head parameters) are cheaper to check in Python than with a
        # kernel. Otherwise any NaN or inf makes the sum NaN or inf, so a finite sum clears the tensor
        # in one reduction with no temporary (about 100x cheaper than isfinite().all() on CPU); a
        # non-finite sum (a NaN, an inf, or an overflow of huge finite values) gets the exact test.
        if x.numel() <= 256 and not x.is_complex():
            if all(map(math.isfinite, x.reshape(-1).tolist())):
                return
        else:
            total = x.sum(dtype=None if x.is_complex() else torch.float64 if x.dtype == torch.float64 else torch.float32)
            finite = bool(torch.isfinite(total)) if total.is_complex() else math.isfinite(float(total))
            if finite or bool(torch.isfinite(x).all()):
                return
        bad = (~torch.isfinite(x)).flatten()
        first = tuple(int(i) for i in torch.unravel_index(bad.nonzero()[0, 0], x.shape))
        n_nan = int(torch.isnan(x).sum())
        raise ValueError(
            f"{name} must be finite, got {n_nan} NaN and {int(bad.sum()) - n_nan} inf of {x.numel()} "
            f"entries (first at index {first})"
        )
    if isinstance(value, (int, float)) and not isinstance(value, bool) and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {value}")


def check_output_finite(name: str, out: torch.Tensor, module: torch.nn.Module | None = None, compiled_stand_in=()):
    """A model's check of its own output (LM: the logits), after its layers checked their inputs:
    it catches what no layer input shows, a non-finite parameter after the last attention op (the
    last MLP, the final norm, the head) or an overflow there.

    Eager: `check_finite(name, out)`; the ValueError also names the first non-finite parameter of
    `module`, or says that none is (an activation overflowed). Under torch.compile (`value_check_mode`)
    it is one assert inside the graph over the output and every parameter of `module` (the largest
    magnitude of each, one fused reduction: a NaN or inf anywhere fails it), which stands for the checks
    the layers leave out of a model's graph (`set_model_boundary`): RuntimeError("<name> must be
    finite ...") on the CPU, a device-side assert on an accelerator; the parameter is not named there.
    `compiled_stand_in`: tensors checked instead of `out` under torch.compile (LM: h and the loss; a check of
    the logits made Inductor keep their float32 log-softmax for the backward)."""
    if torch.compiler.is_compiling():
        if COMPILED_VALUE_CHECKS:
            params = [] if module is None else [p for p in module.parameters()
                                                if p.is_floating_point() and type(p) in (torch.nn.Parameter, torch.Tensor)]
            peaks = torch._foreach_norm([t.detach() for t in [*(compiled_stand_in or (out,)), *params]], float("inf"))
            assert_values(
                torch.isfinite(torch.stack([m.float() for m in peaks])).all(),
                f"{name} must be finite: a parameter or an activation of the compiled model is NaN or inf "
                f"(run the model uncompiled to name the first non-finite parameter)",
            )
        return
    try:
        check_finite(name, out)
    except ValueError as err:
        why = "no parameter is non-finite: an activation overflowed"
        for pname, p in (module.named_parameters() if module is not None else ()):
            if p.is_floating_point() and not bool(torch.isfinite(p.detach()).all()):
                n_nan = int(torch.isnan(p.detach()).sum())
                why = f"parameter {pname} has {n_nan} NaN and {int((~torch.isfinite(p.detach())).sum()) - n_nan} inf"
                break
        raise ValueError(f"{err}; {why}") from None


def check_positive(name: str, value) -> None:
    """A finite value > 0 (every entry, for a tensor; an in-graph assert under torch.compile)."""
    check_finite(name, value)
    if isinstance(value, (int, float)):
        if not value > 0:
            raise ValueError(f"{name} must be > 0, got {value}")
    elif isinstance(value, torch.Tensor) and value.numel():
        mode = value_check_mode(value)
        if mode != "eager":
            if mode == "assert":
                assert_values((value.detach() > 0).all(), f"{name} must be > 0 everywhere (checked in a compiled graph)")
            return
        if not bool((value > 0).all()):
            raise ValueError(f"{name} must be > 0 everywhere, got min {value.detach().min().item():.4g}")


def check_like(name: str, x: torch.Tensor, like: torch.Tensor, like_name: str) -> None:
    """x must be a floating tensor with the dtype and device of `like` (TypeError / ValueError naming x)."""
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got dtype {x.dtype}")
    if x.dtype != like.dtype:
        raise TypeError(f"{name} must have the dtype of {like_name} ({like.dtype}), got {x.dtype}")
    if x.device != like.device:
        raise ValueError(f"{name} must be on the device of {like_name} ({like.device}), got {x.device}")


def check_param(name: str, value, B: int, H: int, T: int, like: torch.Tensor) -> torch.Tensor:
    """A mixing parameter (tau, alpha, beta, gamma): a finite float, or a finite floating tensor of
    any dtype, (), (H,) or (B, H, T), on `like`'s device. Returns it broadcastable to (B, H, T)
    in `like`'s dtype."""
    if isinstance(value, bool):
        raise TypeError(f"{name} must be a float or a tensor, got bool")
    if isinstance(value, torch.Tensor):
        if not value.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor, got dtype {value.dtype}")
        if value.device != like.device:
            raise ValueError(f"{name} must be on the device of the inputs ({like.device}), got {value.device}")
    check_finite(name, value)
    return broadcast_param(name, value, B, H, T, like).to(like.dtype)


def check_linear_qkv(q, k, v) -> tuple[int, int, int, int, int]:
    """Finite floating (B, H, T, Dk) q and k of one shape, v (B, H, T, Dv), all of q's dtype and
    device: returns B, H, T, Dk, Dv. T = 0 is allowed (the ops return empty outputs)."""
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_tensor(name, x, 4)
        check_like(name, x, q, "q")
    B, H, T, Dk = q.shape
    check_same("q", tuple(q.shape), "k", tuple(k.shape), "shape (B, H, T, Dk)")
    check_same("q", tuple(q.shape[:3]), "v", tuple(v.shape[:3]), "(B, H, T)")
    for name, x in (("q", q), ("k", k), ("v", v)):
        check_finite(name, x)
    return B, H, T, Dk, v.shape[-1]


def empty_result(shape: Sequence[int], *inputs: torch.Tensor) -> torch.Tensor:
    """The output of an op called with T = 0: zeros of `shape` (which has a zero dim) in the
    dtype of the first input, joined to the autograd graph of the inputs so that backward runs
    and gives zero gradients, as it would for any other length."""
    like = inputs[0]
    out = like.new_zeros(shape)
    for x in inputs:
        if isinstance(x, torch.Tensor) and x.requires_grad:
            out = out + x.sum().to(out.dtype) * 0  # finite inputs (checked), so exactly zero
    return out


def check_qkv_step(q_t, k_t, v_t) -> tuple[int, int, int, int]:
    """Finite (B, H, Dk) q_t and k_t of one shape and v_t (B, H, Dv), all of q_t's dtype and
    device, for the decode steps of the linear family: returns B, H, Dk, Dv."""
    for name, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        check_tensor(name, x, 3)
        check_like(name, x, q_t, "q_t")
    B, H, Dk = q_t.shape
    check_same("q_t", tuple(q_t.shape), "k_t", tuple(k_t.shape), "shape (B, H, Dk)")
    check_same("q_t", (B, H), "v_t", tuple(v_t.shape[:2]), "(B, H)")
    for name, x in (("q_t", q_t), ("k_t", k_t), ("v_t", v_t)):
        check_finite(name, x)
    return B, H, Dk, v_t.shape[-1]


def check_state(name: str, state, shape: tuple, dtype: torch.dtype, like: torch.Tensor) -> None:
    """A recurrent state: a finite tensor of `shape` in the op's compute dtype, on like's device."""
    check_tensor(name, state, len(shape))
    if tuple(state.shape) != tuple(shape):
        raise ValueError(f"{name} must have shape {tuple(shape)}, got {tuple(state.shape)}")
    if state.dtype != dtype:
        raise TypeError(
            f"{name} must have the compute dtype {dtype} (float32 for 16-bit inputs, else the inputs' dtype), "
            f"got {state.dtype}"
        )
    if state.device != like.device:
        raise ValueError(f"{name} must be on the device of the inputs ({like.device}), got {state.device}")
    check_finite(name, state)


def check_window(window, causal: bool = True, name: str = "window") -> int | None:
    """A sliding window: None (every key) or an int >= 1, which needs causal masking (the window is
    the last `window` keys up to each query). Returns it."""
    if window is None:
        return None
    check_int(name, window)
    if not causal:
        raise ValueError(f"{name}={window!r} is a causal sliding window: it needs causal=True")
    return window


def check_lengths(Tq: int, Tk: int, causal: bool, q_name: str = "q", k_name: str = "k") -> None:
    """Causal ops take at most as many queries as keys (the queries are the last Tq positions)."""
    if causal and Tq > Tk:
        raise ValueError(
            f"causal masking needs at least as many keys as queries: {q_name} has {Tq} positions, {k_name} has {Tk}"
        )



def check_docs(docs, B: int, Tk: int, like: torch.Tensor, triton: bool) -> None:
    """docs: None, or (B, Tk) integer document ids of the keys on `like`'s device (packed documents:
    each query reads its own document's keys only), which only the Triton kernels take (`triton`:
    whether the call runs on them)."""
    if docs is None:
        return
    if not isinstance(docs, torch.Tensor) or docs.dtype.is_floating_point or docs.dtype == torch.bool:
        raise TypeError(f"docs must be an integer tensor of document ids (B, Tk), got "
                        f"{type(docs).__name__ if not isinstance(docs, torch.Tensor) else docs.dtype}")
    if tuple(docs.shape) != (B, Tk):
        raise ValueError(f"docs must have shape (B, Tk) = {(B, Tk)}, got {tuple(docs.shape)}")
    if docs.device != like.device:
        raise ValueError(f"docs must be on {like.device}, got {docs.device}")
    if not triton:
        raise ValueError("docs (packed documents) needs the Triton kernel: impl='triton', or 'auto' on CUDA with "
                         "Triton installed, and no sliding window")
