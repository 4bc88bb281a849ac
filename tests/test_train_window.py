"""Training through the window (train_window, local_window): the gather path equals the dense
reference (outputs and every gradient, with ties), and decoding reads exactly the trained keys."""

import pytest
import torch

from attnlab.cache.sorted import SortedScalarCache
from attnlab.layers import Attention, AttentionConfig
from attnlab.ops import window_indices, windowed_attention
from attnlab.testing import rel_rms


def scalars(B=2, H=4, G=2, T=37, D=8, hybrid=False, ties=False, seed=0):
    g = torch.Generator().manual_seed(seed)
    qs, ks = (torch.randn(B, H, T, generator=g, dtype=torch.float64) for _ in range(2))
    if ties:
        ks = ks.round()  # many keys at exactly the same distance
    v = torch.randn(B, G, T, D, generator=g, dtype=torch.float64)
    tau = torch.rand(H, generator=g, dtype=torch.float64) + 0.3
    q = torch.randn(B, H, T, D, generator=g, dtype=torch.float64) if hybrid else None
    k = torch.randn(B, G, T, D, generator=g, dtype=torch.float64) if hybrid else None
    return qs, ks, v, tau, q, k


@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("n_prefix", [0, 1])
@pytest.mark.parametrize("local", [0, 3])
@pytest.mark.parametrize("hybrid", [False, True])
def test_gather_path_equals_dense_with_gradients(hybrid, local, n_prefix, ties):
    qs, ks, v, tau, q, k = scalars(hybrid=hybrid, ties=ties)
    leaves = [x.requires_grad_() for x in (qs, ks, v, tau, q, k) if x is not None]
    res = []
    for impl in ("naive", "fast"):
        o = windowed_attention(qs, ks, v, tau, 5, q=q, k=k, n_prefix=n_prefix, local=local, impl=impl, query_chunk=7)
        res.append([o, *torch.autograd.grad(o.square().sum(), leaves)])
    for a, b in zip(*res):
        assert rel_rms(b, a) < 1e-12


def test_indices_are_the_window_and_small():
    qs, ks, *_ = scalars(T=50, ties=True)
    idx, ok = window_indices(qs, ks, 4, n_prefix=1, local=2, query_chunk=16)
    assert idx.shape == (2, 4, 50, 1 + 2 + 4)  # O(T x (k + w + prefix)) per head, never T x T
    from attnlab.ops import window_mask
    dense = window_mask(qs, ks, 4, n_prefix=1, local=2)
    got = torch.zeros_like(dense).scatter_(-1, idx, ok)  # valid indices -> mask (an index may repeat if invalid)
    got[..., 0] = True
    assert torch.equal(got, dense)
    tau = torch.ones(4)
    windowed_attention(qs, ks, torch.zeros(2, 4, 50, 3, dtype=torch.float64), tau, 4, local=2)  # runs at T=50
    from attnlab.ops.scalar.chunked import chunk_bias, chunk_mask
    keep = chunk_mask(idx[:, :, 10:30], ok[:, :, 10:30], 30)  # the SDPA path's additive mask: the same keys
    bias = chunk_bias(idx[:, :, 10:30], ok[:, :, 10:30], 30, torch.float32)
    assert bias.dtype == torch.float32 and torch.equal(bias, torch.zeros(()).masked_fill(~keep, float("-inf")))


LAYERS = [("scalar", {}), ("hybrid", {"rope": True}), ("scalar", {"sink": True}),
          ("hybrid", {"sink": True, "sink_weight": 0.5}), ("scalar", {"n_scalar_heads": 2, "rope": True}),
          ("hybrid", {"scalar_gain": 0.5})]


@pytest.mark.parametrize("kernel", ["gaussian", "cauchy"])
@pytest.mark.parametrize("local", [0, 3])
@pytest.mark.parametrize("mech,extra", LAYERS,
                         ids=["scalar", "hybrid-rope", "scalar-sink", "hybrid-wsink", "mixed", "hybrid-gain"])
