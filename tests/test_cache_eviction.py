"""Eviction, density compression, slot reclamation and window-error control of the sorted cache."""

import math

import pytest
import torch

from attnlab.cache.sorted import SortedScalarCache
from attnlab.cache.window_error import erfc_bound, window_error
from attnlab.testing import rel_rms

TOL = 1e-5


def full_attention(ks, v, qs, tau, n_groups, keep=None, sink=None):
    """Reference over raw tokens ks (N, B, H), v (N, B, G, Dv); keep (N, B, H) marks live tokens."""
    N, B, H = ks.shape
    score = -((qs.double()[None] - ks.double()) ** 2) / tau
    if keep is not None:
        score = score.masked_fill(~keep, float("-inf"))
    vals = v.double()[:, :, torch.arange(H) // (H // n_groups)]
    if sink is not None:
        score = torch.cat([score, (-((qs.double() - sink[0]) ** 2) / tau)[None]], 0)
        vals = torch.cat([vals, sink[1].double().expand(1, B, H, -1)], 0)
    return (torch.softmax(score, 0)[..., None] * vals).sum(0)


def filled(N=120, B=2, H=4, G=2, Dv=6, sink=True, **kw):
    ks, v = torch.randn(N, B, H), torch.randn(N, B, G, Dv)
    sk = (torch.randn(H), torch.randn(H, Dv)) if sink else None
    extra = dict(sink_key=sk[0], sink_value=sk[1]) if sink else {}
    cache = SortedScalarCache(B, H, G, Dv, buffer_size=8, level_ratio=4, **extra, **kw)
    for t in range(N):
        cache.append(ks[t], v[t])
    return cache, ks, v, sk


def test_geometric_eviction_keeps_query_range_and_sink_zone():
    cache, ks, v, sk = filled(sink_zone=(1.5, 2.5), query_history=4)
    qs_seen = [torch.rand(2, 4) - 0.5 for _ in range(6)]  # only the last 4 count
    for qs in qs_seen:
        cache.attend(qs, 0.3)
    recent = torch.stack(qs_seen[-4:])  # (4, B, H)
    r = 0.4
    lo, hi = recent.amin(0) - r, recent.amax(0) + r
    keep = ((ks >= lo) & (ks <= hi)) | ((ks >= 1.5) & (ks <= 2.5))  # (N, B, H)
    removed = cache.evict_geometric(r)
    assert removed == int((~keep).sum())
    assert torch.equal(cache.n_entries(), keep.sum(0))
    qs = torch.randn(2, 4)
    assert rel_rms(cache.attend(qs, 0.3, window=None), full_attention(ks, v, qs, 0.3, 2, keep, sk)) < TOL
    # slots referenced by no head of a group were reclaimed: the value store shrank
    assert cache.n_slots == int(keep.view(120, 2, 2, 2).any(-1).sum(0).max())


def test_eviction_by_tolerance_radius():
    cache, ks, v, sk = filled()
    cache.attend(torch.zeros(2, 4), 0.3)
    tau, eps = 0.05, 1e-4
    r = math.sqrt(-tau * math.log(eps))
    cache.evict_geometric(tau=tau, eps=eps)
    assert torch.equal(cache.n_entries(), (ks.abs() <= r).sum(0))
    with pytest.raises(ValueError, match="radius, or both tau and eps"):
        cache.evict_geometric()


def test_everything_evicted_leaves_the_sink():
    cache, ks, v, sk = filled(N=40)
    cache.attend(torch.full((2, 4), 100.0), 0.3)
    assert cache.evict_geometric(0.5) == 40 * 8
    assert cache.n_slots == 0 and int(cache.n_entries().max()) == 0
    for kw in (dict(window=64), dict(window=None), dict(eps=1e-3)):
        out = cache.attend(torch.randn(2, 4), 0.3, **kw)
        assert rel_rms(out, sk[1].expand(2, 4, -1)) < TOL
    cache.append(torch.zeros(2, 4), torch.ones(2, 2, 6))  # still usable afterwards
    assert int(cache.n_entries().min()) == 1


def test_everything_evicted_without_sink_raises():
    cache, *_ = filled(N=20, sink=False)
    cache.attend(torch.full((2, 4), 100.0), 0.3)
    cache.evict_geometric(0.5)
    with pytest.raises(ValueError, match="empty and has no sink"):
        cache.attend(torch.zeros(2, 4), 0.3)
    with pytest.raises(ValueError, match="needs recent queries"):
        filled(N=3)[0].evict_geometric(1.0)


def test_reclaim_lets_a_full_cache_continue():
    cache = SortedScalarCache(1, 2, 1, 4, capacity=10, sink_key=0.0, sink_value=torch.zeros(4))
    for t in range(10):
        cache.append(torch.full((1, 2), float(t)), torch.full((1, 1, 4), float(t)))
    cache.attend(torch.full((1, 2), 9.0), 0.5)
    cache.evict_geometric(2.0, reclaim=False)  # keeps keys 7, 8, 9
    assert cache.n_slots == 10
    cache.append(torch.full((1, 2), 9.5), torch.full((1, 1, 4), 9.5))  # full: reclaims, then appends
    assert cache.n_slots == 4
    out = cache.attend(torch.full((1, 2), 9.0), 0.5, window=None)
    w = torch.softmax(-(torch.tensor([0.0, 7.0, 8.0, 9.0, 9.5]) - 9.0) ** 2 / 0.5, 0)  # sink first
    assert rel_rms(out[0, 0], (w * torch.tensor([0.0, 7, 8, 9, 9.5])).sum().expand(4)) < TOL


@pytest.mark.parametrize("group", [2, 4])
def test_compressing_equal_keys_is_exact(group):
    B, H, G, Dv = 2, 4, 2, 6
    ks = torch.randint(-3, 4, (80, B, H)).float()  # many duplicates
    v = torch.randn(80, B, G, Dv)
    cache = SortedScalarCache(B, H, G, Dv, buffer_size=8, level_ratio=4)
    for t in range(80):
        cache.append(ks[t], v[t])
    qs = torch.randn(B, H)
    before = cache.attend(qs, 0.7, window=None)
    removed = cache.compress_density(0.0, group=group)
    assert removed > 0 and int(cache.n_entries().sum()) == 80 * 8 - removed
    assert cache.bytes_per_token()["key_index_per_head"] == 12
    assert rel_rms(cache.attend(qs, 0.7, window=None), before) < TOL
    assert rel_rms(cache.attend(qs, 0.7, window=None, impl="naive"), before) < TOL
    assert rel_rms(before, full_attention(ks, v, qs, 0.7, G)) < TOL
    cache.compress_density(0.0, group=group)  # representatives merge again: still exact
    assert rel_rms(cache.attend(qs, 0.7, window=None), before) < TOL


@pytest.mark.parametrize("d_k", [None, 8], ids=["scalar", "hybrid"])
def test_compressing_dense_regions_approximates(d_k):
    B, H, G, Dv, N = 1, 2, 1, 8, 400
    ks = torch.randn(N, B, H) * 2
    ks[:200] = 0.5 + 1e-3 * torch.randn(200, B, H)  # a dense cluster
    # hybrid: merged members' dot products differ by q.(k_i - k_mean)/sqrt(d_k); keep that small
    v, k = torch.randn(N, B, G, Dv), torch.randn(N, B, H, d_k or 1) * 0.03
    cache = SortedScalarCache(B, H, G, Dv, d_k=d_k, sink_zone=(0.499, 0.5))
    for t in range(N):
        cache.append(ks[t], v[t], k[t] if d_k else None)
    qs, q = torch.full((B, H), 0.6), torch.randn(B, H, d_k) if d_k else None
    before = cache.attend(qs, 0.5, q, window=None)
    removed = cache.compress_density(0.01, group=8)
    assert removed > 100
    after = cache.attend(qs, 0.5, q, window=None)
    assert rel_rms(after, before) < (1e-3 if d_k is None else 3e-2)
    ent = cache.index.all_entries()
    keys = ent[0].view(torch.float32)
    zone = (ks >= 0.499) & (ks <= 0.5)  # the sink zone is never compressed
    in_zone = (keys >= 0.499) & (keys <= 0.5)
    assert torch.equal(in_zone.sum(1), zone.view(N, -1).sum(0))
    assert torch.equal(ent[2][in_zone], torch.zeros_like(ent[2][in_zone]))


def test_compress_arguments():
    cache, *_ = filled(N=10)
    with pytest.raises(ValueError, match="max_span"):
        cache.compress_density(-1.0)
    with pytest.raises(ValueError, match="group"):
        cache.compress_density(0.1, group=1)


# ---- error control ----------------------------------------------------------------------
def grid_cache(n, lo, hi, H=2, stratified=True):
    """One key per cell of a uniform grid on [lo, hi] (jittered inside its cell)."""
    step = (hi - lo) / n
    jitter = torch.rand(n, H) if stratified else torch.full((n, H), 0.5)
    ks = lo + step * (torch.arange(n).float()[:, None] + jitter)  # (n, H)
    cache = SortedScalarCache.from_tensors(ks.T[None].contiguous(), torch.randn(1, 1, n, 4))
    return cache, ks


def test_window_error_matches_brute_force():
    cache, ks, v, sk = filled(N=200)
    qs, tau = torch.randn(2, 4), 0.2
    err = window_error(cache, qs, tau, window=16)
    score = -((qs[None] - ks) ** 2).double() / tau  # (N, B, H)
    sink = (-((qs - sk[0]) ** 2) / tau).double()
    near = (qs[None] - ks).abs().argsort(0)[:16]  # the window
    z_full = torch.logsumexp(torch.cat([score, sink[None]]), 0)
    z_win = torch.logsumexp(torch.cat([score.gather(0, near), sink[None]]), 0)
    assert torch.allclose(err.mass_out, 1 - (z_win - z_full).exp(), atol=1e-9)
    assert torch.allclose(err.radius.float(), (qs[None] - ks).abs().sort(0).values[16])
    assert torch.equal(window_error(cache, qs, tau, window=None).mass_out, torch.zeros(2, 4, dtype=torch.float64))


def test_window_error_with_ties_at_the_edge():
    keys = torch.tensor([0.0, 1.0, 1.0, 1.0, 2.0]).view(1, 1, 5)
    cache = SortedScalarCache.from_tensors(keys, torch.randn(1, 1, 5, 2))
    tau = 0.5
    err = window_error(cache, torch.zeros(1, 1), tau, window=2)  # keeps 0 and one of the 1s
    w = torch.exp(-keys.view(-1).double() ** 2 / tau)
    assert torch.allclose(err.mass_out.view(()), (2 * w[1] + w[4]) / w.sum(), rtol=1e-12)
    assert float(err.radius) == 1.0


@pytest.mark.parametrize("rel_r", [1.0, 1.5, 2.0, 2.5])
def test_erfc_bound_holds_at_uniform_density(rel_r):
    """Stratified keys of constant density, spacing << sqrt(tau), window well inside the key
    range: the bound is the continuum value of the leftover mass, so the measured mass sits on
    it, within the discretisation error of 100 keys per sqrt(tau) (a few percent)."""
    tau = 0.01
    cache, ks = grid_cache(4000, -2.0, 2.0)
    r = rel_r * math.sqrt(tau)
    qs = torch.rand(1, 2) - 0.5
    err = window_error(cache, qs, tau, radius=r, window=None)
    bound = erfc_bound(r, tau)
    assert bool((err.mass_out <= bound * 1.05).all()), (err.mass_out, bound)
    assert bool((err.mass_out >= bound * 0.95).all())  # the bound is tight here
    assert torch.allclose(err.bound, torch.tensor(bound, dtype=torch.float64).expand(1, 2), rtol=0.1)


@pytest.mark.parametrize("rel_r", [1.0, 2.0, 3.0])
def test_erfc_bound_holds_when_density_falls_off(rel_r):
    """Keys denser near the query than farther out (Gaussian around it): the bound holds strictly."""
    tau = 0.01
    ks = 0.3 * torch.randn(1, 2, 5000)
    cache = SortedScalarCache.from_tensors(ks, torch.randn(1, 1, 5000, 4))
    r = rel_r * math.sqrt(tau)
    err = window_error(cache, torch.zeros(1, 2), tau, radius=r, window=None)
    assert bool((err.mass_out < erfc_bound(r, tau)).all())


def test_erfc_bound_fails_when_keys_are_denser_outside():
    """A query in a sparse region with a dense cluster just past r: the bound's uniform-density
    assumption is broken and the leftover mass exceeds erfc(r / sqrt(tau)) by far."""
    tau, r = 0.01, 0.15
    sparse = torch.linspace(-r, r, 5)
    cluster = 0.2 + 0.01 * torch.rand(500)
    keys = torch.cat([sparse, cluster]).view(1, 1, -1)
    cache = SortedScalarCache.from_tensors(keys, torch.randn(1, 1, keys.shape[2], 4))
    err = window_error(cache, torch.zeros(1, 1), tau, radius=r, window=None)
    assert float(err.mass_out) > 0.5 > 10 * erfc_bound(r, tau)


def test_out_of_window_mass_does_not_grow_with_n_at_fixed_density():
    tau, k = 0.01, 64
    masses = []
    for n in (500, 4000):
        cache, _ = grid_cache(n, -n / 1000, n / 1000, stratified=False)  # density 500 / unit
        masses.append(window_error(cache, torch.zeros(1, 2), tau, window=k).mass_out)
    assert torch.allclose(masses[0], masses[1], rtol=1e-3, atol=1e-12)
    assert float(masses[0].max()) <= erfc_bound(k / 2 / 500, tau) * 1.05


@pytest.mark.parametrize("rel_r", [1.0, 3.0, 10.0])
def test_cauchy_bound_is_the_continuum_value_at_uniform_density(rel_r):
    """The Cauchy kernel's leftover mass, 1 - (2/pi) atan(r / sqrt(tau)) over an unbounded continuum:
    measured on keys of constant density over +-20 sqrt(tau) it sits just below it (the tail beyond
    the keys' range, 2 / (20 pi) of the mass at most, is missing), and far above the Gaussian's."""
    from attnlab.cache.window_error import cauchy_bound

    tau = 0.01
    ks = torch.linspace(-2.0, 2.0, 4001, dtype=torch.float64).float().expand(1, 2, -1).contiguous()
    cache = SortedScalarCache.from_tensors(ks, torch.randn(1, 1, 4001, 4), kernel="cauchy")
    r = rel_r * math.sqrt(tau)
    err = window_error(cache, torch.zeros(1, 2), tau, radius=r, window=None)
    bound = cauchy_bound(r, tau)
    assert bool((err.mass_out <= bound + 1e-3).all()) and bool((err.mass_out >= bound - 2 / (20 * math.pi)).all())
    assert torch.allclose(err.bound, torch.tensor(bound, dtype=torch.float64).expand(1, 2), rtol=0.1)
    assert bound > erfc_bound(r, tau) * (100 if rel_r >= 3 else 3)
