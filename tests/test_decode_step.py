"""Decode: T calls of `step` equal one `forward`; the plain caches keep what was appended."""

import pytest
import torch

from attnlab.cache.kv import KVCache, RecurrentState
from attnlab.layers import Attention, AttentionConfig
from attnlab.ops import hybrid_attention, scalar_attention, softmax_attention
from attnlab.testing import rel_rms

C, H, T, B = 32, 4, 10, 2
D = C // H

CONFIGS = {
    "softmax": dict(mechanism="softmax"),
    "softmax-gqa-rope": dict(mechanism="softmax", n_kv_heads=2, rope=True),
    "softmax-ktotal": dict(mechanism="softmax", scale="ktotal"),
    "softmax-kmean": dict(mechanism="softmax", scale="kmean", n_kv_heads=1),
    "softmax-krms": dict(mechanism="softmax", scale="krms"),
    "softmax-pnorm": dict(mechanism="softmax", scale="pnorm", p=3.0),
    "softmax-n_sqrt_d": dict(mechanism="softmax", scale="n_sqrt_d"),
    "softmax-float": dict(mechanism="softmax", scale=0.3, output_gate="elementwise"),
    "scalar-gva": dict(mechanism="scalar", n_value_groups=2),
    "scalar-token-tau-sink-gate": dict(mechanism="scalar", n_value_groups=1, tau="token", sink=True, output_gate="headwise"),
    "scalar-global-cap": dict(mechanism="scalar", tau="global", tau_max=0.5),
    "mixed-sink-rope": dict(mechanism="scalar", n_scalar_heads=2, n_kv_heads=1, sink=True, rope=True),
    "hybrid": dict(mechanism="hybrid", tau="token"),
    "hybrid-gqa-sink-rope": dict(mechanism="hybrid", n_kv_heads=2, sink=True, rope=True, sink_key=-0.3),
    "principled-head-v0": dict(mechanism="principled", v0="head", alpha_init=0.5, gamma_init=-0.2),
    "principled-query-gqa": dict(mechanism="principled", alpha="query", beta="query", gamma="query", v0="layer", n_kv_heads=2, rope=True),
    "principled-const-layer": dict(mechanism="principled", alpha="constant", beta="layer", gamma="constant", output_gate="elementwise"),
    "cosformer": dict(mechanism="cosformer", cosformer_max_len=T),
    "cosformer-long-horizon": dict(mechanism="cosformer", cosformer_max_len=64, cosformer_normalize=False),
    "gla": dict(mechanism="gla", gla_rank=4, output_gate="elementwise"),
    "ssd": dict(mechanism="ssd", rope=True),
    "goat-gqa": dict(mechanism="goat", n_kv_heads=2, goat_rank=3, goat_train_len=T),
    "goat-hybrid": dict(mechanism="goat_hybrid", tau="token", goat_rank=2, goat_train_len=T),
}


def make(kw, dtype=torch.float64):
    layer = Attention(AttentionConfig(C, H, **kw)).to(dtype)
    with torch.no_grad():  # give the zero-initialised extras values that matter
        for name, prm in layer.named_parameters():
            if name in ("sink_value", "gate.proj.weight", "ground.value") or name.endswith(("alpha.weight", "beta.weight", "gamma.weight")):
                prm.normal_(0, 0.5)
    return layer


def run_steps(layer, x, cache):
    return torch.cat([layer.step(x[:, t:t + 1], cache) for t in range(x.shape[1])], dim=1)


@pytest.mark.parametrize("name", list(CONFIGS))
def test_step_equals_forward(name):
    layer = make(CONFIGS[name])
    x = torch.randn(B, T, C, dtype=torch.float64)
    cache = layer.make_cache(B)
    with torch.no_grad():
        y = layer(x)
        ys = run_steps(layer, x, cache)
    assert ys.shape == (B, T, C)
    assert rel_rms(ys, y) < 1e-10
    assert cache.pos == T


def test_cosformer_default_horizon_decodes_with_max_len():
    layer = make(dict(mechanism="cosformer"))  # forward uses M = T
    x = torch.randn(B, T, C, dtype=torch.float64)
    with pytest.raises(ValueError, match="max_len"):
        layer.make_cache(B)
    with torch.no_grad():
        assert rel_rms(run_steps(layer, x, layer.make_cache(B, max_len=T)), layer(x)) < 1e-10


@pytest.mark.parametrize("name", ["scalar-token-tau-sink-gate", "mixed-sink-rope", "hybrid-gqa-sink-rope", "hybrid"])
def test_sorted_cache_exact_window_equals_forward(name):
    pytest.importorskip("attnlab.cache.sorted")
    layer = make(CONFIGS[name], torch.float32)
    x = torch.randn(B, T, C)
    with torch.no_grad():
        y = layer(x)
        ys = run_steps(layer, x, layer.make_cache(B, window=T))  # window holds every key: exact
    assert rel_rms(ys, y) < 1e-5


