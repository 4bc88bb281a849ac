"""The decode step's fast paths beside their references: sparse attention gathered once per candidate
set (equal to the per-head gather, outputs and gradients, fillers and empty rows included), the
exact index's growing buffer and half-precision keys, and top-K without a mask when every key is
admissible."""

from __future__ import annotations

import pytest
import torch

from attnlab.search.retrieval import ExactIndex, topk_candidates
from attnlab.search.sparse import sparse_attention, sparse_attention_grouped, sparse_attention_naive
from attnlab.testing import compare_fwd_bwd


@pytest.mark.parametrize("H,G", [(6, 3), (4, 1), (2, 2)])
@pytest.mark.parametrize("T,K", [(1, 8), (5, 6)])
def test_grouped_gather_equals_per_head_gather(H, G, T, K):
    g = torch.Generator().manual_seed(H * 10 + T)
    B, D, Tk = 2, 8, 20
    q = torch.randn(B, H, T, D, dtype=torch.float64, generator=g, requires_grad=True)
    k = torch.randn(B, G, Tk, D, dtype=torch.float64, generator=g, requires_grad=True)
    v = torch.randn(B, G, Tk, D, dtype=torch.float64, generator=g, requires_grad=True)
    idx = torch.randint(0, Tk, (B, G, T, K), generator=g)
    valid = torch.rand(B, G, T, K, generator=g) > 0.3
    valid[0, 0, 0] = False  # a row with no candidate: output 0
    idx[valid.logical_not()] = 10 ** 6  # filler slots may hold anything
    errs = compare_fwd_bwd(lambda q, k, v: sparse_attention_grouped(q, k, v, idx, valid, 0.3),
                           lambda q, k, v: sparse_attention_naive(q, k, v, idx, valid, 0.3), [q, k, v])
    assert max(errs.values()) < 1e-12, errs
    out = sparse_attention(q, k, v, idx, valid, 0.3)  # auto takes the grouped path here
    assert torch.allclose(out, sparse_attention_naive(q, k, v, idx, valid, 0.3), atol=1e-12)
    assert out[0, : H // G, 0].abs().max() == 0


def test_exact_index_grows_in_place_and_equals_one_add():
    g = torch.Generator().manual_seed(0)
    ks, qs = torch.randn(1, 3, 300, 16, generator=g), torch.randn(1, 3, 1, 16, generator=g)
    one, steps = ExactIndex(), ExactIndex()
    one.add(ks)
    for t in range(300):
        steps.add(ks[:, :, t:t + 1])
    assert steps.ntotal == 300 and torch.equal(steps.keys, ks)
    assert steps._buf.shape[2] < 2 * 300  # grown by half, not one slot per step
    allowed = torch.ones(1, 1, 1, 300, dtype=torch.bool)
    i1, v1 = one.search(qs, allowed, 32)
    i2, v2 = steps.search(qs, allowed, 32)
    assert torch.equal(i1, i2) and v1.all() and v2.all()
    steps.reset()
    assert steps.ntotal == 0 and steps.keys is None


def test_half_precision_keys_keep_the_ranking():
    g = torch.Generator().manual_seed(1)
    unit = lambda x: torch.nn.functional.normalize(x, dim=-1)  # noqa: E731
    ks, qs = unit(torch.randn(1, 2, 4000, 64, generator=g)), unit(torch.randn(1, 2, 8, 64, generator=g))
    allowed = torch.ones(1, 1, 8, 4000, dtype=torch.bool)
    full, half = ExactIndex(), ExactIndex(dtype=torch.float16)
    full.add(ks)
    half.add(ks)
    assert half.keys.dtype == torch.float16
    i1, _ = full.search(qs, allowed, 64)
    i2, _ = half.search(qs, allowed, 64)
    overlap = (i1[..., :, None] == i2[..., None, :]).any(-1).float().mean()
    assert overlap > 0.95
    with pytest.raises(ValueError, match="dtype"):
        ExactIndex(dtype=torch.int8)


def test_topk_without_mask_equals_masked_topk():
    g = torch.Generator().manual_seed(2)
    scores = torch.randn(2, 3, 1, 50, generator=g)
    all_ok = torch.ones(1, 1, 1, 50, dtype=torch.bool)
    i1, v1 = topk_candidates(scores, all_ok, 8)
    assert v1.all() and torch.equal(i1, scores.topk(8, dim=-1).indices)
    some = all_ok.clone()
    some[..., 40:] = False
    i2, v2 = topk_candidates(scores, some, 45)  # five slots beyond the 40 admissible keys: invalid
    assert v2.sum(-1).eq(40).all() and (i2[v2] < 40).all()
