"""Machine code of attnlab's Triton kernels for an H100 (sm_90a), built on the CPU: no GPU needed.

    python benchmarks/kernel_sass.py                      # every case, both variants -> results/kernel_sass.json
    python benchmarks/kernel_sass.py --baseline 1378d2e   # and the code of that commit ("baseline" rows)
    python benchmarks/kernel_sass.py --cases hybrid-cauchy/fwd --variants fast --out -   # JSON on stdout

(results/kernel_sass.json was written with --baseline 1378d2e: the kernels before the scores in units of
the product's scale, the key-major dk/dv kernel, the 64 + 16 split of GOAT's product and principled's
two-part readout.)

Each case is one kernel as its launcher starts it on a GPU for bf16 inputs, D = Dv = 64 (GOAT: D = 80,
its 64-wide head and 16 prior columns, with the key-only bias; principled: gate width 16), causal, no
packed documents, with the launchers' GPU tiles (`triton_op._blocks`, `triton_selected._tiles`,
`principled.triton_kernel._blocks`); pointers and the integer sizes carry Triton's divisibility-by-16
specialisation, as at B = 4, H = 16, T = 8K. Triton's compiler lowers it for GPUTarget("cuda", 90, 32)
(source -> TTIR -> TTGIR -> LLVM -> PTX, as tests/test_triton_compile.py does for the first two
stages), then the `ptxas` Triton ships (or TRITON_PTXAS_PATH, or one on PATH) assembles it with the
flags Triton's own build uses (-lineinfo -v --gpu-name=sm_90a) and `cuobjdump -sass` disassembles it.

Two variants per case: "accurate" (the kernels' FAST switch off, as launched with
ATTNLAB_TRITON_FAST_MATH=0 or under the interpreter: libdevice's log2f, div.full.f32) and "fast" (the
switch as `triton_kernel.fast_math()` sets it on a GPU: PTX lg2.approx / rcp.approx for the Cauchy
kernel's log and division; the other kernels do not read the switch, so their two rows agree).

Per kernel: SASS instructions (NOP padding left out), the instructions of each loop (a backward branch
and its target; `main_loop` is the key- or query-tile loop that takes whole, unmasked tiles: most of
the work at long T), the scores each thread computes per trip of it (`scores_per_thread`: tiles differ
between kernels and versions, so `main_loop_per_score` compares them), ptxas's registers and spill
bytes, Triton's shared memory, local-memory instructions (STL / LDL), MUFU instructions by function,
libdevice log2f bodies still inlined (each carries one FFMA by its leading polynomial coefficient,
-0.16845393 = 0xbe2c7f30), FFMA / FMUL counts, HGMMA (wgmma) instructions, and the PTX's log /
division forms.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

if __name__ == "__main__":  # compile, not interpret (before Triton is imported); importing this module sets nothing
    os.environ["TRITON_INTERPRET"] = "0"
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))
sys.path.insert(0, str(ROOT / "benchmarks"))

from kernel_cases import CASES, DEFAULT_CASES, _has_kernel, _kernel_module, _launch  # noqa: E402, F401 (tests read them here)

OUT = ROOT / "benchmarks" / "results" / "kernel_sass.json"
ARCH = 90  # sm_90a: ptxas's name for an H100 with wgmma
VARIANTS = ("accurate", "fast")
LIBDEVICE_LOG2F = "-0.16845393"  # libdevice log2f's leading polynomial coefficient (FFMA immediate)


def find_tool(name: str) -> str | None:
    """Triton's own copy of an NVIDIA tool (triton/backends/nvidia/bin), TRITON_<NAME>_PATH, or one on PATH."""
    env = os.environ.get(f"TRITON_{name.upper()}_PATH")
    if env and Path(env).is_file():
        return env
    try:
        import importlib.util

        spec = importlib.util.find_spec("triton")
        if spec and spec.origin:
            p = Path(spec.origin).parent / "backends" / "nvidia" / "bin" / name
            if p.is_file():
                return str(p)
    except ImportError:
        pass
    return shutil.which(name)


