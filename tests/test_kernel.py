"""The Cauchy kernel (kernel="cauchy"): its weights are 1 / (1 + (qs - ks)^2 / tau) normalised, the
chunked and gathered paths equal the naive reference in outputs and every gradient (ties, the
local window, a prefix, per-query tau, the hybrid's gain), and the sorted cache reads the formula.
(A layer trained through its window decodes what it trained on under either kernel:
tests/test_train_window.py.)"""

import pytest
import torch

from attnlab.layers import AttentionConfig
from attnlab.ops import hybrid_attention, scalar_attention, windowed_attention
from attnlab.ops.scalar.chunked import chunked_kernel_attention
from attnlab.testing import rel_rms


def inputs(B=2, H=4, G=2, T=29, D=8, ties=False, per_query=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    qs, ks = (torch.randn(B, H, T, generator=g, dtype=torch.float64) for _ in range(2))
    if ties:
        ks = ks.round()
    v = torch.randn(B, G, T, D, generator=g, dtype=torch.float64)
    tau = (torch.rand(B, H, T, generator=g, dtype=torch.float64) if per_query
           else torch.rand(H, generator=g, dtype=torch.float64)) + 0.3
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64)
    k = torch.randn(B, G, T, D, generator=g, dtype=torch.float64)
    return qs, ks, v, tau, q, k


def test_cauchy_weights_are_the_kernel():
    qs, ks, v, tau, *_ = inputs(H=2, G=2, T=6)
    out = scalar_attention(qs, ks, v, tau, kernel="cauchy", impl="naive")
    x = (qs[..., :, None] - ks[..., None, :]) ** 2 / tau.view(1, -1, 1, 1)
    w = torch.tril(1.0 / (1.0 + x))
    w = w / w.sum(-1, keepdim=True)
    assert rel_rms(out, w @ v) < 1e-12
    gauss = scalar_attention(qs, ks, v, tau, impl="naive")
    assert rel_rms(out, gauss) > 1e-3  # another kernel, not the Gaussian


@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("per_query", [False, True])
def test_chunked_path_equals_naive_with_gradients(hybrid, causal, per_query):
    qs, ks, v, tau, q, k = inputs(per_query=per_query)
    qs = qs[..., 5:]  # fewer queries than keys: the queries are the last ones
    tau = tau[..., 5:] if per_query else tau
    q = q[:, :, 5:]
    lam = torch.tensor([0.0, 0.5, 1.0, 2.0], dtype=torch.float64)
    leaves = [x.requires_grad_() for x in (qs, ks, v, tau, *((q, k, lam) if hybrid else ()))]
    res = []
    for impl in ("naive", "auto"):
        if hybrid:
            o = hybrid_attention(q, k, v, qs, ks, tau, causal=causal, impl=impl, scalar_scale=lam, kernel="cauchy")
        else:
            o = scalar_attention(qs, ks, v, tau, causal=causal, impl=impl, kernel="cauchy")
        res.append([o, *torch.autograd.grad(o.square().sum(), leaves)])
    for a, b in zip(*res):
        assert rel_rms(b, a) < 1e-12
    small = chunked_kernel_attention(qs.detach(), ks.detach(), v.detach(), tau.detach(), None, None, "cauchy", causal,
                                     None, chunk=3)  # chunk edges anywhere
    assert rel_rms(small, scalar_attention(qs.detach(), ks.detach(), v.detach(), tau.detach(), causal=causal,
                                           impl="naive", kernel="cauchy")) < 1e-12


@pytest.mark.parametrize("kernel", ["cauchy", "gaussian"])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("n_prefix,local", [(0, 0), (1, 3)])
@pytest.mark.parametrize("hybrid", [False, True])
def test_window_gather_path_equals_dense_with_gradients(hybrid, n_prefix, local, ties, kernel):
    qs, ks, v, tau, q, k = inputs(ties=ties, per_query=True)
    if not hybrid:
        q = k = None
    lam = torch.tensor([-0.5, 0.0, 1.0, 3.0], dtype=torch.float64) if hybrid else None
    leaves = [x.requires_grad_() for x in (qs, ks, v, tau, q, k, lam) if x is not None]
    res = []
    for impl in ("naive", "fast"):
        o = windowed_attention(qs, ks, v, tau, 4, q=q, k=k, n_prefix=n_prefix, local=local, impl=impl, query_chunk=7,
                               scalar_scale=lam, kernel=kernel)
        res.append([o, *torch.autograd.grad(o.square().sum(), leaves)])
    for a, b in zip(*res):
        assert rel_rms(b, a) < 1e-12
    if kernel == "cauchy":  # the same keys, another weighting
        gauss = windowed_attention(qs, ks, v, tau, 4, q=q, k=k, n_prefix=n_prefix, local=local, scalar_scale=lam)
        assert rel_rms(res[0][0], gauss) > 1e-3


