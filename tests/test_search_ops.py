"""Search ops on bare tensors: sparse attention paths, distillation losses, selectors, metrics."""

import math

import pytest
import torch

from attnlab.data.packing import doc_causal_mask
from attnlab.search.capture import pack_contexts, teacher_attention
from attnlab.search.metrics import mass_at_k, recall_at_k, rel_gap, retrieval_stats, token_nll
from attnlab.index.projections import SearchProjections, search_losses, search_losses_from, search_targets
from attnlab.search.quest import QuestIndex, quest_bounds, quest_select
from attnlab.search.retrieval import (ExactIndex, HNSWIndex, block_starts, oracle_select,
                                      streaming_select, topk_candidates)
from attnlab.search.sparse import candidate_mask, sparse_attention
from attnlab.testing import compare_fwd_bwd, rel_rms


def _causal(T, B=1):
    return torch.ones(T, T, dtype=torch.bool).tril()[None, None].expand(B, 1, T, T)


def _random_candidates(B, G, T, K, allowed):
    scores = torch.randn(B, G, T, T)
    return topk_candidates(scores, allowed, K)


@pytest.mark.parametrize("H,Hkv,G", [(4, 2, 1), (6, 3, 3), (2, 2, 2), (6, 3, 6), (6, 2, 3)],
                         ids=["gqa-shared", "per-kv-group", "mha", "per-head-sets", "sets-across-kv-heads"])
@pytest.mark.parametrize("T,K", [(1, 4), (37, 8), (64, 80)], ids=["T1", "T37-K8", "T64-K80-fillers"])
def test_sparse_attention_fast_matches_naive(H, Hkv, G, T, K):
    B, D = 2, 16
    q = torch.randn(B, H, T, D, dtype=torch.float64, requires_grad=True)
    k = torch.randn(B, Hkv, T, D, dtype=torch.float64, requires_grad=True)
    v = torch.randn(B, Hkv, T, D, dtype=torch.float64, requires_grad=True)
    idx, valid = _random_candidates(B, G, T, K, _causal(T, B))
    errs = compare_fwd_bwd(lambda q, k, v: sparse_attention(q, k, v, idx, valid, 0.25, impl="fast"),
                           lambda q, k, v: sparse_attention(q, k, v, idx, valid, 0.25, impl="naive"), [q, k, v])
    assert max(errs.values()) < 1e-10, errs


@pytest.mark.parametrize("G", [1, 3])
def test_sparse_attention_never_copies_the_cache_per_head(G):
    """A decode step gathers K keys per head from the KV heads in place (no per-head copy of k or v),
    and the masked path builds one (Tq, Tk) mask per candidate set, not per head."""
    from attnlab.testing import LargestTensor

    B, H, Hkv, Tk, D, K = 1, 9, 3, 4096, 16, 32
    k, v = torch.randn(B, Hkv, Tk, D), torch.randn(B, Hkv, Tk, D)
    q1 = torch.randn(B, H, 1, D)
    idx, valid = torch.randint(0, Tk, (B, G, 1, K)), torch.ones(B, G, 1, K, dtype=torch.bool)
    with LargestTensor() as seen:
        sparse_attention(q1, k, v, idx, valid, 0.25, impl="naive")
    assert seen.numel <= H * K * D
    Tq = 64
    q = torch.randn(B, H, Tq, D)
    allowed = torch.ones(B, 1, Tq, Tk, dtype=torch.bool)
    idx, valid = topk_candidates(torch.randn(B, G, Tq, Tk), allowed, K)
    with LargestTensor() as seen:
        sparse_attention(q, k, v, idx, valid, 0.25, impl="fast")
    assert seen.numel <= max(G * Tq * (Tk + 1), B * Hkv * Tk * D)  # a mask per set; at most one k-sized tensor


def test_sparse_attention_all_keys_is_full_attention():
    B, H, Hkv, T, D = 1, 4, 2, 20, 8
    q, k, v = torch.randn(B, H, T, D), torch.randn(B, Hkv, T, D), torch.randn(B, Hkv, T, D)
    idx, valid = topk_candidates(torch.zeros(B, 1, T, T), _causal(T), T)
    ref = torch.nn.functional.scaled_dot_product_attention(
        q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
    for impl in ("naive", "fast"):
        assert rel_rms(sparse_attention(q, k, v, idx, valid, D ** -0.5, impl=impl), ref) < 1e-6


def test_sparse_attention_row_without_candidates_is_zero():
    q, k, v = torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4), torch.randn(1, 2, 3, 4)
    idx = torch.zeros(1, 1, 3, 2, dtype=torch.long)
    valid = torch.tensor([[[[True, False], [False, False], [True, True]]]])
    for impl in ("naive", "fast"):
        out = sparse_attention(q, k, v, idx, valid, 0.5, impl=impl)
        assert torch.equal(out[:, :, 1], torch.zeros(1, 2, 4))
        assert torch.isfinite(out).all()