def build_ptx(case: str, fast: bool) -> tuple[str, dict]:
    """The case's PTX for sm_90a, through Triton's stages (no GPU, no cache)."""
    from triton._C.libtriton import ir
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend

    fn, sig, cons, attrs, warps, stages_n, FAST, per_thread = _launch(case, fast)
    target = GPUTarget("cuda", ARCH, 32)
    backend = make_backend(target)
    src = ASTSource(fn, sig, cons, attrs)
    options = backend.parse_options(dict(num_warps=warps, num_stages=stages_n))
    stages: dict = {}
    backend.add_stages(stages, options, src.language)
    ctx = ir.context()
    ir.load_dialects(ctx)
    backend.load_dialects(ctx)
    mod = src.make_ir(target, options, backend.get_codegen_implementation(options), backend.get_module_map(), ctx)
    meta: dict = {}
    for stage in ("ttir", "ttgir", "llir", "ptx"):
        mod = stages[stage](mod, meta)
    return mod, dict(num_warps=warps, num_stages=stages_n, FAST=FAST, scores_per_thread=per_thread,
                     shared_bytes=meta.get("shared"))


_INSTR = re.compile(r"/\*([0-9a-f]{4,})\*/\s+(@!?U?P[T0-9]+\s+)?([A-Z][A-Z0-9_.]*)([^;]*);")


def parse_sass(sass: str) -> list[tuple[int, str, str, str]]:
    """(address, predicate, opcode, operands) of each instruction of a cuobjdump -sass listing."""
    return [(int(a, 16), (p or "").strip(), op, rest.strip()) for a, p, op, rest in _INSTR.findall(sass)]


def loops(instrs) -> list[dict]:
    """Each backward branch's loop: first and last address and its instructions (NOPs left out)."""
    out = []
    for addr, _, op, rest in instrs:
        if op.split(".")[0] != "BRA":
            continue
        m = re.match(r"(?:!?U?P\w+,\s*)?(0x[0-9a-f]+)", rest)
        if not m:
            continue
        target = int(m.group(1), 16)
        if target < addr:  # (BRA to itself is the exit spin, not a loop)
            body = [i for i in instrs if target <= i[0] <= addr and i[2] != "NOP"]
            out.append(dict(start=hex(target), end=hex(addr), instructions=len(body), stats=_stats(body)))
    return out


def _stats(instrs) -> dict:
    ops = [op for _, _, op, _ in instrs]
    mufu = {}
    for op in ops:
        if op.startswith("MUFU."):
            mufu[op[5:]] = mufu.get(op[5:], 0) + 1
    return dict(
        mufu=mufu,
        ffma=sum(op.split(".")[0] == "FFMA" for op in ops),
        fmul=sum(op.split(".")[0] == "FMUL" for op in ops),
        libdevice_log2f=sum(op.startswith("FFMA") and LIBDEVICE_LOG2F in rest for _, _, op, rest in instrs),
        hgmma=sum(op.startswith("HGMMA") for op in ops),
        fchk=sum(op.startswith("FCHK") for op in ops),  # the accurate division's range check (its slow path)
        calls=sum(op.split(".")[0] == "CALL" for op in ops),  # a subroutine (the slow division, a library call)
        local_stores=sum(op.startswith("STL") for op in ops),
        local_loads=sum(op.startswith("LDL") for op in ops),
    )


