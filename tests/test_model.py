"""The decoder LM: shapes and gradients for every mechanism, cached decoding == full recompute,
document restarts == separate documents, embeddings, and bad input."""

import pytest
import torch

from attnlab.models import LM, MECHANISMS, ModelConfig
from attnlab.models.lm import document_segments
from attnlab.testing import rel_rms

V = 61


def tiny(attn="softmax", **kw) -> LM:
    kw.setdefault("max_seq_len", 32)
    if str(attn).startswith("goat"):  # head_dim 8: room for a prior of 2 frequencies (2R + 1 + 2 columns)
        kw.setdefault("attention", {"goat_rank": 2})
    cfg = ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, attn=attn, **kw)
    torch.manual_seed(0)
    return LM(cfg).double()


@pytest.mark.parametrize("attn", MECHANISMS)
def test_forward_backward_every_mechanism(attn):
    model = tiny(attn)
    idx = torch.randint(V, (2, 17))
    targets = idx.roll(-1, 1)
    targets[:, -1] = -100
    logits, loss = model(idx, targets)
    assert logits.shape == (2, 17, V)
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), targets[:, :-1].reshape(-1))
    assert float(loss.detach()) == pytest.approx(float(ref.detach()), rel=1e-12)
    loss.backward()
    grads = [p.grad for p in model.parameters()]
    assert all(g is not None and torch.isfinite(g).all() for g in grads)
    assert model(idx)[1] is None


