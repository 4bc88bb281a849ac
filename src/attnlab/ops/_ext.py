"""attnlab's compiled CPU kernels (ops/csrc/): built on first use, cached, called through ctypes.

The kernels are C++ with OpenMP and a plain C interface; `torch.utils.cpp_extension.load` builds
them once per machine (a few seconds: they include no torch header) into torch's extension
cache (TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), and later processes load the
cached library. They call the BLAS that libtorch carries and run on torch's OpenMP threads
(`torch.get_num_threads()`).

Without a C++ compiler or ninja, or when the build fails, the ops fall back to their pure-PyTorch
fast paths with one warning. ``ATTNLAB_NO_EXT=1`` in the environment (read at each call) or the
`disabled()` context manager selects the fallback on purpose.

Callers pass contiguous CPU tensors of one dtype (float32 or float64) whose shapes they have
checked; the wrappers here only compute sizes and pointers.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import sys
import threading
import warnings
from contextlib import contextmanager
from pathlib import Path

import torch

CSRC = Path(__file__).resolve().parent / "csrc"
SOURCES = ("principled.cpp", "gla.cpp", "window.cpp")
CFLAGS = ("-O3", "-march=native", "-fopenmp", "-fno-math-errno", "-fno-trapping-math")
DTYPES = {torch.float32: "f32", torch.float64: "f64"}

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_off = 0  # depth of `disabled()` blocks


def _cpu_tag() -> str:
    """Short hash of the CPU's feature flags: -march=native code must not run on another CPU."""
    flags = platform.machine() + platform.processor()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                flags += line
                break
    except OSError:
        pass
    return hashlib.sha1(flags.encode()).hexdigest()[:8]


@contextmanager
def _ninja_on_path():
    """pip's ninja installs next to the interpreter, which is not on PATH unless the venv is active."""
    old = os.environ.get("PATH", "")
    extra = [str(Path(sys.executable).parent)]
    try:
        import ninja  # noqa: F401  (the PyPI package)

        extra.append(ninja.BIN_DIR)
    except (ImportError, AttributeError):
        pass
    os.environ["PATH"] = os.pathsep.join([old, *extra]) if old else os.pathsep.join(extra)
    try:
        yield
    finally:
        os.environ["PATH"] = old


STALE_LOCK_S = 900  # a build takes seconds: a build lock older than this was left by a killed process


def clear_stale_lock(build_dir: str | Path, max_age: float = STALE_LOCK_S) -> bool:
    """Remove torch's build lock in build_dir when it is older than max_age seconds (a process killed
    while building leaves it, and every later build would wait on it forever); True if removed."""
    import time

    lock = Path(build_dir) / "lock"
    try:
        age = time.time() - lock.stat().st_mtime
    except FileNotFoundError:
        return False
    if age <= max_age:
        return False
    lock.unlink(missing_ok=True)
    warnings.warn(f"attnlab: removed a build lock left {age / 60:.0f} minutes ago by a killed process ({lock})",
                  RuntimeWarning, stacklevel=2)
    return True


