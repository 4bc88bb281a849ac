"""Split-K decode steps (attnlab.cache.static.split): the chunked softmax with its log-sum-exp combine
equals one softmax over every key (outputs and gradients, hidden keys, wholly hidden chunks, the sink
as an extra key); a StaticDecoder whose exact steps split the cache gives the unsplit decoder's logits
for softmax (every scaling, GQA), scalar and hybrid layers (GQA, value groups, the sink and its weight,
a sliding window) and a mixed layer's dot-product heads, eager and compiled; "auto" splits on CUDA
from SPLIT_MIN keys only; bad values of split refused by name."""

from __future__ import annotations

import pytest
import torch

from attnlab.cache.static import CHUNK, SPLIT_MIN, split_attention, split_attention_naive, split_chunk
from attnlab.layers.mechanisms import scalar_static, softmax
from attnlab.models.config import ModelConfig
from attnlab.models.lm import LM
from attnlab.models.static_decode import StaticDecoder
from test_static_decode import random_sinks

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("sink", [False, True], ids=["plain", "sink"])
def test_split_attention_equals_one_softmax(sink):
    """Outputs and every gradient against the naive formula in float64, with hidden keys, a chunk
    wholly hidden (m = -inf: it weighs nothing) and logits far apart between chunks."""
    g = torch.Generator().manual_seed(0)
    B, G, r, S, c, D = 2, 2, 3, 5, 4, 6
    s = torch.randn(B, G, r, S, c, generator=g, dtype=torch.float64) * 3
    s[:, :, :, 2] += 40.0  # one chunk dominates: the combine rescales the others by e^(m_s - M)
    hidden = torch.rand(B, G, r, S, c, generator=g) < 0.3
    hidden[:, :, :, 4] = True  # a chunk with no visible key
    hidden[:, :, :, 2, 0] = False  # every query sees a key
    s = s.masked_fill(hidden, float("-inf")).requires_grad_()
    v = torch.randn(B, G, S, c, D, generator=g, dtype=torch.float64, requires_grad=True)
    extra = None
    if sink:
        extra = (torch.randn(B, G, r, generator=g, dtype=torch.float64, requires_grad=True) + 40.0,
                 torch.randn(B, G, r, D, generator=g, dtype=torch.float64, requires_grad=True))
    out, ref = split_attention(s, v, extra), split_attention_naive(s, v, extra)
    assert out.shape == (B, G, r, D) and out.dtype == torch.float32
    assert torch.allclose(out, ref.float(), atol=1e-6, rtol=1e-5)
    leaves = [s, v, *(extra or ())]
    w = torch.randn(B, G, r, D, generator=g)
    got = torch.autograd.grad((out * w).sum(), leaves)
    want = torch.autograd.grad((ref.float() * w).sum(), leaves)
    for name, a, b in zip(["s", "v", "sink logit", "sink value"], got, want):
        assert torch.allclose(torch.nan_to_num(a), torch.nan_to_num(b), atol=1e-5), name


def test_split_attention_refuses_shapes_that_do_not_fit():
    with pytest.raises(ValueError, match="s must be"):
        split_attention(torch.zeros(1, 1, 1, 2, 4), torch.zeros(1, 1, 2, 3, 5))
    with pytest.raises(ValueError, match="extra must be"):
        split_attention(torch.zeros(1, 1, 1, 2, 4), torch.zeros(1, 1, 2, 4, 5),
                        (torch.zeros(1, 1, 1), torch.zeros(1, 5)))


def test_split_chunk_is_chosen_by_device_and_length():
    assert split_chunk("auto", 1 << 20, "cpu") is None  # the CPU never splits by itself
    assert split_chunk("auto", SPLIT_MIN, "cuda") == CHUNK and split_chunk("auto", SPLIT_MIN - 1, "cuda") is None
    assert split_chunk(None, 1 << 20, "cuda") is None
    assert split_chunk(8, 9, "cpu") == 8 and split_chunk(8, 8, "cpu") is None  # one chunk: nothing to split
    for bad in (0, -4, 2.0, True, "yes"):
        with pytest.raises(ValueError, match="split must be"):
            split_chunk(bad, 64, "cpu")
    m = LM(ModelConfig(vocab_size=50, d_model=64, n_layers=1, n_heads=4, max_seq_len=64))
    with pytest.raises(ValueError, match="split must be"):
        StaticDecoder(m, 1, 16, split=0)


