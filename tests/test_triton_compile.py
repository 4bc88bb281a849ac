"""Every Triton kernel of attnlab lowers for a Hopper GPU (sm_90), checked on the CPU.

The interpreter tests (TRITON_INTERPRET=1) run each kernel's Python body, which accepts code the
compiler refuses: a name rebound to a tensor of another shape inside a loop, say, ran under the
interpreter and failed to compile on the first H100 it met. Here each kernel launch of the GPU paths
(both dtypes, forward and backward, causal or not, packed documents) is recorded under the
interpreter, then compiled in a fresh process without it through Triton's front end and its GPU
layout passes (source -> TTIR -> TTGIR for CUDA sm_90). No GPU is needed for that; the later stages
(LLVM, PTX) are left to the GPU check, where they cost nothing extra.

Recording and lowering take about 30 s; a passing run is remembered in $ATTNLAB_CACHE (or
~/.cache/attnlab)/triton_lowered/, keyed by a hash of everything its outcome depends on (the ops'
sources and attnlab's top-level modules, benchmarks/gpu_paths.py, this file, the Triton, torch and
Python versions), so a rerun after an unrelated change costs nothing, as Triton's own cache does.

    python tests/test_triton_compile.py LAUNCHES.json   # the compile half, on its own
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
STAGES = ("ttir", "ttgir")  # front end + GPU layout passes; LLVM/PTX are the GPU check's
BF16 = ("hybrid-cauchy/triton", "goat/triton", "principled/triton", "hybrid-cauchy-window16+32/triton")


def _type(v) -> str:
    if isinstance(v, torch.Tensor):
        return "*" + {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.float64: "fp64",
                      torch.int32: "i32", torch.int64: "i64", torch.int8: "i8", torch.uint8: "u8",
                      torch.bool: "i1"}[v.dtype]
    if isinstance(v, bool):
        return "i1"
    if isinstance(v, int):
        return "i64" if abs(v) >= 2 ** 31 else "i32"
    if isinstance(v, float):
        return "fp32"
    if v is None:
        return "constexpr"
    raise TypeError(f"argument of type {type(v).__name__}")


def record_launches(calls) -> list[dict]:
    """Run `calls()` under the interpreter and return each distinct launch: kernel (module, name), the
    type of each runtime argument and the value of each constexpr."""
    from triton.runtime import interpreter

    seen: dict[str, dict] = {}
    real = interpreter.InterpretedFunction.run

    def run(self, *args, grid, warmup, **kwargs):
        params = inspect.signature(self.fn).parameters
        bound = {**dict(zip(params, args)), **kwargs}
        sig, cons = {}, {}
        for n, p in params.items():
            v = bound.get(n)
            if "constexpr" in str(p.annotation) or v is None:
                sig[n], cons[n] = "constexpr", getattr(v, "value", v)
            else:
                sig[n] = _type(v)
        row = {"module": self.fn.__module__, "name": self.fn.__name__, "signature": sig, "constexprs": cons}
        seen[json.dumps(row, default=str)] = row
        return real(self, *args, grid=grid, warmup=warmup, **kwargs)

    interpreter.InterpretedFunction.run = run
    try:
        calls()
    finally:
        interpreter.InterpretedFunction.run = real
    return list(seen.values())


def lower(launches: list[dict], arch: int = 90) -> list[str]:
    """Compile each launch for CUDA `arch` through STAGES (Triton must not be in interpreter mode);
    one message per launch that fails."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton._C.libtriton import ir

    target = GPUTarget("cuda", arch, 32)
    backend = make_backend(target)
    fails = []
    for r in launches:
        fn = getattr(importlib.import_module(r["module"]), r["name"])
        names = list(inspect.signature(fn.fn).parameters)
        cons = {(names.index(n),): v for n, v in r["constexprs"].items()}
        src = ASTSource(fn, {n: r["signature"][n] for n in names}, cons)
        options = backend.parse_options({})
        stages: dict = {}
        backend.add_stages(stages, options, src.language)
        ctx = ir.context()
        ir.load_dialects(ctx)
        backend.load_dialects(ctx)
        try:
            mod = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), ctx)
            meta: dict = {}
            for stage in STAGES:
                mod = stages[stage](mod, meta)
        except Exception as e:  # noqa: BLE001 - each failure is reported with its launch
            fails.append(f"{r['module']}.{r['name']} {r['constexprs']}: {str(e)[-1500:]}")
    return fails