def test_bad_kernel_is_refused_by_name():
    qs, ks, v, tau, q, k = inputs(T=5)
    for call in (lambda: scalar_attention(qs, ks, v, tau, kernel="laplace"),
                 lambda: hybrid_attention(q, k, v, qs, ks, tau, kernel=None),
                 lambda: windowed_attention(qs, ks, v, tau, 2, kernel="Cauchy")):
        with pytest.raises(ValueError, match="kernel"):
            call()
    for bad in ("laplace", 1):
        with pytest.raises(ValueError, match="kernel"):
            AttentionConfig(d_model=32, n_heads=4, mechanism="scalar", kernel=bad)
    with pytest.raises(ValueError, match="kernel"):
        AttentionConfig(d_model=32, n_heads=4, mechanism="softmax", kernel="cauchy")
    with pytest.raises(ValueError, match="kernel"):
        AttentionConfig(d_model=32, n_heads=4, mechanism="scalar", kernel="cauchy", impl="approx")


@pytest.mark.parametrize("d_k", [None, 8], ids=["scalar", "hybrid"])
def test_sorted_cache_under_cauchy_fast_equals_naive_and_the_formula(d_k):
    """SortedScalarCache(kernel="cauchy"): the fast path equals the naive one (outputs and gradients,
    window, radius, eps, the hybrid's gain), the window's output is the formula over the k nearest,
    and eps maps to the Cauchy radius sqrt(tau (1/eps - 1))."""
    import math

    from attnlab.cache.sorted import SortedScalarCache
    from attnlab.testing import compare_fwd_bwd

    g = torch.Generator().manual_seed(1)
    B, H, G, Dv, N = 2, 4, 2, 6, 120
    ks, v = torch.randn(N, B, H, generator=g), torch.randn(N, B, G, Dv, generator=g)
    k = torch.randn(N, B, H, d_k, generator=g) if d_k else None
    cache = SortedScalarCache(B, H, G, Dv, d_k=d_k, buffer_size=8, level_ratio=4, kernel="cauchy",
                              sink_key=torch.zeros(H), sink_value=torch.randn(H, Dv, generator=g))
    for t in range(N):
        cache.append(ks[t], v[t], None if k is None else k[t])
    qs = torch.randn(B, H, generator=g)
    q = torch.randn(B, H, d_k, generator=g) if d_k else None
    tau = torch.rand(B, H, generator=g) + 0.2
    lam = torch.tensor([0.5, 0.0, -0.5, 2.0]) if d_k else None
    inputs = [qs.clone().requires_grad_(), tau.clone().requires_grad_()] + ([q.clone().requires_grad_()] if d_k else [])
    for kw in (dict(window=7), dict(window=None), dict(eps=0.2, window=None), dict(radius=0.3, window=4)):
        errs = compare_fwd_bwd(
            lambda *a: cache.attend(a[0], a[1], *a[2:], impl="fast", scalar_scale=lam, **kw),
            lambda *a: cache.attend(a[0], a[1], *a[2:], impl="naive", scalar_scale=lam, **kw), inputs)
        assert max(errs.values()) < 1e-5, (kw, errs)
    # the formula over the 7 nearest keys and the sink, per head
    out = cache.attend(qs, tau, q=q, window=7, scalar_scale=lam)
    keys = torch.cat([ks.permute(1, 2, 0), torch.zeros(B, H, 1)], -1)  # (B, H, N + 1), the sink last
    d = (keys - qs[..., None]).abs()
    near = d[..., :N].argsort(-1)[..., :7]
    logit = -torch.log1p(d ** 2 / tau[..., None]) * (lam.view(1, H, 1) if d_k else 1.0)
    if d_k:
        kv = torch.cat([k.permute(1, 2, 0, 3), torch.zeros(B, H, 1, d_k)], 2)
        logit = logit + (kv @ q[..., None]).squeeze(-1) / math.sqrt(d_k)
    keep = torch.zeros(B, H, N + 1, dtype=torch.bool).scatter_(-1, near, True)
    keep[..., N] = True
    w = torch.softmax(logit.masked_fill(~keep, float("-inf")), -1)
    vals = torch.cat([v.permute(1, 2, 0, 3).repeat_interleave(H // G, 1), cache.sink.value.view(B, H, 1, Dv)], 2)
    assert rel_rms(out, (w[..., None] * vals).sum(2)) < 1e-5
    r = (0.5 * (1 / 0.2 - 1)) ** 0.5
    assert torch.equal(cache.attend(qs, 0.5, q=q, eps=0.2, window=None, scalar_scale=lam),
                       cache.attend(qs, 0.5, q=q, radius=r, window=None, scalar_scale=lam))
