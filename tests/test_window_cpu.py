"""Windowed attention on the compiled CPU kernels (csrc/window.cpp, ops/scalar/window_cpu.py): the
selection equals the dense rule's indices in its order (ties newest first, all keys equal, packed
documents, k + w >= T), and attention over the selected keys equals the naive op on outputs and every
gradient (scalar and hybrid, both kernels, tau per head / per query, a signed gain, GQA, a sink, a
local window, packed documents), at T 1, 63 and 130; plus float32 / bf16 tolerances, gradcheck,
thread-count independence and the fallback when the kernels are off."""

from __future__ import annotations

import itertools

import pytest
import torch

from attnlab.ops import _ext, windowed_attention
from attnlab.ops.scalar import window_cpu
from attnlab.ops.scalar.window import window_indices
from attnlab.testing import compare_fwd_bwd

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture
def kernels():
    if _ext.library() is None:
        pytest.skip("compiled kernels unavailable on this machine (no C++ compiler or build failed)")


def _keys(kind: str, B: int, H: int, T: int, dtype, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    qs, ks = torch.randn(B, H, T, generator=g, dtype=dtype), torch.randn(B, H, T, generator=g, dtype=dtype)
    if kind == "grid":  # many exact ties, on both sides of a query
        qs, ks = (qs * 2).round() / 2, (ks * 2).round() / 2
    elif kind == "repeat":
        ks[..., T // 2:] = ks[..., : T - T // 2]
    elif kind == "equal":
        ks = torch.zeros_like(ks)
    return qs, ks


def _docs(B: int, T: int) -> torch.Tensor:
    """(B, T) ids of uneven documents: cuts at 1, T // 3 and T - 2 in row 0, one document in row 1."""
    docs = torch.zeros(B, T, dtype=torch.long)
    for cut in sorted({1, T // 3, T - 2}):
        if 0 < cut < T:
            docs[0, cut:] += 1
    return docs


@pytest.mark.parametrize("T", [1, 63, 130])
@pytest.mark.parametrize("kind", ["random", "grid", "repeat", "equal"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_selection_equals_the_dense_rule(kernels, T, kind, dtype):
    qs, ks = _keys(kind, 2, 3, T, dtype)
    for window, local, n_prefix, docs in ((1, 0, 0, False), (7, 5, 1, False), (40, 32, 0, False), (200, 0, 2, False),
                                          (5, 3, 0, True), (16, 0, 0, True)):
        seg = None
        if docs:
            from attnlab.ops.common.packed import packing

            seg = packing(None, _docs(2, T), 2, T, qs).seg
        got = window_indices(qs, ks, window, n_prefix=n_prefix, local=local, seg=seg)
        with _ext.disabled():
            want = window_indices(qs, ks, window, n_prefix=n_prefix, local=local, query_chunk=16, seg=seg)
        assert torch.equal(got[1], want[1]), (window, local, n_prefix, docs)
        if dtype == torch.float32:  # the dense rule's float32 top-k orders by (distance, newest): the same order
            assert torch.equal(got[0][got[1]], want[0][want[1]]), (window, local, n_prefix, docs)
        else:  # its float64 rule returns the keys unordered: the same set per query
            sets = [torch.where(i[1], i[0], -1).sort(-1).values for i in (got, want)]
            assert torch.equal(*sets), (window, local, n_prefix, docs)


def test_selection_takes_the_newest_of_equal_keys(kernels):
    ks = torch.tensor([[[0.0, 1.0, 1.0, 1.0, 5.0, 1.0, 9.0, 3.0]]])
    qs = torch.full_like(ks, 1.0)
    idx, ok = window_cpu.select_nearest(qs, ks, 2, 0, 0)
    assert idx[0, 0, 6].tolist() == [5, 3] and ok[0, 0, 6].all()
    qs = torch.full_like(ks, 2.0)  # 1.0 and 3.0 are equally near: the newer (3.0 at position 7) first
    idx, ok = window_cpu.select_nearest(qs, ks, 2, 0, 0)
    assert idx[0, 0, 7].tolist() == [7, 5]


def _case(T, hybrid, kernel, tau_form, gain, n_prefix, local, docs, dtype=torch.float64, seed=0, ties=True):
    B, H, G, D, Dv = 2, 4, 2, 8, 6
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    qs, ks, v = r(B, H, T), r(B, H, T), r(B, G, T, Dv)
    if ties:  # exact ties (not for finite differences: a nudged tie changes the selection)
        ks[..., T // 2:] = ks[..., : T - T // 2]
    tau = {"float": 0.6, "head": torch.rand(H, generator=g, dtype=dtype) + 0.3,
           "query": torch.rand(B, H, T, generator=g, dtype=dtype) + 0.3}[tau_form]
    q, k = (r(B, H, T, D), r(B, 1, T, D)) if hybrid else (None, None)
    lam = torch.tensor([0.7, 0.0, -0.4, 2.0], dtype=dtype) if gain and hybrid else None
    return [qs, ks, v, tau, q, k, lam], dict(n_prefix=n_prefix, local=local, kernel=kernel,
                                             docs=_docs(B, T) if docs else None)


def _op(impl, window):
    def fn(qs, ks, v, tau, q, k, lam, **kw):
        return windowed_attention(qs, ks, v, tau, window, q=q, k=k, scalar_scale=lam, impl=impl, **kw)
    return fn


CASES = [  # T, hybrid, kernel, tau, gain, n_prefix, local, docs, window
    (1, False, "gaussian", "float", False, 0, 0, False, 4),
    (63, False, "cauchy", "query", False, 2, 4, False, 5),
    (63, True, "gaussian", "head", True, 0, 8, False, 3),
    (130, True, "cauchy", "query", True, 1, 32, False, 16),
    (130, True, "cauchy", "head", False, 0, 5, True, 7),
    (63, False, "gaussian", "query", False, 0, 0, True, 2),
    (40, True, "gaussian", "float", False, 0, 32, False, 16),  # k + w >= T
]


@pytest.mark.parametrize("case", CASES, ids=[f"T{c[0]}-{'hyb' if c[1] else 'sca'}-{c[2]}-{c[3]}" for c in CASES])
def test_attention_matches_naive_on_every_gradient(cpu_kernels, case):
    *spec, window = case
    inputs, kw = _case(*spec)
    for x in inputs:
        if isinstance(x, torch.Tensor):
            x.requires_grad_()
    err = compare_fwd_bwd(lambda *a: _op("fast", window)(*a, **kw), lambda *a: _op("naive", window)(*a, **kw), inputs)
    assert max(err.values()) < 1e-10, err


@pytest.mark.parametrize("dtype,tol", [(torch.float32, 2e-5), (torch.bfloat16, 1e-2)])
def test_low_precision_inputs(kernels, dtype, tol):
    inputs, kw = _case(130, True, "cauchy", "query", True, 1, 32, False)
    low = [x.to(dtype) if isinstance(x, torch.Tensor) and x.dim() > 1 else x for x in inputs]
    ref = [x.to(dtype).double() if isinstance(x, torch.Tensor) and x.dim() > 1 else x for x in inputs]
    for x in low + ref:
        if isinstance(x, torch.Tensor) and x.is_floating_point():
            x.requires_grad_()
    err = compare_fwd_bwd(lambda *a: _op("fast", 16)(*a, **kw), lambda *a: _op("naive", 16)(*a, **kw), low)
    err_ref = compare_fwd_bwd(lambda *a: _op("naive", 16)(*a, **kw), lambda *a: _op("naive", 16)(*a, **kw), ref)
    assert max(err.values()) < tol and max(err_ref.values()) == 0.0, err


@pytest.mark.heavy  # seconds
def test_gradcheck(kernels):
    inputs, kw = _case(9, True, "cauchy", "query", True, 1, 2, False, ties=False)
    leaves = [x.requires_grad_() if isinstance(x, torch.Tensor) else x for x in inputs]
    assert torch.autograd.gradcheck(lambda *a: _op("fast", 3)(*a, **kw), leaves)


def test_results_do_not_depend_on_the_thread_count(kernels):
    inputs, kw = _case(130, True, "cauchy", "query", True, 0, 8, False, dtype=torch.float32)
    outs = []
    for threads in (1, 2):
        torch.set_num_threads(threads)
        leaves = [x.detach().clone().requires_grad_() if isinstance(x, torch.Tensor) else x for x in inputs]
        out = _op("fast", 5)(*leaves, **kw)
        grads = torch.autograd.grad(out.square().sum(), [x for x in leaves if isinstance(x, torch.Tensor)])
        outs.append((out, *grads))
    torch.set_num_threads(1)
    assert all(torch.equal(a, b) for a, b in zip(*outs))


def test_kernels_off_take_the_pytorch_path(kernels, monkeypatch):
    """ATTNLAB_NO_EXT=1 routes around the kernels (same values), and the kernels see the inputs otherwise."""
    inputs, kw = _case(63, True, "cauchy", "head", False, 0, 4, False)
    calls = []
    real = window_cpu.selected_cpu
    monkeypatch.setattr(window_cpu, "selected_cpu", lambda *a, **k: calls.append(1) or real(*a, **k))
    on = _op("fast", 5)(*inputs, **kw)
    assert calls == [1]
    monkeypatch.setenv("ATTNLAB_NO_EXT", "1")
    off = _op("fast", 5)(*inputs, **kw)
    assert calls == [1]
    torch.testing.assert_close(on, off, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("T,k,local", list(itertools.product([2, 50], [1, 6], [0, 3])))
def test_selection_of_every_query_is_its_nearest(kernels, T, k, local):
    """Direct statement of the rule per query (independent of the dense code): the chosen keys are the
    k smallest (distance, -position) among positions <= t - local."""
    qs, ks = _keys("grid", 1, 2, T, torch.float32, seed=T)
    idx, ok = window_cpu.select_nearest(qs, ks, k, 0, local)
    for h in range(2):
        for t in range(T):
            cand = sorted(range(0, t - local + 1), key=lambda s: (abs(float(qs[0, h, t] - ks[0, h, s])), -s))[:k]
            assert idx[0, h, t][ok[0, h, t]].tolist() == cand


def test_benchmark_runs_and_writes_its_rows(kernels, tmp_path, monkeypatch):
    """benchmarks/window_cpu.py at two tiny lengths: a row per length with every path timed, and a path
    past --max-s left out of the longer length."""
    import importlib.util
    import json
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    spec = importlib.util.spec_from_file_location("window_cpu_bench", bench / "window_cpu.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    out = tmp_path / "w.json"
    mod.main(["--T", "40,80", "--rounds", "1", "--threads", "1", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert [r["T"] for r in rows] == [40, 80]
    assert all(r["kernels_ms"] > 0 and r["exact_over_kernels"] > 0 and r["select_ms"] > 0 for r in rows)
    mod.main(["--T", "40,80", "--rounds", "1", "--threads", "1", "--max-s", "0", "--out", str(out)])
    rows = json.loads(out.read_text())["rows"]
    assert "kernels_ms" in rows[1] and "exact_ms" not in rows[1] and "pytorch_ms" not in rows[1]
