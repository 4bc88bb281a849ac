"""The Cauchy kernel's machine code for an H100 (sm_90a), built on the CPU: no GPU needed.

`benchmarks/kernel_sass.py` lowers the scalar family's Triton kernels as the launchers build them on a
GPU (bf16, D = Dv = 64, causal, the GPU tiles) through Triton's compiler for GPUTarget("cuda", 90, 32),
assembles the PTX with the ptxas Triton ships and disassembles it with cuobjdump. It runs in a child
process (Triton compiles only outside the interpreter that tests/conftest.py turns on). Skipped when
ptxas or cuobjdump is not found.

Budgets, from the measurements in benchmarks/results/kernel_sass.json (Triton 3.6.0, its ptxas 12.8):
the Cauchy forward with the accurate log (libdevice log2f, ~25 instructions per score) had 4,100 SASS
instructions, 1.73x the Gaussian forward's 2,376, and 1,420 in its key-tile loop, 2.6x the Gaussian's
555; with lg2.approx (one MUFU.LG2 per score) 2,440 (1.03x) and 587 (1.06x). The test allows 1.5x for
the whole kernel and 1.25x for the loop: a return of the libdevice routine fails both.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "kernel_sass.py"


def _tools_or_skip() -> None:
    pytest.importorskip("triton")
    pytest.importorskip("triton.backends.nvidia")
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from kernel_sass import find_tool
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    for tool in ("ptxas", "cuobjdump"):
        if find_tool(tool) is None:
            pytest.skip(f"no {tool} (neither Triton's triton/backends/nvidia/bin nor TRITON_{tool.upper()}_PATH "
                        f"nor PATH has one): cannot assemble sm_90a code")


def _sass(cases: list[str], variants: str = "fast") -> dict:
    env = {**os.environ, "TRITON_INTERPRET": "0", "PYTHONPATH": os.pathsep.join(
        [str(ROOT / "src"), *filter(None, [os.environ.get("PYTHONPATH")])])}
    p = subprocess.run([sys.executable, str(SCRIPT), "--cases", ",".join(cases), "--variants", variants, "--out", "-"],
                       capture_output=True, text=True, env=env, timeout=300)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-6000:]
    return {(r["case"], r["variant"]): r for r in json.loads(p.stdout)["rows"]}


def test_cauchy_forward_uses_the_hardware_log():
    """The bf16 Cauchy forward as launched on a GPU: its scores' log is MUFU.LG2 (no libdevice log2f
    left in the key-tile loop), nothing spills to local memory, wgmma does the products, and its
    instruction counts stay within the budgets of the module docstring against the Gaussian forward."""
    _tools_or_skip()
    rows = _sass(["hybrid-cauchy/fwd", "hybrid-gaussian/fwd"])
    c, g = rows["hybrid-cauchy/fwd", "fast"], rows["hybrid-gaussian/fwd", "fast"]
    assert c["FAST"] is True and c["ptx"]["lg2.approx"] > 0
    assert c["mufu_lg2_present"] and c["main_loop_mufu_lg2"], c["mufu"]
    assert c["main_loop_libdevice_log"] is False, c["main_loop"]
    assert c["spill_store_bytes"] == 0 and c["spill_load_bytes"] == 0 and c["local_stores"] == c["local_loads"] == 0
    assert c["hgmma_present"]
    assert c["sass_instructions"] < 1.5 * g["sass_instructions"], (c["sass_instructions"], g["sass_instructions"])
    assert c["main_loop_instructions"] < 1.25 * g["main_loop_instructions"], (c["main_loop_instructions"],
                                                                           g["main_loop_instructions"])


def test_cauchy_backward_lowers_with_the_hardware_log_and_reciprocal():
    """Both bf16 Cauchy backward kernels assemble for sm_90a with the inline PTX (tests/test_triton_compile.py
    records launches under the interpreter, where the switch is off): lg2.approx and rcp.approx in the
    PTX, MUFU.LG2 and no libdevice log2f in the main loop, no accurate division left."""
    _tools_or_skip()
    rows = _sass(["hybrid-cauchy/bwd_kv", "hybrid-cauchy/bwd_q"])
    for case in ("hybrid-cauchy/bwd_kv", "hybrid-cauchy/bwd_q"):
        r = rows[case, "fast"]
        assert r["ptx"]["lg2.approx"] > 0 and r["ptx"]["rcp.approx"] > 0, (case, r["ptx"])
        assert r["ptx"]["div.full.f32"] == r["ptx"]["div.rn.f32"] == 0, (case, r["ptx"])
        assert r["main_loop_mufu_lg2"] and r["main_loop_libdevice_log"] is False, (case, r["main_loop"])
        assert r["hgmma_present"], case