def analyse(case: str, fast: bool, ptxas: str, cuobjdump: str) -> dict:
    """Compile one case to SASS and read it."""
    t0 = time.perf_counter()
    ptx, meta = build_ptx(case, fast)
    t_ptx = time.perf_counter() - t0
    with tempfile.TemporaryDirectory() as tmp:
        src, binary = Path(tmp) / "k.ptx", Path(tmp) / "k.cubin"
        src.write_text(ptx)
        p = subprocess.run([ptxas, "-lineinfo", "-v", f"--gpu-name=sm_{ARCH}a", str(src), "-o", str(binary)],
                           capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"ptxas failed on {case}:\n{p.stderr[-3000:]}")
        log = p.stdout + p.stderr
        sass = subprocess.run([cuobjdump, "-sass", str(binary)], capture_output=True, text=True, check=True).stdout
    instrs = parse_sass(sass)
    real = [i for i in instrs if i[2] != "NOP"]
    regs = re.search(r"Used (\d+) registers", log)
    spill = re.search(r"(\d+) bytes spill stores, (\d+) bytes spill loads", log)
    found = loops(instrs)
    main, expect = CASES[case][4], CASES[case][5]  # the main loop's index, if the kernel has the loops expected
    named = len(found) in expect
    loop = found[main]["stats"] if named else None
    ptx_ops = {k: len(re.findall(pat, ptx)) for k, pat in (
        ("lg2.approx", r"\blg2\.approx\S*"), ("rcp.approx", r"\brcp\.approx\S*"),
        ("div.full.f32", r"\bdiv\.full\.f32"), ("div.rn.f32", r"\bdiv\.rn\S*\.f32"),
        ("wgmma.mma_async", r"\bwgmma\.mma_async"))}
    row = dict(
        case=case, variant="fast" if fast else "accurate", FAST=meta["FAST"], kernel=CASES[case][1],
        num_warps=meta["num_warps"], num_stages=meta["num_stages"],
        sass_instructions=len(real),
        main_loop_instructions=found[main]["instructions"] if named else None,
        scores_per_thread=meta["scores_per_thread"],
        main_loop_per_score=round(found[main]["instructions"] / meta["scores_per_thread"], 2) if named else None,
        loop_instructions=[lp["instructions"] for lp in found],
        registers=int(regs.group(1)) if regs else None,
        shared_bytes=meta["shared_bytes"],  # Triton's shared memory per program (the H100 allows 227 KB)
        spill_store_bytes=int(spill.group(1)) if spill else None,
        spill_load_bytes=int(spill.group(2)) if spill else None,
        **_stats(real),
        mufu_lg2_present=any(op == "MUFU.LG2" for _, _, op, _ in real),
        hgmma_present=any(op.startswith("HGMMA") for _, _, op, _ in real),
        # the per-score log in the hot loop (the kernels' epilogue keeps one accurate log2 per row, of the sum)
        main_loop_libdevice_log=bool(loop["libdevice_log2f"]) if loop else None,
        main_loop_mufu_lg2=bool(loop["mufu"].get("LG2")) if loop else None,
        main_loop=loop,
        ptx=ptx_ops,
        compile_s=round(t_ptx, 2),
    )
    return row


def _summary(rows: list[dict]) -> list[dict]:
    """Per case, each measure over the variants present (baseline, accurate, fast)."""
    out = []
    by = {(r["case"], r["variant"]): r for r in rows}
    for case in dict.fromkeys(r["case"] for r in rows):
        have = [v for v in ("baseline", "baseline-fast", *VARIANTS) if (case, v) in by]
        if len(have) > 1:
            out.append(dict(case=case, **{f"{k} ({' -> '.join(have)})": [by[case, v].get(k) for v in have] for k in (
                "sass_instructions", "main_loop_instructions", "scores_per_thread", "main_loop_per_score",
                "registers", "spill_store_bytes", "spill_load_bytes", "shared_bytes", "hgmma")}))
    return out


