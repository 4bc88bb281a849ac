"""cu_seqlens on the softmax-shaped ops: softmax (every scaling, the sliding window, causal or not),
scalar and hybrid (both kernels, with and without a window) and principled. Documents packed in one
row equal each document run alone through the naive op, outputs and every gradient, on every path
(naive, fast, and the Triton kernels under TRITON_INTERPRET=1), at awkward lengths (0, 1, 63, one
document, many); the (B, T) docs form; one graph under torch.compile for the fast paths."""

from __future__ import annotations

import pytest
import torch

from attnlab.ops import goat_attention, hybrid_attention, principled_attention, scalar_attention, softmax_attention
from attnlab.testing import PACKED_LENGTHS, cu_offsets, rel_rms

pytestmark = pytest.mark.usefixtures("one_thread")

LENGTHS, offsets = PACKED_LENGTHS, cu_offsets
# the kernels' cases at twelve documents take seconds each under the interpreter: `make test-heavy`
# (and the interpreted kernels at the awkward lengths, 2-3 s each)
KERNEL_CASES = [pytest.param(n, impl, id=f"{n}-{impl}",
                             marks=pytest.mark.heavy if n == "many" or (n, impl) == ("awkward", "triton") else ())
                for n in ("len1", "awkward", "many") for impl in ("fast", "naive", "triton")]


def randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def compare(fn, tensors: dict, cu, impl, tol=(1e-5, 1e-4), floor=1e-3, **kw):
    """fn(**tensors, impl=impl, cu_seqlens=cu, **kw) against fn on each document alone (impl naive,
    float64; per-query tensors, those with the length T last, cut with them), outputs and every
    gradient. fn returns a tensor or a tuple of tensors."""
    T = cu[-1]
    leaves = {n: x.detach().requires_grad_() for n, x in tensors.items()}
    refs = {n: x.detach().double().requires_grad_() for n, x in tensors.items()}
    got = fn(**leaves, impl=impl, cu_seqlens=torch.tensor(cu), **kw)
    got = got if isinstance(got, tuple) else (got,)

    def cut(x, a, b):
        if x.dim() == 4:
            return x[:, :, a:b]
        return x[..., a:b] if x.dim() == 3 and x.shape[-1] == T else x

    parts = [fn(**{n: cut(x, a, b) for n, x in refs.items()}, impl="naive", **kw) for a, b in zip(cu[:-1], cu[1:])
             if b > a]
    parts = [p if isinstance(p, tuple) else (p,) for p in parts]
    want = tuple(torch.cat(xs, 2) for xs in zip(*parts))
    for a, b in zip(got, want):
        assert rel_rms(a, b) < tol[0], rel_rms(a, b)
    gen = torch.Generator().manual_seed(5)
    cots = [torch.randn(a.shape, generator=gen) for a in got]
    grads = [x for x in leaves.values()]
    g_got = torch.autograd.grad(sum((a * c).sum() for a, c in zip(got, cots)), grads, allow_unused=True)
    g_want = torch.autograd.grad(sum((b * c.double()).sum() for b, c in zip(want, cots)), list(refs.values()),
                                 allow_unused=True)
    for name, a, b in zip(leaves, g_got, g_want):
        if b is None:
            continue
        assert rel_rms(a, b, floor=floor) < tol[1], (name, rel_rms(a, b, floor=floor))


SCALES = ["sqrt_d", "ktotal", "kmean", "krms", "pnorm", "n_sqrt_d", 0.3]


def softmax(q, k, v, **kw):
    return softmax_attention(q, k, v, p=3.0, **kw)


@pytest.mark.parametrize("impl", ["fast", "naive"])
@pytest.mark.parametrize("lengths", LENGTHS.values(), ids=LENGTHS.keys())
@pytest.mark.parametrize("scale", SCALES)
def test_softmax_scalings_documents_alone(scale, lengths, impl):
    """Every scaling's divisor restarts in each document; GQA (4 query heads on 2 key groups, Dv != D)."""
    cu = offsets(lengths)
    T = cu[-1]
    t = {"q": randn(1, 4, T, 8, seed=1), "k": randn(1, 2, T, 8, seed=2), "v": randn(1, 2, T, 6, seed=3)}
    compare(softmax, t, cu, impl, scale=scale)