def test_sparse_attention_rejects_bad_input():
    q, k, v = torch.randn(1, 4, 5, 8), torch.randn(1, 2, 5, 8), torch.randn(1, 2, 5, 8)
    idx, valid = torch.zeros(1, 1, 5, 3, dtype=torch.long), torch.ones(1, 1, 5, 3, dtype=torch.bool)
    with pytest.raises(TypeError, match="idx must be an integer"):
        sparse_attention(q, k, v, idx.float(), valid, 1.0)
    with pytest.raises(ValueError, match="valid must have the shape"):
        sparse_attention(q, k, v, idx, valid[..., :2], 1.0)
    with pytest.raises(ValueError, match="impl"):
        sparse_attention(q, k, v, idx, valid, 1.0, impl="slow")
    with pytest.raises(ValueError, match="value groups"):
        sparse_attention(q, torch.randn(1, 3, 5, 8), torch.randn(1, 3, 5, 8), idx, valid, 1.0)
    for bad in (5, -1):  # a valid slot outside the keys; an invalid (filler) slot may hold anything
        for impl in ("naive", "fast"):
            with pytest.raises(ValueError, match="idx: a valid slot points outside the 5 keys"):
                sparse_attention(q, k, v, idx.clone().fill_(bad), valid, 1.0, impl=impl)
    out = sparse_attention(q, k, v, idx.clone().fill_(7), torch.zeros_like(valid), 1.0, impl="naive")
    assert torch.equal(out, torch.zeros_like(out))  # no valid slot: zero output, no error


@pytest.mark.parametrize("k_pos", [1, 3, 50], ids=["kpos1", "kpos3", "kpos-exceeds-keys"])
def test_search_losses_fast_matches_naive(k_pos):
    B, T, d = 2, 13, 8
    seg = torch.tensor([[0] * 6 + [1] * 7, [0] * 13])
    allowed = doc_causal_mask(seg)[:, 0]
    teacher = torch.softmax(torch.randn(B, T, T).masked_fill(~allowed, float("-inf")), -1)
    teacher[0, 5, 0] = 0.0  # an exact zero in the teacher: 0 log 0 = 0
    teacher[0, 5] /= teacher[0, 5].sum()
    teacher[1, 3, 10] = 0.2  # teacher mass on a key the query may not read: not in either loss
    allowed = allowed.clone()
    allowed[1, 7] = False  # a query with no admissible key: it adds 0 to both means
    qs = torch.nn.functional.normalize(torch.randn(B, T, d, dtype=torch.float64), dim=-1).requires_grad_()
    ks = torch.nn.functional.normalize(torch.randn(B, T, d, dtype=torch.float64), dim=-1).requires_grad_()
    if k_pos >= T:  # every admissible key is a positive: L_NCE is 0 on both paths
        for impl in ("naive", "fast"):
            assert abs(search_losses(qs, ks, teacher.double(), allowed, 0.1, k_pos, impl=impl)[0].item()) < 1e-12
    for which in ((1,) if k_pos >= T else (0, 1)):
        errs = compare_fwd_bwd(
            lambda a, b: search_losses(a, b, teacher.double(), allowed, 0.1, k_pos, impl="fast")[which],
            lambda a, b: search_losses(a, b, teacher.double(), allowed, 0.1, k_pos, impl="naive")[which],
            [qs, ks])
        assert max(errs.values()) < 1e-9, (which, errs)
    targets = search_targets(teacher.double(), allowed, k_pos)  # computed once, reused by every step
    for _ in range(2):
        got = search_losses_from(qs, ks, targets, 0.1)
        want = search_losses(qs, ks, teacher.double(), allowed, 0.1, k_pos, impl="naive")
        assert all(abs(g.item() - w.item()) < 1e-9 for g, w in zip(got, want))


