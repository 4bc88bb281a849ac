"""Decode steps check each token's values once, when the cache takes it, not the whole cache again at
every step: the elements a step's value checks read stay the same as the cache grows, and a NaN key
is still refused, naming it, at the step that brings it."""

from __future__ import annotations

import pytest
import torch

import attnlab.checks as checks
from attnlab.cache import KVCache
from attnlab.models import LM, ModelConfig


def _elements_checked(monkeypatch) -> list[int]:
    seen = []
    real = checks.check_finite

    def spy(name, value):
        if isinstance(value, torch.Tensor) and id(value) not in getattr(checks._trusted, "ids", ()):
            seen.append(value.numel())
        return real(name, value)

    for module in list(__import__("sys").modules.values()):  # every module that imported the function
        if getattr(module, "check_finite", None) is real and getattr(module, "__name__", "").startswith("attnlab"):
            monkeypatch.setattr(module, "check_finite", spy)
    return seen


@pytest.mark.heavy  # 1.1-2.5 s per mechanism
@pytest.mark.parametrize("attn", ["softmax", "principled", "scalar", "hybrid"])
def test_a_step_reads_no_more_as_the_cache_grows(attn, monkeypatch):
    """(GOAT is not here: its step computes the key-only term of every held key, O(n) work of its own,
    and checks that as it checks any computed input.)"""
    torch.manual_seed(0)
    model = LM(ModelConfig(vocab_size=32, d_model=32, n_layers=1, n_heads=4, attn=attn, max_seq_len=256)).eval()
    idx = torch.randint(0, 32, (1, 200))
    seen = _elements_checked(monkeypatch)
    caches = model.make_caches(1)
    per_step = []
    with torch.no_grad():
        for t in range(200):
            seen.clear()
            model.step(idx[:, t:t + 1], caches, t)
            per_step.append(sum(seen))
    assert per_step[150] == per_step[20], (per_step[20], per_step[150])


def test_a_nan_key_is_refused_at_append():
    cache = KVCache(1)
    cache.append(k=torch.randn(1, 2, 3, 4), v=torch.randn(1, 2, 3, 4))
    bad = torch.randn(1, 2, 1, 4)
    bad[0, 1, 0, 2] = float("nan")
    with pytest.raises(ValueError, match="k must be finite"):
        cache.append(k=bad, v=torch.randn(1, 2, 1, 4))
    assert len(cache) == 3
