"""The decode path under attnlab.hf, at the LM level (no transformers needed): the prompt in one
parallel forward (`LM.prefill`, chunked or not) equals stepping token by token for every
mechanism; the sorted cache is built in bulk from the prefill; left-padded batches decode as each
prompt alone (`DecodeState`), and anything but left padding is refused."""

import pytest
import torch

from attnlab.cache.sorted import SortedScalarCache
from attnlab.models import LM, MECHANISMS, ModelConfig
from attnlab.models.decode import DecodeState
from attnlab.testing import rel_rms

pytestmark = pytest.mark.usefixtures("one_thread")

V = 61


def tiny(attn="softmax", **kw) -> LM:
    kw.setdefault("max_seq_len", 32)
    if str(attn).startswith("goat") or (isinstance(attn, list) and any(a.startswith("goat") for a in attn)):
        kw.setdefault("attention", {"goat_rank": 2})
    torch.manual_seed(0)
    return LM(ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, attn=attn, **kw)).double().eval()


def left_padded(prompts, T=None):
    T = T or max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), T, dtype=torch.long)
    mask = torch.zeros(len(prompts), T, dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, T - len(p):], mask[i, T - len(p):] = p, 1
    return ids, mask


@pytest.mark.parametrize("attn", [*MECHANISMS, "mixed", "sink"])
def test_prefill_chunks_equal_forward_for_every_mechanism(attn):
    """prefill(5 tokens), prefill(3 more, into the filled caches), then a step: the logits of the
    full forward, and the caches continue exactly."""
    model = {"mixed": lambda: tiny("scalar", attention={"n_scalar_heads": 2, "n_value_groups": 2}),
             "sink": lambda: tiny("hybrid", attention={"sink": True})}.get(attn, lambda: tiny(attn))()
    idx = torch.randint(V, (2, 10))
    caches = model.make_caches(2)
    got = torch.cat([model.prefill(idx[:, :5], caches), model.prefill(idx[:, 5:8], caches),
                     model.step(idx[:, 8:9], caches, pos=8)[:, None], model.prefill(idx[:, 9:], caches)], 1)
    assert all(c.pos == 10 for c in caches)
    assert rel_rms(got, model(idx)[0]) < 1e-12
    assert rel_rms(model.prefill(idx[:, :6], model.make_caches(2), last=2), model(idx[:, :6])[0][:, -2:]) < 1e-12


@pytest.mark.parametrize("window", [64, 3])
@pytest.mark.parametrize("attn", ["scalar", "hybrid", "mixed"])
def test_windowed_prefill_builds_the_sorted_cache_in_bulk(attn, window):
    """With window=k the prompt's readout is the windowed op and the sorted cache is loaded from the
    prompt's keys at once; both equal stepping the sorted cache token by token (k = 64 covers
    everything: also the exact forward)."""
    kw = {"attention": {"n_scalar_heads": 2, "n_value_groups": 2, "sink": True}} if attn == "mixed" else {}
    model = tiny(["softmax", "scalar" if attn == "mixed" else attn], **kw)
    if attn == "mixed":
        with torch.no_grad():
            model.blocks[1].attn.sink_value.normal_()
    idx = torch.randint(V, (2, 12))
    bulk = model.make_caches(2, window=window)
    got = torch.cat([model.prefill(idx[:, :9], bulk), model.step(idx[:, 9:10], bulk, pos=9)[:, None]], 1)
    assert isinstance(bulk[1].scalar, SortedScalarCache) and len(bulk[1].scalar) == 10
    steps = model.make_caches(2, window=window)
    ref = torch.stack([model.step(idx[:, t:t + 1], steps, pos=t) for t in range(10)], 1)
    assert rel_rms(got, ref) < 1e-5  # the index keeps float32 scalar keys
    if window == 64:
        assert rel_rms(got, model(idx[:, :10])[0]) < 1e-5
    # a cache that evicts after each step takes the prompt one token at a time, through step
    evicting, stepped = model.make_caches(2, window=window, budget=4), model.make_caches(2, window=window, budget=4)
    ref = torch.stack([model.step(idx[:, t:t + 1], stepped, pos=t) for t in range(9)], 1)
    assert rel_rms(model.prefill(idx[:, :9], evicting), ref) < 1e-12