def test_search_losses_hold_exponents_above_the_floor_exactly():
    """Sharp scores (tau 0.002: most exponents z - max far below -87, where the held log-sum-exp
    floors them) in float32 give the float64 query-by-query losses and gradients; a hidden key
    scoring above every admissible one, and a query with no admissible key, change nothing."""
    B, T, d = 2, 40, 8
    allowed = torch.ones(T, T, dtype=torch.bool).tril().expand(B, T, T).clone()
    allowed[0, 20] = False  # no admissible key
    allowed[1, 30, 29] = False  # hidden: the best score of its row (below)
    g = torch.Generator().manual_seed(3)
    teacher = torch.softmax(torch.randn(B, T, T, generator=g).masked_fill(~allowed, float("-inf")), -1).nan_to_num(0.0)
    qs = torch.nn.functional.normalize(torch.randn(B, T, d, generator=g), dim=-1)
    ks = torch.nn.functional.normalize(torch.randn(B, T, d, generator=g), dim=-1)
    ks[1, 29] = qs[1, 30]
    z = (qs @ ks.transpose(1, 2)) / 0.002
    assert (z - z.amax(-1, keepdim=True) < -90).float().mean() > 0.5  # the floor is in play
    qs, ks = qs.requires_grad_(), ks.requires_grad_()
    for which in (0, 1):
        errs = compare_fwd_bwd(
            lambda a, b: search_losses(a, b, teacher, allowed, 0.002, 4, impl="fast")[which],
            lambda a, b: search_losses(a.double(), b.double(), teacher.double(), allowed, 0.002, 4, impl="naive")[which],
            [qs, ks])
        assert all(math.isfinite(e) for e in errs.values()) and max(errs.values()) < 1e-5, (which, errs)


def test_search_losses_hand_values():
    # one query, two admissible keys, scores z = (2, 0), teacher (0.5, 0.5), positives = top-1
    qs = torch.tensor([[[1.0, 0.0], [1.0, 0.0]]])
    ks = torch.tensor([[[1.0, 0.0], [0.0, 1.0]]])
    allowed = torch.tensor([[[True, False], [True, True]]])
    teacher = torch.tensor([[[1.0, 0.0], [0.75, 0.25]]])
    nce, kl = search_losses(qs, ks, teacher, allowed, tau=0.5, k_pos=1, impl="naive")
    lse = math.log(math.exp(2.0) + 1.0)
    # query 0: one key -> both losses 0; query 1: positive = key 0 (z=2)
    assert nce.item() == pytest.approx((0 + (lse - 2.0)) / 2, rel=1e-5)
    kl1 = 0.75 * (math.log(0.75) - (2.0 - lse)) + 0.25 * (math.log(0.25) - (0.0 - lse))
    assert kl.item() == pytest.approx(kl1 / 2, rel=1e-5)
    with pytest.raises(ValueError, match="k_pos"):
        search_losses(qs, ks, teacher, allowed, 0.5, k_pos=0)
    with pytest.raises(ValueError, match="tau"):
        search_losses(qs, ks, teacher, allowed, 0.0)


