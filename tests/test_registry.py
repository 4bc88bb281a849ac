"""The mechanism registry: config names map to one class each, options that a mechanism does not
read are errors naming them, and a mechanism added from outside works end to end."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from attnlab.layers import MECHANISMS, REGISTRY, Attention, AttentionConfig, mechanism_class, register
from attnlab.layers.mechanisms.softmax import SoftmaxAttention
from attnlab.models import LM, ModelConfig


@pytest.mark.parametrize("name", MECHANISMS)
def test_config_name_gives_its_class_and_configs_round_trip(name):
    cfg = AttentionConfig(64, 2, mechanism=name)  # head_dim 32: room for GOAT's default prior
    layer = Attention(cfg)
    assert type(layer) is mechanism_class(name) and isinstance(layer, Attention) and layer.mechanism == name
    again = dataclasses.replace(cfg)  # derived fields go back in: they must not read as set options
    assert again == cfg
    assert type(Attention(again)) is type(layer)


@pytest.mark.parametrize(
    "name,field,value",
    [("softmax", "tau", "token"), ("softmax", "sink", True), ("hybrid", "n_value_groups", 2), ("gla", "alpha", "query"),
     ("principled", "gla_rank", 4), ("scalar", "cosformer_max_len", 8), ("cosformer", "scale", "ktotal")],
)
def test_option_the_mechanism_does_not_read_is_an_error_naming_it(name, field, value):
    with pytest.raises(ValueError, match=rf"AttentionConfig\.{field}: got .*mechanism '{name}' does not use it"):
        AttentionConfig(32, 4, mechanism=name, **{field: value})


def test_unknown_mechanism_names_the_known_ones():
    with pytest.raises(ValueError, match="AttentionConfig.mechanism: got 'flash'.*'softmax'"):
        AttentionConfig(32, 4, mechanism="flash")
    with pytest.raises(ValueError, match="'softmax'"):
        mechanism_class("flash")


def test_a_mechanism_added_from_outside_trains_and_decodes():
    """One subclass and one registration: softmax with every score halved."""

    class HalfScale(SoftmaxAttention):
        mechanism = "half"
        options = ("n_kv_heads", "rope", "rope_base")

        def attend(self, p, values=None, impl=None):
            from attnlab.ops import softmax_attention

            v = p.v if values is None else values
            return softmax_attention(p.q, p.k, v, scale=0.5 / self.config.head_dim ** 0.5, impl=impl or self.config.impl), None

        def step_readout(self, p, cache):
            from attnlab.ops import softmax_attention

            full = cache.kv.append(k=p.k, v=p.v)
            return softmax_attention(p.q, full["k"], full["v"], scale=0.5 / self.config.head_dim ** 0.5)

    register(HalfScale)
    try:
        with pytest.raises(ValueError, match="new, non-empty name"):
            register(HalfScale)
        torch.manual_seed(0)
        model = LM(ModelConfig(vocab_size=11, d_model=16, n_layers=2, n_heads=2, attn=["half", "softmax"], max_seq_len=12))
        assert type(model.blocks[0].attn) is HalfScale
        idx = torch.randint(0, 11, (2, 9))
        logits = model(idx)[0]
        out = model.generate(idx[:, :3], 6)  # token by token through step
        steps = torch.stack([model(out[:, : t + 1])[0][:, -1] for t in range(2, 8)], 1)
        assert torch.equal(out[:, 3:], steps.argmax(-1))
        assert torch.isfinite(logits).all()
    finally:
        REGISTRY.pop("half", None)
