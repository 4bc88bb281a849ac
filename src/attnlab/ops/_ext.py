"""The build and load of attnlab's compiled CPU kernels (ops/csrc/): built on first use, cached, called
through ctypes.

The kernels are C++ with OpenMP and a plain C interface; `torch.utils.cpp_extension.load` builds
them once per machine (they include no torch header) into torch's extension cache
(TORCH_EXTENSIONS_DIR, default ~/.cache/torch_extensions), and later processes load the cached
library. They call the BLAS that libtorch carries and run on torch's OpenMP threads
(`torch.get_num_threads()`).

Without a C++ compiler or ninja, or when the build fails, the ops fall back to their pure-PyTorch
fast paths with one warning. ``ATTNLAB_NO_EXT=1`` in the environment (read at each call) or the
`disabled()` context manager selects the fallback on purpose.

This module knows no op family: it builds and loads the library and calls a C function by name
(`call`). Each family declares the C signatures of its kernels (`declare`) and binds them as torch
custom ops with autograd beside its other paths (`attnlab.ops.principled.cpu`, `attnlab.ops.gla.cpu`,
`attnlab.ops.scalar.window_cpu`). Callers pass contiguous CPU tensors of one dtype (float32 or
float64) whose shapes they have checked; the bindings only compute sizes and pointers.
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
PTR, I64, INT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_int  # the kernels' argument types

_lock = threading.Lock()
_lib: ctypes.CDLL | None = None
_tried = False
_off = 0  # depth of `disabled()` blocks
_signatures: dict[str, list] = {}  # C function name (no dtype suffix) -> argtypes, from `declare`


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


STALE_LOCK_S = 900  # a build lock older than this (s) was left by a killed process


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


def declare(name: str, argtypes: list) -> None:
    """The C signature of `name` (`name_f32` and `name_f64` in the library): its argument types, of
    PTR (a tensor's data pointer), I64 and INT. An op family declares its kernels when it is imported;
    `call` needs the declaration (without it ctypes would pass every int as a 32-bit int)."""
    with _lock:
        _signatures[name] = list(argtypes)
        if _lib is not None:
            _set_argtypes(_lib, name, _signatures[name])


def _set_argtypes(lib: ctypes.CDLL, name: str, argtypes: list) -> None:
    for suffix in DTYPES.values():
        getattr(lib, f"{name}_{suffix}").argtypes = argtypes


def _bind(lib: ctypes.CDLL) -> ctypes.CDLL:
    """The loaded library with every signature declared so far set (later ones are set by `declare`)."""
    for name, argtypes in _signatures.items():
        _set_argtypes(lib, name, argtypes)
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
    return loaded()


def loaded() -> bool:
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


def no_autocast(fn):
    """The kernels get their operands in the work dtype; autocast must not recast anything around them."""
    def wrapped(ctx, *args):
        with torch.autocast("cpu", enabled=False):
            return fn(ctx, *args)
    return wrapped
