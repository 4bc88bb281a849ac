"""The IVF index for learned search keys: exact when every list is probed (before and after its
centroids are learned, across document blocks, causal), batched search equal to one call per query,
high recall on clustered keys at a few lists, and its arguments checked."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("faiss")

from attnlab.index.ivf import IVFIndex  # noqa: E402
from attnlab.search.retrieval import ExactIndex  # noqa: E402


def unit(x):
    return torch.nn.functional.normalize(x, dim=-1)


def same_sets(i1, v1, i2, v2):
    assert torch.equal(v1, v2)
    a = torch.where(v1, i1, -1).sort(-1).values
    b = torch.where(v2, i2, -1).sort(-1).values
    assert torch.equal(a, b)


@pytest.mark.parametrize("train_at", [48, 1000])  # centroids learned mid-sequence / never (exact throughout)
def test_every_list_probed_is_exact_search_with_blocks(train_at):
    g = torch.Generator().manual_seed(0)
    B, G, T, d, K = 2, 3, 160, 12, 8
    qs, ks = unit(torch.randn(B, G, T, d, generator=g)), unit(torch.randn(B, G, T, d, generator=g))
    seg = torch.zeros(B, T, dtype=torch.long)
    seg[0, 70:] = 1  # row 0: two documents
    pos = torch.arange(T)
    allowed = (pos[None, :, None] >= pos[None, None, :]) & (seg[:, :, None] == seg[:, None, :])
    allowed = allowed[:, None]  # (B, 1, T, T) block-causal
    ex = ExactIndex()
    i0, v0 = ex.grow_and_search(qs, ks, allowed, K)
    ivf = IVFIndex(d, nlist=6, nprobe=6, train_at=train_at, pin=2)
    i1, v1 = ivf.grow_and_search(qs, ks, allowed, K, chunk=16)
    same_sets(i0, v0, i1, v1)
    assert ivf.trained == (train_at < 70)
    assert not (v1 & ~allowed.expand(B, 1, T, T).gather(-1, i1.transpose(1, 2).reshape(B, 1, T, -1))
                .reshape(B, T, G, K).transpose(1, 2)).any()


@pytest.mark.parametrize("pin", [0, 3])
def test_batched_ivf_search_equals_one_call_per_query(pin):
    g = torch.Generator().manual_seed(1)
    T, d, K = 200, 8, 10
    q, x = unit(torch.randn(2, T, d, generator=g)), unit(torch.randn(2, T, d, generator=g))
    ivf = IVFIndex(d, nlist=8, nprobe=2, train_at=64, pin=pin)
    ivf._add_rows(x, None)
    allowed = torch.tril(torch.ones(T, T, dtype=torch.bool))[None, None]
    i1, v1 = ivf._search_rows(q, allowed, K)
    i2, v2 = ivf._search_rows(q, allowed, K, batched=False)
    assert torch.equal(i1, i2) and torch.equal(v1, v2)


def test_few_lists_find_clustered_neighbours():
    """Keys around 32 directions: a query near one direction finds its K best in 4 of 32 lists."""
    g = torch.Generator().manual_seed(2)
    d, n, K = 32, 4096, 32
    centres = unit(torch.randn(32, d, generator=g))
    ks = unit(centres[torch.randint(0, 32, (n,), generator=g)] + 0.15 * torch.randn(n, d, generator=g))
    qs = unit(centres[torch.randint(0, 32, (64,), generator=g)] + 0.15 * torch.randn(64, d, generator=g))
    allowed = torch.ones(1, 1, 1, n, dtype=torch.bool)
    ex, ivf = ExactIndex(), IVFIndex(d, nlist=32, nprobe=4, train_at=1024, pin=0)
    ex.add(ks[None, None])
    ivf.add(ks[None, None])
    i0, _ = ex.search(qs[None, None], allowed, K)
    i1, v1 = ivf.search(qs[None, None], allowed, K)
    assert v1.all()
    hits = (i1[..., :, None] == i0[..., None, :]).any(-1).float().mean()
    assert hits > 0.9
    assert ivf.trained


@pytest.mark.parametrize("kw, word", [({"nprobe": 9, "nlist": 8}, "nprobe"), ({"nlist": 0}, "nlist"),
                                      ({"train_at": 4, "nlist": 8, "nprobe": 2}, "train_at"), ({"nprobe": 0}, "nprobe")])
def test_ivf_arguments_checked(kw, word):
    with pytest.raises(ValueError, match=word):
        IVFIndex(8, **kw)


@pytest.mark.parametrize("kind", ["hnsw", "ivf"])
@pytest.mark.parametrize("pin", [0, 4])
def test_decode_step_fast_path_equals_the_general_search(kind, pin):
    """Every query admits every stored key (a decode step): one FAISS call per row and one merge,
    the same ids as the per-query reference."""
    from attnlab.search.retrieval import HNSWIndex

    g = torch.Generator().manual_seed(3)
    B, G, N, d, K = 2, 3, 300, 8, 12
    ks, qs = unit(torch.randn(B, G, N, d, generator=g)), unit(torch.randn(B, G, 2, d, generator=g))
    ix = IVFIndex(d, 8, 2, train_at=64, pin=pin) if kind == "ivf" else HNSWIndex(d, 8, 32, 16, pin=pin)
    ix.add(ks)
    allowed = torch.ones(1, 1, 2, N, dtype=torch.bool)
    assert ix._whole(allowed, B * G, K)
    i1, v1 = ix.search(qs, allowed, K)
    i2, v2 = ix._search_rows(qs.reshape(B * G, 2, d), allowed.expand(B * G, 1, 2, N), K, batched=False)
    assert torch.equal(i1, i2.view(B, G, 2, K)) and torch.equal(v1, v2.view(B, G, 2, K))


def test_eval_and_task_configs_check_the_ivf_settings():
    from attnlab.search.patch import SelectorConfig
    from attnlab.search.sweep import EvalConfig
    from attnlab.search.tasks import TaskConfig

    with pytest.raises(ValueError, match="nprobe"):
        EvalConfig(model="tiny-llama", methods=["quest"], ivf_nlist=8, ivf_nprobe=9)
    with pytest.raises(ValueError, match="nlist"):
        TaskConfig(model="tiny-llama", methods=["full"], ivf_nlist=0)
    with pytest.raises(ValueError, match="train_at"):
        SelectorConfig("learned-ivf", ivf_nlist=64, ivf_nprobe=4, ivf_train_at=8)