def baseline_rows(rev: str, cases: list[str]) -> list[dict]:
    """The cases compiled from the src/ of git revision `rev` (read with git archive; the checkout is not
    touched), in a child process: variants "baseline" (its FAST switch off, or code from before it) and
    "baseline-fast" (as that code ran on a GPU)."""
    commit = subprocess.run(["git", "-C", str(ROOT), "rev-parse", "--short", rev], capture_output=True, text=True,
                            check=True).stdout.strip()
    with tempfile.TemporaryDirectory() as tmp:
        tar = subprocess.run(["git", "-C", str(ROOT), "archive", commit, "src"], capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", tmp], input=tar, check=True)
        p = subprocess.run([sys.executable, __file__, "--src", str(Path(tmp) / "src"), "--cases", ",".join(cases),
                            "--variants", "accurate,fast", "--out", "-"], capture_output=True, text=True)
        if p.returncode:
            raise RuntimeError(f"baseline {rev} failed:\n{p.stderr[-3000:]}")
    rows = json.loads(p.stdout)["rows"]
    for r in rows:
        r["variant"] = "baseline" if r["variant"] == "accurate" else "baseline-fast"
        r["source"] = f"git {commit} ({rev})"
    return rows


def _print(r: dict, quiet: bool) -> None:
    print(f"{r['case']:24s} {r['variant']:13s} sass {r['sass_instructions']:5d}  main loop "
          f"{r['main_loop_instructions']!s:>5s} ({r.get('main_loop_per_score')!s:>5s} / score)  regs {r['registers']}  "
          f"spill {r['spill_store_bytes']}/"
          f"{r['spill_load_bytes']} B  MUFU {r['mufu']}  libdevice log2f {r['libdevice_log2f']} (main loop "
          f"{(r['main_loop'] or {}).get('libdevice_log2f')})  HGMMA {r['hgmma']}",
          file=sys.stderr if quiet else sys.stdout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--cases", default=",".join(DEFAULT_CASES), help=f"comma-separated, of {', '.join(CASES)}")
    ap.add_argument("--variants", default=",".join(VARIANTS), help="accurate, fast or both")
    ap.add_argument("--out", default=str(OUT), help="JSON path, or - for stdout only")
    ap.add_argument("--baseline", metavar="REV", help="also compile the cases from git revision REV's src/ "
                    "(variant 'baseline': the code before the FAST switch, e.g. the commit before it)")
    ap.add_argument("--src", help=argparse.SUPPRESS)  # import attnlab from here (the baseline's child process)
    args = ap.parse_args(argv)
    if args.src:
        sys.path.insert(0, args.src)
    cases = [c for c in args.cases.split(",") if c]
    variants = [v for v in args.variants.split(",") if v]
    bad = [c for c in cases if c not in CASES] + [v for v in variants if v not in VARIANTS]
    if bad:
        ap.error(f"unknown: {bad}")
    ptxas, cuobjdump = find_tool("ptxas"), find_tool("cuobjdump")
    if not ptxas or not cuobjdump:
        print(f"needs ptxas and cuobjdump (found {ptxas}, {cuobjdump})", file=sys.stderr)
        return 2
    rows = baseline_rows(args.baseline, cases) if args.baseline else []
    for r in rows:
        _print(r, args.out == "-")
    for case in cases:
        if args.src and not _has_kernel(case):  # a baseline predating the kernel
            continue
        for v in variants:
            r = analyse(case, v == "fast", ptxas, cuobjdump)
            rows.append(r)
            _print(r, args.out == "-")
    ver = [ln for ln in subprocess.run([ptxas, "--version"], capture_output=True, text=True).stdout.splitlines()
           if "release" in ln]
    import triton

    out = dict(
        target=f"sm_{ARCH}a (GPUTarget('cuda', {ARCH}, 32)), compiled on the CPU", triton=triton.__version__,
        ptxas=(ver or ["?"])[0], ptxas_path=ptxas,
        shape="bf16, D = Dv = 64 (GOAT: D = 80 with its key-only bias; principled: gate width 16), causal, no "
              "documents, the launchers' GPU tiles; divisibility-16 args",
        rows=rows, summary=_summary(rows))
    if args.out == "-":
        print(json.dumps(out, indent=1))
    else:
        from _interleaved import write_json

        write_json(args.out, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
