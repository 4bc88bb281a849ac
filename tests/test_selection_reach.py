"""`selection_reach`: where by position the keys a scalar window selects lie, against a count
from the dense window mask; a selection that tracks position is all inside the budget, one that
ignores it sits at chance."""

import pytest
import torch

from attnlab.eval.metrics import selection_reach
from attnlab.ops import window_mask


def brute(qs, ks, k, local, n_prefix, budget):
    T = qs.shape[-1]
    keep = window_mask(qs, ks, k, n_prefix=n_prefix, local=local)  # (B, H, T, T)
    t = torch.arange(T)
    older = t[None, :] <= t[:, None] - local  # keys older than each query's local window
    chosen = keep & older & (t[None, :] >= n_prefix)
    rows = (t + 1 - n_prefix) > budget
    chosen = chosen & rows[:, None]
    dist = (t[:, None] - t[None, :]).expand_as(chosen)
    share = [((dist[:, h] < budget) & chosen[:, h]).sum().item() / chosen[:, h].sum().item() for h in range(qs.shape[1])]
    med = [dist[:, h][chosen[:, h]].double().median().item() for h in range(qs.shape[1])]
    return share, med


@pytest.mark.parametrize("k,local,n_prefix", [(4, 0, 0), (4, 3, 0), (5, 2, 1)])
def test_reach_matches_the_dense_count(k, local, n_prefix):
    qs, ks = torch.randn(2, 3, 60), torch.randn(2, 3, 60)
    r = selection_reach(qs, ks, k, local=local, n_prefix=n_prefix)
    share, med = brute(qs, ks, k, local, n_prefix, k + local)
    assert r["in_budget"] == pytest.approx(share) and r["median_distance"] == pytest.approx(med)


def test_position_tracking_selection_is_a_local_window_and_random_is_chance():
    T = 400
    pos = torch.arange(T, dtype=torch.float32).expand(1, 2, T)
    local = selection_reach(pos.clone(), pos.clone(), 16, local=8)
    assert local["in_budget"] == pytest.approx([1.0, 1.0]) and local["median_distance"][0] < 24
    torch.manual_seed(0)
    rand = selection_reach(torch.randn(4, 2, T), torch.randn(4, 2, T), 16, local=8)
    for got, chance in zip(rand["in_budget"], rand["uniform"]):
        assert abs(got - chance) < 0.02 and 0.05 < chance < 0.3
    with pytest.raises(ValueError, match="window"):
        selection_reach(pos, pos, 0)