def test_decode_reads_what_training_read(mech, extra, local, kernel):
    """Under either kernel: the window's fast path equals the naive layer (outputs and gradients),
    token-by-token decode (sorted cache + ring of the last w) and prefill equal the training forward,
    on inputs with repeated tokens (exact ties in scalar space, broken newest first by both), and
    exact=True decodes over every key like the exact layer."""
    torch.manual_seed(0)
    cfg = dict(d_model=32, n_heads=4, mechanism=mech, train_window=3, local_window=local, kernel=kernel, **extra)
    m = Attention(AttentionConfig(**cfg)).double()
    ref_m = Attention(AttentionConfig(**cfg, impl="naive")).double()
    if "sink" in extra:
        with torch.no_grad():
            m.sink_value.normal_()
    ref_m.load_state_dict(m.state_dict())
    x = torch.randn(2, 30, 32, dtype=torch.float64, generator=torch.Generator().manual_seed(3))
    x[:, 10:20] = x[:, 0:10]
    x[:, 20:25] = x[:, 0:5]
    xx = x.clone().requires_grad_()
    y = m(xx)
    g1 = torch.autograd.grad(y.square().sum(), [xx, *m.parameters()])
    g2 = torch.autograd.grad(ref_m(xx).square().sum(), [xx, *ref_m.parameters()])
    assert max(rel_rms(b, a) for a, b in zip(g1, g2)) < 1e-12
    ref = y.detach()
    with torch.no_grad():
        c = m.make_cache(2)  # a window-trained layer decodes through its window by default
        assert c.window == 3 and (c.ring is not None) == bool(local)
        step = torch.cat([m.step(x[:, t : t + 1], c) for t in range(30)], 1)
        c = m.make_cache(2)
        pre = torch.cat([m.prefill(x[:, :7], c), m.prefill(x[:, 7:], c)], 1)
    assert rel_rms(step, ref) < 1e-6 and rel_rms(pre, ref) < 1e-6  # the sorted cache keeps float32 keys
    if kernel == "cauchy":  # the kernel is used, not ignored
        gauss = Attention(AttentionConfig(**{**cfg, "kernel": "gaussian"})).double()
        gauss.load_state_dict(m.state_dict())
        assert rel_rms(gauss(x), ref) > 1e-3
    exact = Attention(AttentionConfig(**{**cfg, "train_window": None, "local_window": 0})).double()
    exact.load_state_dict(m.state_dict())
    assert rel_rms(exact(x), ref) > 1e-3  # the window is not exact attention here
    w = exact.attention_weights(x[:1])
    assert torch.allclose(w.sum(-1), torch.ones_like(w.sum(-1)))
    with torch.no_grad():  # exact=True decodes a window-trained layer over every key
        c = m.make_cache(2, exact=True)
        every = torch.cat([m.step(x[:, t : t + 1], c) for t in range(30)], 1)
    assert c.window is None and c.ring is None and rel_rms(every, exact(x)) < 1e-6
    with pytest.raises(ValueError, match="exact"):
        m.make_cache(2, exact=True, window=4)


def test_config_errors_and_extra_columns():
    for field, bad in (("train_window", 0), ("train_window", 2.0), ("local_window", -1)):
        with pytest.raises(ValueError, match=field):
            AttentionConfig(d_model=32, n_heads=4, mechanism="scalar", **{"train_window": 4, field: bad})
    with pytest.raises(ValueError, match="local_window"):
        AttentionConfig(d_model=32, n_heads=4, mechanism="scalar", local_window=4)
    with pytest.raises(ValueError, match="train_window"):
        AttentionConfig(d_model=32, n_heads=4, mechanism="softmax", train_window=4)
    AttentionConfig(d_model=32, n_heads=4, mechanism="hybrid", train_window=4, scalar_gain=0.0)  # the gain windows too
    with pytest.raises(ValueError, match="train_window"):
        AttentionConfig(d_model=32, n_heads=4, mechanism="scalar", train_window=4, impl="approx")
    cache = SortedScalarCache(1, 2, 2, 3)
    for bad in ((torch.zeros(1, 2, 1),), (torch.zeros(1, 2, 1), torch.zeros(1, 2, 2, 3)),
                (torch.full((1, 2, 1), float("nan")), torch.zeros(1, 2, 1, 3))):
        with pytest.raises((TypeError, ValueError), match="extra"):
            cache.attend(torch.zeros(1, 2), 1.0, extra=bad)
    out = cache.attend(torch.zeros(1, 2), 1.0, extra=(torch.zeros(1, 2, 1), torch.ones(1, 2, 1, 3)))  # empty + ring
    assert torch.equal(out, torch.ones(1, 2, 3))
    with pytest.raises(ValueError, match="local"):
        windowed_attention(*scalars()[:4], 4, local=-1)
    with pytest.raises(ValueError, match="impl"):
        windowed_attention(*scalars()[:4], 4, impl="gpu")


