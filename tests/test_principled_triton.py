"""Principled attention's Triton kernel (attnlab.ops.principled.triton_kernel) against the naive op in float64:
the output, the ground weight and every gradient (q, k, qg, kg, v, alpha, beta, gamma, v0), causal and
not, GQA, decode offsets, per-head and per-query parameters, 16-bit inputs, logits at the threshold. On
the CPU the kernel runs in Triton's interpreter (tests/conftest.py sets TRITON_INTERPRET=1), so shapes
stay small; the `cuda` test runs the same check at GPU shapes on the GPU machine."""

from __future__ import annotations

import pytest
import torch

from attnlab.ops.principled import principled_attention
from attnlab.testing import rel_rms

triton = pytest.importorskip("triton")

pytestmark = pytest.mark.usefixtures("one_thread")

DEV = "cuda" if torch.cuda.is_available() else "cpu"
NAMES = ("q", "k", "qg", "kg", "v", "alpha", "beta", "gamma", "v0")


def make(B, H, G, Tq, Tk, D, Dg, Dv, *, per_query=False) -> dict:
    g = torch.Generator().manual_seed(Tq * 131 + Tk * 7 + D)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    form = (B, H, Tq) if per_query else (H,)
    return dict(q=r(B, H, Tq, D), k=r(B, G, Tk, D), qg=r(B, H, Tq, Dg), kg=r(B, G, Tk, Dg), v=r(B, G, Tk, Dv),
                alpha=0.5 * r(*form), beta=0.5 * r(*form), gamma=r(*form), v0=r(H, Dv))


def run(ins: dict, impl: str, causal: bool, dtype=torch.float64, dout_dtype=None):
    """((o, w0), grads by name) of the op at `impl`; tensors cast to dtype on DEV (the parameters stay
    float32 or wider); the outputs' gradients are fixed draws, rounded to dout_dtype if given."""
    wide = max(dtype, torch.float32, key=lambda d: d.itemsize)
    t = {n: x.to(DEV, wide if n in ("alpha", "beta", "gamma") else dtype).requires_grad_() for n, x in ins.items()}
    o, w0 = principled_attention(t["q"], t["k"], t["qg"], t["kg"], t["v"], alpha=t["alpha"], beta=t["beta"],
                                 gamma=t["gamma"], v0=t["v0"], causal=causal, impl=impl, return_ground=True)
    gen = torch.Generator().manual_seed(5)
    grads_out = [torch.randn(x.shape, generator=gen, dtype=torch.float64).to(dout_dtype or x.dtype).to(DEV, x.dtype)
                 for x in (o, w0)]
    grads = torch.autograd.grad((o, w0), list(t.values()), grads_out)
    return (o, w0), dict(zip(t, grads))


def rounded(ins: dict, dtype) -> dict:
    """The inputs as a 16-bit run sees them (tensors rounded to dtype), in float64."""
    return {n: (x if n in ("alpha", "beta", "gamma") else x.to(dtype).double()) for n, x in ins.items()}


def check(ins, causal, dtype=torch.float32, tol=1e-4, dout_dtype=None):
    ref, ref_g = run(rounded(ins, dtype) if dtype != torch.float32 else ins, "naive", causal, dout_dtype=dout_dtype)
    out, got = run(ins, "triton", causal, dtype)
    assert out[0].dtype == dtype
    for name, a, b in (("o", out[0], ref[0]), ("w0", out[1], ref[1])):
        assert rel_rms(a, b, floor=1e-2) < tol, name
    for name in NAMES:
        assert rel_rms(got[name], ref_g[name], floor=1e-2) < 10 * tol, name


# (B, H, G, Tq, Tk, D, Dg, Dv, causal): T = 1, T not a tile multiple, GQA, decode offsets, non-causal
SHAPES = {
    "T1": (1, 2, 2, 1, 1, 16, 8, 16, True),
    "ragged-gqa": (2, 4, 2, 37, 37, 16, 8, 24, True),
    "mqa-offset": (1, 4, 1, 9, 45, 32, 16, 16, True),
    "noncausal": (1, 2, 1, 33, 20, 16, 16, 16, False),
}


@pytest.mark.heavy
@pytest.mark.parametrize("shape", SHAPES.values(), ids=SHAPES.keys())
def test_kernel_matches_naive(shape):
    *dims, causal = shape
    check(make(*dims), causal)


@pytest.mark.heavy
def test_per_query_parameters_and_a_strong_threshold():
    """alpha, beta, gamma per query, gamma large enough that most keys sit below the threshold (the
    ground state takes most of the mass)."""
    ins = make(1, 2, 2, 40, 40, 16, 8, 16, per_query=True)
    ins["gamma"] = ins["gamma"] + 3.0
    check(ins, True)


