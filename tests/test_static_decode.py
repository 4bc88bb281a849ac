"""Static-shape exact decoding (attnlab.models.static_decode): every step's logits equal the full
forward's, tokens equal LM.generate's, for softmax and hybrid layers (GQA, RoPE, sliding window,
output gate, learned positions, Cauchy kernel, the gain); the compiled step; refusals by name."""

from __future__ import annotations

import pytest
import torch

from attnlab.models.config import ModelConfig
from attnlab.models.lm import LM
from attnlab.models.static_decode import StaticDecoder

pytestmark = pytest.mark.usefixtures("one_thread")

SETTINGS = {
    "softmax": ("softmax", {}, {}),
    "softmax-gqa-window": ("softmax", dict(n_kv_heads=2, sliding_window=5), {}),
    "softmax-gate": ("softmax", dict(output_gate="elementwise"), {}),
    "softmax-learned-positions": ("softmax", dict(rope=False), dict(pos_embedding="learned")),
    "hybrid-gqa": ("hybrid", dict(n_kv_heads=2), {}),
    "hybrid-cauchy-gain": ("hybrid", dict(kernel="cauchy", scalar_gain=0.5), {}),
    "hybrid-trained-window": ("hybrid", dict(train_window=3, local_window=2), {}),
}


def model(attn, attention, extra, dev="cpu"):
    torch.manual_seed(0)
    return LM(ModelConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=4, attn=attn, max_seq_len=64,
                          attention=attention, **extra)).to(dev).eval()


@pytest.mark.parametrize("name", list(SETTINGS))
def test_steps_equal_the_forward_and_generate(name):
    m = model(*SETTINGS[name])
    idx = torch.randint(0, 50, (2, 7), generator=torch.Generator().manual_seed(1))
    exact = name == "hybrid-trained-window"  # LM.generate decodes a trained window through it by default
    ref = m.generate(idx, 12, window=None) if not exact else None
    dec = StaticDecoder(m, 2, 32)
    got = dec.generate(idx, 12)
    if ref is not None:
        assert torch.equal(got, ref)
    if exact:  # the exact forward: the same weights without the trained window
        ex = model("hybrid", {}, {})
        ex.load_state_dict(m.state_dict())
        full = ex(got)[0]
    else:
        full = m(got)[0]  # (B, 19, V)
    dec2 = StaticDecoder(m, 2, 32)
    assert torch.allclose(dec2.prefill(got[:, :7], chunk=3), full[:, 6], atol=1e-5)  # in chunks of 3
    for t in range(7, 18):
        assert torch.allclose(dec2.step(got[:, t : t + 1]), full[:, t], atol=1e-5), t


def test_generate_compile_builds_one_compiled_decoder(monkeypatch):
    """LM.generate(compile=True) compiles the decoder's step once (torch.compile, no CUDA graphs on the
    CPU), keeps it for the next call that fits, and samples as the eager path does."""
    calls = []
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: calls.append(kw) or fn)
    m = model(*SETTINGS["hybrid-gqa"])
    idx = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(2))
    assert torch.equal(m.generate(idx, 9, compile=True), m.generate(idx, 9))
    assert torch.equal(m.generate(idx[:, :4], 8, compile=True), m.generate(idx[:, :4], 8))
    assert calls == [dict(mode=None, fullgraph=True)]
    kw = dict(greedy=False, temperature=0.7)
    a = m.generate(idx, 5, generator=torch.Generator().manual_seed(3), compile=True, **kw)
    assert torch.equal(a, m.generate(idx, 5, generator=torch.Generator().manual_seed(3), **kw))
    import copy

    copy.deepcopy(m)  # the decoder stays behind


@pytest.mark.slow
def test_compiled_step_equals_eager():
    m = model(*SETTINGS["hybrid-cauchy-gain"])
    idx = torch.randint(0, 50, (1, 5), generator=torch.Generator().manual_seed(4))
    assert torch.equal(m.generate(idx, 10, compile=True), m.generate(idx, 10))


def test_refusals_name_what_is_wrong():
    with pytest.raises(ValueError, match="layer 0 has mechanism 'principled'"):
        StaticDecoder(model("principled", {}, {}), 1, 8)
    with pytest.raises(ValueError, match="scale='ktotal'"):
        StaticDecoder(model("softmax", dict(scale="ktotal"), {}), 1, 8)
    with pytest.raises(ValueError, match="a sink"):
        StaticDecoder(model("hybrid", dict(sink=True), {}), 1, 8)
    m = model(*SETTINGS["softmax-learned-positions"])
    with pytest.raises(ValueError, match="max_len=65 is past the learned position embedding"):
        StaticDecoder(m, 1, 65)
    with pytest.raises(ValueError, match="max_len must be an int >= 1"):
        StaticDecoder(m, 1, 0)
    dec = StaticDecoder(m, 1, 4)
    with pytest.raises(ValueError, match="step before prefill"):
        dec.step(torch.zeros(1, 1, dtype=torch.long))
    dec.prefill(torch.zeros(1, 4, dtype=torch.long))
    with pytest.raises(ValueError, match="buffers are full"):
        dec.step(torch.zeros(1, 1, dtype=torch.long))
    with pytest.raises(ValueError, match="idx must be"):
        dec.prefill(torch.zeros(2, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="compile=True decodes exactly"):
        m.generate(torch.zeros(1, 2, dtype=torch.long), 3, compile=True, attention_mask=torch.ones(1, 2))


@pytest.mark.cuda
def test_cuda_graphs_step_equals_eager():
    """On CUDA: the step compiled with mode='reduce-overhead' (CUDA graphs) decodes the eager tokens."""
    m = model(*SETTINGS["hybrid-gqa"], dev="cuda")
    idx = torch.randint(0, 50, (2, 6), generator=torch.Generator().manual_seed(5)).cuda()
    assert torch.equal(m.generate(idx, 20, compile=True), m.generate(idx, 20))
