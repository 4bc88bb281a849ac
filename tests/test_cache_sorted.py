"""Sorted scalar KV cache: decode outputs against full attention, windows, bulk load, bad input."""

import math

import pytest
import torch

from attnlab.cache.sorted import SortedScalarCache, bytes_per_token
from attnlab.testing import compare_fwd_bwd, rel_rms

TOL = 1e-5


def reference(ks, v, qs, tau, n_groups, k=None, q=None, sink=None, select=None):
    """Full (or selected) attention by the formula over raw tokens.
    ks (N, B, H), v (N, B, G, Dv), qs (B, H), k (N, B, H, Dk), q (B, H, Dk);
    sink = (key (H,), value (H, Dv)[, vkey (H, Dk)]); select(dist (N, B, H)) -> bool mask."""
    N, B, H = ks.shape
    tau = torch.as_tensor(tau, dtype=torch.float64)
    tau = tau.view(1, 1, H) if tau.dim() == 1 else tau.view(1, *tau.shape[-2:]) if tau.dim() == 2 else tau.view(1, 1, 1)
    score = -((qs.double()[None] - ks.double()) ** 2) / tau  # (N, B, H)
    if k is not None:
        score = score + (k.double() * q.double()[None]).sum(-1) / math.sqrt(k.shape[-1])
    if select is not None:
        score = score.masked_fill(~select((qs[None] - ks).abs()), float("-inf"))
    vals = v.double()[:, :, torch.arange(H) // (H // n_groups)]  # (N, B, H, Dv)
    if sink is not None:
        s = -((qs.double() - sink[0].double()) ** 2) / tau[0]
        if k is not None:
            s = s + (q.double() * sink[2].double()).sum(-1) / math.sqrt(k.shape[-1])
        score = torch.cat([score, s[None]], 0)
        vals = torch.cat([vals, sink[1].double().expand(1, B, H, -1)], 0)
    w = torch.softmax(score, 0).nan_to_num(0.0)
    return (w[..., None] * vals).sum(0)  # (B, H, Dv)


def nearest(k):
    def select(dist):
        order = dist.argsort(0)
        rank = torch.empty_like(order).scatter_(0, order, torch.arange(dist.shape[0]).view(-1, 1, 1).expand_as(order))
        return rank < k
    return select


def fill(B=2, H=4, G=2, Dv=8, N=100, d_k=None, sink=False, **kw):
    ks, v = torch.randn(N, B, H), torch.randn(N, B, G, Dv)
    k = torch.randn(N, B, H, d_k) if d_k else None
    sk = (torch.randn(H), torch.randn(H, Dv), torch.randn(H, d_k) if d_k else None) if sink else None
    extra = dict(sink_key=sk[0], sink_value=sk[1], sink_vkey=sk[2]) if sink else {}
    cache = SortedScalarCache(B, H, G, Dv, d_k=d_k, buffer_size=8, level_ratio=4, **extra, **kw)
    for t in range(N):
        cache.append(ks[t], v[t], None if k is None else k[t])
    return cache, ks, v, k, sk


@pytest.mark.parametrize("N", [1, 63, 300], ids=lambda n: f"N{n}")
@pytest.mark.parametrize("d_k", [None, 16], ids=["scalar", "hybrid"])
@pytest.mark.parametrize("sink", [False, True], ids=["nosink", "sink"])
def test_exact_mode_equals_full_attention(N, d_k, sink):
    cache, ks, v, k, sk = fill(N=N, d_k=d_k, sink=sink)
    qs, q = torch.randn(2, 4), torch.randn(2, 4, d_k) if d_k else None
    ref = reference(ks, v, qs, 0.5, 2, k, q, sk)
    for window in (None, N, 10 ** 6):  # larger than what the cache holds: clamped, i.e. exact
        for impl in ("fast", "naive"):
            assert rel_rms(cache.attend(qs, 0.5, q=q, window=window, impl=impl), ref) < TOL


@pytest.mark.parametrize("window", [1, 5, 16])
@pytest.mark.parametrize("d_k", [None, 8], ids=["scalar", "hybrid"])
def test_window_is_the_k_nearest(window, d_k):
    cache, ks, v, k, sk = fill(N=200, d_k=d_k, sink=True)
    qs, q = torch.randn(2, 4), torch.randn(2, 4, d_k) if d_k else None
    tau = torch.rand(4) + 0.1  # per head
    ref = reference(ks, v, qs, tau, 2, k, q, sk, select=nearest(window))
    assert rel_rms(cache.attend(qs, tau, q=q, window=window), ref) < TOL


@pytest.mark.parametrize("d_k", [None, 8], ids=["scalar", "hybrid"])
def test_fast_matches_naive_outputs_and_gradients(d_k):
    cache, *_ = fill(N=150, d_k=d_k, sink=True)
    qs = torch.randn(2, 4, requires_grad=True)
    tau = (torch.rand(2, 4) + 0.2).requires_grad_()
    inputs = [qs, tau] + ([torch.randn(2, 4, d_k, requires_grad=True)] if d_k else [])
    for kw in (dict(window=7), dict(window=None), dict(eps=1e-2, window=None), dict(radius=0.3, window=4)):
        errs = compare_fwd_bwd(lambda *a: cache.attend(a[0], a[1], *a[2:], impl="fast", **kw),
                               lambda *a: cache.attend(a[0], a[1], *a[2:], impl="naive", **kw), inputs)
        assert max(errs.values()) < TOL, (kw, errs)


def test_radius_and_tolerance_modes():
    cache, ks, v, _, sk = fill(N=300, sink=True)
    qs, tau, eps = torch.randn(2, 4), 0.2, 1e-3
    r = math.sqrt(-tau * math.log(eps))
    ref = reference(ks, v, qs, tau, 2, sink=sk, select=lambda d: d <= r)
    assert rel_rms(cache.attend(qs, tau, eps=eps, window=None), ref) < TOL
    assert rel_rms(cache.attend(qs, tau, radius=r, window=None), ref) < TOL
    capped = reference(ks, v, qs, tau, 2, sink=sk, select=lambda d: (d <= r) & nearest(3)(d))
    assert rel_rms(cache.attend(qs, tau, radius=r, window=3), capped) < TOL
    # a radius with no key inside leaves only the sink
    far = cache.attend(torch.full((2, 4), 50.0), tau, radius=0.1)
    assert rel_rms(far, sk[1].expand(2, 4, -1)) < TOL


def test_bulk_load_equals_appends():
    B, H, G, Dv, N = 1, 4, 1, 8, 120
    ks, v, k = torch.randn(B, H, N), torch.randn(B, G, N, Dv), torch.randn(B, H, N, 4)
    bulk = SortedScalarCache.from_tensors(ks, v, k, buffer_size=8, level_ratio=4)
    seq = SortedScalarCache(B, H, G, Dv, d_k=4, buffer_size=8, level_ratio=4)
    for t in range(N):
        seq.append(ks[:, :, t], v[:, :, t], k[:, :, t])
    for _ in range(3):
        qs, q = torch.randn(B, H), torch.randn(B, H, 4)
        for window in (None, 9):
            assert rel_rms(bulk.attend(qs, 0.3, q, window=window), seq.attend(qs, 0.3, q, window=window)) < TOL
    step_k, step_v = torch.randn(B, H), torch.randn(B, G, Dv)  # bulk caches keep growing
    bulk.append(step_k, step_v, torch.randn(B, H, 4))
    assert len(bulk) == N + 1 and bool((bulk.n_entries() == N + 1).all())


def test_grouped_values_stored_once_per_group():
    cache, ks, v, _, _ = fill(B=1, H=8, G=2, Dv=4, N=10)
    assert tuple(cache.values.shape[:2]) == (1, 2) and cache.n_slots == 10
    # heads 0-3 read group 0, heads 4-7 group 1: attending with all keys equal gives the group mean
    same = SortedScalarCache(1, 8, 2, 4)
    for t in range(10):
        same.append(torch.zeros(1, 8), v[t, :1])
    out = same.attend(torch.zeros(1, 8), 1.0, window=None)
    assert rel_rms(out[0, :4], v[:, 0, 0].mean(0).expand(4, -1)) < TOL
    assert rel_rms(out[0, 4:], v[:, 0, 1].mean(0).expand(4, -1)) < TOL


def test_duplicate_keys_exact():
    B, H, G, Dv = 1, 2, 1, 4
    cache = SortedScalarCache(B, H, G, Dv, buffer_size=4, level_ratio=2)
    ks = torch.tensor([0.0, 1.0, 1.0, 1.0, -1.0, 1.0, 0.0] * 5).view(-1, 1, 1).expand(-1, B, H)
    v = torch.randn(ks.shape[0], B, G, Dv)
    for t in range(ks.shape[0]):
        cache.append(ks[t].contiguous(), v[t])
    qs = torch.full((B, H), 0.9)
    assert rel_rms(cache.attend(qs, 0.1, window=None), reference(ks, v, qs, 0.1, G)) < TOL


def test_bf16_values():
    cache, ks, v, _, _ = fill(N=50, dtype=torch.bfloat16)
    qs = torch.randn(2, 4)
    out = cache.attend(qs, 0.5, window=None)
    assert out.dtype == torch.bfloat16
    assert rel_rms(out, reference(ks, v.bfloat16(), qs, 0.5, 2)) < 2e-2


def test_bytes_per_token():
    scalar = bytes_per_token(8, 2, 64)
    assert scalar["key_index_per_head"] == 8 <= 12
    assert scalar["key_index"] == 64 and scalar["values"] == 2 * 64 * 4 and scalar["total"] == 64 + 512
    assert scalar["full_attention_kv"] == 8 * 128 * 4
    assert bytes_per_token(8, 2, 64, weighted=True)["key_index_per_head"] == 12
    hyb = bytes_per_token(8, 8, 64, d_k=32, dtype=torch.bfloat16)
    assert hyb["vector_keys"] == 8 * 32 * 2 and hyb["values"] == 8 * 64 * 2
    cache, *_ = fill(N=10)
    assert cache.bytes_per_token() == bytes_per_token(4, 2, 8)
    assert cache.memory_bytes() >= 10 * cache.bytes_per_token()["total"]


# ---- bad input --------------------------------------------------------------------------
def snapshot(cache):
    return (cache.index.all_entries().clone(), cache.values.clone(), cache.n_tokens, cache.n_slots)


def same_state(a, b):
    return all(torch.equal(x, y) if isinstance(x, torch.Tensor) else x == y for x, y in zip(a, b))


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), -float("inf")], ids=["nan", "inf", "-inf"])
def test_nonfinite_keys_rejected_and_cache_unchanged(bad):
    cache, *_ = fill(N=13, d_k=4)
    before = snapshot(cache)
    ks = torch.randn(2, 4)
    ks[1, 2] = bad
    with pytest.raises(ValueError, match="ks must be finite"):
        cache.append(ks, torch.randn(2, 2, 8), torch.randn(2, 4, 4))
    k = torch.randn(2, 4, 4)
    k[0, 0, 1] = bad
    with pytest.raises(ValueError, match="k must be finite"):
        cache.append(torch.randn(2, 4), torch.randn(2, 2, 8), k)
    assert same_state(before, snapshot(cache))
    big = torch.full((2, 4), 3e38)  # finite keys whose sum overflows are accepted
    cache.append(big, torch.randn(2, 2, 8), torch.randn(2, 4, 4))
    assert len(cache) == 14


