"""Training through the window in Triton (attnlab.ops.scalar.triton_selected) against the naive
windowed op in float64: outputs and every gradient (q, k, v, qs, ks, tau, the gain), scalar and hybrid
heads, both kernels, T = 1 / 63 / 130, D = 16 / 64, GQA, the sink, k + w >= T, ties; the layer's
`impl="triton"`; the hostile-input policy. On the CPU the kernel runs in Triton's interpreter."""

from __future__ import annotations

import pytest
import torch

from attnlab.ops.scalar.windowed import windowed_attention
from attnlab.testing import rel_rms

pytest.importorskip("triton")
pytestmark = pytest.mark.usefixtures("one_thread")
DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make(B, H, G, T, D, Dv, *, hybrid, per_query_tau=False, ties=False, seed=0):
    g = torch.Generator().manual_seed(seed * 1000 + T)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    qs, ks = r(B, H, T), r(B, H, T)
    if ties:
        qs, ks = qs.round(), ks.round()
    tau = 0.3 + (torch.rand(B, H, T, generator=g, dtype=torch.float64) if per_query_tau else
                 torch.rand(H, generator=g, dtype=torch.float64))
    ins = dict(qs=qs, ks=ks, v=r(B, G, T, Dv), tau=tau)
    if hybrid:
        ins.update(q=r(B, H, T, D), k=r(B, G, T, D), lam=0.5 + torch.rand(H, generator=g, dtype=torch.float64))
    return ins


def run(ins, impl, dtype, *, window, local=0, n_prefix=0, kernel="gaussian", dout_dtype=None):
    t = {n: x.to(DEV, dtype if n not in ("tau", "lam") else torch.float32 if dtype != torch.float64 else dtype)
         .requires_grad_() for n, x in ins.items()}
    out = windowed_attention(t["qs"], t["ks"], t["v"], t["tau"], window, q=t.get("q"), k=t.get("k"),
                             scalar_scale=t.get("lam"), local=local, n_prefix=n_prefix, impl=impl, kernel=kernel)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
    if dout_dtype is not None:
        dout = dout.to(dout_dtype).double()
    grads = torch.autograd.grad(out, list(t.values()), dout.to(DEV, out.dtype))
    return out, dict(zip(t, grads))


def check(ins, dtype=torch.float32, tol=1e-5, **kw):
    # the float64 reference sees the inputs and output gradient the kernel sees, rounded to its dtype
    # (tau and the scalar scale in float32): rounding qs and ks can change which keys are nearest
    rounded = {n: x.to(torch.float32 if n in ("tau", "lam") else dtype).double() for n, x in ins.items()}
    ref, ref_g = run(rounded, "naive", torch.float64, dout_dtype=dtype, **kw)
    out, got = run(ins, "triton", dtype, **kw)
    assert out.dtype == dtype
    assert rel_rms(out.double().cpu(), ref.cpu()) < tol
    for n in ref_g:
        assert rel_rms(got[n].double().cpu(), ref_g[n].cpu(), floor=1e-2) < 10 * tol, n


# (B, H, G, T, D, Dv, window, local, n_prefix): T = 1, not a tile multiple, GQA, a sink, k + w >= T, D = 80
CASES = {
    "T1": (1, 2, 1, 1, 16, 16, 3, 2, 0),
    "T63-gqa": (2, 4, 2, 63, 16, 8, 5, 3, 0),
    "T130-sink": (1, 2, 2, 130, 64, 16, 7, 4, 1),
    "k+w>=T": (1, 2, 1, 20, 16, 16, 30, 4, 0),
    "no-local": (1, 2, 2, 40, 16, 16, 6, 0, 0),
    "D80-sink2": (1, 2, 1, 50, 80, 24, 5, 3, 2),  # D not a power of two; queries before the sink's end
}


@pytest.mark.parametrize("hybrid", [False, True], ids=["scalar", "hybrid"])
@pytest.mark.parametrize("kernel", ["gaussian", "cauchy"])
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.heavy) if CASES[c][3] > 60 or CASES[c][4] > 64 else c
                                  for c in CASES])
