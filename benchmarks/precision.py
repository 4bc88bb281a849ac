"""Accuracy of the scalar and hybrid fast paths on keys far from zero with a small tau.

    .venv/bin/python benchmarks/precision.py

Keys |ks| ~ 10 with spread 0.5, each query near some key, tau = 0.01, T = 257 (B=2, H=4, D=16,
2 value groups): the expanded score terms 2 qs ks / tau and ks^2 / tau are ~1e4 while a row's
logits differ by O(1). For bf16 and fp32 inputs the fast path runs forward and backward with a
fixed cotangent; the error is the largest relative RMS over the output and every input gradient
against the naive formula in float64 on the same (rounded) inputs. "expanded_bf16" is the textbook
expansion without the shift, run by the fused kernel in bf16, for contrast.
Results go to benchmarks/results/precision.json.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
import torch.nn.functional as F

from attnlab.ops import hybrid_attention, scalar_attention
from attnlab.testing import rel_rms

B, H, G, T, D, TAU = 2, 4, 2, 257, 16, 0.01


def inputs(dtype, gen):
    ks = 10 + 0.5 * torch.randn(B, H, T, generator=gen)
    qs = ks[:, :, torch.randperm(T, generator=gen)] + 0.05 * torch.randn(B, H, T, generator=gen)
    q, k, v = (torch.randn(B, n, T, D, generator=gen) for n in (H, G, G))
    return {n: x.to(dtype) for n, x in dict(q=q, k=k, v=v, qs=qs, ks=ks).items()}


def run(op, a, impl):
    leaves = {n: x.detach().clone().requires_grad_(True) for n, x in a.items()}
    if op == "scalar":
        out = scalar_attention(leaves["qs"], leaves["ks"], leaves["v"], TAU, impl=impl)
        used = ("qs", "ks", "v")
    else:
        out = hybrid_attention(*(leaves[n] for n in ("q", "k", "v", "qs", "ks")), TAU, impl=impl)
        used = ("q", "k", "v", "qs", "ks")
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(cot.to(out.dtype))
    return [out] + [leaves[n].grad for n in used]


def expanded_bf16(a):
    qs, ks, v = a["qs"], a["ks"], a["v"].repeat_interleave(H // G, dim=1)
    qa = F.pad(torch.stack([2 * qs / TAU, -torch.ones_like(qs) / TAU], -1), (0, D - 2))
    ka = F.pad(torch.stack([ks, ks * ks], -1), (0, D - 2))
    return F.scaled_dot_product_attention(qa, ka, v, is_causal=True, scale=1.0)


def main() -> None:
    rows = {}
    for dtype in (torch.bfloat16, torch.float32):
        a = inputs(dtype, torch.Generator().manual_seed(0))
        for op in ("scalar", "hybrid"):
            fast = run(op, a, "fast")
            ref = run(op, {n: x.double() for n, x in a.items()}, "naive")
            rows[f"{op}_{str(dtype).split('.')[-1]}"] = max(rel_rms(x, y) for x, y in zip(fast, ref))
    a = inputs(torch.bfloat16, torch.Generator().manual_seed(0))
    ref = run("scalar", {n: x.double() for n, x in a.items()}, "naive")[0]
    rows["expanded_bf16"] = rel_rms(expanded_bf16(a), ref)
    print(f"{'case':<18} {'max rel RMS':>12}")
    for name, err in rows.items():
        print(f"{name:<18} {err:>12.2e}")
    out = Path(__file__).parent / "results" / "precision.json"
    out.write_text(json.dumps({"setup": dict(B=B, H=H, G=G, T=T, D=D, tau=TAU, key_scale=10, key_spread=0.5),
                               "max_rel_rms": rows, "torch": torch.__version__}, indent=1) + "\n")


if __name__ == "__main__":
    main()
