"""Every layer configuration through hostile inputs (docs/guide/input-policy.md): a non-finite or
wrongly typed x raises naming it; T = 0 gives (B, 0, C); later tokens, however extreme, never
change earlier outputs; bf16 autocast runs forward and backward for every mechanism."""

from __future__ import annotations

import pytest
import torch

from attnlab.layers import Attention, AttentionConfig
from attnlab.testing import rel_rms

from test_layers import CONFIGS

C, H, B, T = 32, 4, 2, 12
NAMES = list(CONFIGS)


def _layer(name, dtype=torch.float32):
    torch.manual_seed(0)
    return Attention(AttentionConfig(C, H, **CONFIGS[name])).to(dtype)


def _x(t=T, dtype=torch.float32, seed=0):
    return torch.randn(B, t, C, generator=torch.Generator().manual_seed(seed), dtype=torch.float64).to(dtype)


def _cache(layer):
    return layer.make_cache(B, max_len=32 if layer.config.mechanism == "cosformer" else None)


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("name", NAMES)
def test_nonfinite_input_raises_naming_x(name, bad):
    layer = _layer(name)
    x = _x()
    x[1, 5, 3] = bad
    with pytest.raises(ValueError, match=r"^x must be finite"):
        layer(x)
    cache = _cache(layer)
    with pytest.raises(ValueError, match=r"^x_t must be finite"):
        layer.step(x[:, 5:6], cache)
    assert cache.pos == 0  # nothing appended


@pytest.mark.parametrize("name", NAMES)
def test_input_of_another_dtype_raises_naming_x(name):
    layer = _layer(name)
    with pytest.raises(TypeError, match=r"^x must have the layer's dtype"):
        layer(_x(dtype=torch.float64))
    with pytest.raises(TypeError, match=r"^x must be a floating-point tensor"):
        layer(_x().long())
    with pytest.raises(TypeError, match=r"^x_t must have the layer's dtype"):
        layer.step(_x(1, torch.float64), _cache(layer))


@pytest.mark.parametrize("name", NAMES)
def test_empty_sequence_gives_empty_output(name):
    layer = _layer(name)
    x = _x(0).requires_grad_(True)
    y = layer(x)
    assert y.shape == (B, 0, C)
    y.sum().backward()


@pytest.mark.parametrize("name", NAMES)
def test_later_tokens_never_change_earlier_outputs(name):
    """x at positions >= 6 set to +-1e4: rows before equal the clean run in float64 (same length:
    cosFormer without a fixed horizon takes M = T, so its rows depend on T, never on later values)."""
    layer = _layer(name)
    x = _x()
    far = x.clone()
    far[:, 6:] = 1e4 * torch.sign(torch.randn(B, T - 6, C, generator=torch.Generator().manual_seed(1)))
    ref = layer.double()(x.double())[:, :6]
    if CONFIGS[name].get("mechanism") != "cosformer" or CONFIGS[name].get("cosformer_max_len"):
        assert rel_rms(layer(x[:, :6].double()), ref) <= 1e-12  # and equal the truncated run
    out = layer.float()(far)
    assert torch.isfinite(out[:, :6]).all()
    assert rel_rms(out[:, :6], ref) <= 1e-5


@pytest.mark.parametrize("name", NAMES)
def test_bf16_autocast_forward_and_backward(name):
    layer = _layer(name)
    x = _x().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = layer(x)
    y.float().pow(2).sum().backward()
    assert torch.isfinite(y.float()).all() and torch.isfinite(x.grad).all()
    ref = layer(x.detach())
    assert rel_rms(y.float(), ref) <= 5e-2  # bf16 projections: a few digits
