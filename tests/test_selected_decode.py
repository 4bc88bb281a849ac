"""Decoding attnlab models through learned key selection (`attnlab.cache.selected`): token by token,
with prefill, through `LM.generate` with left padding, it reads the keys the full-sequence
`select_keys(model, "learned", K)` forward reads; the HNSW and IVF indexes and half-precision
search keys; bad arguments refused."""

import pytest
import torch

from attnlab.cache.selected import DecodeSelector
from attnlab.eval.selectors import select_keys
from attnlab.testing import rel_rms

from test_selectors import CONFIGS, IDS, _projections, _tokens
from test_window import _model

pytestmark = pytest.mark.usefixtures("one_thread")

CASES = CONFIGS + [("hybrid", {"sink": True, "sink_weight": 0.5}), (["hybrid", "softmax"], {})]
CASE_IDS = IDS + ["hybrid-weighted-sink", "hybrid-then-softmax"]


def _stepped(model, idx, selector, prefill=0):
    caches = model.make_caches(idx.shape[0], selector=selector)
    out = [model.prefill(idx[:, :prefill], caches)] if prefill else []
    out += [model.step(idx[:, t:t + 1], caches, pos=t)[:, None] for t in range(prefill, idx.shape[1])]
    return torch.cat(out, 1)


@pytest.mark.parametrize("attn,attention", CASES, ids=CASE_IDS)
def test_decode_through_the_selector_equals_the_selection_forward(attn, attention):
    model = _model(attn, **attention)
    proj, idx, K = _projections(model), _tokens(), 5
    with torch.no_grad():
        with select_keys(model, "learned", K, projections=proj):
            ref = model(idx)[0]
        full = model(idx)[0]
        stepped = _stepped(model, idx, DecodeSelector(proj, K))
        prefilled = _stepped(model, idx, DecodeSelector(proj, K), prefill=11)
    assert rel_rms(stepped, ref) < 1e-5 and rel_rms(prefilled, ref) < 1e-5
    assert rel_rms(stepped, full) > 1e-3  # K = 5 of up to 28 keys: not exact attention