def test_sorted_cache_small_window_is_close_when_tau_is_small():
    """τ → 0: nearly all mass on the nearest key, so 3 nearest keys (+ sink) reproduce the layer."""
    pytest.importorskip("attnlab.cache.sorted")
    layer = make(dict(mechanism="scalar", n_value_groups=2, sink=True, tau_init=1e-5), torch.float32)
    x = torch.randn(B, 3 * T, C)
    with torch.no_grad():
        y = layer(x)
        y_win = run_steps(layer, x, layer.make_cache(B, window=3))
        y_one = run_steps(layer, x, layer.make_cache(B, window=1))
    assert rel_rms(y_win, y) < 1e-3
    assert rel_rms(y_win, y) <= rel_rms(y_one, y)


def test_make_cache_and_step_reject_bad_input():
    soft = make(dict(mechanism="softmax"))
    with pytest.raises(ValueError, match="window"):
        soft.make_cache(B, window=4)
    with pytest.raises(ValueError, match="max_len"):
        soft.make_cache(B, max_len=8)
    with pytest.raises(ValueError, match="batch_size"):
        soft.make_cache(0)
    cache = soft.make_cache(B)
    with pytest.raises(ValueError, match="one token"):
        soft.step(torch.randn(B, 2, C, dtype=torch.float64), cache)
    with pytest.raises(ValueError, match="batch"):
        soft.step(torch.randn(B + 1, 1, C, dtype=torch.float64), cache)
    with pytest.raises(TypeError, match="make_cache"):
        soft.step(torch.randn(B, 1, C, dtype=torch.float64), {})
    scalar = make(dict(mechanism="scalar"))
    with pytest.raises(ValueError, match="window"):
        scalar.make_cache(B, window=0)


@pytest.mark.parametrize("scale", ["sqrt_d", "ktotal", "kmean", "krms", "pnorm", "n_sqrt_d", 0.7])
def test_softmax_decode_query_is_last_row_of_op(scale):
    """The one-query form a decode step calls (fast path) against the full naive call."""
    q = torch.randn(B, H, T, D, dtype=torch.float64)
    k = torch.randn(B, 2, T, D, dtype=torch.float64)
    v = torch.randn(B, 2, T, 5, dtype=torch.float64)
    full = softmax_attention(q, k, v, scale=scale, p=1.5, impl="naive")
    last = softmax_attention(q[:, :, -1:], k, v, scale=scale, p=1.5)
    assert rel_rms(last, full[:, :, -1:]) < 1e-12


def test_scalar_and_hybrid_decode_queries_are_last_row_of_ops():
    qs, ks = torch.randn(B, H, T, dtype=torch.float64), torch.randn(B, H, T, dtype=torch.float64)
    q, k = torch.randn(B, H, T, D, dtype=torch.float64), torch.randn(B, 1, T, D, dtype=torch.float64)
    v = torch.randn(B, 2, T, 3, dtype=torch.float64)
    tau = torch.rand(B, H, T, dtype=torch.float64) + 0.1
    full = scalar_attention(qs, ks, v, tau, impl="naive")
    assert rel_rms(scalar_attention(qs[..., -1:], ks, v, tau[..., -1:]), full[:, :, -1:]) < 1e-12
    full = hybrid_attention(q, k, v, qs, ks, tau, impl="naive")
    assert rel_rms(hybrid_attention(q[:, :, -1:], k, v, qs[..., -1:], ks, tau[..., -1:]), full[:, :, -1:]) < 1e-12


def test_kv_cache_grows_and_keeps_contents():
    cache = KVCache(batch_size=2, initial_capacity=2)
    ks, vs = [], []
    for _ in range(9):  # past several doublings
        ks.append(torch.randn(2, 3, 1))
        vs.append(torch.randn(2, 1, 1, 4))
        full = cache.append(ks=ks[-1], v=vs[-1])
    assert len(cache) == 9 and cache.capacity >= 9
    assert torch.equal(full["ks"], torch.cat(ks, dim=2)) and torch.equal(full["v"], torch.cat(vs, dim=2))
    more = cache.append(ks=torch.randn(2, 3, 4), v=torch.randn(2, 1, 4, 4))  # several steps at once
    assert more["ks"].shape == (2, 3, 13) and torch.equal(more["ks"][..., :9], torch.cat(ks, dim=2))
    assert cache.nbytes() == 13 * (2 * 3 + 2 * 4) * 4


def test_kv_cache_rejects_mismatches():
    cache = KVCache(batch_size=2)
    cache.append(k=torch.randn(2, 1, 1, 4))
    with pytest.raises(ValueError, match="names"):
        cache.append(v=torch.randn(2, 1, 1, 4))
    with pytest.raises(ValueError, match="shaped"):
        cache.append(k=torch.randn(2, 1, 1, 5))
    with pytest.raises(ValueError, match="batch"):
        cache.append(k=torch.randn(3, 1, 1, 4))
    with pytest.raises(ValueError, match="steps"):
        KVCache(2).append(k=torch.randn(2, 1, 2, 4), v=torch.randn(2, 1, 1, 4))
    with pytest.raises(ValueError, match="batch_size"):
        KVCache(0)


def test_recurrent_state_holds_detached_state_and_counts():
    st = RecurrentState(batch_size=1)
    s = torch.randn(1, 2, 3, 3, requires_grad=True)
    st.update((s * 2, s), steps=4)
    assert st.pos == 4 and not st.state[0].requires_grad and st.nbytes() == 2 * 18 * 4
