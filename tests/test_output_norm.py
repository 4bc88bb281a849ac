"""`output_norm`: each head's readout at unit RMS over its channels, times a learned per-head,
per-channel scale, before the output gate and W_O, for every mechanism. Checked against the formula
written out (outputs and every gradient, a readout of zeros and one of huge values among the inputs),
its place before the gate, its scale's weight decay (none, as a norm's), a bad value named, and a
trained model's round trip through save and the Hugging Face export."""

from __future__ import annotations

import pytest
import torch

from attnlab.layers.attention import OUT_NORM_EPS, Attention
from attnlab.layers.config import AttentionConfig
from attnlab.models import LM, ModelConfig

pytestmark = pytest.mark.usefixtures("one_thread")

MECHS = {"gla": {}, "ssd": {}, "cosformer": {}, "softmax": {}, "hybrid": {}, "scalar": {}, "principled": {},
         "goat": dict(goat_rank=2, head_dim=16)}


def written_out(layer, o, x):
    """The readout o (B, H, T, D) through output_norm, the gate and W_O, by the formula."""
    B, H, T, D = o.shape
    o64 = o.double()
    rms = (o64.pow(2).mean(-1, keepdim=True) + OUT_NORM_EPS).sqrt()
    o = (o64 / rms * layer.out_norm.double().view(H, 1, D)).to(o.dtype)
    if layer.gate is not None:
        return layer.gate.gated(o, x)[0] @ layer.wo.weight.T
    return o.transpose(1, 2).reshape(B, T, H * D) @ layer.wo.weight.T


@pytest.mark.parametrize("mech", list(MECHS))
def test_the_readout_is_normalised_per_head_then_scaled(mech):
    torch.manual_seed(0)
    layer = Attention(AttentionConfig(mechanism=mech, d_model=32, n_heads=4, output_norm=True, **MECHS[mech]))
    plain = Attention(AttentionConfig(mechanism=mech, d_model=32, n_heads=4, **MECHS[mech]))
    plain.load_state_dict({k: v for k, v in layer.state_dict().items() if k != "out_norm"})
    with torch.no_grad():
        layer.out_norm.normal_(1.0, 0.5)
    x = torch.randn(2, 7, 32)
    o = plain.attend(plain.project(x))[0]  # the same readout: output_norm sits after it
    assert torch.allclose(layer(x), written_out(layer, o, x).float(), atol=1e-5)


@pytest.mark.parametrize("gate", [None, "elementwise", "headwise"])
def test_gradients_equal_the_formulas_on_hostile_readouts(gate):
    """Every gradient (the readout, the scale, W_O, the gate) in float64, on readouts of zeros (the
    epsilon keeps them finite) and of 1e30 (no overflow in the mean of squares)."""
    torch.manual_seed(1)
    layer = Attention(AttentionConfig(mechanism="gla", d_model=16, n_heads=2, output_norm=True,
                                      output_gate=gate)).double()
    with torch.no_grad():
        layer.out_norm.normal_(1.0, 0.5)
    x = torch.randn(2, 5, 16, dtype=torch.float64)
    for o in (torch.randn(2, 2, 5, 8, dtype=torch.float64), torch.zeros(2, 2, 5, 8, dtype=torch.float64),
              1e30 * torch.randn(2, 2, 5, 8, dtype=torch.float64)):
        o.requires_grad_(True)
        got = layer.finish(o, x)
        params = [o, *layer.parameters()]
        g_got = torch.autograd.grad(got.sum(), params, allow_unused=True)
        want = written_out(layer, o, x)
        g_want = torch.autograd.grad(want.sum(), params, allow_unused=True)
        assert torch.isfinite(got).all() and torch.allclose(got, want, rtol=1e-10, atol=1e-10)
        for a, b in zip(g_got, g_want):
            assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, rtol=1e-9, atol=1e-12))


def test_the_scale_takes_no_weight_decay_and_off_adds_nothing(tmp_path):
    from attnlab.train.config import TrainConfig
    from attnlab.train.setup import make_optimizer

    m = LM(ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, attn="gla", max_seq_len=16,
                       attention=dict(output_norm=True)))
    opt = make_optimizer(m, TrainConfig())
    scales = {id(b.attn.out_norm) for b in m.blocks}
    decay = {id(p) for g in opt.param_groups if g["weight_decay"] > 0 for p in g["params"]}
    assert scales and not scales & decay
    off = LM(ModelConfig(vocab_size=40, d_model=32, n_layers=2, n_heads=4, attn="gla", max_seq_len=16))
    assert not any("out_norm" in k for k in off.state_dict())  # a checkpoint without it loads unchanged


def test_a_bad_value_is_named():
    with pytest.raises(ValueError, match="output_norm"):
        AttentionConfig(mechanism="gla", d_model=32, n_heads=4, output_norm="yes")


def test_save_and_hf_export_keep_the_scales(tmp_path):
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    import attnlab.hf as H
    from attnlab.data.tokenizer import ByteTokenizer

    torch.manual_seed(2)
    lm = LM(ModelConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4, attn=["gla", "softmax"], max_seq_len=32,
                        attention=dict(output_norm=True))).eval()
    with torch.no_grad():
        for b in lm.blocks:
            b.attn.out_norm.normal_(1.0, 0.5)
    H.export.save_folder(lm, tmp_path, ByteTokenizer())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    idx = torch.randint(257, (2, 11))
    with torch.no_grad():
        assert torch.allclose(hf(idx).logits, lm(idx)[0], atol=1e-5)
    assert all(torch.equal(hf.model.blocks[i].attn.out_norm, b.attn.out_norm) for i, b in enumerate(lm.blocks))
