"""Sorted scalar KV cache: decode outputs against full attention, windows, bulk load, bad input."""

import math

import pytest
import torch

from attnlab.cache.kv import KVCache
from attnlab.cache.sorted import SortedScalarCache, bytes_per_token
from attnlab.testing import compare_fwd_bwd, rel_rms
from test_cache_properties import same_state, snapshot  # one bit-exact state comparison for both files

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
    dtype = kw.get("dtype", torch.float32)  # appended tensors must have the cache's dtype
    ks, v = torch.randn(N, B, H).to(dtype), torch.randn(N, B, G, Dv).to(dtype)
    k = torch.randn(N, B, H, d_k).to(dtype) if d_k else None
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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16, torch.float16], ids=str)
@pytest.mark.parametrize("d_k", [None, 6], ids=["scalar", "hybrid"])
def test_bytes_per_token(dtype, d_k):
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

    # against the bytes the cache really allocates: a bulk load with capacity N holds exactly N
    # slots per sequence in its stores and N entries per head in its index levels (no padding)
    B, H, G, Dv, N = 2, 6, 2, 5, 37  # G < H: values stored once per group
    ks, v = torch.randn(B, H, N).to(dtype), torch.randn(B, G, N, Dv).to(dtype)
    k = torch.randn(B, H, N, d_k).to(dtype) if d_k else None
    cache = SortedScalarCache.from_tensors(ks, v, k, capacity=N, buffer_size=4, level_ratio=2)
    nbytes = lambda t: t.numel() * t.element_size()
    per_token = lambda total: total / (B * N)
    for weighted in (False, True):
        if weighted:
            cache.index.ensure_weighted()  # what density compression does: a log-weight per entry
        got = cache.bytes_per_token()
        assert got["key_index_per_head"] == (12 if weighted else 8)
        assert per_token(sum(nbytes(run) for run in cache.index.runs())) == got["key_index"]
        assert per_token(nbytes(cache.values)) == got["values"]
        assert per_token(nbytes(cache.vkeys) if d_k else 0) == got["vector_keys"]
        assert per_token(cache.memory_bytes() - nbytes(cache.index.buf)) == got["total"]
    # an ordinary per-head K and V cache of the same head sizes, filled with the same tokens
    kv, keys = KVCache(B), k if d_k else torch.randn(B, H, N, Dv).to(dtype)  # scalar heads: keys of size d_v
    for t in range(N):
        full = kv.append(k=keys[:, :, t: t + 1], v=v[:, torch.arange(H) // (H // G), t: t + 1])
    assert per_token(nbytes(full["k"]) + nbytes(full["v"])) == got["full_attention_kv"]


# ---- bad input --------------------------------------------------------------------------
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
    assert same_state(before, cache)
    big = torch.full((2, 4), 3e38)  # finite keys whose sum overflows are accepted
    cache.append(big, torch.randn(2, 2, 8), torch.randn(2, 4, 4))
    assert len(cache) == 14


BAD = [float("nan"), float("inf"), -float("inf")]


@pytest.mark.parametrize("bad", BAD, ids=["nan", "inf", "-inf"])
@pytest.mark.parametrize("d_k", [None, 4], ids=["scalar", "hybrid"])
def test_nonfinite_input_rejected_everywhere(bad, d_k):
    """Policy: NaN/inf in any appended tensor, sink argument or query argument raises ValueError
    naming it (how many, of how many, where) before anything changes."""
    cache, ks, v, k, sk = fill(N=13, d_k=d_k, sink=True)
    cache.attend(torch.randn(2, 4), 0.5, q=torch.randn(2, 4, d_k) if d_k else None)  # a query history too
    before = snapshot(cache)
    good = dict(ks=torch.randn(2, 4), v=torch.randn(2, 2, 8), k=torch.randn(2, 4, d_k) if d_k else None)
    for name in ("ks", "v", "k") if d_k else ("ks", "v"):
        args = dict(good, **{name: good[name].clone()})
        args[name].view(-1)[3] = bad
        n = args[name].numel()
        with pytest.raises(ValueError, match=rf"^{name} must be finite, got .* of {n} entries .*unchanged"):
            cache.append(**args)
        assert same_state(before, cache), name
    query = dict(qs=torch.randn(2, 4), q=torch.randn(2, 4, d_k) if d_k else None, tau=torch.full((4,), 0.5))
    for name in ("qs", "q", "tau") if d_k else ("qs", "tau"):
        args = dict(query, **{name: query[name].clone()})
        args[name].view(-1)[1] = bad
        with pytest.raises(ValueError, match=rf"^{name} must be finite"):
            cache.attend(args["qs"], args["tau"], q=args["q"])
        assert same_state(before, cache), name
    for name, kw in (("tau", dict(tau=bad)), ("radius", dict(tau=0.5, radius=bad))):
        with pytest.raises(ValueError, match=rf"^{name} must be finite"):
            cache.attend(query["qs"], q=query["q"], **kw)
    assert same_state(before, cache)
    cache.append(**good)  # still usable; it takes the next slot
    assert len(cache) == 14 and cache.n_slots == 14

    # the sink, wherever it is set: constructor (float or tensor key, value, vector key) and bulk load
    sink = dict(sink_key=torch.zeros(4), sink_value=torch.zeros(2, 8), sink_vkey=torch.zeros(4, d_k) if d_k else None)
    for name in ("sink_key", "sink_value", "sink_vkey") if d_k else ("sink_key", "sink_value"):
        args = dict(sink, **{name: sink[name].clone()})
        args[name].view(-1)[-1] = bad
        with pytest.raises(ValueError, match=rf"^{name} must be finite"):
            SortedScalarCache(2, 4, 2, 8, d_k=d_k, **args)
        with pytest.raises(ValueError, match=rf"^{name} must be finite"):
            SortedScalarCache.from_tensors(torch.randn(2, 4, 5), torch.randn(2, 2, 5, 8),
                                           torch.randn(2, 4, 5, d_k) if d_k else None, **args)
    with pytest.raises(ValueError, match="^sink_key must be finite"):
        SortedScalarCache(2, 4, 2, 8, sink_key=bad, sink_value=torch.zeros(8))
    bulk = dict(ks=torch.randn(2, 4, 5), v=torch.randn(2, 2, 5, 8), k=torch.randn(2, 4, 5, d_k) if d_k else None)
    for name in ("ks", "v", "k") if d_k else ("ks", "v"):
        args = dict(bulk, **{name: bulk[name].clone()})
        args[name].view(-1)[7] = bad
        with pytest.raises(ValueError, match=rf"^{name} must be finite"):
            SortedScalarCache.from_tensors(**args)


def test_dtype_mismatch_rejected_and_cache_unchanged():
    """Appended tensors must have the cache's dtype, query tensors a floating one shared by qs
    and q, mixing parameters (tau, radius) any floating dtype; integer tensors are TypeErrors."""
    cache, *_ = fill(N=9, d_k=4, sink=True)
    before = snapshot(cache)
    good = dict(ks=torch.randn(2, 4), v=torch.randn(2, 2, 8), k=torch.randn(2, 4, 4))
    for name in good:
        for dtype in (torch.float64, torch.bfloat16, torch.int64):
            with pytest.raises(TypeError, match=rf"^{name} must have the cache's dtype torch.float32, got {dtype}"):
                cache.append(**dict(good, **{name: good[name].to(dtype)}))
    assert same_state(before, cache)
    qs, q = torch.randn(2, 4), torch.randn(2, 4, 4)
    with pytest.raises(TypeError, match="^qs must be a floating-point tensor, got torch.int64"):
        cache.attend(qs.long(), 0.5, q=q)
    with pytest.raises(TypeError, match=r"^q must have the dtype of qs \(torch.float32\), got torch.float64"):
        cache.attend(qs, 0.5, q=q.double())
    with pytest.raises(TypeError, match="^tau must be a float or a floating-point tensor, got torch.int64"):
        cache.attend(qs, torch.ones(4, dtype=torch.int64), q=q)
    assert same_state(before, cache)
    out = cache.attend(qs.double(), torch.full((4,), 0.5, dtype=torch.float64), q=q.double())  # float64 queries
    assert rel_rms(out, cache.attend(qs, 0.5, q=q)) < TOL
    with pytest.raises(TypeError, match="^sink_value must be a floating-point tensor"):
        SortedScalarCache(1, 4, 2, 8, sink_key=0.0, sink_value=torch.zeros(8, dtype=torch.int64))
    with pytest.raises(TypeError, match="^sink_key must be a float or a floating-point tensor"):
        SortedScalarCache(1, 4, 2, 8, sink_key=torch.zeros(4, dtype=torch.int32), sink_value=torch.zeros(8))
    # bulk load: the cache takes v's dtype unless told otherwise; ks and k must match it
    ks, v, k = torch.randn(1, 4, 6), torch.randn(1, 2, 6, 8), torch.randn(1, 4, 6, 4)
    assert SortedScalarCache.from_tensors(ks.double(), v.double(), k.double()).dtype == torch.float64
    with pytest.raises(TypeError, match="^ks must have the cache's dtype torch.float64, got torch.float32"):
        SortedScalarCache.from_tensors(ks, v.double(), k.double())
    with pytest.raises(TypeError, match="^v must have the cache's dtype torch.bfloat16, got torch.float32"):
        SortedScalarCache.from_tensors(ks.bfloat16(), v, k.bfloat16(), dtype=torch.bfloat16)


def test_float64_keys_beyond_float32_range_rejected():
    """The index holds float32 scalar keys: a finite float64 key or query that would round to inf
    there is rejected by name (not stored as inf), the cache unchanged."""
    cache = SortedScalarCache(1, 2, 1, 4, dtype=torch.float64)
    cache.append(torch.zeros(1, 2, dtype=torch.float64), torch.ones(1, 1, 4, dtype=torch.float64))
    before = snapshot(cache)
    with pytest.raises(ValueError, match="^ks must lie within the float32 range"):
        cache.append(torch.tensor([[0.0, 1e39]], dtype=torch.float64), torch.ones(1, 1, 4, dtype=torch.float64))
    with pytest.raises(ValueError, match="^qs must lie within the float32 range"):
        cache.attend(torch.tensor([[-1e39, 0.0]], dtype=torch.float64), 0.5)
    assert same_state(before, cache)
    big = torch.tensor([[3e38, -3e38]], dtype=torch.float64)  # within range: accepted
    cache.append(big, torch.ones(1, 1, 4, dtype=torch.float64))
    assert len(cache) == 2


def test_compress_on_a_full_cache_raises_and_leaves_it_unchanged():
    """Compression writes merged entries to new slots before freeing the old ones; without room
    in a fixed capacity it raises before touching anything (the index keeps its layout too)."""
    cache = SortedScalarCache(1, 2, 1, 4, capacity=10, buffer_size=4, level_ratio=2)
    for t in range(10):
        cache.append(torch.full((1, 2), float(t // 2)), torch.randn(1, 1, 4))  # pairs of equal keys
    before = snapshot(cache)
    with pytest.raises(RuntimeError, match="cache is full: compressing needs 10 new value slots.*unchanged"):
        cache.compress_density(0.0, group=2)  # 5 merged entries per head, 2 heads in the one group
    assert same_state(before, cache)
    cache.attend(torch.full((1, 2), 4.0), 0.5)
    cache.evict_geometric(1.5)  # keeps keys 3, 4 (four tokens per head): room for 2 x 2 merged entries
    assert cache.compress_density(0.0, group=2) == 2 * 2
    assert cache.n_slots == 4 and int(cache.n_entries().max()) == 2 and cache.index.weighted


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


def test_scalar_scale_scores_the_window_with_the_gain():
    """attend(scalar_scale=lam): the k nearest entries (chosen by distance) scored q·k/√d − lam (qs − ks)²/τ,
    for lam of any sign and 0; fast equals naive in outputs and gradients (lam's too); refused for
    pure scalar heads."""
    cache, ks, v, k, sk = fill(N=120, d_k=8, sink=True)
    qs, q = torch.randn(2, 4), torch.randn(2, 4, 8)
    lam = torch.tensor([0.6, 0.0, -0.5, 2.0])
    ref = reference(ks * lam.abs().sqrt(), v, qs * lam.abs().sqrt(), 0.5 * lam.sign().where(lam != 0, torch.ones(4)),
                    2, k, q, (sk[0] * lam.abs().sqrt(), sk[1], sk[2]), select=nearest(9))
    # lam = 0: the scalar term vanishes (a huge tau does the same in the reference)
    zero = reference(ks, v, qs, torch.tensor([0.5, 1e30, 0.5, 0.5]), 2, k, q, sk, select=nearest(9))
    got = cache.attend(qs, 0.5, q=q, window=9, scalar_scale=lam)
    assert rel_rms(got[:, [0, 2, 3]], ref[:, [0, 2, 3]]) < TOL and rel_rms(got[:, 1], zero[:, 1]) < TOL
    leaves = [qs.clone().requires_grad_(), q.clone().requires_grad_(), lam.clone().requires_grad_()]
    errs = compare_fwd_bwd(lambda a, b, c: cache.attend(a, 0.5, q=b, window=9, impl="fast", scalar_scale=c),
                           lambda a, b, c: cache.attend(a, 0.5, q=b, window=9, impl="naive", scalar_scale=c), leaves)
    assert max(errs.values()) < TOL, errs
    scalar, *_ = fill(N=10)
    with pytest.raises(ValueError, match="pure scalar heads"):
        scalar.attend(torch.randn(2, 4), 0.5, window=3, scalar_scale=lam)