LAYERS = {  # one model per row: (mechanism per layer, per-layer options)
    "softmax-gqa-kmean": (["softmax", "softmax"], [dict(n_kv_heads=2), dict(scale="kmean")]),
    "softmax-pnorm-float": (["softmax", "softmax"], [dict(scale="pnorm", p=3.0, n_kv_heads=1), dict(scale=0.2)]),
    "hybrid-sink-weight-gqa": (["hybrid", "hybrid"], [dict(sink=True, sink_weight=0.5, n_kv_heads=2, scalar_gain=0.5),
                                                      dict(kernel="cauchy")]),
    "scalar-groups-sink-sliding": (["scalar", "scalar"], [dict(n_value_groups=2, sink=True),
                                                          dict(sliding_window=5, kernel="cauchy")]),
    "mixed-heads": (["scalar", "softmax"], [dict(n_scalar_heads=2, n_kv_heads=2, sink=True), dict(sliding_window=3)]),
}


def layered(name):
    attn, per_layer = LAYERS[name]
    torch.manual_seed(0)
    return random_sinks(LM(ModelConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=4, attn=attn, max_seq_len=64,
                                       layer_attention=per_layer))).eval()


@pytest.mark.parametrize("name", list(LAYERS))
def test_split_steps_equal_the_unsplit_steps(name, monkeypatch):
    """Every step's logits with the cache split in chunks of 8 (buffers padded from 30 to 32 slots) equal
    the unsplit decoder's and the full forward's; the split form runs in every step of a split layer."""
    calls = []
    for mod in (scalar_static, softmax):
        real = mod.split_attention
        monkeypatch.setattr(mod, "split_attention", lambda *a, real=real: calls.append(1) or real(*a))
    m = layered(name)
    idx = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(2))
    full = m(idx)[0]
    plain, split = StaticDecoder(m, 2, 30, split=None), StaticDecoder(m, 2, 30, split=8)
    assert split.slots.shape[0] == 32 and plain.slots.shape[0] == 30
    with torch.no_grad():
        assert torch.allclose(split.prefill(idx[:, :6]), plain.prefill(idx[:, :6]), atol=1e-5)
        assert calls == []  # a prompt is not a step
        for t in range(6, 20):
            a, b = split.step(idx[:, t : t + 1]), plain.step(idx[:, t : t + 1])
            assert torch.allclose(a, b, atol=1e-5) and torch.allclose(a, full[:, t], atol=1e-5), t
    # two split readouts per step in every model: a softmax ring (sliding window) is O(w) already and is
    # not split, a mixed layer splits its scalar heads and its dot-product heads
    assert len(calls) == 14 * 2


@pytest.mark.slow
def test_compiled_split_steps_equal_eager_unsplit():
    """The compiled split step (torch.compile, one graph) gives the eager unsplit step's logits, for a
    model of softmax (GQA), hybrid (sink weight) and mixed layers."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    m = random_sinks(LM(ModelConfig(vocab_size=50, d_model=64, n_layers=3, n_heads=4, max_seq_len=64,
                                    attn=["softmax", "hybrid", "scalar"],
                                    layer_attention=[dict(n_kv_heads=2), dict(sink=True, sink_weight=0.5, n_kv_heads=2),
                                                     dict(n_scalar_heads=2, sink=True)]))).eval()
    idx = torch.randint(0, 50, (2, 20), generator=torch.Generator().manual_seed(2))
    plain, fast = StaticDecoder(m, 2, 30, split=None), StaticDecoder(m, 2, 30, split=8, compile=True)
    assert torch.allclose(fast.prefill(idx[:, :6]), plain.prefill(idx[:, :6]), atol=1e-5)
    for t in range(6, 20):
        assert torch.allclose(fast.step(idx[:, t : t + 1]), plain.step(idx[:, t : t + 1]), atol=1e-5), t
