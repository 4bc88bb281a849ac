"""The scalar family's Triton kernel (attnlab.ops.scalar.triton_kernel) against the naive op in float64:
outputs and every gradient (q, k, v, qs, ks, tau, the gain), both kernels, scalar and hybrid heads,
awkward shapes, GQA, decode offsets, ties and far-off scalar keys. On the CPU the kernel runs in
Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so shapes stay small; the `cuda`
tests run the same checks at GPU shapes on the GPU machine (benchmarks/gpu.py)."""

from __future__ import annotations

import pytest
import torch

from attnlab.ops import hybrid_attention, scalar_attention
from attnlab.testing import rel_rms

triton = pytest.importorskip("triton")

pytestmark = pytest.mark.usefixtures("one_thread")

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS error with a floor of 0.01 for gradients that are exactly zero (one visible key:
    float32 rounding leaves ~1e-7 there)."""
    return rel_rms(a, b, floor=1e-2)


def make(B, H, G, Tq, Tk, D, Dv, *, hybrid: bool, per_query_tau=False, spread=1.0, center=0.0, ties=False):
    g = torch.Generator().manual_seed(Tq * 131 + Tk * 7 + D)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    ks = center + spread * r(B, H, Tk)
    if ties:
        ks = ks.round()  # many equal scalar keys
    qs = center + spread * r(B, H, Tq)
    tau = (0.3 + torch.rand(B, H, Tq, generator=g, dtype=torch.float64)) if per_query_tau else \
        (0.3 + torch.rand(H, generator=g, dtype=torch.float64))
    ins = dict(v=r(B, G, Tk, Dv), qs=qs, ks=ks, tau=tau)
    if hybrid:
        ins.update(q=r(B, H, Tq, D), k=r(B, G, Tk, D), lam=0.5 + torch.rand(H, generator=g, dtype=torch.float64))
    return ins


def run(ins: dict, impl: str, kernel: str, causal: bool, dtype=torch.float64, dout_dtype=None):
    """(output, grads by name) of the op at `impl`, inputs cast to dtype on DEV (tau, lam stay float32+);
    the output's gradient is one fixed draw, rounded to dout_dtype (a 16-bit run's) if given."""
    t = {n: x.to(DEV, dtype if n not in ("tau", "lam") else max(dtype, torch.float32, key=lambda d: d.itemsize))
         .requires_grad_() for n, x in ins.items()}
    if "q" in t:
        out = hybrid_attention(t["q"], t["k"], t["v"], t["qs"], t["ks"], t["tau"], causal=causal, impl=impl,
                               kernel=kernel, scalar_scale=t["lam"])
    else:
        out = scalar_attention(t["qs"], t["ks"], t["v"], t["tau"], causal=causal, impl=impl, kernel=kernel)
    g = torch.Generator().manual_seed(5)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dout_dtype or out.dtype).to(DEV, out.dtype)
    grads = torch.autograd.grad(out, list(t.values()), dout)
    return out, dict(zip(t, grads))


# (B, H, G, Tq, Tk, D, Dv, causal): T = 1, T not a tile multiple, GQA, decode offsets, non-causal
SHAPES = {
    "T1": (1, 2, 2, 1, 1, 16, 16, True),
    "T63-gqa": (1, 4, 2, 63, 63, 16, 24, True),
    "T130-D64": (1, 2, 1, 130, 130, 64, 64, True),
    "offset-5of70": (2, 2, 2, 5, 70, 16, 16, True),
    "noncausal-33x20": (1, 2, 2, 33, 20, 32, 16, False),
    "noncausal-40x70": (1, 2, 1, 40, 70, 16, 16, False),
    "offset-40of100": (1, 2, 2, 40, 100, 16, 16, True),
    "T70-D80-split": (1, 2, 1, 70, 70, 80, 32, True),  # the product as two column blocks, 64 + 16
}


@pytest.mark.heavy
@pytest.mark.parametrize("kernel", ["gaussian", "cauchy"])
@pytest.mark.parametrize("shape", list(SHAPES), ids=list(SHAPES))
def test_hybrid_kernel_matches_naive(shape, kernel):
    B, H, G, Tq, Tk, D, Dv, causal = SHAPES[shape]
    ins = make(B, H, G, Tq, Tk, D, Dv, hybrid=True, per_query_tau=shape == "offset-5of70")
    ref, ref_g = run(ins, "naive", kernel, causal)
    out, got = run(ins, "triton", kernel, causal, torch.float32)
    assert out.dtype == torch.float32 and torch.isfinite(out).all()
    assert rel_err(out, ref) < 1e-5
    for name in ref_g:
        assert rel_err(got[name], ref_g[name]) < 1e-4, name


@pytest.mark.heavy
@pytest.mark.parametrize("kernel", ["gaussian", "cauchy"])
@pytest.mark.parametrize("shape", ["T1", "T63-gqa", "noncausal-33x20"])
def test_scalar_kernel_matches_naive(shape, kernel):
    B, H, G, Tq, Tk, D, Dv, causal = SHAPES[shape]
    ins = make(B, H, G, Tq, Tk, D, Dv, hybrid=False, ties=shape == "T63-gqa")
    ref, ref_g = run(ins, "naive", kernel, causal)
    out, got = run(ins, "triton", kernel, causal, torch.float32)
    assert rel_err(out, ref) < 1e-5
    for name in ref_g:
        assert rel_err(got[name], ref_g[name]) < 1e-4, name


def rounded(ins: dict, dtype) -> dict:
    """The inputs as the kernel sees them in `dtype` (tau and the gain stay float32), back in float64:
    the reference for a 16-bit run, so the error measured is the kernel's, not the inputs' rounding."""
    return {n: x.to(dtype).double() if n in ("q", "k", "v", "qs", "ks") else x.float().double()
            for n, x in ins.items()}


@pytest.mark.parametrize("kernel", ["gaussian", "cauchy"])
def test_far_scalar_keys_float32(kernel):
    """Scalar keys near 300 with a spread of 0.5 and tau near 0.03: terms (qs - r)^2 / tau of the
    augmented route reach 1e6 without its shift; the kernel forms qs - ks in float32 directly."""
    ins = make(1, 2, 2, 40, 40, 32, 32, hybrid=True, spread=0.5, center=300.0)
    ins["tau"] = ins["tau"] * 0.05
    ref, ref_g = run(ins, "naive", kernel, True)
    out, got = run(ins, "triton", kernel, True, torch.float32)
    assert rel_err(out, ref) < 1e-4
    for name in ref_g:
        assert rel_err(got[name], ref_g[name]) < 1e-3, name


@pytest.mark.heavy
@pytest.mark.parametrize("kernel", ["gaussian", "cauchy"])
def test_zero_gain_and_extreme_tau(kernel):
    """A head with gain 0 (no scalar term: the kernels' g = 0, d score / d ks = 0) and tau from 0.05 to 20
    across the query rows, over tile edges (T = 70): the kernels fold lam / tau into one factor per row
    and keep scores in units of the product's scale (triton_kernel's module docstring)."""
    ins = make(1, 2, 1, 70, 70, 32, 16, hybrid=True, per_query_tau=True)
    ins["tau"] = 0.05 * 400.0 ** torch.rand(ins["tau"].shape, generator=torch.Generator().manual_seed(1),
                                            dtype=torch.float64)
    ins["lam"] = torch.tensor([0.0, 2.5], dtype=torch.float64)
    ref, ref_g = run(ins, "naive", kernel, True)
    out, got = run(ins, "triton", kernel, True, torch.float32)
    assert rel_err(out, ref) < 1e-5
    for name in ref_g:
        assert rel_err(got[name], ref_g[name]) < 1e-4, name


def test_product_column_blocks():
    """D past a power of two runs as two blocks when that is narrower (GOAT's 64 + 16 prior columns)."""
    from attnlab.ops.scalar.triton_op import _split

    assert _split(80) == (64, 16) and _split(72) == (64, 16) and _split(96) == (64, 32) and _split(48) == (32, 16)
    assert _split(64) == (64, 0) and _split(24) == (32, 0) and _split(100) == (128, 0) and _split(16) == (16, 0)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("kernel", ["gaussian", "cauchy"])
def test_16bit_inputs(kernel, dtype):
    """16-bit q, k, v, qs, ks: products on the matrix units, sums and the scalar term in float32; within
    1e-2 relative RMS of float64 on the same (rounded) inputs, outputs and every gradient."""
    ins = make(1, 2, 2, 40, 40, 32, 32, hybrid=True, spread=0.5)
    ref, ref_g = run(rounded(ins, dtype), "naive", kernel, True, dout_dtype=dtype)
    out, got = run(ins, "triton", kernel, True, dtype)
    assert out.dtype == dtype
    assert rel_err(out, ref) < 1e-2
    for name in ref_g:
        assert rel_err(got[name], ref_g[name]) < 1e-2, name


@pytest.mark.heavy
@pytest.mark.parametrize("through_dot", [True, False], ids=["dot-kernel", "product-free"])
def test_scalar_heads_both_kernels(monkeypatch, through_dot):
    """Scalar heads through the dot-product kernel on zero vectors (SCALAR_DOT, the default) and through
    the product-free kernel compute the same."""
    from attnlab.ops.scalar import triton_op as scalar_triton

    ins = make(1, 2, 1, 40, 70, 16, 16, hybrid=False)
    ref, ref_g = run(ins, "naive", "cauchy", True)
    monkeypatch.setattr(scalar_triton, "SCALAR_DOT", through_dot)
    out, got = run(ins, "triton", "cauchy", True, torch.float32)
    assert rel_err(out, ref) < 1e-5
    for name in ref_g:
        assert rel_err(got[name], ref_g[name]) < 1e-4, name


def test_auto_picks_triton_only_on_cuda(monkeypatch):
    """"auto" runs the Triton kernel on CUDA, and on the CPU keeps the fused SDPA route even with the
    interpreter on (equal to impl="fast" exactly): which route ran is seen by a spy on the kernel's entry."""
    from attnlab.ops.scalar import triton_op

    ins = make(1, 2, 2, 9, 9, 16, 16, hybrid=True)
    t = {n: x.float() for n, x in ins.items()}
    calls, real = [], triton_op.triton_scalar_attention
    monkeypatch.setattr(triton_op, "triton_scalar_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    a = hybrid_attention(t["q"], t["k"], t["v"], t["qs"], t["ks"], t["tau"], impl="auto", scalar_scale=t["lam"])
    via_triton = bool(calls)
    b = hybrid_attention(t["q"], t["k"], t["v"], t["qs"], t["ks"], t["tau"], impl="fast", scalar_scale=t["lam"])
    if DEV == "cpu":
        assert not via_triton and torch.equal(a, b)
    else:
        assert via_triton and rel_err(a, b) < 1e-5


def test_triton_refuses_window_and_bad_impl():
    qs, ks, v = torch.randn(1, 1, 4), torch.randn(1, 1, 4), torch.randn(1, 1, 4, 2)
    with pytest.raises(ValueError, match="window must be None with impl='triton'"):
        scalar_attention(qs, ks, v, 1.0, impl="triton", window=2)
    with pytest.raises(ValueError, match="impl must be one of"):
        scalar_attention(qs, ks, v, 1.0, impl="tritonn")
    with pytest.raises(ValueError, match="NaN or inf|finite"):
        scalar_attention(qs, ks.index_fill(2, torch.tensor([1]), float("nan")), v, 1.0, impl="triton")


def test_autocast_keeps_the_ops_precision():
    """Under bf16 autocast the op computes as it does on bf16 inputs without autocast (its own
    policy: float32 scores), not with the float32 operands it builds cast back to bf16."""
    ins = make(1, 2, 2, 33, 33, 16, 16, hybrid=True, spread=0.5, center=20.0)
    t = {n: x.to(torch.bfloat16) if n not in ("tau", "lam") else x.float() for n, x in ins.items()}
    args = (t["q"], t["k"], t["v"], t["qs"], t["ks"], t["tau"])
    plain = hybrid_attention(*args, scalar_scale=t["lam"], impl="fast")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        under = hybrid_attention(*args, scalar_scale=t["lam"], impl="fast")
    assert torch.equal(plain, under)


def test_sdpa_width_pads_to_eight_exactly():
    """The fused route pads its head width to a multiple of 8 on CUDA; zero columns change nothing."""
    from attnlab.ops.common.sdpa import fused_attention, sdpa_width

    assert sdpa_width(66, torch.device("cuda")) == 72 and sdpa_width(66, torch.device("cpu")) == 66
    q, k, v = torch.randn(1, 2, 20, 66), torch.randn(1, 2, 20, 66), torch.randn(1, 2, 20, 64)
    a = fused_attention(q, k, v, causal=True)
    b = fused_attention(q, k, v, causal=True, width=72)
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["gaussian", "cauchy"])
def test_cuda_kernel_matches_float64_at_gpu_shapes(kernel):
    ins = make(2, 4, 2, 1000, 1000, 64, 64, hybrid=True)
    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 1e-2)):
        ref, ref_g = run(rounded(ins, dtype), "naive", kernel, True, dout_dtype=dtype)
        out, got = run(ins, "triton", kernel, True, dtype)
        assert rel_err(out, ref) < tol
        for name in ref_g:
            assert rel_err(got[name], ref_g[name]) < 2 * tol, (dtype, name)