def test_teacher_attention_matches_per_head_softmax():
    B, H, Hkv, T, D = 2, 6, 2, 9, 4
    q, k = torch.randn(B, H, T, D), torch.randn(B, Hkv, T, D)
    allowed = doc_causal_mask(torch.tensor([[0] * 4 + [1] * 5, [0] * 9]))
    ref = torch.zeros(B, T, T)
    for h in range(H):
        s = q[:, h] @ k[:, h // 3].transpose(-1, -2) * 0.3
        ref += torch.softmax(s.masked_fill(~allowed[:, 0], float("-inf")), -1) / H
    assert rel_rms(teacher_attention(q, k, allowed, 0.3, chunk=4), ref) < 1e-6
    assert torch.allclose(teacher_attention(q, k, allowed, 0.3).sum(-1), torch.ones(B, T))


def test_quest_bound_upper_bounds_every_page_max():
    torch.manual_seed(1)
    B, H, Hkv, T, D, page = 2, 4, 2, 53, 8, 16
    q, k = torch.randn(B, H, T, D), torch.randn(B, Hkv, T, D)
    bound = quest_bounds(q, k, page)  # (B, H, T, pages)
    scores = q @ k.repeat_interleave(2, 1).transpose(-1, -2)
    for p in range(bound.shape[-1]):
        true_max = scores[..., p * page:(p + 1) * page].amax(-1)
        assert (bound[..., p] >= true_max - 1e-5).all()


def test_quest_select_respects_budget_and_mask():
    B, H, T, D = 1, 2, 70, 8
    q, k = torch.randn(B, H, T, D), torch.randn(B, H, T, D)
    allowed = _causal(T)
    idx, valid = quest_select(q, k, allowed, 0.35, K=32, page=16)
    assert idx.shape == (1, 1, T, 32)
    assert allowed.gather(-1, idx)[valid].all()
    assert valid[0, 0, 0].sum() == 1 and valid[0, 0, 69].sum() == 32  # whole pages once enough exist
    idx, valid = quest_select(q, k, allowed, 0.35, K=T, page=16)
    assert torch.equal(valid.sum(-1)[0, 0], torch.arange(1, T + 1))  # K >= context: every key


@pytest.mark.parametrize("chunks", [[70], [1] * 70, [5, 11, 16, 1, 37]])
def test_quest_index_kept_as_keys_arrive_equals_quest_select(chunks):
    """Page bounds updated per added chunk (pages split across chunks, storage growing) select the
    same keys as quest_select over all the keys; decode steps (one query at the newest position) too."""
    torch.manual_seed(3)
    B, H, Hkv, T, D, page, K = 2, 6, 3, 70, 8, 8, 24
    q, k = torch.randn(B, H, T, D), torch.randn(B, Hkv, T, D)
    index, at = QuestIndex(page), 0
    for n in chunks:
        index.add(k[:, :, at:at + n])
        at += n
        step_q = q[:, :, at - 1:at]  # the newest token's query: every stored key admissible
        got = index.select(step_q, torch.ones(1, 1, 1, at, dtype=torch.bool), 0.35, K, groups=3)
        ref = quest_select(step_q, k[:, :, :at], torch.ones(1, 1, 1, at, dtype=torch.bool), 0.35, K, page, groups=3)
        assert torch.equal(got[1], ref[1]) and torch.equal(got[0][got[1]], ref[0][ref[1]])
    assert index.ntotal == T and index.pages == 9
    assert torch.allclose(index._min[:, :, :9], torch.nn.functional.pad(k, (0, 0, 0, 2), value=float("inf"))
                          .view(B, Hkv, 9, page, D).amin(3))
    allowed = _causal(T)
    got, ref = index.select(q, allowed, 0.35, K, groups=3), quest_select(q, k, allowed, 0.35, K, page, groups=3)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])
    with pytest.raises(ValueError, match="page"):
        QuestIndex(0)


def test_streaming_keeps_sinks_and_recent_window():
    seg = torch.tensor([[0] * 5 + [1] * 20])
    idx, valid = streaming_select(doc_causal_mask(seg), K=6, n_sink=2)
    got = sorted(idx[0, 0, 24][valid[0, 0, 24]].tolist())
    assert got == [5, 6, 21, 22, 23, 24]  # sinks of the second document + 4 most recent
    assert valid[0, 0, 2].sum() == 3 and sorted(idx[0, 0, 2][valid[0, 0, 2]].tolist()) == [0, 1, 2]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_exact_and_hnsw_indexes_agree_and_are_causal(dtype):
    """Also with the keys stored in half precision (the exact index and the graph's fp16 quantizer)."""
    torch.manual_seed(2)
    T, d, K = 120, 16, 10
    x = torch.nn.functional.normalize(torch.randn(1, 1, T, d), dim=-1)  # (B, G, T, d)
    allowed = _causal(T)
    ex, hn = ExactIndex(dtype), HNSWIndex(d, M=16, ef_construction=80, ef_search=120, dtype=dtype)
    for s in range(0, T, 40):  # grows as tokens arrive
        ex.add(x[:, :, s:s + 40])
        hn.add(x[:, :, s:s + 40])
    assert ex.ntotal == hn.ntotal == T
    i1, v1 = ex.search(x, allowed, K)
    i2, v2 = hn.search(x, allowed, K)
    assert (i2[v2] <= torch.arange(T).view(1, 1, T, 1).expand_as(i2)[v2]).all()  # never a future key
    assert torch.equal(v1.sum(-1), v2.sum(-1))
    overlap = (torch.sort(i1, -1).values == torch.sort(i2, -1).values).float().mean()
    assert overlap > 0.9
    if dtype == torch.float16:  # the graph holds fp16 vectors: half the bytes of the float32 graph
        flat = HNSWIndex(d, M=16, ef_construction=80, ef_search=120)
        flat.add(x)
        assert len(hn.faiss.serialize_index(hn.rows[0][0])) < len(hn.faiss.serialize_index(flat.rows[0][0])) - T * d
        with pytest.raises(ValueError, match="dtype"):
            HNSWIndex(8, dtype=torch.bfloat16)