def _gpu_path_launches():
    """Forward and backward of each Triton path of benchmarks/gpu_paths.py in float32 (and bf16 for one
    path of each kernel body), and the variants its inputs do not reach: not causal, packed documents,
    the ground output."""
    sys.path.insert(0, str(ROOT / "benchmarks"))
    from gpu_paths import NEEDS_CUDA, PATHS, fwd_bwd, make

    from attnlab.ops import hybrid_attention, principled_attention, scalar_attention
    from attnlab.ops.scalar.windowed import windowed_attention

    cpu = torch.device("cpu")
    for name in (n for n in PATHS if n.endswith("/triton") and n not in NEEDS_CUDA):
        for dtype in (torch.float32, torch.bfloat16)[:2 if name in BF16 else 1]:
            fwd_bwd(name, "fast", make(name, 1, 2, 40, 64, dtype, cpu))
    docs = torch.tensor([[0] * 17 + [1] * 23])
    for kernel in ("gaussian", "cauchy"):
        t = make(f"hybrid-{kernel}/triton", 1, 2, 40, 64, torch.float32, cpu)
        for causal, d in ((False, None), (True, docs)):
            hybrid_attention(t["q"], t["k"], t["v"], t["qs"], t["ks"], t["tau"], impl="triton", kernel=kernel,
                             scalar_scale=t["lam"], causal=causal, docs=d).sum().backward()
            if kernel == "cauchy":
                scalar_attention(t["qs"], t["ks"], t["v"], t["tau"], impl="triton", kernel=kernel, causal=causal,
                                 docs=d).sum().backward()
        windowed_attention(t["qs"], t["ks"], t["v"], t["tau"], 8, local=4, impl="triton",
                           kernel=kernel).sum().backward()  # scalar heads through the window
    t = make("principled/triton", 1, 2, 40, 64, torch.float32, cpu)
    for causal, d in ((False, None), (True, docs)):
        o, w0 = principled_attention(t["q"], t["k"], t["qg"], t["kg"], t["v"], alpha=t["alpha"], beta=t["beta"],
                                     gamma=t["gamma"], impl="triton", causal=causal, docs=d, return_ground=True)
        (o.sum() + w0.sum()).backward()


def _key() -> str:
    """A hash of everything a lowering's outcome depends on (module docstring)."""
    import triton

    src = ROOT / "src" / "attnlab"
    h = hashlib.sha256(f"{triton.__version__} {torch.__version__} {sys.version_info[:3]}".encode())
    for path in [*sorted(src.glob("*.py")), *sorted((src / "ops").rglob("*.py")), ROOT / "benchmarks" / "gpu_paths.py",
                 Path(__file__)]:
        h.update(str(path.relative_to(ROOT)).encode() + b"\0" + path.read_bytes())
    return h.hexdigest()[:20]


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the kernels compile for real in the cuda tests")
@pytest.mark.usefixtures("one_thread")
def test_every_kernel_lowers_for_sm90(tmp_path):
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    assert os.environ.get("TRITON_INTERPRET") == "1"  # tests/conftest.py, on a machine without CUDA
    from attnlab.data.cache import atomic_write_text, default_cache_dir

    passed = default_cache_dir() / "triton_lowered" / f"{_key()}.json"
    if passed.is_file():  # these very sources lowered before: nothing that decides the outcome changed
        assert json.loads(passed.read_text())["failed"] == 0
        return
    launches = record_launches(_gpu_path_launches)
    kernels = {(r["module"], r["name"]) for r in launches}
    assert {m for m, _ in kernels} >= {"attnlab.ops.scalar.triton_kernel", "attnlab.ops.principled.triton_kernel",
                                       "attnlab.ops.scalar.triton_selected"}, kernels
    path = tmp_path / "launches.json"
    path.write_text(json.dumps(launches, default=str))
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    p = subprocess.run([sys.executable, __file__, str(path)], capture_output=True, text=True, env=env, timeout=600)
    assert p.returncode == 0, p.stdout[-6000:] + p.stderr[-3000:]
    assert f"{len(launches)} launches lowered" in p.stdout, p.stdout
    passed.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(passed, json.dumps({"launches": len(launches), "failed": 0}) + "\n")


if __name__ == "__main__":
    launches = json.loads(Path(sys.argv[1]).read_text())
    failed = lower(launches)
    print("\n\n".join(failed))
    print(f"{len(launches) - len(failed)} launches lowered, {len(failed)} failed")
    sys.exit(1 if failed else 0)
