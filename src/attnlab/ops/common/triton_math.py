"""The arithmetic the Triton kernels of the op families share (the scalar family's, principled's): the
base-2 constants, the matrix product's precision switch (`mm`), log2(1 + x) and 1 / (1 + x) in their
accurate or hardware forms (the FAST switch, `fast_math`), and the interpreter switches (`interpreted`,
and a compatibility patch of Triton 3.6's interpreter for NumPy >= 2.4)."""

from __future__ import annotations

import os

import triton
import triton.language as tl

LOG2E: tl.constexpr = tl.constexpr(1.4426950408889634)  # the kernels keep scores and log-sum-exps in base 2
LN2: tl.constexpr = tl.constexpr(0.6931471805599453)


def interpreted() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def fast_math() -> bool:
    """The kernels' FAST switch, read by the launchers at each launch: the Cauchy kernel's log and
    division in the hardware's approximate forms (`log2_1p`, `over_1p`), compiled for a GPU; off
    under the interpreter (TRITON_INTERPRET=1, which cannot run inline PTX) and with
    ATTNLAB_TRITON_FAST_MATH=0 (the accurate forms: benchmarks/kernel_sass.py's baseline)."""
    return not interpreted() and os.environ.get("ATTNLAB_TRITON_FAST_MATH", "1").strip() != "0"


def _interpreter_compat() -> None:
    """Triton 3.6's interpreter turns a scalar into an index by int() of a one-element array, which
    NumPy >= 2.4 refuses; a loop bound read from program_id needs it. Take the element instead."""
    from triton.runtime import interpreter as ti

    if getattr(ti, "_attnlab_index_compat", False):
        return
    patch = ti._patch_lang_tensor

    def patched(tensor, scope):
        patch(tensor, scope)
        scope.set_attr(tensor, "__index__", lambda self: int(self.handle.data.reshape(-1)[0]))

    ti._patch_lang_tensor = patched
    ti._attnlab_index_compat = True


if interpreted():
    _interpreter_compat()


@triton.jit
def mm(a, b, PREC: tl.constexpr, UP: tl.constexpr):
    """a @ b on the matrix units; UP: in float32 from the (already rounded) 16-bit operands, for the
    interpreter, whose dot misreads bf16 (the products are exact either way, the sums float32)."""
    if UP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32), input_precision="ieee")
    return tl.dot(a, b, input_precision=PREC)


@triton.jit
def log2_1p(x, FAST: tl.constexpr):
    """log2(1 + x) for x >= 0 (float32). FAST: the hardware approximation (PTX lg2.approx, one MUFU.LG2:
    error ~2^-22, absolute on [1, 2) and relative above, a few times the float32 rounding of 1 + x
    itself and far below bf16's; flushing subnormals is moot as 1 + x >= 1) in place of libdevice's
    accurate log2f, ~25 instructions per score on sm_90 (benchmarks/kernel_sass.py)."""
    if FAST:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + x], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return tl.log2(1.0 + x)


@triton.jit
def over_1p(a, x, FAST: tl.constexpr):
    """a / (1 + x) for x >= 0 (float32). FAST: a times the hardware reciprocal (PTX rcp.approx.ftz, one
    MUFU.RCP, 1 ulp): two instructions, where Triton's division (div.full.f32, itself approximate) also
    tests and scales both operands for a divisor near either end of the range, ~8; 1 + x >= 1 needs no
    scaling (the reciprocal flushes to 0 past 1 + x = 2^126, where the quotient is below 2^-126 |a|)."""
    if FAST:
        return a * tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [1.0 + x], dtype=tl.float32,
                                             is_pure=True, pack=1)
    return a / (1.0 + x)


@triton.jit
def lg2(x1, FAST: tl.constexpr):
    """log2(x1) for x1 = 1 + x >= 1, as `log2_1p` takes it (FAST: one MUFU.LG2)."""
    if FAST:
        return tl.inline_asm_elementwise("lg2.approx.ftz.f32 $0, $1;", "=f,f", [x1], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return tl.log2(x1)


@triton.jit
def rcp(x1, FAST: tl.constexpr):
    """1 / x1 for x1 = 1 + x >= 1, as `over_1p` takes it (FAST: one MUFU.RCP)."""
    if FAST:
        return tl.inline_asm_elementwise("rcp.approx.ftz.f32 $0, $1;", "=f,f", [x1], dtype=tl.float32,
                                         is_pure=True, pack=1)
    return 1.0 / x1