def test_hnsw_blocks_and_pinned_sinks_track_exact_search():
    """Packed blocks get their own graphs; an outlier block-start key (a sink every query wants) is
    found for every query because pinned keys are scored exactly (graph search alone misses it)."""
    torch.manual_seed(0)
    T, d, K, half = 400, 16, 4, 200
    x = torch.nn.functional.normalize(torch.randn(1, 1, T, d), dim=-1)
    sink = torch.nn.functional.normalize(torch.randn(d), dim=0)
    q = torch.nn.functional.normalize(torch.randn(1, 1, T, d) * 0.3 + sink, dim=-1)  # every query near the sink
    x = torch.nn.functional.normalize(x - sink, dim=-1)  # all other keys far from it
    x[0, 0, 0] = x[0, 0, half] = sink  # the first key of each block
    allowed = doc_causal_mask(torch.tensor([[0] * half + [1] * (T - half)]))

    def sink_found(i, v):
        return sum(bool(((i[0, 0, t] == (0 if t < half else half)) & v[0, 0, t]).any()) for t in range(T))

    i1, v1 = ExactIndex().grow_and_search(q, x, allowed, K)
    small = dict(M=4, ef_construction=8, ef_search=4)
    i2, v2 = HNSWIndex(d, **small).grow_and_search(q, x, allowed, K, chunk=32)
    i0, v0 = HNSWIndex(d, **small, pin=0).grow_and_search(q, x, allowed, K, chunk=32)
    assert allowed.expand(1, 1, T, T).gather(-1, i2)[v2].all()
    exact, pinned, graph_only = sink_found(i1, v1), sink_found(i2, v2), sink_found(i0, v0)
    assert pinned >= exact >= T - 4
    assert graph_only < T // 2  # what the pins are for
    assert torch.equal(v1.sum(-1), v2.sum(-1))


@pytest.mark.parametrize("pin", [0, 3])
def test_batched_hnsw_search_equals_one_call_per_query(pin):
    """Queries sharing their admissible range are searched in one FAISS call: the same ids as one call
    per query, for causal rows, rows that see a whole block, two batch rows with two blocks each, and
    a decode step (the range is the whole graph: no id selector)."""
    import faiss

    torch.manual_seed(4)
    B, T, d, K = 2, 160, 12, 6
    x = torch.nn.functional.normalize(torch.randn(B, 1, T, d), dim=-1)
    q = torch.nn.functional.normalize(torch.randn(B, 1, T, d), dim=-1)
    docs = torch.tensor([[0] * 70 + [1] * 90, [0] * 100 + [1] * 60])
    allowed = doc_causal_mask(docs).expand(B, 1, T, T).clone()
    allowed[:, :, 120:140] = allowed[:, :, 159:160]  # 20 queries that see the whole second block: one range
    hn = HNSWIndex(d, M=8, ef_construction=32, ef_search=16, pin=pin)
    hn.add(x, block_starts(doc_causal_mask(docs), B))
    qs = q.reshape(B, T, d)
    i1, v1 = hn._search_rows(qs, allowed, K)
    i2, v2 = hn._search_rows(qs, allowed, K, batched=False)
    assert torch.equal(i1[v1], i2[v2]) and torch.equal(v1, v2)
    assert v1.sum(-1).min() == 1 and v1[:, :, 120:140].sum(-1).min() == K
    # the decode step's search without a selector equals the one with a selector over every id
    g = hn.rows[0][70]
    xq = qs[0, 150:151].numpy()
    plain = g.search(xq, K, params=faiss.SearchParametersHNSW(efSearch=16))
    ranged = g.search(xq, K, params=faiss.SearchParametersHNSW(sel=faiss.IDSelectorRange(0, g.ntotal), efSearch=16))
    assert (plain[1] == ranged[1]).all()