def test_logits_at_the_threshold():
    """Rows whose logits sit within 1e-13 of gamma (q = 0, gamma = 0, a gate of strength softplus(-30)):
    which side of the threshold each key falls on decides the ground term's gradient, as the naive op's
    torch.maximum decides it."""
    ins = make(1, 2, 2, 20, 20, 16, 8, 16)
    ins["q"][:, :, ::3] = 0.0
    ins["gamma"] = torch.zeros_like(ins["gamma"])
    ins["beta"] = torch.full_like(ins["beta"], -30.0)
    check(ins, True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_16bit_inputs(dtype):
    """16-bit q, k, qg, kg, v: products in the inputs' dtype, everything else float32; within 2e-2 relative
    RMS of float64 on the same rounded inputs (the logit gradients are rounded to 16 bits for the
    backward's products, as in FlashAttention)."""
    check(make(1, 2, 2, 40, 40, 32, 8, 32), True, dtype, tol=2e-3, dout_dtype=dtype)


@pytest.mark.heavy
def test_bf16_threshold_gradients_where_they_cancel():
    """gamma lowered by 2: most keys sit above the threshold, so gamma's gradient -c sum_s ds_s and c's
    (alpha's) are small differences of large terms, sum_s w_s do.v_s against Delta = do.o_keys. The
    forward's key readout must carry the weights as exactly as the backward's w (p in two bf16 parts)
    and c's gradient come from float32 row sums, not from q . dqk of bf16 products: before, gamma's
    gradient was 2.9e-2 off here (the H100's 2.9e-2 at T = 1024) and alpha's 1.4e-2; now ~1e-4."""
    ins = make(1, 2, 2, 64, 64, 32, 8, 32)
    ins["gamma"] = ins["gamma"] - 2.0
    dt = torch.bfloat16
    ref, ref_g = run(rounded(ins, dt), "naive", True, dout_dtype=dt)
    out, got = run(ins, "triton", True, dt)
    for name, a, b in (("o", out[0], ref[0]), ("w0", out[1], ref[1])):
        assert rel_rms(a, b, floor=1e-2) < 1e-2, name
    for name in NAMES:
        tol = 1e-3 if name in ("alpha", "beta", "gamma") else 1e-2
        assert rel_rms(got[name], ref_g[name], floor=1e-2) < tol, name


def test_bf16_key_readout_is_float32_exact():
    """The kernel's float32 key readout sum_s w_s v_s for bf16 inputs, which the backward's Delta reads,
    within 1e-4 of float64 (one bf16 rounding of each weight gave 2e-3)."""
    from attnlab.ops.principled.naive import principled_naive
    from attnlab.ops.principled.triton_kernel import triton_principled
    import torch.nn.functional as F

    ins = make(1, 2, 2, 64, 64, 32, 8, 32)
    x = {n: ins[n].to(torch.bfloat16) for n in ("q", "k", "qg", "kg", "v")}
    T = 64
    c = (1 + F.softplus(ins["alpha"])[:, None] * torch.arange(1, T + 1, dtype=torch.float64).log()).expand(1, 2, T)
    spb, gam = F.softplus(ins["beta"])[:, None].expand(1, 2, T), ins["gamma"][:, None].expand(1, 2, T)
    ok, w0 = triton_principled(*x.values(), c.float(), spb.float(), gam.float(), True)
    ref, ref_w0 = principled_naive(*(t.double() for t in x.values()), ins["alpha"][:, None], ins["beta"][:, None],
                                   ins["gamma"][:, None], None, True)
    assert ok.dtype == torch.float32
    assert rel_rms(ok, ref) < 1e-4 and rel_rms(w0, ref_w0) < 1e-4


def test_auto_picks_triton_only_on_cuda(monkeypatch):
    import attnlab.ops.principled.triton_kernel as pt

    calls = []
    real = pt.triton_principled
    monkeypatch.setattr(pt, "triton_principled", lambda *a: calls.append(1) or real(*a))
    ins = {n: x.float() for n, x in make(1, 2, 2, 8, 8, 16, 8, 16).items()}
    principled_attention(ins["q"], ins["k"], ins["qg"], ins["kg"], ins["v"], alpha=ins["alpha"], beta=ins["beta"],
                         gamma=ins["gamma"], impl="auto")
    assert calls == []  # the CPU keeps its compiled / tiled path
    principled_attention(ins["q"], ins["k"], ins["qg"], ins["kg"], ins["v"], alpha=ins["alpha"], beta=ins["beta"],
                         gamma=ins["gamma"], impl="triton")
    assert calls == [1]


def test_triton_refuses_a_window():
    ins = {n: x.float() for n, x in make(1, 2, 2, 8, 8, 16, 8, 16).items()}
    with pytest.raises(ValueError, match="window must be None with impl='triton'"):
        principled_attention(ins["q"], ins["k"], ins["qg"], ins["kg"], ins["v"], alpha=ins["alpha"],
                             beta=ins["beta"], gamma=ins["gamma"], impl="triton", window=4)


def test_empty_sequence():
    ins = {n: x.float() for n, x in make(1, 2, 2, 0, 0, 16, 8, 16).items()}
    o = principled_attention(ins["q"], ins["k"], ins["qg"], ins["kg"], ins["v"], alpha=ins["alpha"],
                             beta=ins["beta"], gamma=ins["gamma"], impl="triton")
    assert o.shape == (1, 2, 0, 16)


@pytest.mark.cuda
def test_cuda_kernel_matches_float64_at_gpu_shapes():
    ins = make(2, 4, 2, 1000, 1000, 64, 16, 64)
    check(ins, True, torch.float32, tol=1e-3)
    check(ins, True, torch.bfloat16, tol=2e-3, dout_dtype=torch.bfloat16)


@pytest.mark.heavy
def test_packed_documents_equal_each_document_alone():
    """docs=...: each query reads its own document's keys (K counts them); output, w0 and every gradient
    equal the naive op run on each document by itself."""
    lengths = [[12, 20, 13], [45]]
    B, H, G, T = 2, 4, 2, 45
    ins = make(B, H, G, T, T, 16, 8, 16, per_query=True)
    docs = torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in lengths])
    t = {n: x.float().requires_grad_() for n, x in ins.items()}
    o, w0 = principled_attention(t["q"], t["k"], t["qg"], t["kg"], t["v"], alpha=t["alpha"], beta=t["beta"],
                                 gamma=t["gamma"], v0=t["v0"], impl="triton", return_ground=True, docs=docs)
    gen = torch.Generator().manual_seed(7)
    go, gw = torch.randn(o.shape, generator=gen), torch.randn(w0.shape, generator=gen)
    got = torch.autograd.grad((o, w0), list(t.values()), (go, gw))
    r = {n: x.clone().requires_grad_() for n, x in ins.items()}
    outs, grounds = [], []
    for b, row in enumerate(lengths):
        start, ob, wb = 0, [], []
        for n in row:
            s = slice(start, start + n)
            o_, w_ = principled_attention(r["q"][b:b + 1, :, s], r["k"][b:b + 1, :, s], r["qg"][b:b + 1, :, s],
                                          r["kg"][b:b + 1, :, s], r["v"][b:b + 1, :, s],
                                          alpha=r["alpha"][b:b + 1, :, s], beta=r["beta"][b:b + 1, :, s],
                                          gamma=r["gamma"][b:b + 1, :, s], v0=r["v0"], impl="naive", return_ground=True)
            ob.append(o_)
            wb.append(w_)
            start += n
        outs.append(torch.cat(ob, 2))
        grounds.append(torch.cat(wb, 2))
    ref_o, ref_w = torch.cat(outs, 0), torch.cat(grounds, 0)
    want = torch.autograd.grad((ref_o, ref_w), list(r.values()), (go.double(), gw.double()))
    assert rel_rms(o, ref_o) < 1e-5 and rel_rms(w0, ref_w) < 1e-5
    for name, a, b in zip(t, got, want):
        assert rel_rms(a, b, floor=1e-2) < 1e-4, name