@pytest.mark.parametrize("attn", MECHANISMS)
def test_cached_greedy_generation_equals_full_recompute(attn):
    """Decoding token by token through every layer's cache gives the logits (and so the greedy
    tokens) that running the whole growing sequence through forward gives at each step."""
    model = tiny(attn)
    prompt = torch.randint(V, (2, 5))
    out = model.generate(prompt, 6)
    assert out.shape == (2, 11) and torch.equal(out[:, :5], prompt)
    seq = prompt
    for _ in range(6):
        seq = torch.cat([seq, model(seq)[0][:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(out, seq)
    # the step logits themselves, against forward on the final sequence
    caches = model.make_caches(2)
    step_logits = torch.stack([model.step(out[:, t : t + 1], caches, pos=t) for t in range(out.shape[1])], 1)
    assert rel_rms(step_logits, model(out)[0]) < 1e-10


@pytest.mark.parametrize("sink", [False, True], ids=["nosink", "sink"])
@pytest.mark.parametrize("attn", ["scalar", "hybrid"])
def test_sorted_cache_window_covering_everything_is_exact(attn, sink):
    """window=k decodes scalar/hybrid layers from the sorted scalar cache; with k at least the
    sequence length every key is inside the window, so it equals exact decoding. A narrow
    window attends, at every step, exactly the k keys nearest the query in scalar space (plus
    the sink when on), which changes the logits."""
    import math

    from attnlab.cache.sorted import SortedScalarCache

    model = tiny(["softmax", attn], layer_attention=[{}, {"sink": True, "sink_key": 0.5}] if sink else [])
    layer = model.attention_layers()[1]
    if sink:
        with torch.no_grad():
            layer.sink_value.normal_()  # a zero sink value would only rescale the window's weights
    prompt = torch.randint(V, (2, 4))
    exact = model.generate(prompt, 8)
    windowed = model.generate(prompt, 8, window=64)
    assert torch.equal(exact, windowed)
    narrow = model.generate(prompt, 8, window=2)  # runs; may differ from exact
    assert narrow.shape == exact.shape

    def decode(window, calls=None):
        """Step logits (B, T, V) over the fixed sequence `exact`; calls: record the sorted cache's
        appends and attends (with their outputs) into this list."""
        caches = model.make_caches(2, window=window)
        cache = caches[1].scalar
        assert isinstance(cache, SortedScalarCache) and caches[0].scalar is None
        if calls is not None:
            append, attend = cache.append, cache.attend

            def recorded_append(ks, v, k=None, **kw):
                calls.append(("append", ks, v, k))
                append(ks, v, k, **kw)

            def recorded_attend(qs, tau, q=None, window=64, **kw):
                out = attend(qs, tau, q=q, window=window, **kw)
                calls.append(("attend", qs, tau, q, window, out))
                return out

            cache.append, cache.attend = recorded_append, recorded_attend
        return torch.stack([model.step(exact[:, t: t + 1], caches, pos=t) for t in range(exact.shape[1])], 1)

    calls = []
    narrow_logits, wide_logits = decode(2, calls), decode(64)
    assert rel_rms(wide_logits, model(exact)[0]) < 1e-5  # float32 scalar keys in the index
    assert rel_rms(narrow_logits, wide_logits) > 1e-3  # the narrow window is not the full one

    # the reference: the k = 2 keys nearest qs (in the float32 the index stores), by the formula
    ks, vs, kv, checked = [], [], [], 0
    for call in calls:
        if call[0] == "append":
            ks.append(call[1])
            vs.append(call[2])
            kv.append(call[3])
            continue
        _, qs, tau, q, window, out = call
        assert window == 2
        K, Vals = torch.stack(ks).double(), torch.stack(vs).double()  # (N, B, H), (N, B, G, D)
        N, B, H = K.shape
        q32, k32 = qs.float().double(), K.float().double()
        tau = tau.double().view(1, 1, H) if tau.dim() == 1 else tau.double().view(1, B, H)
        dist = (q32[None] - k32).abs()  # (N, B, H)
        score = -dist ** 2 / tau
        if attn == "hybrid":
            score = score + (torch.stack(kv).double() * q.double()[None]).sum(-1) / math.sqrt(q.shape[-1])
        score = score.masked_fill(dist.argsort(0).argsort(0) >= 2, float("-inf"))  # rank by distance
        heads = torch.arange(H) // (H // Vals.shape[2])  # each head's value group
        vals = Vals[:, :, heads]  # (N, B, H, D)
        if sink:
            sink_score = -(q32 - layer.config.options.sink_key) ** 2 / tau[0]  # zero vector key: scalar part only
            score = torch.cat([score, sink_score[None]], 0)
            vals = torch.cat([vals, layer.sink_value.detach().double()[heads].expand(1, B, H, -1)], 0)
        ref = (torch.softmax(score, 0)[..., None] * vals).sum(0)  # (B, H, D)
        assert rel_rms(out, ref) < 1e-5, f"step {N - 1}"
        checked += 1
    assert checked == exact.shape[1] and len(ks) == exact.shape[1]


def test_sampling_is_seeded_and_respects_temperature():
    model = tiny("hybrid")
    prompt = torch.randint(V, (1, 3))
    a = model.generate(prompt, 6, greedy=False, temperature=0.7, generator=torch.Generator().manual_seed(1))
    b = model.generate(prompt, 6, greedy=False, temperature=0.7, generator=torch.Generator().manual_seed(1))
    assert torch.equal(a, b)
    cold = model.generate(prompt, 6, greedy=False, temperature=1e-4, generator=torch.Generator().manual_seed(2))
    assert torch.equal(cold, model.generate(prompt, 6))  # temperature -> 0 is greedy
    with pytest.raises(ValueError, match="temperature"):
        model.generate(prompt, 2, greedy=False, temperature=0.0)


def test_per_layer_mechanisms_and_rope():
    model = tiny(["softmax", "hybrid"])
    layers = model.attention_layers()
    assert [a.config.mechanism for a in layers] == ["softmax", "hybrid"]
    assert all(a.config.rope for a in layers)
    assert not tiny("gla").attention_layers()[0].config.rope
    assert tiny("cosformer").attention_layers()[0].config.options.cosformer_max_len == 32


def test_tied_and_untied_embeddings():
    tied, untied = tiny(), tiny(tie_embeddings=False)
    assert tied.head.weight is tied.tok_emb.weight
    assert untied.head.weight is not untied.tok_emb.weight
    assert untied.num_params() - tied.num_params() == V * 32


def test_document_segments():
    doc_ids = torch.tensor([[0, 0, 1, 1, 1], [1, 2, 2, 2, 3]])
    seg, pos, n = document_segments(doc_ids)
    assert n == 5
    assert seg.tolist() == [0, 0, 1, 1, 1, 2, 3, 3, 3, 4]
    assert pos.tolist() == [0, 1, 0, 1, 2, 0, 0, 1, 2, 0]


@pytest.mark.parametrize("attn", ["softmax", "scalar", "gla"])
def test_doc_ids_restart_attention_at_document_boundaries(attn):
    """With doc_ids, each document's logits equal running that document alone."""
    model = tiny(attn)
    idx = torch.randint(V, (2, 12))
    doc_ids = torch.tensor([[0] * 5 + [1] * 7, [3] * 12])
    logits, _ = model(idx, doc_ids=doc_ids)
    assert rel_rms(logits[0, :5], model(idx[:1, :5])[0][0]) < 1e-12
    assert rel_rms(logits[0, 5:], model(idx[:1, 5:])[0][0]) < 1e-12
    assert rel_rms(logits[1], model(idx[1:])[0][0]) < 1e-12
    assert rel_rms(logits[0, 5:], model(idx[:1])[0][0, 5:]) > 1e-6  # without restarts it differs


def test_record_leaves_records_for_scalar_layers():
    model = tiny(["softmax", "hybrid"])
    model(torch.randint(V, (2, 8)), record=True)
    soft, hyb = model.attention_layers()
    assert hyb.last.qs.shape == (2, 4, 8) and hyb.last.tau is not None
    assert soft.last is not None and soft.last.qs is None


def test_learned_positions():
    model = tiny("scalar", pos_embedding="learned", max_seq_len=10)
    assert model.pos_emb.weight.shape == (10, 32)
    prompt = torch.randint(V, (1, 3))
    out = model.generate(prompt, 7)
    seq = prompt
    for _ in range(7):
        seq = torch.cat([seq, model(seq)[0][:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)
    with pytest.raises(ValueError, match="max_seq_len=10"):
        model(torch.randint(V, (1, 11)))


def test_bad_input_is_named():
    model = tiny()
    with pytest.raises(ValueError, match="idx must be"):
        model(torch.randint(V, (2, 3, 4)))
    with pytest.raises(ValueError, match="targets"):
        model(torch.randint(V, (2, 5)), torch.randint(V, (2, 4)))
    with pytest.raises(ValueError, match="doc_ids"):
        model(torch.randint(V, (2, 5)), doc_ids=torch.zeros(2, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="no layer has scalar heads"):
        model.generate(torch.randint(V, (1, 2)), 2, window=8)
    with pytest.raises(ValueError, match="max_new_tokens"):
        model.generate(torch.randint(V, (1, 2)), -1)
    with pytest.raises(ValueError, match="vocab_size"):
        LM(ModelConfig(vocab_size=0))
