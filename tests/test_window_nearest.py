"""The window's nearest-n rule by topk (`nearest_newest`) equals the stable sort it replaced, on rows
full of ties, infinities, -infinity, NaN and fewer entries than n; window_mask through it keeps
the newest of equally distant keys."""

import pytest
import torch

from attnlab.ops.scalar.nearest import nearest_newest, nearest_newest_naive
from attnlab.ops.scalar.window import window_mask


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_topk_rule_equals_the_stable_sort_on_hostile_rows(dtype):
    g = torch.Generator().manual_seed(0)
    for _ in range(400):
        Tk = int(torch.randint(1, 70, (1,), generator=g))
        n = int(torch.randint(1, Tk + 3, (1,), generator=g))
        d = torch.randint(0, 4, (2, 3, Tk), generator=g).to(dtype)  # many ties
        u = torch.rand(d.shape, generator=g)
        d[u < 0.25] = float("inf")
        d[(u > 0.25) & (u < 0.3)] = float("-inf")
        assert torch.equal(nearest_newest(d, n), nearest_newest_naive(d, n)), (Tk, n)
    d = torch.rand(4, 50, generator=g, dtype=dtype)
    d[1, 3] = float("nan")
    assert torch.equal(nearest_newest(d, 7), nearest_newest_naive(d, 7))
    d = torch.rand(3, 5, 300, generator=g, dtype=dtype)  # distinct values: the topk path alone
    assert torch.equal(nearest_newest(d, 40), nearest_newest_naive(d, 40))


def test_window_mask_takes_the_newest_of_equal_keys():
    ks = torch.tensor([[[0.0, 1.0, 1.0, 1.0, 5.0, 1.0, 9.0]]])
    qs = ks[..., -1:].clone()
    qs[...] = 1.0  # the last query sits on the four keys at 1.0; window 2 takes the newest two
    m = window_mask(qs, ks, 2)
    assert m[0, 0, 0].tolist() == [False, False, False, True, False, True, False]


@pytest.mark.parametrize("local,n_prefix", [(0, 0), (5, 1), (32, 0)])
def test_sorted_search_chooses_the_dense_windows(monkeypatch, local, n_prefix):
    """window_indices through sorted candidates (the long-context route, forced on short sequences)
    returns the dense rule's indices, in its order: random keys, keys repeated (ties broken newest
    first), keys on a coarse grid (ties across the candidates' boundary: those chunks are scored
    densely), and all keys equal."""
    from attnlab.ops.scalar import window as wmod

    monkeypatch.setenv("ATTNLAB_NO_EXT", "1")  # the PyTorch selection (the compiled one: test_window_cpu.py)
    g = torch.Generator().manual_seed(4)
    B, H, T = 2, 3, 300
    qs, ks = torch.randn(B, H, T, generator=g), torch.randn(B, H, T, generator=g)
    rep = ks.clone()
    rep[..., 100:200] = rep[..., :100]
    grid = (ks * 2).round() / 2
    for keys in (ks, rep, grid, torch.zeros_like(ks)):
        for window in (1, 7):
            monkeypatch.setattr(wmod, "SORTED_FROM", 10**9)
            want = wmod.window_indices(qs, keys, window, n_prefix=n_prefix, local=local, query_chunk=16)
            monkeypatch.setattr(wmod, "SORTED_FROM", 20)
            got = wmod.window_indices(qs, keys, window, n_prefix=n_prefix, local=local, query_chunk=16)
            assert torch.equal(got[1], want[1]) and torch.equal(got[0][got[1]], want[0][want[1]])


def test_sorted_search_defers_undecided_rows():
    """A tie across the boundary of the candidates leaves the choice to the dense rule (None)."""
    from attnlab.ops.scalar.nearest import nearest_sorted

    q, k = torch.zeros(1, 1, 64), torch.zeros(1, 1, 64)
    assert nearest_sorted(q, k, 48, 64, 0, 0, 4) is None
    k = torch.arange(64.0).view(1, 1, 64)
    q = k.clone() + 0.25
    idx, ok = nearest_sorted(q, k, 48, 64, 0, 0, 3)
    assert ok.all() and torch.equal(idx[0, 0, 0], torch.tensor([48, 47, 46]))


def test_accelerators_choose_densely_without_reading_back(monkeypatch):
    """Where the sorted search would read a bool back from the device (any device but the CPU), every
    chunk is scored densely: the same indices as the CPU's sorted route, and no value read at all."""
    from attnlab.ops.scalar import window as wmod

    monkeypatch.setenv("ATTNLAB_NO_EXT", "1")  # the PyTorch selection (the compiled one: test_window_cpu.py)
    g = torch.Generator().manual_seed(5)
    qs, ks = torch.randn(1, 2, 200, generator=g), torch.randn(1, 2, 200, generator=g)
    monkeypatch.setattr(wmod, "SORTED_FROM", 20)
    want = wmod.window_indices(qs, ks, 5, local=4, query_chunk=16)
    monkeypatch.setattr(wmod, "SORTED_ON", ())  # the CPU treated as an accelerator
    reads = []
    for name in ("item", "__bool__", "__int__", "__float__", "nonzero", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _r=real, _n=name, **k: reads.append(_n) or _r(self, *a, **k))
    got = wmod.window_indices(qs, ks, 5, local=4, query_chunk=16)
    monkeypatch.undo()
    assert reads == []
    assert torch.equal(got[1], want[1]) and torch.equal(got[0][got[1]], want[0][want[1]])