def test_generate_with_a_selector_and_left_padding():
    model = _model("hybrid", sink=True)
    proj, idx = _projections(model), _tokens(T=12)
    sel = DecodeSelector(proj, 4)
    out = model.generate(idx, 6, selector=sel)
    with torch.no_grad():  # greedy by hand from the selection forward
        seq = idx
        for _ in range(6):
            with select_keys(model, "learned", 4, projections=proj):
                seq = torch.cat([seq, model(seq)[0][:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)
    padded = torch.cat([torch.zeros(1, 3, dtype=torch.long), idx[1:]], 1)
    mask = torch.cat([torch.zeros(1, 3, dtype=torch.long), torch.ones(1, 12, dtype=torch.long)], 1)
    alone = model.generate(idx[1:], 6, selector=sel)
    assert torch.equal(model.generate(padded, 6, selector=sel, attention_mask=mask)[:, 3:], alone)


@pytest.mark.heavy
def test_hnsw_ivf_and_half_keys_decode_as_the_exact_index_where_they_are_exact():
    """HNSW reads every key while they fit in K and stays close after; IVF probing every list is exact
    search (exact too before its lists are learned); half-precision search keys stay close."""
    pytest.importorskip("faiss")
    model = _model("hybrid")
    proj, idx = _projections(model), _tokens(T=40)
    with torch.no_grad():
        run = lambda K, **kw: _stepped(model, idx, DecodeSelector(proj, K, **kw))  # noqa: E731
        exact8, exact6 = run(8), run(6)
        graph, full = run(8, index="hnsw", hnsw_m=8, hnsw_ef_search=32), run(40, index="hnsw", hnsw_m=8)
        ivf = run(6, index="ivf", ivf_nlist=4, ivf_nprobe=4, ivf_train_at=12)  # lists learned at the 12th key
        few = run(6, index="ivf", ivf_nlist=4, ivf_nprobe=1, ivf_train_at=12)
        half = run(6, key_dtype="float16")
        graph16 = run(8, index="hnsw", hnsw_m=8, hnsw_ef_search=32, key_dtype="float16")
    assert rel_rms(graph[:, :8], exact8[:, :8]) < 1e-6  # n <= K: every key, no graph search
    assert rel_rms(graph, exact8) < 0.05 and rel_rms(full, model(idx)[0]) < 1e-5
    assert rel_rms(ivf, exact6) < 1e-5 and rel_rms(few[:, :11], exact6[:, :11]) < 1e-5
    assert torch.isfinite(few).all() and rel_rms(few, exact6) > 1e-3  # one list of four: other keys
    assert rel_rms(half, exact6) < 0.05
    assert rel_rms(graph16[:, :8], exact8[:, :8]) < 1e-6 and rel_rms(graph16, exact8) < 0.05


@pytest.mark.parametrize("kwargs, error, words", [
    ({"K": 0}, ValueError, "K"),
    ({"K": 4, "index": "lsh"}, ValueError, "index"),
    ({"K": 4, "hnsw_ef_search": 0}, ValueError, r"^hnsw_ef_search must be a positive int, got 0"),
    ({"K": 4, "hnsw_ef_construction": 0}, ValueError, r"^hnsw_ef_construction must be"),
    ({"K": 4, "index": "ivf", "ivf_nlist": 0}, ValueError, r"^ivf_nlist must be a positive int, got 0"),
    ({"K": 4, "index": "ivf", "ivf_nlist": 4, "ivf_nprobe": 5}, ValueError,
     r"^ivf_nprobe \(5\) must be at most ivf_nlist \(4\)"),
    ({"K": 4, "index": "ivf", "ivf_nlist": 8, "ivf_nprobe": 2, "ivf_train_at": 4}, ValueError, r"^ivf_train_at \(4\)"),
    ({"K": 4, "key_dtype": "int8"}, ValueError, "key_dtype"),
    ({"K": 4, "index": "ivf", "key_dtype": "float16"}, ValueError, "key_dtype"),
])
def test_bad_selector_settings_name_the_argument(kwargs, error, words):
    model = _model("hybrid")
    with pytest.raises(error, match=words):
        DecodeSelector(_projections(model), **kwargs)


def test_bad_selector_uses_are_refused_before_any_cache_exists():
    model = _model("hybrid")
    sel = DecodeSelector(_projections(model), 4)
    with pytest.raises(ValueError, match="window"):
        model.make_caches(1, window=4, selector=sel)
    with pytest.raises(TypeError, match="DecodeSelector"):
        model.make_caches(1, selector=_projections(model))
    with pytest.raises(ValueError, match="scalar or hybrid"):
        _model("softmax").make_caches(1, selector=sel)
    other = _model("scalar", n_scalar_heads=2)
    with pytest.raises(ValueError, match="search spaces"):
        other.make_caches(1, selector=sel)


@pytest.mark.parametrize("attn,attention", CASES, ids=CASE_IDS)
@pytest.mark.parametrize("page", [3, 4])
def test_quest_decode_equals_the_quest_forward(attn, attention, page):
    """DecodeSelector(None, K, index="quest"): per-page key ranges grown token by token read the keys
    select_keys(model, "quest", K, page=...) reads in one forward, step by step and after a prefill."""
    model = _model(attn, **attention)
    idx, K = _tokens(), 5
    with torch.no_grad():
        with select_keys(model, "quest", K, page=page):
            ref = model(idx)[0]
        full = model(idx)[0]
        stepped = _stepped(model, idx, DecodeSelector(None, K, index="quest", page=page))
        prefilled = _stepped(model, idx, DecodeSelector(None, K, index="quest", page=page), prefill=9)
    assert rel_rms(stepped, ref) < 1e-5 and rel_rms(prefilled, ref) < 1e-5
    assert rel_rms(stepped, full) > 1e-3


@pytest.mark.parametrize("kernel", ["gaussian", "cauchy"])
def test_quest_decode_bounds_the_layers_own_logits(kernel):
    """Under the Cauchy kernel and a learned gain of either sign per head, the decoded Quest reads the
    keys of the forward's Quest, whose page bounds are over the layer's own logits."""
    model = _model("hybrid", kernel=kernel, scalar_gain=1.0)
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.scalar_scale.copy_(torch.tensor([1.5, -0.7, 0.0, 0.3])[:blk.attn.n_scalar])
    idx, K, page = _tokens(), 5, 3
    with torch.no_grad():
        with select_keys(model, "quest", K, page=page):
            ref = model(idx)[0]
        stepped = _stepped(model, idx, DecodeSelector(None, K, index="quest", page=page))
    assert rel_rms(stepped, ref) < 1e-5


def test_quest_selector_arguments():
    model = _model("hybrid")
    with pytest.raises(ValueError, match="projections=None"):
        DecodeSelector(_projections(model), 4, index="quest")
    with pytest.raises(ValueError, match="needs search projections"):
        DecodeSelector(None, 4)
    with pytest.raises(ValueError, match="page"):
        DecodeSelector(None, 4, index="quest", page=0)
    out = model.generate(_tokens(T=10), 5, selector=DecodeSelector(None, 4, index="quest", page=2))
    assert out.shape == (_tokens(T=10).shape[0], 15)


def test_an_exact_index_takes_the_prompt_in_one_pass(monkeypatch):
    """The prompt through an exact-index selector is one forward per layer (no step per token) that
    leaves the caches as stepping would: the next steps read the same keys; a selector already
    holding keys takes a second prompt token by token, as half-precision keys and HNSW do."""
    from attnlab.layers.attention import Attention

    model = _model("hybrid", sink=True, sink_weight=0.5)
    proj, idx = _projections(model), _tokens()
    with torch.no_grad():
        want = _stepped(model, idx, DecodeSelector(proj, 5))
        steps = []
        real = Attention.step
        monkeypatch.setattr(Attention, "step", lambda self, *a, **k: steps.append(1) or real(self, *a, **k))
        caches = model.make_caches(idx.shape[0], selector=DecodeSelector(proj, 5))
        got = [model.prefill(idx[:, :11], caches)]
        assert not steps
        got.append(model.prefill(idx[:, 11:14], caches))  # keys held already: stepped
        assert len(steps) == 3 * len(model.blocks)
        got += [model.step(idx[:, t:t + 1], caches, pos=t)[:, None] for t in range(14, idx.shape[1])]
    assert rel_rms(torch.cat(got, 1), want) < 1e-5
