"""The native-vector baseline (the model's own post-RoPE q and k in a search index) and Recall@K /
Mass@K against brute-force references computed query by query."""

import itertools

import pytest
import torch

from attnlab.search.capture import teacher_attention
from attnlab.search.metrics import mass_at_k, recall_at_k
from attnlab.search.patch import RetrieveThenAttend, SelectorConfig
from attnlab.search.retrieval import ExactIndex, HNSWIndex, native_vectors


def _mean_logits(q, k, G):
    """(B, G, Tq, Tk): each set's mean over its heads of q_h . k_kv(h), by a loop over heads."""
    B, H, Tq, _ = q.shape
    Hkv, Tk = k.shape[1], k.shape[2]
    n, r = H // G, H // Hkv
    out = torch.zeros(B, G, Tq, Tk, dtype=torch.float64)
    for g in range(G):
        for h in range(g * n, (g + 1) * n):
            out[:, g] += q[:, h].double() @ k[:, h // r].double().transpose(-1, -2) / n
    return out


@pytest.mark.parametrize("H,Hkv,G", [(6, 3, 1), (6, 3, 3), (6, 3, 6), (6, 2, 3), (4, 4, 2), (9, 3, 3)],
                         ids=["shared", "per-kv", "per-head", "uneven-reads", "mha", "smollm2-kv"])
def test_native_inner_products_are_the_sets_mean_logits(H, Hkv, G):
    torch.manual_seed(0)
    q, k = torch.randn(2, H, 7, 8), torch.randn(2, Hkv, 11, 8)
    qn, kn = native_vectors(q, k, G)
    assert qn.shape[:3] == (2, G, 7) and kn.shape[:3] == (2, G, 11) and qn.shape[-1] == kn.shape[-1]
    got = qn.double() @ kn.double().transpose(-1, -2)
    # Each query block is fl(fl(sum of at most r = H / Hkv float32 queries) / n): at most r roundings of
    # u = 2^-24 relative to the sum of the terms' magnitudes, so a logit is off by at most r * u times the
    # same mean over |q| and |k| (the key blocks are copied exactly). A relative tolerance alone fails
    # for logits near zero, as it did under ATEN_CPU_CAPABILITY=default.
    bound = (H // Hkv) * 2.0 ** -24 * _mean_logits(q.abs(), k.abs(), G) + 1e-12
    assert ((got - _mean_logits(q, k, G)).abs() <= bound).all()


def test_native_width_is_the_kv_heads_a_set_reads():
    q, k = torch.randn(1, 9, 3, 64), torch.randn(1, 3, 5, 64)
    assert native_vectors(q, k, 3)[0].shape[-1] == 64  # one KV head per set
    assert native_vectors(q, k, 1)[0].shape[-1] == 192  # the shared set reads all three
    # 6 heads over 2 KV heads in 3 sets: sets read 1, 2, 1 KV heads -> every set gets both blocks
    assert native_vectors(torch.randn(1, 6, 3, 4), torch.randn(1, 2, 5, 4), 3)[0].shape[-1] == 8


def _causal(T):
    return torch.ones(T, T, dtype=torch.bool).tril()[None, None]


@pytest.mark.parametrize("G", [1, 3])
def test_native_exact_selects_the_top_mean_logit_keys(G):
    torch.manual_seed(1)
    B, H, Hkv, T, D, K = 2, 9, 3, 40, 16, 6
    q, k = torch.randn(B, H, T, D), torch.randn(B, Hkv, T, D)
    allowed = _causal(T)
    idx, valid = RetrieveThenAttend(0, SelectorConfig("native", K, groups=G)).select(None, q, k, allowed, D ** -0.5)
    ref = _mean_logits(q, k, G)
    for b, g, t in itertools.product(range(B), range(G), range(T)):
        n = min(K, t + 1)
        assert valid[b, g, t].sum() == n
        want = set(ref[b, g, t, : t + 1].topk(n).indices.tolist())
        assert set(idx[b, g, t][valid[b, g, t]].tolist()) == want


def _recall_mass_loop(idx, valid, teacher, allowed, K):
    """Recall@K and Mass@K as their definitions read: per (query, set) with more than K admissible keys,
    |selected ∩ teacher top-K| / K and the teacher mass on the selected keys, averaged."""
    B, G, Tq, Tk = teacher.shape
    rec, mass = [], []
    for b, g, t in itertools.product(range(B), range(G), range(Tq)):
        adm = [j for j in range(Tk) if allowed[min(b, allowed.shape[0] - 1), 0, t, j]]
        if len(adm) <= K:
            continue
        sel = {int(j) for j, ok in zip(idx[b, g, t], valid[b, g, t]) if ok and int(j) in adm}
        top = set(sorted(adm, key=lambda j: -float(teacher[b, g, t, j]))[:K])
        rec.append(len(sel & top) / K)
        mass.append(sum(float(teacher[b, g, t, j]) for j in sel))
    return sum(rec) / len(rec), sum(mass) / len(mass)


@pytest.mark.parametrize("method", ["native", "native-hnsw"])
def test_recall_and_mass_equal_the_brute_force_reference(method):
    torch.manual_seed(2)
    B, H, Hkv, T, D, K, G = 1, 4, 2, 48, 8, 5, 2
    q, k = torch.randn(B, H, T, D), torch.randn(B, Hkv, T, D)
    allowed = _causal(T)
    sel = RetrieveThenAttend(0, SelectorConfig(method, K, groups=G, hnsw_ef_search=16))
    idx, valid = sel.select(None, q, k, allowed, D ** -0.5)
    teacher = teacher_attention(q, k, allowed, D ** -0.5, groups=G)
    want_recall, want_mass = _recall_mass_loop(idx, valid, teacher, allowed, K)
    assert recall_at_k(idx, valid, teacher, allowed, K) == pytest.approx(want_recall, abs=1e-6)
    assert mass_at_k(idx, valid, teacher, allowed, K) == pytest.approx(want_mass, abs=1e-6)
    assert 0 < want_recall <= 1


def test_native_hnsw_equals_exact_search_with_a_wide_beam():
    """On a small index a beam wider than the index makes HNSW exhaustive: the same keys as exact MIPS."""
    torch.manual_seed(3)
    qn, kn = torch.randn(1, 1, 30, 12), torch.randn(1, 1, 30, 12)
    allowed = _causal(30)
    exact, hnsw = ExactIndex(), HNSWIndex(12, M=8, ef_construction=64, ef_search=64, pin=0)
    i1, v1 = exact.grow_and_search(qn, kn, allowed, 4)
    i2, v2 = hnsw.grow_and_search(qn, kn, allowed, 4)
    assert torch.equal(v1, v2)
    for t in range(30):
        assert set(i1[0, 0, t][v1[0, 0, t]].tolist()) == set(i2[0, 0, t][v2[0, 0, t]].tolist())


def test_native_needs_no_projections_and_checks_groups():
    RetrieveThenAttend(3, SelectorConfig("native-hnsw", 8))  # no projections needed
    with pytest.raises(ValueError, match="groups"):
        native_vectors(torch.randn(1, 6, 2, 4), torch.randn(1, 3, 2, 4), 4)