@pytest.mark.parametrize("impl", ["fast", "naive"])
@pytest.mark.parametrize("case", ["window", "bidirectional"])
@pytest.mark.parametrize("scale", SCALES)
def test_softmax_window_and_bidirectional_documents_alone(scale, case, impl):
    """A sliding window composed with the same-document mask; non-causal, each document reads itself."""
    cu = offsets(LENGTHS["many"])
    T = cu[-1]
    t = {"q": randn(1, 4, T, 8, seed=1), "k": randn(1, 2, T, 8, seed=2), "v": randn(1, 2, T, 6, seed=3)}
    kw = {"window": 4} if case == "window" else {"causal": False}
    compare(softmax, t, cu, impl, scale=scale, **kw)


def test_softmax_long_row_keeps_short_documents_exact():
    """A short document late in a long row whose earlier keys are far larger: the divisors restart in
    log space (no subtraction of row prefixes), so its result is as exact as the document alone."""
    cu = [0, 3000, 3003]
    k = randn(1, 1, 3003, 8, seed=2)
    k[:, :, :3000] *= 1e6
    t = {"q": randn(1, 1, 3003, 8, seed=1), "k": k, "v": randn(1, 1, 3003, 4, seed=3)}
    for scale in ("ktotal", "krms", "pnorm"):
        out = softmax(**t, scale=scale, cu_seqlens=cu)[:, :, 3000:]
        ref = softmax(*(x[:, :, 3000:].double() for x in t.values()), scale=scale, impl="naive")
        assert rel_rms(out, ref) < 1e-5, scale


def test_softmax_docs_rows_and_decode_offset():
    """docs (B, Tk) with each row packed its own way, and fewer queries than keys (the last Tq)."""
    rows = [[5, 1, 20, 4], [30]]
    docs = torch.tensor([[i for i, n in enumerate(r) for _ in range(n)] for r in rows])
    q, k, v = randn(2, 4, 30, 8, seed=1), randn(2, 2, 30, 8, seed=2), randn(2, 2, 30, 6, seed=3)
    for scale in ("sqrt_d", "kmean", "pnorm"):
        for impl in ("fast", "naive"):
            out = softmax(q[:, :, -7:], k, v, scale=scale, docs=docs, impl=impl)  # (2, 4, 7, 6)
            for b, r in enumerate(rows):  # each document alone, read at the last 7 positions
                cu = offsets(r)
                ref = torch.cat([softmax(*(x[b:b + 1, :, a:e].double() for x in (q, k, v)), scale=scale, impl="naive")
                                 for a, e in zip(cu[:-1], cu[1:])], 2)[:, :, -7:]
                assert rel_rms(out[b:b + 1], ref) < 1e-5, (scale, impl, b)


def test_softmax_bad_cu_seqlens():
    q, k, v = randn(1, 2, 10, 8), randn(1, 2, 10, 8), randn(1, 2, 10, 8)
    with pytest.raises(ValueError, match="cu_seqlens must end at T = 10"):
        softmax_attention(q, k, v, cu_seqlens=torch.tensor([0, 4, 8]))
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        softmax_attention(q, k, v, cu_seqlens=torch.tensor([0, 6, 4, 10], dtype=torch.int32))
    with pytest.raises(ValueError, match="batch size must be 1, got 2"):
        softmax_attention(*(torch.cat([x, x]) for x in (q, k, v)), cu_seqlens=[0, 10])
    with pytest.raises(ValueError, match="cu_seqlens must be an int32 or int64 tensor"):
        softmax_attention(q, k, v, cu_seqlens=torch.tensor([0.0, 10.0]))


KERNELS = [("gaussian", None), ("cauchy", None), ("gaussian", 4), ("cauchy", 4)]


def scalar_inputs(T, hybrid):
    t = {"qs": randn(1, 4, T, seed=1), "ks": randn(1, 4, T, seed=2), "v": randn(1, 2, T, 6, seed=3),
         "tau": torch.rand(4, generator=torch.Generator().manual_seed(4)) + 0.5}
    if hybrid:
        t.update(q=randn(1, 4, T, 8, seed=5), k=randn(1, 2, T, 8, seed=6),
                 scalar_scale=torch.rand(4, generator=torch.Generator().manual_seed(7)))
    return t