def test_kernel_matches_naive(case, kernel, hybrid):
    B, H, G, T, D, Dv, window, local, n_prefix = CASES[case]
    ins = make(B, H, G, T, D, Dv, hybrid=hybrid, per_query_tau=case == "T63-gqa")
    check(ins, window=window, local=local, n_prefix=n_prefix, kernel=kernel)


@pytest.mark.heavy  # 2.0 s under the interpreter
def test_ties_pick_the_keys_the_naive_op_picks():
    """Integer scalar keys: many equal distances; the window takes the newest first, as the cache."""
    ins = make(1, 2, 2, 48, 16, 16, hybrid=True, ties=True)
    check(ins, window=6, local=4, kernel="cauchy")


@pytest.mark.heavy  # 2.0 s under the interpreter
def test_bf16_inputs():
    ins = make(1, 2, 1, 40, 64, 16, hybrid=True)
    check(ins, torch.bfloat16, tol=2e-2, window=8, local=8, kernel="cauchy")


@pytest.mark.heavy
def test_the_layer_trains_through_the_kernel(monkeypatch):
    """A windowed hybrid layer with impl='triton' runs the kernel (and its loss equals impl='fast')."""
    from attnlab.models.config import ModelConfig
    from attnlab.models.lm import LM
    from attnlab.ops.scalar import triton_selected

    calls = []
    real = triton_selected.triton_selected_attention
    monkeypatch.setattr(triton_selected, "triton_selected_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    losses = []
    for impl in ("triton", "fast"):
        torch.manual_seed(0)
        cfg = ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=2, attn="hybrid", max_seq_len=40,
                          attention=dict(train_window=4, local_window=4, kernel="cauchy", impl=impl))
        m = LM(cfg).to(DEV)
        idx = torch.randint(0, 32, (2, 41), generator=torch.Generator().manual_seed(1)).to(DEV)
        loss = m(idx[:, :-1], targets=idx[:, 1:])[1]
        loss.backward()
        losses.append(loss.item())
    assert calls and abs(losses[0] - losses[1]) < 1e-5


def test_refusals_name_the_argument():
    ins = make(1, 2, 1, 8, 16, 16, hybrid=False)
    with pytest.raises(ValueError, match="impl='triton' reads selected keys: it takes no budget"):
        windowed_attention(ins["qs"], ins["ks"], ins["v"], ins["tau"], 3, budget=4, impl="triton")
    with pytest.raises(ValueError, match="impl must be"):
        windowed_attention(ins["qs"], ins["ks"], ins["v"], ins["tau"], 3, impl="trition")


def test_without_the_interpreter_triton_on_the_cpu_is_refused(monkeypatch):
    from attnlab.ops.common import triton_math

    monkeypatch.setattr(triton_math, "interpreted", lambda: False)
    monkeypatch.setattr("attnlab.ops.scalar.triton_op.interpreted", lambda: False)
    ins = make(1, 2, 1, 8, 16, 16, hybrid=False)
    if DEV == "cpu":
        with pytest.raises(ValueError, match="impl='triton': Triton runs on CUDA tensors"):
            windowed_attention(ins["qs"], ins["ks"], ins["v"], ins["tau"], 3, impl="triton")


@pytest.mark.cuda
@pytest.mark.parametrize("kernel", ["gaussian", "cauchy"])
def test_cuda_kernel_matches_float64_at_gpu_shapes(kernel):
    ins = make(2, 8, 2, 1000, 64, 64, hybrid=True)
    check(ins, torch.float32, tol=1e-4, window=16, local=32, kernel=kernel)
    check(ins, torch.bfloat16, tol=2e-2, window=16, local=32, kernel=kernel)