@pytest.mark.parametrize("attn", MECHANISMS)
def test_left_padded_batch_decodes_as_each_prompt_alone(attn):
    """Rows of 3, 6, 6 and 1 real tokens, left-padded: the prompt logits and the greedy tokens of
    every row are those of the row alone (pads enter no cache or state; positions start at each
    row's first token)."""
    model = tiny(attn)
    prompts = [torch.randint(V, (n,)) for n in (3, 6, 6, 1)]
    ids, mask = left_padded(prompts)
    state = DecodeState(model, 4)
    logits = state.feed(ids, mask)
    assert len(state.groups) == 3 and state.lengths().tolist() == [3, 6, 6, 1] and state.seen == 6
    for i, p in enumerate(prompts):
        assert rel_rms(logits[i, 6 - len(p):], model(p[None])[0][0]) < 1e-12
        assert bool((logits[i, : 6 - len(p)] == 0).all())
    out = model.generate(ids, 4, attention_mask=mask)
    for i, p in enumerate(prompts):
        assert torch.equal(out[i, 6:], model.generate(p[None], 4)[0, len(p):])


def test_left_padding_with_the_sorted_cache_and_in_chunks():
    model = tiny(["hybrid", "gla"])
    prompts = [torch.randint(V, (n,)) for n in (2, 7, 5)]
    ids, mask = left_padded(prompts)
    out = model.generate(ids, 5, attention_mask=mask, window=3)
    for i, p in enumerate(prompts):
        assert torch.equal(out[i, 7:], model.generate(p[None], 5, window=3)[0, len(p):])
    # the same columns fed in chunks of 3 (a row may still be all pad in the first chunk)
    state, whole = DecodeState(model, 3), DecodeState(model, 3).feed(ids, mask)
    parts = torch.cat([state.feed(ids[:, :3], mask[:, :3]), state.feed(ids[:, 3:6], mask[:, 3:6]),
                       state.feed(ids[:, 6:], mask[:, 6:])], 1)
    assert rel_rms(parts, whole) < 1e-12 and state.lengths().tolist() == [2, 7, 5]


@pytest.mark.parametrize("mask, match", [
    ([[1, 1, 0], [1, 1, 1]], "row 0 has a pad"),          # right padding
    ([[0, 1, 0], [1, 1, 1]], "row 0 has a pad"),          # a hole
    ([[0, 2, 1], [1, 1, 1]], "0 \\(pad\\) and 1"),
    ([[1, 1], [1, 1]], "shape"),
])
def test_decode_state_refuses_anything_but_left_padding(mask, match):
    state = DecodeState(tiny(), 2)
    with pytest.raises(ValueError, match=match):
        state.feed(torch.zeros(2, 3, dtype=torch.long), torch.tensor(mask))
    state.feed(torch.zeros(2, 3, dtype=torch.long), torch.tensor([[0, 0, 1], [1, 1, 1]]))
    with pytest.raises(ValueError, match="row 0 has a pad"):  # once a row has started, no more pads
        state.feed(torch.zeros(2, 1, dtype=torch.long), torch.tensor([[0], [1]]))


def test_one_group_of_fewer_rows_than_the_batch():
    """The first chunk starts one row only (the other is all pad): the next chunk feeds that group its
    own row, not the whole batch; every row's logits are its own (a prompt fed in chunks, and an
    empty prompt that starts later)."""
    model = tiny(["hybrid", "softmax"])
    a, b = torch.randint(V, (5,)), torch.randint(V, (2,))
    ids = torch.stack([a, torch.cat([torch.zeros(3, dtype=torch.long), b])])
    mask = torch.tensor([[1] * 5, [0, 0, 0, 1, 1]])
    state = DecodeState(model, 2)
    first = state.feed(ids[:, :3], mask[:, :3])  # one group, row 0 only
    assert len(state.groups) == 1 and state.groups[0].rows.tolist() == [0]
    rest = state.feed(ids[:, 3:], mask[:, 3:])  # row 0 continues, row 1 starts
    logits = torch.cat([first, rest], 1)
    assert rel_rms(logits[0], model(a[None])[0][0]) < 1e-12
    assert rel_rms(logits[1, 3:], model(b[None])[0][0]) < 1e-12
    step = state.feed(torch.tensor([[7], [9]]))  # then one step each
    assert rel_rms(step[0, 0], model(torch.cat([a, torch.tensor([7])])[None])[0][0, -1]) < 1e-12
    assert rel_rms(step[1, 0], model(torch.cat([b, torch.tensor([9])])[None])[0][0, -1]) < 1e-12
