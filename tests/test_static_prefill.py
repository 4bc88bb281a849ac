"""StaticDecoder takes every prompt in one pass, never token by token: under a memory budget the prompt's
evictions come from `budget_evictions` over the whole prompt, and learned selection scores the prompt's
search keys in one matmul per chunk. Every step's logits equal LM.generate's route (the caches stepped
by LM.step, what generate feeds after its prefill), eager and compiled, and the budget state the prompt
leaves (live keys, recent queries) is what stepping it would leave."""

from __future__ import annotations

import pytest
import torch

from attnlab.models.config import ModelConfig
from attnlab.models.lm import LM
from attnlab.models.static_decode import StaticDecoder
from test_static_decode import random_sinks

pytestmark = pytest.mark.usefixtures("one_thread")

BUDGETS = {  # (attn, attention, window k, budget M)
    "hybrid": ("hybrid", {}, 4, 6),
    "trained-window-ring": ("hybrid", dict(train_window=3, local_window=2), 3, 5),
    "scalar-weighted-sink": ("scalar", dict(sink=True, sink_weight=0.5, kernel="cauchy", n_value_groups=2), 4, 5),
}


def lm(attn, attention):
    torch.manual_seed(0)
    return random_sinks(LM(ModelConfig(vocab_size=50, d_model=64, n_layers=2, n_heads=4, attn=attn, max_seq_len=128,
                                       attention=attention))).eval()


def cache_logits(m, idx, **options) -> torch.Tensor:
    """Every position's logits (B, T, V) through LM.step and the caches LM.generate decodes with."""
    caches = m.make_caches(idx.shape[0], **options)
    with torch.no_grad():
        return torch.stack([m.step(idx[:, t : t + 1], caches, t) for t in range(idx.shape[1])], 1)


def no_stepped_prompt(dec, monkeypatch):
    def refuse(*a):
        raise AssertionError("the prompt went through step_logits: token by token")
    monkeypatch.setattr(dec, "step_logits", refuse)


@pytest.mark.parametrize("name", list(BUDGETS))
def test_a_budgeted_prompt_prefills_in_one_pass(name, monkeypatch):
    """A 30-token prompt under budget M (evictions from its 7th older key on): one pass, then every
    step's logits equal the stepped caches'; the live keys and query history equal a decoder's that
    stepped the prompt token by token (the former route)."""
    attn, attention, k, budget = BUDGETS[name]
    m = lm(attn, attention)
    g = torch.Generator().manual_seed(3)
    idx = torch.stack([torch.randperm(50, generator=g)[:44] for _ in range(2)])  # distinct: no exact ties
    want = cache_logits(m, idx, window=k, budget=budget)
    dec = StaticDecoder(m, 2, 48, window=k, budget=budget)
    no_stepped_prompt(dec, monkeypatch)
    assert torch.allclose(dec.prefill(idx[:, :30]), want[:, 29], atol=1e-5)
    monkeypatch.undo()
    stepped = StaticDecoder(m, 2, 48, window=k, budget=budget)
    with torch.no_grad():
        for i in range(len(m.blocks)):
            stepped.states[str(i)].alive.fill_(True)
        for t in range(30):
            stepped.pos.fill_(t)
            stepped.step_logits(idx[:, t : t + 1])
    w = m.blocks[0].attn.config.options.local_window
    older = stepped.slots <= 29 - w
    for i in range(len(m.blocks)):
        one, steps = dec.states[str(i)], stepped.states[str(i)]
        assert torch.equal(one.alive & older, steps.alive & older), i
        assert int((one.alive & older).sum(-1).max()) == budget
        assert torch.allclose(one.qh[..., :30], steps.qh[..., :30], atol=1e-6)
    for t in range(30, 44):
        assert torch.allclose(dec.step(idx[:, t : t + 1]), want[:, t], atol=1e-5), t


@pytest.mark.parametrize("attention", [{}, dict(sink=True, sink_weight=0.5, n_kv_heads=2)], ids=["hybrid", "sink-gqa"])
def test_learned_selection_prompt_in_one_pass(attention, monkeypatch):
    """A DecodeSelector's prompt: one pass (in chunks of 8), every step's logits equal the selector
    caches' (LM.generate's route), and greedy tokens equal LM.generate(selector=...)."""
    from attnlab.cache.selected import DecodeSelector
    from attnlab.index.projections import SearchProjections

    m = lm("hybrid", attention)
    sel = DecodeSelector(SearchProjections([0, 1], 64, d_search=8, groups=4, rope=True), K=5)
    idx = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(1))
    want = cache_logits(m, idx, selector=sel)
    dec = StaticDecoder(m, 2, 48, selector=sel)
    no_stepped_prompt(dec, monkeypatch)
    with torch.no_grad():
        assert torch.allclose(dec.prefill(idx[:, :20], chunk=8), want[:, 19], atol=1e-5)
    monkeypatch.undo()
    for t in range(20, 40):
        assert torch.allclose(dec.step(idx[:, t : t + 1]), want[:, t], atol=1e-5), t
    assert torch.equal(StaticDecoder(m, 2, 48, selector=sel).generate(idx[:, :9], 20),
                       m.generate(idx[:, :9], 20, selector=sel))


@pytest.mark.slow
def test_compiled_one_pass_prompts_equal_the_caches():
    """Compiled (torch.compile, one graph per step): a budgeted and a learned decoder, each prompt in one
    pass, give the stepped caches' logits at every step."""
    from attnlab.cache.selected import DecodeSelector
    from attnlab.index.projections import SearchProjections

    torch._dynamo.reset()
    g = torch.Generator().manual_seed(3)
    idx = torch.stack([torch.randperm(50, generator=g)[:40] for _ in range(2)])
    m = lm("hybrid", dict(train_window=3, local_window=2))
    sel = DecodeSelector(SearchProjections([0, 1], 64, d_search=8, groups=4, rope=True), K=5)
    for options in (dict(window=3, budget=5), dict(selector=sel)):
        want = cache_logits(m, idx, **options)
        dec = StaticDecoder(m, 2, 48, compile=True, **options)
        assert torch.allclose(dec.prefill(idx[:, :20]), want[:, 19], atol=1e-5)
        for t in range(20, 40):
            assert torch.allclose(dec.step(idx[:, t : t + 1]), want[:, t], atol=1e-5), (options, t)