def test_bad_shapes_and_arguments():
    cache, *_ = fill(N=5)
    qs = torch.randn(2, 4)
    with pytest.raises(ValueError, match=r"qs must have shape \(2, 4\)"):
        cache.attend(torch.randn(1, 4), 0.5)
    with pytest.raises(ValueError, match="qs"):
        cache.attend(torch.randn(2, 4, 1), 0.5)
    with pytest.raises(ValueError, match="ks must have shape"):
        cache.append(torch.randn(2, 3), torch.randn(2, 2, 8))
    with pytest.raises(ValueError, match="v must have shape"):
        cache.append(torch.randn(2, 4), torch.randn(2, 4, 8))
    with pytest.raises(ValueError, match="k must be None"):
        cache.append(torch.randn(2, 4), torch.randn(2, 2, 8), torch.randn(2, 4, 3))
    with pytest.raises(ValueError, match="q must be None"):
        cache.attend(qs, 0.5, q=torch.randn(2, 4, 3))
    for window in (0, -3):
        with pytest.raises(ValueError, match="window"):
            cache.attend(qs, 0.5, window=window)
    with pytest.raises(TypeError, match="window"):
        cache.attend(qs, 0.5, window=2.5)
    with pytest.raises(ValueError, match="tau must be > 0"):
        cache.attend(qs, 0.0)
    with pytest.raises(ValueError, match="tau"):
        cache.attend(qs, torch.ones(3))
    with pytest.raises(ValueError, match="radius or eps"):
        cache.attend(qs, 0.5, radius=1.0, eps=0.1)
    with pytest.raises(ValueError, match="eps"):
        cache.attend(qs, 0.5, eps=1.5)
    with pytest.raises(ValueError, match="qs must be finite"):
        cache.attend(torch.full((2, 4), float("nan")), 0.5)
    with pytest.raises(ValueError, match="impl"):
        cache.attend(qs, 0.5, impl="fastest")
    hyb, *_ = fill(N=3, d_k=4)
    with pytest.raises(ValueError, match="q .* is required"):
        hyb.attend(qs, 0.5)
    with pytest.raises(ValueError, match="k .* is required"):
        hyb.append(qs, torch.randn(2, 2, 8))
    with pytest.raises(ValueError, match="n_groups"):
        SortedScalarCache(1, 6, 4, 8)
    with pytest.raises(ValueError, match="sink_key and sink_value"):
        SortedScalarCache(1, 4, 2, 8, sink_key=0.0)
    with pytest.raises(ValueError, match="sink_value must have shape"):
        SortedScalarCache(1, 4, 2, 8, sink_key=0.0, sink_value=torch.zeros(3, 8))
    with pytest.raises(ValueError, match="sink_zone"):
        SortedScalarCache(1, 4, 2, 8, sink_zone=(1.0, -1.0))


def test_empty_cache():
    with pytest.raises(ValueError, match="empty and has no sink"):
        SortedScalarCache(1, 2, 1, 4).attend(torch.zeros(1, 2), 0.5)
    sink_v = torch.randn(1, 4)  # per group
    cache = SortedScalarCache(1, 2, 1, 4, sink_key=0.0, sink_value=sink_v)
    assert rel_rms(cache.attend(torch.randn(1, 2), 0.5), sink_v.expand(1, 2, 4)) < TOL


def test_capacity_full_raises():
    cache = SortedScalarCache(1, 2, 1, 4, capacity=3)
    for _ in range(3):
        cache.append(torch.randn(1, 2), torch.randn(1, 1, 4))
    with pytest.raises(RuntimeError, match="capacity=3"):
        cache.append(torch.randn(1, 2), torch.randn(1, 1, 4))
    assert len(cache) == 3


def test_growth_keeps_contents():
    cache, ks, v, _, _ = fill(N=1500)  # initial store holds 1024 slots: grows once
    qs = torch.randn(2, 4)
    assert cache.values.shape[2] >= 1500
    assert rel_rms(cache.attend(qs, 0.4, window=None), reference(ks, v, qs, 0.4, 2)) < TOL