def test_search_rope_is_norm_preserving_and_relative():
    torch.manual_seed(0)
    p = SearchProjections([0], 8, 6, rope=True, rope_theta=100.0)
    h = torch.randn(1, 1, 8).expand(1, 20, 8)  # the same content at every position
    qs, ks = p(0, h)  # (B, G=1, T, d)
    assert torch.allclose(qs.norm(dim=-1), torch.ones(1, 1, 20), atol=1e-6)
    s = qs[0, 0] @ ks[0, 0].T  # depends on t - j only
    assert torch.allclose(s.diagonal(3), s.diagonal(3)[:1].expand(17), atol=1e-5)
    assert not torch.allclose(s.diagonal(0)[:5], s.diagonal(3)[:5], atol=1e-3)
    q2, k2 = p(0, h[:, 5:], start=5)  # positions carry over to later calls (decode)
    assert torch.allclose(q2, qs[:, :, 5:], atol=1e-6) and torch.allclose(k2, ks[:, :, 5:], atol=1e-6)
    with pytest.raises(ValueError, match="d_search must be even"):
        SearchProjections([0], 8, 5, rope=True)


def test_recall_and_mass_hand_example():
    teacher = torch.tensor([[[0.5, 0.3, 0.1, 0.1, 0.0], [1.0, 0.0, 0.0, 0.0, 0.0]]])  # (B=1, Tq=2, Tk=5)
    allowed = torch.tensor([[[[True, True, True, True, False], [True, False, False, False, False]]]])
    idx = torch.tensor([[[[1, 2], [0, 0]]]])
    valid = torch.tensor([[[[True, True], [True, False]]]])
    # query 0: teacher top-2 {0, 1}, selected {1, 2} -> recall 1/2, mass 0.3 + 0.1;
    # query 1 has only 1 admissible key (<= K) and is left out of the averages
    assert recall_at_k(idx, valid, teacher, allowed, 2) == pytest.approx(0.5)
    assert mass_at_k(idx, valid, teacher, allowed, 2) == pytest.approx(0.4)
    assert math.isnan(mass_at_k(idx, valid, teacher, allowed, 4))


def test_token_nll_skips_document_boundaries_and_rel_gap():
    logits = torch.zeros(1, 4, 3)
    ids = torch.tensor([[0, 1, 2, 0]])
    nll, n = token_nll(logits, ids, torch.tensor([[0, 0, 1, 1]]))
    assert n == 2 and nll == pytest.approx(2 * math.log(3))
    assert rel_gap(10.1, 10.0) == pytest.approx(0.01)


def test_pack_contexts_blocks_positions_and_short_corpus():
    enc = lambda s: [ord(c) for c in s]  # noqa: E731
    p = pack_contexts(["abc", "de", "fghij"], enc, 0, context=4, n_contexts=3, seed=None)
    assert p.input_ids.tolist() == [[97, 98, 99, 0], [100, 101, 0, 102], [103, 104, 105, 106]]
    assert p.segments.tolist() == [[0, 0, 0, 0], [0, 0, 0, 1], [0, 0, 0, 0]]
    assert p.position_ids.tolist() == [[0, 1, 2, 3], [0, 1, 2, 0], [0, 1, 2, 3]]
    m = doc_causal_mask(p.segments)[1, 0]
    assert not m[3, :3].any() and m[3, 3] and m[2, :3].all()
    with pytest.raises(ValueError, match="corpus too short for the context"):
        pack_contexts(["abc"], enc, 0, context=8, n_contexts=2)