@pytest.mark.cuda
def test_cuda_fused_route_never_uses_the_math_backend():
    """impl="fast" (Gaussian, the augmented SDPA route) runs with SDPA's math backend forbidden."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    ins = make(2, 4, 2, 256, 256, 64, 64, hybrid=True)
    for dtype in (torch.float32, torch.bfloat16):
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION]):
            out, grads = run(ins, "fast", "gaussian", True, dtype)
        assert torch.isfinite(out).all() and all(torch.isfinite(g).all() for g in grads.values())


GOAT_SHAPES = {  # (B, H, G, Tq, Tk, D, R, hybrid term, u batched)
    "T63-gqa": (1, 4, 2, 63, 63, 16, 4, False, False),
    "offset-20of70-hybrid": (2, 2, 1, 20, 70, 24, 3, True, True),
    "T1": (1, 2, 2, 1, 1, 16, 2, False, False),
    "D64-R8-split-gqa": (1, 4, 2, 45, 45, 64, 8, True, False),  # 64 + 16 prior columns: two blocks, not 128
}


def goat_inputs(B, H, G, Tq, Tk, D, R, hybrid, batched_u):
    g = torch.Generator().manual_seed(Tk * 3 + D)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    ins = dict(q=r(B, H, Tq, D), k=r(B, G, Tk, D), v=r(B, G, Tk, D), lam_sym=0.5 * r(G, R), lam_asym=0.5 * r(G, R),
               u=2.0 * r(B if batched_u else 1, G, Tk))
    if hybrid:
        ins.update(qs=r(B, H, Tq), ks=r(B, H, Tk), tau=0.3 + torch.rand(H, generator=g, dtype=torch.float64))
    return ins


def run_goat(ins: dict, impl: str, dtype=torch.float64, dout_dtype=None):
    from attnlab.ops import goat_attention

    R = ins["lam_sym"].shape[1]
    freqs = torch.logspace(-2, 0, R, dtype=torch.float64).to(DEV)
    t = {n: x.to(DEV, dtype if n in ("q", "k", "v", "qs", "ks") else max(dtype, torch.float32,
                                                                        key=lambda d: d.itemsize)).requires_grad_()
         for n, x in ins.items()}
    out = goat_attention(t["q"], t["k"], t["v"], freqs.to(t["lam_sym"].dtype), t["lam_sym"], t["lam_asym"], t["u"],
                         qs=t.get("qs"), ks=t.get("ks"), tau=t.get("tau"), impl=impl)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(7), dtype=torch.float64)
    grads = torch.autograd.grad(out, list(t.values()), dout.to(dout_dtype or out.dtype).to(DEV, out.dtype))
    return out, dict(zip(t, grads))


@pytest.mark.heavy
@pytest.mark.parametrize("shape", list(GOAT_SHAPES), ids=list(GOAT_SHAPES))
def test_goat_through_the_kernel(shape):
    """GOAT (and goat_hybrid) through the kernel: the prior's columns in the product, u as a float32
    bias per key; outputs and every gradient (q, k, v, both spectral weights, u, qs, ks, tau)."""
    ins = goat_inputs(*GOAT_SHAPES[shape])
    ref, ref_g = run_goat(ins, "naive")
    out, got = run_goat(ins, "triton", torch.float32)
    assert rel_err(out, ref) < 1e-5
    for name in ref_g:
        assert rel_err(got[name], ref_g[name]) < 1e-4, name


@pytest.mark.heavy
def test_goat_through_the_kernel_bf16():
    """bf16 inputs: the output and the activations' gradients within 1e-2 of float64; the spectral
    weights' gradients are sums over every query of the prior columns' bf16 gradients (as any bf16
    activation's parameter gradient is), measured at 1.3e-2 here: 2e-2 for them."""
    ins = goat_inputs(1, 2, 1, 40, 40, 32, 4, True, False)
    ref, ref_g = run_goat(rounded(ins, torch.bfloat16), "naive", dout_dtype=torch.bfloat16)
    out, got = run_goat(ins, "triton", torch.bfloat16)
    assert out.dtype == torch.bfloat16
    assert rel_err(out, ref) < 1e-2
    for name in ref_g:
        assert rel_err(got[name], ref_g[name]) < (2e-2 if name.startswith("lam_") else 1e-2), name


@pytest.mark.cuda
def test_cuda_goat_matches_float64_at_gpu_shapes():
    ins = goat_inputs(2, 4, 2, 1000, 1000, 56, 4, True, False)
    for dtype, tol in ((torch.float32, 1e-3), (torch.bfloat16, 2e-2)):
        ref, ref_g = run_goat(rounded(ins, dtype), "naive", dout_dtype=dtype)
        out, got = run_goat(ins, "triton", dtype)
        assert rel_err(out, ref) < tol
        for name in ref_g:
            assert rel_err(got[name], ref_g[name]) < 2 * tol, (dtype, name)


def test_empty_sequence_through_the_kernel():
    """T = 0 through impl="triton": the empty output the naive op gives, of the right shape and dtype."""
    qs, ks, v = torch.randn(1, 2, 0), torch.randn(1, 2, 0), torch.randn(1, 2, 0, 8)
    q, k = torch.randn(1, 2, 0, 16), torch.randn(1, 2, 0, 16)
    for impl in ("naive", "triton"):
        a = scalar_attention(qs, ks, v, 0.5, impl=impl)
        b = hybrid_attention(q, k, v, qs, ks, 0.5, impl=impl)
        assert a.shape == (1, 2, 0, 8) and b.shape == (1, 2, 0, 8) and a.dtype == b.dtype == v.dtype


DOCS = {  # (B, H, G, T, D, Dv, document lengths per row): ragged documents across tile edges, T = 1 documents
    "three-docs": (1, 2, 2, 70, 16, 16, [[30, 1, 39]]),
    "gqa-rows": (2, 4, 2, 45, 16, 24, [[45], [12, 20, 13]]),
}


@pytest.mark.heavy
@pytest.mark.parametrize("shape", DOCS.values(), ids=DOCS.keys())
@pytest.mark.parametrize("kernel", ["gaussian", "cauchy"])
def test_packed_documents_equal_each_document_alone(shape, kernel):
    """docs=...: each query reads its own document only (tiles of others skipped); output and every
    gradient equal the naive op run on each document by itself."""
    B, H, G, T, D, Dv, lengths = shape
    ins = make(B, H, G, T, T, D, Dv, hybrid=True)
    docs = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in lengths])
    t = {n: x.float().requires_grad_() for n, x in ins.items()}
    out = hybrid_attention(t["q"], t["k"], t["v"], t["qs"], t["ks"], t["tau"], impl="triton", kernel=kernel,
                           scalar_scale=t["lam"], docs=docs)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    got = torch.autograd.grad(out, list(t.values()), dout)
    r = {n: x.clone().requires_grad_() for n, x in ins.items()}
    parts = []
    for b, row in enumerate(lengths):
        start, outs = 0, []
        for n in row:
            s = slice(start, start + n)
            outs.append(hybrid_attention(r["q"][b:b + 1, :, s], r["k"][b:b + 1, :, s], r["v"][b:b + 1, :, s],
                                         r["qs"][b:b + 1, :, s], r["ks"][b:b + 1, :, s], r["tau"], causal=True,
                                         impl="naive", kernel=kernel, scalar_scale=r["lam"]))
            start += n
        parts.append(torch.cat(outs, 2))
    ref = torch.cat(parts, 0)
    want = torch.autograd.grad(ref, list(r.values()), dout.double())
    assert rel_err(out, ref) < 1e-5
    for name, a, b in zip(t, got, want):
        assert rel_err(a, b) < 1e-4, name


def test_documents_need_their_shape():
    """docs= of the wrong shape or dtype: one error naming docs (every route takes docs:
    tests/test_cu_seqlens_softmax_family.py compares them with each document alone)."""
    ins = {n: x.float() for n, x in make(1, 2, 2, 8, 8, 16, 16, hybrid=True).items()}
    docs = torch.zeros(1, 8, dtype=torch.long)
    args = (ins["q"], ins["k"], ins["v"], ins["qs"], ins["ks"], ins["tau"])
    for impl in ("naive", "fast", "auto"):  # the CPU's routes, without the kernel: one document is no packing
        torch.testing.assert_close(hybrid_attention(*args, impl=impl, docs=docs), hybrid_attention(*args, impl=impl))
    with pytest.raises(ValueError, match="docs must have shape"):
        hybrid_attention(*args, impl="triton", docs=docs[:, :5])
    with pytest.raises(TypeError, match="docs must be an integer tensor"):
        scalar_attention(ins["qs"], ins["ks"], ins["v"], ins["tau"], impl="triton", docs=docs.float())
    with pytest.raises(ValueError, match="window must be None with impl='triton'"):
        scalar_attention(ins["qs"], ins["ks"], ins["v"], ins["tau"], impl="triton", window=4, docs=docs)
