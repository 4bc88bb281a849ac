"""The window's nearest-n rule by topk (`nearest_newest`) equals the stable sort it replaced, on rows
full of ties, infinities, -infinity, NaN and fewer entries than n; window_mask through it keeps
the newest of equally distant keys; the merge-sort tree (`tree.tree_select`) selects the same keys."""

import pytest
import torch

from attnlab.ops.scalar.nearest import nearest_newest, nearest_newest_naive
from attnlab.ops.scalar.window import window_mask

pytestmark = pytest.mark.usefixtures("one_thread")


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


@pytest.mark.parametrize("local,n_prefix,block", [(0, 0, 4), (5, 1, 64), (32, 0, 4), (0, 3, 16)])
def test_tree_chooses_the_dense_windows(monkeypatch, local, n_prefix, block):
    """window_indices through the merge-sort tree (the long-context route where no compiled kernel runs,
    forced on short sequences) returns the dense rule's indices, in its order: random keys, keys
    repeated (ties broken newest first), keys on a coarse grid (ties on both sides of a query and
    across node boundaries), and all keys equal; lengths around the block and level sizes."""
    from attnlab.ops.scalar import tree, window as wmod

    monkeypatch.setenv("ATTNLAB_NO_EXT", "1")  # the PyTorch selection (the compiled one: test_window_cpu.py)
    monkeypatch.setattr(tree, "TREE_BLOCK", block)
    monkeypatch.setattr(tree.tree_select, "__defaults__", (37, block))  # chunks that split the rows unevenly
    g = torch.Generator().manual_seed(4)
    for T in (1, 64, 130):
        B, H = 2, 3
        qs, ks = torch.randn(B, H, T, generator=g), torch.randn(B, H, T, generator=g)
        rep = ks.clone()
        rep[..., T // 3 : 2 * (T // 3)] = rep[..., : T // 3]
        grid = (ks * 2).round() / 2
        for keys, q in ((ks, qs), (rep, qs), (grid, (qs * 2).round() / 2), (torch.zeros_like(ks), qs)):
            for window in (1, 7):
                monkeypatch.setattr(wmod, "TREE_FROM", 10**9)
                want = wmod.window_indices(q, keys, window, n_prefix=n_prefix, local=local, query_chunk=16)
                monkeypatch.setattr(wmod, "TREE_FROM", 1)
                got = wmod.window_indices(q, keys, window, n_prefix=n_prefix, local=local, query_chunk=16)
                assert torch.equal(got[1], want[1]), (T, window)
                assert torch.equal(got[0][got[1]], want[0][want[1]]), (T, window)
                sel = tree.tree_select(q.float(), keys.float(), window, n_prefix, local)
                assert not sel[0][~sel[1]].any()  # padding slots 0: the same on every device (CUDA's topk
                #                                   orders ties of the padding's key as it likes)


def test_tree_reads_nothing_back(monkeypatch):
    """The tree's selection runs on any device without a host sync: no tensor value is read on the host
    (the route accelerators take for long sequences), and it gives the dense rule's keys."""
    from attnlab.ops.scalar import window as wmod

    monkeypatch.setenv("ATTNLAB_NO_EXT", "1")
    g = torch.Generator().manual_seed(5)
    qs, ks = torch.randn(1, 2, 200, generator=g), torch.randn(1, 2, 200, generator=g)
    want = wmod.window_indices(qs, ks, 5, local=4, query_chunk=16)
    monkeypatch.setattr(wmod, "TREE_FROM", 1)
    reads = []
    for name in ("item", "__bool__", "__int__", "__float__", "nonzero", "tolist"):
        real = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name, lambda self, *a, _r=real, _n=name, **k: reads.append(_n) or _r(self, *a, **k))
    got = wmod.window_indices(qs, ks, 5, local=4, query_chunk=16)
    monkeypatch.undo()
    assert reads == []
    assert torch.equal(got[1], want[1]) and torch.equal(got[0][got[1]], want[0][want[1]])


@pytest.mark.cuda
def test_cuda_tree_selects_what_the_cpu_does_at_8k():
    """On CUDA (the route its long sequences take): the same keys in the same order as on the CPU, with
    ties (the second half of the keys repeats the first), the sink and a local window."""
    from attnlab.ops.scalar.tree import tree_select

    g = torch.Generator().manual_seed(6)
    qs, ks = torch.randn(2, 4, 8192, generator=g), torch.randn(2, 4, 8192, generator=g)
    ks[..., 4096:] = ks[..., :4096]
    want = tree_select(qs, ks, 16, 1, 32)
    got = tree_select(qs.cuda(), ks.cuda(), 16, 1, 32)
    assert torch.equal(got[1].cpu(), want[1]) and torch.equal(got[0].cpu(), want[0])
