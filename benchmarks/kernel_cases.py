"""The cases of benchmarks/kernel_sass.py: each Triton kernel of the GPU paths as its launcher starts it on
a GPU (signature, constexprs, the JIT's divisibility hints, warps and stages), for compiling on the CPU."""

from __future__ import annotations

import importlib
import inspect
import os

D = DV = 64
GOAT_D = 80  # GOAT's product: D = 64 and its prior's 2R = 16 columns (R = 8, benchmarks/gpu_paths.py)
DG = 16  # principled's gate width (the layer's default)


def _cases() -> dict:
    """name -> (module, kernel, KERNEL code, tile kind, index of the main loop among the kernel's loops,
    the number of loops the kernel has; a kernel compiled into another count names no main loop)."""
    cases = {}
    scalar = "attnlab.ops.scalar."
    for family, code in (("hybrid-gaussian", 0), ("hybrid-cauchy", 1), ("goat", 2)):
        # _fwd / _bwd_q: loop 0 takes the whole key tiles, loop 1 the diagonal; _bwd_kv: the diagonal, the
        # whole query tiles, the ragged end (before the key-major kernel: the diagonal, then the rest)
        for kind, mod, name, main, n in (("fwd", "triton_kernel", "_fwd", 0, (2,)),
                                         ("bwd_kv", "triton_backward", "_bwd_kv", 1, (3, 2)),
                                         ("bwd_q", "triton_backward", "_bwd_q", 0, (2,))):
            cases[f"{family}/{kind}"] = (scalar + mod, name, code, kind, main, n)
    for kind, name in (("fwd", "_fwd"), ("bwd_kv", "_bwd_kv"), ("bwd_q", "_bwd_q")):  # one loop each (causal)
        cases[f"principled/{kind}"] = ("attnlab.ops.principled.triton_kernel", name, None, kind, 0, (1,))
    for family, code in (("window-gaussian", 0), ("window-cauchy", 1)):  # training through the window
        for kind, name in (("sel_fwd", "_sel_fwd"), ("sel_bwd", "_sel_bwd"), ("sel_bwd_keys", "_sel_bwd_keys")):
            cases[f"{family}/{kind}"] = (scalar + "triton_selected", name, code, kind, 0, (1,))
    # a trained window's choice of keys in a decode step: no key-tile loop (its rounds are unrolled)
    cases["window-decode/keys"] = ("attnlab.cache.static.window_kernel", "_window_keys", None, "decode_keys", 0, ())
    return cases


CASES = _cases()
DEFAULT_CASES = tuple(CASES)


