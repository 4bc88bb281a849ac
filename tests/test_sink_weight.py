"""A learned sink weighed in the normaliser (sink_weight): w = 0 is exactly no sink and still learns."""

import pytest
import torch

from attnlab.cache.options import KeyRule
from attnlab.cache.sorted import SortedScalarCache
from attnlab.layers import Attention, AttentionConfig
from attnlab.testing import rel_rms

KW = {"scalar": dict(d_model=32, n_heads=4, mechanism="scalar", n_value_groups=2),
      "hybrid": dict(d_model=32, n_heads=4, mechanism="hybrid", n_kv_heads=2)}


def layer(mech, impl="auto", **kw):
    torch.manual_seed(0)
    return Attention(AttentionConfig(**KW[mech], impl=impl, **kw)).double()


def x_input(T=11):
    return torch.randn(2, T, 32, generator=torch.Generator().manual_seed(1), dtype=torch.float64)


@pytest.mark.parametrize("impl", ["auto", "naive"])
@pytest.mark.parametrize("mech", ["scalar", "hybrid"])
def test_weight_zero_is_no_sink_and_learns(mech, impl):
    base, sunk = layer(mech, impl), layer(mech, impl, sink=True, sink_weight=0.0)
    sunk.load_state_dict(base.state_dict(), strict=False)
    with torch.no_grad():
        sunk.sink_value.normal_()
    x = x_input()
    y = sunk(x)
    assert rel_rms(y, base(x)) < 1e-12
    y.square().sum().backward()
    assert bool((sunk.sink_weight.grad != 0).all())  # |w| at 0 has gradient +1, not abs's 0


@pytest.mark.parametrize("mech", ["scalar", "hybrid"])
def test_weight_one_is_the_plain_sink_and_weights_scale_its_mass(mech):
    plain, one = layer(mech, sink=True), layer(mech, sink=True, sink_weight=1.0)
    with torch.no_grad():
        plain.sink_value.normal_()
    one.load_state_dict(plain.state_dict(), strict=False)
    x = x_input()
    assert rel_rms(one(x), plain(x)) < 1e-12
    with torch.no_grad():  # mass w·e^s / (Z + w·e^s): against the softmax of logits with log w on the sink
        one.sink_weight.copy_(torch.tensor([0.5, 2.0, -3.0, 0.0]))  # |w| is used
        a = one.attention_weights(x)  # (B, H, T, T + 1)
        assert torch.allclose(a.sum(-1), torch.ones(()).double())
        sink_mass = a[..., 0]
        assert float(sink_mass[:, 3].abs().max()) == 0.0 and float(sink_mass[:, 2].min()) > 0
        eye_w = super(type(one), one).attention_weights(x)  # the readout of identity values (split channels)
        assert rel_rms(eye_w, a) < 1e-10


@pytest.mark.parametrize("mech", ["scalar", "hybrid"])
def test_fast_equals_naive_with_gradients(mech):
    x = x_input().requires_grad_()
    grads = []
    for impl in ("naive", "auto"):
        m = layer(mech, impl, sink=True, sink_weight=0.0)
        with torch.no_grad():
            m.sink_value.normal_()
            m.sink_weight.copy_(torch.tensor([0.0, 0.3, 1.5, 0.0]))
        y = m(x)
        gs = torch.autograd.grad(y.square().sum(), [x, m.sink_weight, m.sink_value, m.wqs.weight])
        grads.append([y, *gs])
    for a, b in zip(*grads):
        assert rel_rms(b, a) < 1e-10


@pytest.mark.parametrize("window", [None, 3, 64])
@pytest.mark.parametrize("impl", ["auto", "naive"])
@pytest.mark.parametrize("mech", ["scalar", "hybrid"])
def test_decode_equals_forward(mech, impl, window):
    m = layer(mech, impl, sink=True, sink_weight=0.0)
    with torch.no_grad():
        m.sink_value.normal_()
        m.sink_weight.copy_(torch.tensor([0.0, 0.3, 1.5, 4.0]))
    x = x_input()
    with torch.no_grad():
        ref = m(x, key_rule=None if window is None else KeyRule(window=window))
    for prefill in (False, True):
        cache = m.make_cache(2, window=window)
        with torch.no_grad():
            if prefill:
                got = torch.cat([m.prefill(x[:, :6], cache), *(m.step(x[:, t : t + 1], cache) for t in range(6, 11))], 1)
            else:
                got = torch.cat([m.step(x[:, t : t + 1], cache) for t in range(11)], 1)
        assert rel_rms(got, ref) < (1e-12 if window is None else 1e-6)


def test_config_and_cache_errors():
    with pytest.raises(ValueError, match="sink_weight"):
        AttentionConfig(**KW["scalar"], sink_weight=0.0)  # no sink
    for bad in (-1.0, float("nan"), float("inf"), True, "0"):
        with pytest.raises(ValueError, match="sink_weight"):
            AttentionConfig(**KW["scalar"], sink=True, sink_weight=bad)
    with pytest.raises(ValueError, match="sink_weight"):
        AttentionConfig(d_model=32, n_heads=4, mechanism="softmax", sink_weight=0.0)
    kw = dict(sink_key=0.0, sink_value=torch.zeros(8))
    for bad in (float("nan"), float("inf"), torch.zeros(3)):
        with pytest.raises(ValueError, match="sink_logw"):
            SortedScalarCache(1, 4, 2, 8, sink_logw=bad, **kw)
    with pytest.raises(TypeError, match="sink_logw"):
        SortedScalarCache(1, 4, 2, 8, sink_logw="x", **kw)
    with pytest.raises(ValueError, match="sink_logw"):
        SortedScalarCache(1, 4, 2, 8, sink_logw=0.0)  # no sink to weigh
    c = SortedScalarCache(1, 4, 2, 8, sink_logw=float("-inf"), **kw)  # weight 0 and an empty cache: output 0
    out = c.attend(torch.zeros(1, 4), 1.0)
    assert out.shape == (1, 4, 8) and float(out.abs().max()) == 0.0