def test_ring_hands_its_oldest_token_to_the_sorted_cache():
    from attnlab.cache.ring import Ring

    ring, left = Ring(3), []
    for t in range(5):
        ring.push(torch.full((1, 2), float(t)), torch.full((1, 1, 4), float(t)), None,
                  lambda ks, v, k: left.append((ks.clone(), v.clone(), k)))
    assert [int(ks[0, 0]) for ks, _, _ in left] == [0, 1] and all(k is None for *_, k in left)
    ks, v, k = ring.view()
    assert len(ring) == 3 and sorted(ks[0, 0].tolist()) == [2.0, 3.0, 4.0] and k is None
    assert torch.equal(ks[0, 0], v[0, 0, :, 0])  # keys and values stay paired
    with pytest.raises(ValueError, match="size"):
        Ring(0)


@pytest.mark.parametrize("T", [3, 6, 20])
@pytest.mark.parametrize("bulk", [True, False], ids=["one-pass", "stepped"])
def test_prompt_through_the_ring_in_one_pass(monkeypatch, T, bulk):
    """A window-trained model with a local ring (and a sink) prefills its prompt in one pass: the last w
    tokens fill the ring (`Ring.fill`) and the older ones the sorted cache, as stepping leaves them;
    logits and every later step equal T single steps. Past CPU_BULK_PREFILL tokens on the CPU the
    prompt is stepped instead."""
    from attnlab.cache.ring import Ring
    from attnlab.layers.mechanisms import scalar_decode
    from attnlab.models.config import ModelConfig
    from attnlab.models.lm import LM

    fills = []
    real = Ring.fill
    monkeypatch.setattr(Ring, "fill", lambda self, *a, **k: fills.append(a[0].shape[-1]) or real(self, *a, **k))
    if not bulk:
        monkeypatch.setattr(scalar_decode, "CPU_BULK_PREFILL", 2)
    torch.manual_seed(0)
    m = LM(ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, attn="hybrid", max_seq_len=64,
                       attention=dict(train_window=4, local_window=6, kernel="cauchy", sink=True, n_kv_heads=2))).eval()
    idx = torch.randint(0, 50, (2, T + 4), generator=torch.Generator().manual_seed(T))
    with torch.no_grad():
        c1, c2 = m.make_caches(2), m.make_caches(2)
        a = m.prefill(idx[:, :T], c1)
        b = torch.cat([m.step(idx[:, t : t + 1], c2, t)[:, None] for t in range(T)], 1)
        assert torch.allclose(a, b, atol=1e-5)
        for t in range(T, T + 4):
            assert torch.allclose(m.step(idx[:, t : t + 1], c1, t), m.step(idx[:, t : t + 1], c2, t), atol=1e-5)
    assert fills == ([min(T, 6)] * 2 if bulk else [])  # one fill per layer, or none when stepped
    ring = Ring(2)
    ring.push(torch.zeros(1, 1), torch.zeros(1, 1, 3), None, lambda *a: None)
    with pytest.raises(ValueError, match="empty ring"):
        ring.fill(torch.zeros(1, 1, 1), torch.zeros(1, 1, 1, 3), None, start=0)


def test_a_step_whose_projections_overflow_is_refused_and_changes_nothing():
    torch.manual_seed(0)
    m = Attention(AttentionConfig(d_model=32, n_heads=4, mechanism="hybrid", train_window=3, local_window=2))
    x = torch.randn(1, 6, 32)
    with torch.no_grad():
        c = m.make_cache(1)
        for t in range(6):
            m.step(x[:, t : t + 1], c)
        before = (c.pos, len(c.scalar), len(c.ring), c.ring.ks.clone())
        m.wk.weight.mul_(1e38)  # finite input, keys overflow to inf
        with pytest.raises(ValueError, match="must be finite.*the cache is unchanged"):
            m.step(torch.full((1, 1, 32), 10.0), c)
    assert (c.pos, len(c.scalar), len(c.ring)) == before[:3] and torch.equal(c.ring.ks, before[3])
    cache = SortedScalarCache(1, 2, 1, 3)
    nan_key = torch.tensor([[0.0, float("nan")]])
    with pytest.raises(ValueError, match="ks must be finite"):
        cache.append(nan_key, torch.zeros(1, 1, 3))
    assert len(cache) == 0
    cache.append(torch.zeros(1, 2), torch.zeros(1, 1, 3), check_values=False)  # a caller that checked already
    assert len(cache) == 1