@pytest.mark.parametrize("kernel", ["gaussian", pytest.param("cauchy", marks=pytest.mark.heavy)])
def test_keys_given_as_indices_go_through_the_kernel(kernel):
    """An IndexedKeep (the learned selector's keys: any K keys per query, the sink first) through
    impl="triton" equals the naive op masked by the same keep_fn, in float64 against float32."""
    from attnlab.index.keep import IndexedKeep, learned_indices, learned_keep

    ins = make(1, 2, 1, 40, 16, 16, hybrid=True)
    g = torch.Generator().manual_seed(3)
    sq, sk = (torch.randn(1, 2, 40, 4, generator=g, dtype=torch.float64) for _ in range(2))
    keep = IndexedKeep(learned_keep(sq, sk, 6, 1), lambda: tuple(x.to(DEV) for x in learned_indices(sq, sk, 6, 1)))

    def through(impl, dtype):
        t = {n: x.to(DEV, dtype if n not in ("tau", "lam") or dtype == torch.float64 else torch.float32)
             .requires_grad_() for n, x in ins.items()}
        out = windowed_attention(t["qs"], t["ks"], t["v"], t["tau"], None, q=t["q"], k=t["k"], scalar_scale=t["lam"],
                                 n_prefix=1, keep_fn=keep, impl=impl, kernel=kernel)
        dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(5), dtype=torch.float64)
        return out, torch.autograd.grad(out, list(t.values()), dout.to(DEV, out.dtype))

    ref, ref_g = through("naive", torch.float64)
    out, got = through("triton", torch.float32)
    assert rel_rms(out.double().cpu(), ref.cpu()) < 1e-5
    for a, b in zip(got, ref_g):
        assert rel_rms(a.double().cpu(), b.cpu(), floor=1e-2) < 1e-4


def test_selection_inverted_by_key():
    """`_invert`: every used (query, key) pair once, grouped by key in query order, START the first pair of
    each key; unused columns (-1) sort past the last key."""
    from attnlab.ops.scalar.triton_selected import _invert

    sel = torch.tensor([[[[0, -1], [1, 0], [2, 1]]]], dtype=torch.int32)  # (1, 1, T=3, M=2)
    pq, pk, start = _invert(sel)
    assert start[0, 0].tolist() == [0, 2, 4, 5]
    assert pk[0, 0, :5].tolist() == [0, 0, 1, 1, 2] and pq[0, 0, :5].tolist() == [0, 1, 1, 2, 2]


@pytest.mark.heavy
def test_one_graph_under_compile_with_the_kernels_opaque():
    """The kernels run inside custom ops (attnlab::selected_fwd / selected_bwd): torch.compile traces the
    layer's call as one graph without reading the Triton source (on a GPU, Inductor's own launch of
    these kernels failed), and the compiled forward and gradients equal the eager ones."""
    import torch._dynamo

    from attnlab.ops.scalar import triton_selected  # noqa: F401 - registers the ops

    ins = make(1, 2, 1, 40, 16, 16, hybrid=True, seed=3)

    def f(qs, ks, v, tau, q, k, lam):
        return windowed_attention(qs, ks, v, tau, 4, q=q, k=k, scalar_scale=lam, local=3, impl="triton",
                                  kernel="cauchy")

    t = [ins[n].float().requires_grad_() for n in ("qs", "ks", "v", "tau", "q", "k", "lam")]
    want = f(*t)
    want_g = torch.autograd.grad(want.square().sum(), t)
    torch._dynamo.reset()
    got = torch.compile(f, fullgraph=True, backend="aot_eager")(*t)
    got_g = torch.autograd.grad(got.square().sum(), t)
    assert torch.allclose(got, want, atol=1e-6)
    for a, b in zip(got_g, want_g):
        assert torch.allclose(a, b, atol=1e-5)
    graph = torch._dynamo.explain(f)(*t)
    assert graph.graph_count == 1 and graph.graph_break_count == 0, graph.break_reasons
    code = "".join(m.code for m in graph.graphs[0].modules() if isinstance(m, torch.fx.GraphModule))
    assert "selected_fwd" in code and "selected_bwd" in code and "triton_kernel_wrapper" not in code