def build(verbose: bool = False) -> str:
    """Compile (or find in the cache) the kernels' shared library; returns its path. Raises on failure."""
    from torch.utils import cpp_extension

    cxx = os.environ.get("CXX", "c++")
    if shutil.which(cxx) is None:
        raise RuntimeError(f"no C++ compiler: {cxx!r} is not on PATH (set CXX to use another)")
    name = f"attnlab_kernels_{_cpu_tag()}"
    clear_stale_lock(cpp_extension._get_build_directory(name, False))
    with _ninja_on_path():
        if not cpp_extension.is_ninja_available():
            raise RuntimeError("ninja is not available (pip install ninja)")
        return cpp_extension.load(
            name=name,
            sources=[str(CSRC / s) for s in SOURCES],
            extra_cflags=list(CFLAGS),
            extra_ldflags=["-fopenmp"],
            is_python_module=False,
            verbose=verbose,
        )


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    p, i, n = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int
    for suffix in DTYPES.values():
        getattr(lib, f"attnlab_principled_fwd_{suffix}").argtypes = [p] * 11 + [i] * 10 + [n, i, i, n]
        getattr(lib, f"attnlab_principled_bwd_{suffix}").argtypes = [p] * 21 + [i] * 10 + [n, i, i, n]
        getattr(lib, f"attnlab_gla_fwd_{suffix}").argtypes = [p] * 8 + [i] * 6 + [n]
        getattr(lib, f"attnlab_gla_bwd_{suffix}").argtypes = [p] * 14 + [i] * 6 + [n]
        getattr(lib, f"attnlab_window_select_{suffix}").argtypes = [p] * 5 + [i] * 6 + [n]
        getattr(lib, f"attnlab_window_fwd_{suffix}").argtypes = [p] * 11 + [i] * 6 + [n, n]
        getattr(lib, f"attnlab_window_bwd_{suffix}").argtypes = [p] * 18 + [i] * 6 + [n, n]
    return lib


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (disabled, or unavailable: then one warning says why)."""
    global _lib, _tried
    if os.environ.get("ATTNLAB_NO_EXT", "") not in ("", "0") or _off:
        return None
    if not _tried:
        with _lock:
            if not _tried:
                try:
                    _lib = _bind(ctypes.CDLL(build()))
                except Exception as err:  # any failure to build or load: the PyTorch paths still work
                    warnings.warn(
                        f"attnlab: compiled CPU kernels unavailable ({type(err).__name__}: {err}); "
                        "using the pure-PyTorch fast paths",
                        RuntimeWarning,
                        stacklevel=3,
                    )
                    _lib = None
                _tried = True
    return _lib


def usable(*tensors: torch.Tensor) -> bool:
    """True when the compiled kernels can take these tensors: CPU, float32/float64, kernels loaded."""
    t = tensors[0]
    if t.device.type != "cpu" or t.dtype not in DTYPES:
        return False
    return _loaded()


def _loaded() -> bool:
    """library() is not None. Under torch.compile the answer is read from this module's state, which
    dynamo guards on (loading takes a lock, which it cannot trace): kernels already loaded when a model
    is traced are used by the compiled graph; kernels not loaded yet are not loaded then, and the
    graph takes the pure-PyTorch fast paths. (Not `torch.compiler.assume_constant_result`: that
    decorator imports dynamo, two seconds at every `import attnlab`.)"""
    if torch.compiler.is_compiling():
        return _lib is not None and not _off
    return library() is not None


@contextmanager
def disabled():
    """Run the block with the pure-PyTorch fast paths (for comparisons and benchmarks)."""
    global _off
    _off += 1
    try:
        yield
    finally:
        _off -= 1


def call(name: str, dtype: torch.dtype, *args) -> None:
    """lib.<name>_<f32|f64>(*args): tensors go as data pointers, ints as int64. Uses the loaded
    library even inside `disabled()`: a backward pass follows the route its forward pass took."""
    fn = getattr(_lib, f"{name}_{DTYPES[dtype]}")
    fn(*(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in args))


def _no_autocast(fn):
    """The kernels get their operands in the work dtype; autocast must not recast anything around them."""
    def wrapped(ctx, *args):
        with torch.autocast("cpu", enabled=False):
            return fn(ctx, *args)
    return wrapped


# ------------------------------------------------------------------------------------------ principled

PRINCIPLED_BLOCK_Q = 128
PRINCIPLED_BLOCK_K = 128


# The kernels run as torch custom ops (torch.library): torch.compile keeps each as one opaque call in
# its graph, with the output shapes given by the fake implementations, instead of breaking the graph
# at the ctypes call.

@torch.library.custom_op("attnlab::principled_fwd", mutates_args=())
def _principled_fwd(q: torch.Tensor, k: torch.Tensor, qg: torch.Tensor, kg: torch.Tensor, v: torch.Tensor,
                    c: torch.Tensor, spb: torch.Tensor, gamma: torch.Tensor, causal: bool, block_q: int,
                    block_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, H, Tq, D = q.shape
    ok, w0, lse2 = q.new_empty(B, H, Tq, v.shape[3]), q.new_empty(B, H, Tq), q.new_empty(B, H, Tq)
    call("attnlab_principled_fwd", q.dtype, q, k, qg, kg, v, c, spb, gamma, ok, w0, lse2,
         *_principled_sizes(q, k, qg, kg, v), int(causal), block_q, block_k, torch.get_num_threads())
    return ok, w0, lse2


@_principled_fwd.register_fake
def _(q, k, qg, kg, v, c, spb, gamma, causal, block_q, block_k):
    B, H, Tq, _ = q.shape
    return q.new_empty(B, H, Tq, v.shape[3]), q.new_empty(B, H, Tq), q.new_empty(B, H, Tq)


@torch.library.custom_op("attnlab::principled_bwd", mutates_args=())
def _principled_bwd(q: torch.Tensor, k: torch.Tensor, qg: torch.Tensor, kg: torch.Tensor, v: torch.Tensor,
                    c: torch.Tensor, spb: torch.Tensor, gamma: torch.Tensor, ok: torch.Tensor, w0: torch.Tensor,
                    lse2: torch.Tensor, d_ok: torch.Tensor, d_w0: torch.Tensor, causal: bool, block_q: int,
                    block_k: int) -> list[torch.Tensor]:
    dq, dqg, dk, dkg, dv, dc, dspb, dgamma = _principled_grads_like(q, k, qg, kg, v, c)
    call("attnlab_principled_bwd", q.dtype, q, k, qg, kg, v, c, spb, gamma, ok, w0, lse2,
         d_ok.contiguous(), d_w0.contiguous(), dq, dk, dqg, dkg, dv, dc, dspb, dgamma,
         *_principled_sizes(q, k, qg, kg, v), int(causal), block_q, block_k, torch.get_num_threads())
    return [dq, dk, dqg, dkg, dv, dc, dspb, dgamma]


@_principled_bwd.register_fake
def _(q, k, qg, kg, v, c, spb, gamma, ok, w0, lse2, d_ok, d_w0, causal, block_q, block_k):
    return list(_principled_grads_like(q, k, qg, kg, v, c))


def _principled_sizes(q, k, qg, kg, v) -> tuple[int, ...]:
    B, H, Tq, D = q.shape
    return B, H, k.shape[1], kg.shape[1], v.shape[1], Tq, k.shape[2], D, qg.shape[3], v.shape[3]


def _principled_grads_like(q, k, qg, kg, v, c):
    """Gradient buffers: k, kg, v per query head (B, H, Tk, E); the caller sums them to groups."""
    B, H, _, _ = q.shape
    Tk = k.shape[2]
    dq, dqg = torch.empty_like(q), torch.empty_like(qg)
    dk, dkg, dv = q.new_empty(B, H, Tk, k.shape[3]), q.new_empty(B, H, Tk, kg.shape[3]), q.new_empty(B, H, Tk, v.shape[3])
    return dq, dqg, dk, dkg, dv, torch.empty_like(c), torch.empty_like(c), torch.empty_like(c)


class _Principled(torch.autograd.Function):
    """csrc/principled.cpp on q (B, H, Tq, D), k (B, G, Tk, D), qg (B, H, Tq, Dg), kg (B, Gg, Tk, Dg),
    v (B, Gv, Tk, Dv) and per-query c, softplus(beta), gamma (B, H, Tq). Returns the key readout
    sum_j w_j v_j (B, H, Tq, Dv) and the ground weight w0 (B, H, Tq)."""

    @staticmethod
    @_no_autocast
    def forward(ctx, q, k, qg, kg, v, c, spb, gamma, causal, block_q, block_k):
        ok, w0, lse2 = _principled_fwd(q, k, qg, kg, v, c, spb, gamma, causal, block_q, block_k)
        ctx.flags = (causal, block_q, block_k)
        ctx.groups = (k.shape[1], kg.shape[1], v.shape[1])
        ctx.save_for_backward(q, k, qg, kg, v, c, spb, gamma, ok, w0, lse2)
        return ok, w0

    @staticmethod
    @torch.autograd.function.once_differentiable
    @_no_autocast
    def backward(ctx, d_ok, d_w0):
        saved = ctx.saved_tensors
        dq, dk, dqg, dkg, dv, dc, dspb, dgamma = _principled_bwd(*saved, d_ok, d_w0, *ctx.flags)
        G, Gg, Gv = ctx.groups
        dk, dkg, dv = (_group_sum(x, n) for x, n in ((dk, G), (dkg, Gg), (dv, Gv)))
        return dq, dk, dqg, dkg, dv, dc, dspb, dgamma, None, None, None


def _group_sum(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, H, T, E) per query head -> (B, G, T, E): head h's gradient goes to group h // (H / G)."""
    B, H, T, E = x.shape
    return x if groups == H else x.view(B, groups, H // groups, T, E).sum(2)


def principled(q, k, qg, kg, v, c, spb, gamma, causal: bool, block_q: int | None, block_k: int | None):
    """Fused principled attention on checked inputs of one dtype (grouped k, kg, v are read in place).
    c, spb, gamma: broadcastable to (B, H, Tq). Returns (key readout (B, H, Tq, Dv), w0 (B, H, Tq))."""
    B, H, Tq, _ = q.shape
    rows = [x.expand(B, H, Tq).contiguous() for x in (c, spb, gamma)]
    blocks = (min(block_q or PRINCIPLED_BLOCK_Q, Tq), min(block_k or PRINCIPLED_BLOCK_K, k.shape[2]))  # tile buffers
    return _Principled.apply(*(x.contiguous() for x in (q, k, qg, kg, v)), *rows, causal, *blocks)


# ------------------------------------------------------------------------------------------ gla

GLA_SUB_CHUNK = 16


@torch.library.custom_op("attnlab::gla_fwd", mutates_args=())
def _gla_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, s0: torch.Tensor,
             chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """o (B, H, T, V) and the states (B, H, N + 1, K, V): the entry state of every chunk, then the final state."""
    B, H, T, K = q.shape
    V, N = v.shape[3], -(-T // chunk)
    o, states = q.new_empty(B, H, T, V), q.new_empty(B, H, N + 1, K, V)
    g = q.new_empty(B, H, N, K)
    call("attnlab_gla_fwd", q.dtype, q, k, v, a, s0, o, states, g, *_gla_sizes(q, v, chunk), torch.get_num_threads())
    return o, states


@_gla_fwd.register_fake
def _(q, k, v, a, s0, chunk):
    B, H, T, K = q.shape
    return q.new_empty(B, H, T, v.shape[3]), q.new_empty(B, H, -(-T // chunk) + 1, K, v.shape[3])


@torch.library.custom_op("attnlab::gla_bwd", mutates_args=())
def _gla_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, states: torch.Tensor,
             d_o: torch.Tensor, d_final: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    dq, dk, dv, da = (torch.empty_like(x) for x in (q, k, v, a))
    ds0, dstates = torch.empty_like(states[:, :, 0]), torch.empty_like(states)
    B, H, N1 = states.shape[:3]
    g = q.new_empty(B, H, N1 - 1, q.shape[3])
    call("attnlab_gla_bwd", q.dtype, q, k, v, a, states, d_o.contiguous(), d_final.contiguous(), dq, dk, dv, da,
         ds0, dstates, g, *_gla_sizes(q, v, chunk), torch.get_num_threads())
    return [dq, dk, dv, da, ds0]


@_gla_bwd.register_fake
def _(q, k, v, a, states, d_o, d_final, chunk):
    return [torch.empty_like(x) for x in (q, k, v, a)] + [states.new_empty(states[:, :, 0].shape)]


def _gla_sizes(q, v, chunk: int) -> tuple[int, ...]:
    B, H, T, K = q.shape
    return B * H, T, K, v.shape[3], chunk, min(GLA_SUB_CHUNK, chunk)


class _GLA(torch.autograd.Function):
    """csrc/gla.cpp: q (pre-scaled), k (B, H, T, K), v (B, H, T, V), log-decay a (B, H, T, K),
    initial state (B, H, K, V). Returns o (B, H, T, V) and the final state (B, H, K, V)."""

    @staticmethod
    @_no_autocast
    def forward(ctx, q, k, v, a, s0, chunk):
        o, states = _gla_fwd(q, k, v, a, s0, chunk)
        ctx.chunk = chunk
        ctx.save_for_backward(q, k, v, a, states)
        return o, states[:, :, -1].clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    @_no_autocast
    def backward(ctx, d_o, d_final):
        q, k, v, a, states = ctx.saved_tensors
        dq, dk, dv, da, ds0 = _gla_bwd(q, k, v, a, states, d_o, d_final, ctx.chunk)
        return dq, dk, dv, da, ds0, None


def gla_chunked(q, k, v, log_decay, state, chunk_size: int):
    """GLA on checked inputs of one dtype (q already scaled): returns o (B, H, T, V) and the final state."""
    return _GLA.apply(*(x.contiguous() for x in (q, k, v, log_decay, state)), min(chunk_size, q.shape[2]))
