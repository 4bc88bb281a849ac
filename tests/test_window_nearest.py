"""The window's nearest-n rule by topk (`nearest_newest`) equals the stable sort it replaced, on rows
full of ties, infinities, -infinity, NaN and fewer entries than n; window_mask through it keeps
the newest of equally distant keys."""

import pytest
import torch

from attnlab.ops.scalar.window import nearest_newest, nearest_newest_naive, window_mask


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