@pytest.mark.parametrize("lengths, impl", KERNEL_CASES)
@pytest.mark.parametrize("kernel, window", KERNELS, ids=[f"{k}-w{w}" for k, w in KERNELS])
@pytest.mark.parametrize("op", ["scalar", "hybrid"])
def test_scalar_hybrid_documents_alone(op, kernel, window, lengths, impl):
    """The Triton kernel masks other documents and skips their tiles; naive masks its logits; fast runs
    explicit-score chunks under a same-document mask (with the window's band when there is one)."""
    if impl == "triton":
        pytest.importorskip("triton")
        if window is not None:
            pytest.skip("the kernel has no sliding window (impl='triton' refuses one)")
    cu = offsets(LENGTHS[lengths])
    fn = scalar_attention if op == "scalar" else hybrid_attention
    # floor: with one key a score's gradient is exactly zero, and float32 kernels leave ~1e-7 there
    compare(fn, scalar_inputs(cu[-1], op == "hybrid"), cu, impl, floor=1e-2, kernel=kernel, window=window)


PRINCIPLED = {"causal": {}, "window": {"window": 5}, "bidirectional": {"causal": False}}


def principled(q, k, qg, kg, v, alpha, **kw):
    beta, gamma, v0 = torch.tensor([0.3, -0.2, 0.1, 0.5]), torch.tensor([0.1, -1.0, 0.4, 0.0]), torch.ones(6) * 0.5
    return principled_attention(q, k, qg, kg, v, alpha=alpha, beta=beta.to(q.dtype), gamma=gamma.to(q.dtype),
                                v0=v0.to(q.dtype), return_ground=True, **kw)


@pytest.mark.parametrize("lengths, impl", KERNEL_CASES)
@pytest.mark.parametrize("case", PRINCIPLED.keys())
def test_principled_documents_alone(case, lengths, impl):
    """K counts each query's own document (and window); the ground weight w0 too."""
    kw = PRINCIPLED[case]
    if impl == "triton":
        pytest.importorskip("triton")
        if kw:
            pytest.skip("the kernel runs causal attention without a window")
    cu = offsets(LENGTHS[lengths])
    T = cu[-1]
    t = {"q": randn(1, 4, T, 8, seed=1), "k": randn(1, 2, T, 8, seed=2), "qg": randn(1, 4, T, 4, seed=3),
         "kg": randn(1, 2, T, 4, seed=4), "v": randn(1, 2, T, 6, seed=5), "alpha": randn(1, 4, T, seed=6)}
    compare(principled, t, cu, impl, floor=1e-2, **kw)


def test_scalar_family_docs_rows():
    """docs (B, Tk), every route off the kernel: each row's documents alone."""
    rows = [[5, 1, 20, 4], [30]]
    docs = torch.tensor([[i for i, n in enumerate(r) for _ in range(n)] for r in rows])
    t = {n: (torch.cat([x, x.flip(-1)]) if x.dim() >= 3 else x) for n, x in scalar_inputs(30, True).items()}
    for impl in ("fast", "naive"):
        out = hybrid_attention(t["q"], t["k"], t["v"], t["qs"], t["ks"], t["tau"], scalar_scale=t["scalar_scale"],
                               kernel="cauchy", docs=docs, impl=impl)
        for b, r in enumerate(rows):
            cu = offsets(r)
            ref = torch.cat([hybrid_attention(t["q"][b:b + 1, :, a:e], t["k"][b:b + 1, :, a:e], t["v"][b:b + 1, :, a:e],
                                              t["qs"][b:b + 1, :, a:e], t["ks"][b:b + 1, :, a:e], t["tau"],
                                              scalar_scale=t["scalar_scale"], kernel="cauchy", impl="naive")
                             for a, e in zip(cu[:-1], cu[1:])], 2)
            assert rel_rms(out[b:b + 1], ref) < 1e-5, (impl, b)


FAST_GRAPHS = {
    "softmax-krms": lambda t, cu: softmax_attention(t["q"], t["k"], t["v"], scale="krms", cu_seqlens=cu),
    "softmax-pnorm-window": lambda t, cu: softmax_attention(t["q"], t["k"], t["v"], scale="pnorm", window=4,
                                                            cu_seqlens=cu),
    "hybrid-cauchy": lambda t, cu: hybrid_attention(t["q"], t["k"], t["v"], t["qs"], t["ks"], 0.7, kernel="cauchy",
                                                    cu_seqlens=cu),
    "principled": lambda t, cu: principled_attention(t["q"], t["k"], t["q"], t["k"], t["v"], alpha=0.2, beta=0.1,
                                                     gamma=-0.5, cu_seqlens=cu),
}