def test_documents_need_their_shape():
    """docs= of the wrong shape or dtype: one error naming docs (every route takes docs:
    tests/test_cu_seqlens_softmax_family.py compares them with each document alone)."""
    ins = {n: x.float() for n, x in make(1, 2, 2, 8, 8, 16, 8, 16).items()}
    docs = torch.zeros(1, 8, dtype=torch.long)
    for impl in ("naive", "fast"):  # the CPU's routes, without the kernel: one document is no packing
        args = (ins["q"], ins["k"], ins["qg"], ins["kg"], ins["v"])
        kw = dict(alpha=ins["alpha"], beta=ins["beta"], gamma=ins["gamma"], impl=impl)
        torch.testing.assert_close(principled_attention(*args, docs=docs, **kw), principled_attention(*args, **kw))
    with pytest.raises(ValueError, match="docs must have shape"):
        principled_attention(ins["q"], ins["k"], ins["qg"], ins["kg"], ins["v"], alpha=ins["alpha"],
                             beta=ins["beta"], gamma=ins["gamma"], impl="triton", docs=docs[:, :4])
    with pytest.raises(TypeError, match="docs must be an integer tensor"):
        principled_attention(ins["q"], ins["k"], ins["qg"], ins["kg"], ins["v"], alpha=ins["alpha"],
                             beta=ins["beta"], gamma=ins["gamma"], impl="triton", docs=docs.float())