def test_grouped_selectors_equal_each_group_alone():
    """G candidate sets per token: set g is what the shared (G = 1) selector gives on group g's heads
    alone, for the teacher, oracle, Quest and both indexes."""
    torch.manual_seed(5)
    B, H, Hkv, T, D, K, G = 2, 6, 3, 70, 8, 12, 3
    q, k = torch.randn(B, H, T, D), torch.randn(B, Hkv, T, D)
    seg = torch.tensor([[0] * 30 + [1] * 40, [0] * 70])
    allowed = doc_causal_mask(seg)
    tg = teacher_attention(q, k, allowed, 0.4, groups=G)
    assert tg.shape == (B, G, T, T)
    assert rel_rms(tg.mean(1), teacher_attention(q, k, allowed, 0.4)) < 1e-6
    oi, ov = oracle_select(q, k, allowed, 0.4, K, groups=G)
    qi, qv = quest_select(q, k, allowed, 0.4, K, page=8, groups=G)
    for g in range(G):
        qg, kg = q[:, 2 * g:2 * g + 2], k[:, g:g + 1]
        assert torch.equal(tg[:, g], teacher_attention(qg, kg, allowed, 0.4))
        i1, v1 = oracle_select(qg, kg, allowed, 0.4, K)
        assert torch.equal(oi[:, g:g + 1][ov[:, g:g + 1]], i1[v1])
        i2, v2 = quest_select(qg, kg, allowed, 0.4, K, page=8)
        assert torch.equal(qi[:, g:g + 1], i2) and torch.equal(qv[:, g:g + 1], v2)
    with pytest.raises(ValueError, match="groups must be a positive divisor of the 6 query heads"):
        teacher_attention(q, k, allowed, 0.4, groups=4)
    with pytest.raises(ValueError, match="groups must be a positive divisor"):
        quest_select(q, k, allowed, 0.4, K, groups=4)
    qs = torch.nn.functional.normalize(torch.randn(B, G, T, 16), dim=-1)
    ks = torch.nn.functional.normalize(torch.randn(B, G, T, 16), dim=-1)
    small = dict(M=16, ef_construction=80, ef_search=200)
    ei, ev = ExactIndex().grow_and_search(qs, ks, allowed, K)
    hi, hv = HNSWIndex(16, **small).grow_and_search(qs, ks, allowed, K, chunk=16)
    assert ei.shape == hi.shape == (B, G, T, K)
    for g in range(G):
        e1, f1 = ExactIndex().grow_and_search(qs[:, g:g + 1], ks[:, g:g + 1], allowed, K)
        assert torch.equal(ei[:, g:g + 1], e1) and torch.equal(ev[:, g:g + 1], f1)
        h1, w1 = HNSWIndex(16, **small).grow_and_search(qs[:, g:g + 1], ks[:, g:g + 1], allowed, K, chunk=16)
        assert torch.equal(hi[:, g:g + 1], h1) and torch.equal(hv[:, g:g + 1], w1)
    # Mass@K over G sets = each head's own attention mass kept by its set, averaged over heads
    heads = teacher_attention(q, k, allowed, 0.4, groups=H)
    s = retrieval_stats(ei, ev, tg, allowed, K)
    sel = candidate_mask(ei, ev, T).repeat_interleave(H // G, dim=1) & allowed
    hard = allowed[:, 0].sum(-1) > K
    per_head = (heads * sel).sum(-1).mean(1)[hard]
    assert s["mass"] / s["n"] == pytest.approx(float(per_head.mean()), rel=1e-5)


def test_search_benchmark_runs_shared_and_grouped(tmp_path):
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / "search.py"
    spec = importlib.util.spec_from_file_location("bench_search", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    for groups in (1, 3):
        row = mod.decode_row(300, K=16, rounds=1, groups=groups)
        assert row["N"] == 300 and all(row[f"{m}_ms"] > 0 and row[f"{m}_x_full"] > 0
                                       for m in ("learned_exact", "learned_exact16", "learned_hnsw", "learned_hnsw16",
                                                 "learned_ivf", "native_hnsw", "quest"))
        assert all(0 <= row[f"{m}_recall"] <= 1 for m in ("learned_hnsw", "learned_hnsw16", "learned_ivf", "learned_exact16"))
        assert row["learned_exact_mb"] == 300 * groups * 128 * 4 / 2 ** 20 and row["learned_hnsw_mb"] > row["learned_exact_mb"]
        assert row["learned_hnsw16_mb"] < row["learned_hnsw_mb"]
        assert row["kv_cache_mb"] == 2 * 3 * 300 * 64 * 4 / 2 ** 20
    rows = mod.train_rows(96, [0, 32], rounds=1)
    assert [r["query_rows"] for r in rows] == [96, 32] and rows[0]["x_first"] == 1.0 and rows[1]["step_s"] > 0


def test_search_losses_benchmark_runs(tmp_path):
    """benchmarks/search_losses.py at a tiny size: its three routes agree with each other and with
    the query-by-query reference."""
    import json
    import sys
    from pathlib import Path
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    sys.modules.pop("search_losses", None)
    import search_losses as bench
    bench.main(["--T", "12", "--rounds", "1", "--out", str(tmp_path / "r.json")])
    (row,) = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert row["max_abs_diff"] < 1e-5 and row["max_abs_diff_naive"] < 1e-4
    assert {"in_step_s", "cached_s", "plain_lse_s", "plain_lse_ratio"} <= set(row)