@pytest.mark.heavy
@pytest.mark.parametrize("name", FAST_GRAPHS.keys())
def test_fast_paths_one_graph_under_compile(name):
    """No host read of cu_seqlens and no shape that depends on it: one graph, forward and backward."""
    cu = torch.tensor(offsets(LENGTHS["awkward"]))
    T = int(cu[-1])
    t = {"q": randn(1, 4, T, 8, seed=1), "k": randn(1, 2, T, 8, seed=2), "v": randn(1, 2, T, 6, seed=3),
         "qs": randn(1, 4, T, seed=4), "ks": randn(1, 4, T, seed=5)}
    t = {n: x.requires_grad_() for n, x in t.items()}
    fn = FAST_GRAPHS[name]
    torch._dynamo.reset()
    out = torch.compile(fn, fullgraph=True, backend="aot_eager")(t, cu)
    ref = fn(t, cu)
    assert rel_rms(out, ref) < 1e-6
    got = torch.autograd.grad(out.square().sum(), list(t.values()), allow_unused=True)
    want = torch.autograd.grad(ref.square().sum(), list(t.values()), allow_unused=True)
    for a, b in zip(got, want):
        assert (a is None) == (b is None) and (a is None or rel_rms(a, b) < 1e-5)


@pytest.mark.cuda
@pytest.mark.parametrize("scale", ["sqrt_d", "kmean", "pnorm"])
@pytest.mark.parametrize("window", [None, 64])
def test_cuda_softmax_flex_documents_alone(scale, window):
    """On CUDA through FlexAttention's block mask built on the device: each document alone."""
    cu = offsets([300, 1, 211, 0, 512])
    T = cu[-1]
    q, k, v = (randn(1, 4, T, 64, seed=s).cuda().requires_grad_() for s in (1, 2, 3))
    out = softmax_attention(q, k, v, scale=scale, window=window, cu_seqlens=torch.tensor(cu, device="cuda"))
    ref = torch.cat([softmax_attention(q[:, :, a:b].double(), k[:, :, a:b].double(), v[:, :, a:b].double(),
                                       scale=scale, window=window, impl="naive")
                     for a, b in zip(cu[:-1], cu[1:]) if b > a], 2)
    assert rel_rms(out, ref) < 1e-3
    g = torch.autograd.grad(out.square().sum(), (q, k, v))
    w = torch.autograd.grad(ref.square().sum(), (q, k, v))
    for a, b in zip(g, w):
        assert rel_rms(a, b, floor=1e-3) < 2e-3


GOAT = {"causal": {}, "window": {"window": 5}, "hybrid": {"hybrid": True}, "bidirectional": {"causal": False}}


def goat(q, k, v, freqs, lam_sym, lam_asym, u, hybrid=False, qs=None, ks=None, tau=None, **kw):
    extra = {"qs": qs, "ks": ks, "tau": tau} if hybrid else {}
    return goat_attention(q, k, v, freqs, lam_sym, lam_asym, u, **extra, **kw)


@pytest.mark.parametrize("lengths, impl", KERNEL_CASES)
@pytest.mark.parametrize("case", GOAT.keys())
def test_goat_documents_alone(case, lengths, impl):
    """GOAT's spectral prior reads i - j, the same wherever a document lies: packed, each query reads
    its own document (its key-only term u given per key, as a layer gives it at positions inside the
    document), equal to each document alone, outputs and every gradient (u's and the prior's too)."""
    kw = dict(GOAT[case])
    if impl == "triton":
        pytest.importorskip("triton")
        if "window" in kw or "causal" in kw:
            pytest.skip("the kernel runs GOAT causal, without a window")
    cu = offsets(LENGTHS[lengths])
    T = cu[-1]
    t = {"q": randn(1, 4, T, 8, seed=1), "k": randn(1, 2, T, 8, seed=2), "v": randn(1, 2, T, 6, seed=3),
         "freqs": torch.rand(3, generator=torch.Generator().manual_seed(4)), "lam_sym": randn(2, 3, seed=5),
         "lam_asym": randn(2, 3, seed=6), "u": randn(1, 2, T, seed=7)}
    if kw.pop("hybrid", False):
        t.update(qs=randn(1, 4, T, seed=8), ks=randn(1, 4, T, seed=9),
                 tau=torch.rand(4, generator=torch.Generator().manual_seed(10)) + 0.5)
        kw["hybrid"] = True
    compare(goat, t, cu, impl, floor=1e-2, **kw)