def _launch(case: str, fast: bool):
    """(jit function, signature, constexprs, divisibility attrs, num_warps, num_stages) of one case as the
    launchers build it on a GPU, with the FAST switch `fast_math()` gives under ATTNLAB_TRITON_FAST_MATH."""
    import torch

    from attnlab.ops.scalar import triton_kernel
    from attnlab.ops.scalar.triton_op import _blocks, _pow2
    from attnlab.ops.scalar.triton_selected import _tiles

    before = os.environ.get("ATTNLAB_TRITON_FAST_MATH")
    os.environ["ATTNLAB_TRITON_FAST_MATH"] = "1" if fast else "0"
    try:  # the launchers' switch, read as they read it (None: code from before the switch, --baseline)
        FAST = triton_kernel.fast_math() if hasattr(triton_kernel, "fast_math") else None
    finally:
        if before is None:
            os.environ.pop("ATTNLAB_TRITON_FAST_MATH")
        else:
            os.environ["ATTNLAB_TRITON_FAST_MATH"] = before
    _, name, code, kind, _, _ = CASES[case]
    fn = getattr(_kernel_module(case), name)
    if kind == "decode_keys":
        return _decode_keys_launch(fn) + (FAST, 1)
    cuda = torch.device("cuda")  # only its type is read: the GPU tiles
    d = GOAT_D if code == 2 else D
    try:  # the product's column blocks (one, or 64 + 16 for GOAT's 80); --baseline: one padded block
        from attnlab.ops.scalar.triton_op import _split
    except ImportError:
        _split = lambda n: (_pow2(n), 0)  # noqa: E731
    cons = dict(D=d, DV=DV, BLOCK_D=_split(d)[0], BLOCK_D2=_split(d)[1], BLOCK_DV=_pow2(DV), HAS_DOT=True,
                KERNEL=code, FAST=FAST)
    if kind.startswith("sel"):  # the window's kernels; its key side tiles keys x the pairs selecting them
        a, b, warps = _tiles(cuda)[{"sel_fwd": "fwd", "sel_bwd": "bwd"}.get(kind, "keys")]
        cons.update(zip(("BLOCK_N", "BLOCK_P") if kind == "sel_bwd_keys" else ("BLOCK_M", "BLOCK_J"), (a, b)))
        stages = 3  # Triton's default: the launcher names none
    elif code is None:  # principled: its launcher's tiles, gate width 16
        from attnlab.ops.principled import triton_kernel as principled

        per_kind = "kind" in inspect.signature(principled._blocks).parameters  # tiles per kernel (not in older code)
        BM, BN, warps, stages = principled._blocks(cuda, (D, DG, DV), *([kind] if per_kind else []))
        cons = dict(D=D, DG=DG, DV=DV, BLOCK_D=_pow2(D), BLOCK_DG=_pow2(DG), BLOCK_DV=_pow2(DV), BLOCK_M=BM,
                    BLOCK_N=BN, CAUSAL=True, PREC="ieee", UP=False, DOC=False, FAST=FAST)
    else:
        tiles = _blocks(cuda, d, DV)
        BM, BN, warps, stages = tiles[{"fwd": "fwd", "bwd_q": "bwd"}.get(kind, "bwd_kv") if "bwd_kv" in tiles else
                                      "fwd" if kind == "fwd" else "bwd"]
        cons.update(BLOCK_M=BM, BLOCK_N=BN, BIAS=code == 2, CAUSAL=True, PREC="tf32", UP=False, DOC=False)
    for opt in ("FAST", "BLOCK_D2"):  # constexprs of later code only
        if opt in cons and opt not in inspect.signature(fn.fn).parameters:
            del cons[opt]
    bf16 = {"Q", "K", "V", "DO", "QG", "KG"}  # the inputs in the run's dtype; the rest float32 (DOCS & co.: unused)
    names = list(inspect.signature(fn.fn).parameters)
    sig, attrs = {}, {}
    for i, n in enumerate(names):
        if n in cons:
            sig[n] = "constexpr"
        elif n == "sm_scale":
            sig[n] = "fp32"
        elif n in ("Tq", "Tk", "T", "M", "H", "GK", "GV", "GG"):  # sizes: multiples of 16 at T = 8K, H = 16, but M
            sig[n] = "i32"                                   # (keys per query: sink + k + w) need not be
            if n != "M":
                attrs[(i,)] = [["tt.divisibility", 16]]
        else:  # a tensor
            sig[n] = "*bf16" if n in bf16 else "*i32" if n in ("IDX", "PAIR_Q", "PAIR_K", "START") else "*fp32"
            attrs[(i,)] = [["tt.divisibility", 16]]
    if FAST is None:
        cons.pop("FAST", None)
    missing = set(cons) - set(names)
    assert not missing, f"{name} takes no {missing}"
    rows_, cols_ = (cons["BLOCK_N"], cons["BLOCK_P"]) if "BLOCK_P" in cons else (
        cons["BLOCK_M"], cons.get("BLOCK_N", cons.get("BLOCK_J", 1)))
    per_thread = rows_ * cols_ / (32 * warps)  # scores per loop trip
    per_thread = int(per_thread) if per_thread == int(per_thread) else per_thread
    return fn, sig, {(names.index(n),): v for n, v in cons.items()}, attrs, warps, stages, FAST, per_thread


def _decode_keys_launch(fn) -> tuple:
    """The decode step's window-keys kernel as `cache.static.window_kernel` launches it for the shipped window
    (k = 16) with a tail of 256 over a 128K-position cache."""
    from attnlab.cache.static.window_kernel import PROBES, _pow2, search_rounds

    cons = dict(K=16, TAIL=256, KP=_pow2(16), CP=_pow2(2 * _pow2(16) + 256), ROUNDS=search_rounds(2**17), PROBES=PROBES)
    types = dict(QS="*fp32", KS="*fp32", CODES="*i64", MERGED="*i64", LAST_OLD="*i64", IDX="*i64", OK="*i1", N="i32")
    names = list(inspect.signature(fn.fn).parameters)
    sig = {n: "constexpr" if n in cons else types[n] for n in names}
    attrs = {(i,): [["tt.divisibility", 16]] for i, n in enumerate(names) if n in ("KS", "CODES", "IDX", "N")}
    return fn, sig, {(names.index(n),): v for n, v in cons.items()}, attrs, 4, 3


def _kernel_module(case: str):
    """The case's kernel module (--baseline code may predate triton_backward: then triton_kernel)."""
    module = CASES[case][0]
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError:
        return importlib.import_module(module.replace("triton_backward", "triton_kernel"))


def _has_kernel(case: str) -> bool:
    try:
        return hasattr(_kernel_module(case), CASES[case][1])
    except ModuleNotFoundError:
        return False
