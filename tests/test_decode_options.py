"""The options of a decode (`DecodeOptions`) and the padding rule (`padding_mask`), each checked in one
place: a bad option or a model it does not fit is the same error, word for word, from `LM.make_caches`,
`LM.generate`, `DecodeState` and attnlab.hf's config, cache and generate; an attention_mask is the same
error from a plain forward and from decoding, which differ only in that decoding refuses right padding."""

import dataclasses

import pytest
import torch

from attnlab.cache.selected import DecodeSelector
from attnlab.models import LM, ModelConfig
from attnlab.models.decode import DecodeOptionError, DecodeOptions, DecodeState, padding_mask, sorted_cache_layers

from test_selectors import _projections

pytestmark = pytest.mark.usefixtures("one_thread")

V = 61


def tiny(attn="hybrid", **attention) -> LM:
    torch.manual_seed(0)
    return LM(ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, attn=attn, max_seq_len=32,
                          attention=attention)).double().eval()


def message(fn) -> tuple[type, str]:
    with pytest.raises((TypeError, ValueError)) as e:
        fn()
    return e.type, str(e.value)


@pytest.mark.parametrize("kwargs, names, words", [
    ({"window": 0}, ("window",), "window must be an int >= 1"),
    ({"window": True}, ("window",), "window must be an int >= 1"),
    ({"window": 2.0}, ("window",), "window must be an int >= 1"),
    ({"window": 4, "budget": 0}, ("budget",), "budget must be an int >= 1"),
    ({"budget": 8}, ("budget", "window"), "budget=8 caps the sorted scalar cache: give a window"),
    ({"window": 4, "compress": -1.0}, ("compress",), "compress must be a finite float >= 0"),
    ({"window": 4, "compress": float("inf")}, ("compress",), "compress must be a finite float >= 0"),
    ({"compress": 0.5}, ("compress", "window"), "compress=0.5 merges keys .* give a window"),
    ({"exact": 1}, ("exact",), "exact must be a bool"),
    ({"exact": True, "window": 4}, ("exact",), "exact=True takes no window"),
], ids=["window-0", "window-bool", "window-float", "budget-0", "budget-alone", "compress-negative", "compress-inf",
        "compress-alone", "exact-int", "exact-and-window"])
def test_bad_options_name_the_argument(kwargs, names, words):
    with pytest.raises(DecodeOptionError, match=words) as e:
        DecodeOptions(**kwargs)
    assert e.value.names == names


def test_a_selector_takes_no_window_and_the_options_are_frozen():
    model = tiny()
    sel = DecodeSelector(_projections(model), 3)
    with pytest.raises(TypeError, match="selector must be an attnlab.cache.selected.DecodeSelector, got str"):
        DecodeOptions(selector="learned")
    with pytest.raises(DecodeOptionError, match=r"not both: the selector picks the keys \(got window=4\)") as e:
        DecodeOptions(window=4, selector=sel)
    assert e.value.names == ("selector", "window")
    options = DecodeOptions(window=4, budget=8, compress=0.0)
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.window = 5
    assert options.check(model) == [] and DecodeOptions(selector=sel).check(model) == [(0, model.blocks[0].attn),
                                                                                       (1, model.blocks[1].attn)]


def test_one_error_from_every_lm_entry_point():
    """A bad value, and a window for a model with no layer that decodes through the sorted cache: the
    same message from make_caches, generate and DecodeState."""
    hybrid, softmax = tiny(), tiny("softmax")
    idx = torch.randint(V, (2, 4))
    cases = [
        (hybrid, {"window": 0}, "window must be an int >= 1 or None, got 0"),
        (softmax, {"window": 4}, "no layer has scalar heads that decode through it"),
        (tiny("hybrid", sliding_window=8), {"window": 4}, "unless they read a sliding window"),
        (tiny("goat_hybrid", goat_rank=2), {"window": 4}, "no layer has scalar heads that decode through it"),
        (softmax, {"selector": DecodeSelector(_projections(hybrid), 3)}, "selector needs scalar or hybrid layers"),
    ]
    for model, kw, words in cases:
        got = {message(lambda: model.make_caches(2, **kw)), message(lambda: model.generate(idx, 2, **kw)),
               message(lambda: DecodeState(model, 2, DecodeOptions(**kw)))}
        assert len(got) == 1, got
        kind, text = got.pop()
        assert kind is DecodeOptionError and words in text, text
    mixed = tiny(["softmax", "scalar"])
    assert sorted_cache_layers(mixed) == [(1, mixed.blocks[1].attn)] and not sorted_cache_layers(cases[2][0])


def test_make_caches_takes_keywords_or_options_not_both():
    model = tiny()
    a = model.make_caches(2, window=4, budget=8)
    b = model.make_caches(2, options=DecodeOptions(window=4, budget=8))
    assert [(c.window, c.budget) for c in a] == [(c.window, c.budget) for c in b] == [(4, 8), (4, 8)]
    with pytest.raises(TypeError, match="not both"):
        model.make_caches(2, window=4, options=DecodeOptions(window=4))
    with pytest.raises(TypeError, match="options must be a DecodeOptions, got dict"):
        model.make_caches(2, options={"window": 4})
    with pytest.raises(TypeError, match="options must be a DecodeOptions, got dict"):
        DecodeState(model, 2, {"window": 4})


@pytest.mark.parametrize("mask, right, words", [
    ([[1, 0, 1], [1, 1, 1]], True, r"row 0 has a pad \(0\) between real tokens"),
    ([[1, 1, 1], [0, 1, 0]], False, r"row 1 has a pad \(0\) after a real token"),
    ([[1, 1, 1], [0, 1, 0]], True, None),
    ([[0, 0, 1], [1, 1, 1]], False, None),
    ([[0, 2, 1], [1, 1, 1]], True, r"0 \(pad\) and 1 \(real token\) only"),
    ([[0.0, 1.0, 1.0], [1.0, 1.0, 1.0]], False, None),
    ([[0.0, 0.5, 1.0], [1.0, 1.0, 1.0]], True, r"0 \(pad\) and 1"),
], ids=["hole", "right-decoding", "right-forward", "left", "two", "float", "half"])
def test_the_padding_rule(mask, right, words):
    mask = torch.tensor(mask)
    if words is None:
        assert torch.equal(padding_mask(mask, right=right), mask.bool())
    else:
        with pytest.raises(ValueError, match=words):
            padding_mask(mask, right=right)


def test_a_started_row_takes_no_more_pads():
    started = torch.tensor([True, False])
    with pytest.raises(ValueError, match=r"row 0 has a pad \(0\) after a real token"):
        padding_mask(torch.tensor([[0], [1]]), started=started)
    with pytest.raises(ValueError, match=r"row 0 has a pad \(0\) between real tokens"):
        padding_mask(torch.tensor([[0, 1], [1, 1]]), started=started)
    assert padding_mask(torch.tensor([[1, 1], [0, 0]]), started=started).tolist() == [[True, True], [False, False]]


# ------------------------------------------------------------------ attnlab.hf: the same checks


def _hf(model):
    pytest.importorskip("transformers")
    import attnlab.hf as H

    hf = H.AttnlabForCausalLM(H.AttnlabConfig.from_model_config(model.cfg)).double().eval()
    hf.model.load_state_dict(model.state_dict())
    return H, hf


def test_one_error_from_every_hf_entry_point():
    model, softmax = tiny(), tiny("softmax")
    H, hf = _hf(model)
    _, hf_softmax = _hf(softmax)
    ids = torch.randint(V, (2, 4))
    bad = {message(lambda: H.AttnlabCache(window=0)), message(lambda: H.AttnlabConfig(vocab_size=V, window=0)),
           message(lambda: hf.generate(ids, max_new_tokens=2, do_sample=False, window=0)),
           message(lambda: model.generate(ids, 2, window=0))}
    assert bad == {(DecodeOptionError, "window must be an int >= 1 or None, got 0")}
    sel = DecodeSelector(_projections(model), 3)
    both = {message(lambda: H.AttnlabCache(window=4, selector=sel)),
            message(lambda: hf.generate(ids, max_new_tokens=2, do_sample=False, window=4, selector=sel)),
            message(lambda: model.make_caches(2, window=4, selector=sel))}
    assert len(both) == 1 and "not both" in both.pop()[1]
    none = {message(lambda: hf_softmax.generate(ids, max_new_tokens=2, do_sample=False, window=4)),
            message(lambda: softmax.generate(ids, 2, window=4))}
    assert len(none) == 1 and "no layer has scalar heads" in none.pop()[1]
    cache = H.AttnlabCache(window=4)
    assert cache.window == 4 and cache.selector is None and cache.options == DecodeOptions(window=4)


@pytest.mark.parametrize("mask", [[[1, 0, 1, 1], [1, 1, 1, 1]], [[0, 1, 2, 1], [1, 1, 1, 1]],
                                  [[1, 1, 1, 0], [1, 1, 1, 1]]], ids=["hole", "values", "right"])
def test_one_padding_error_with_and_without_a_cache(mask):
    """A pad between real tokens or a value other than 0/1: the same error from a plain forward and
    from every decoding entry point; right padding: a plain forward takes it (exact logits at the
    real tokens), decoding refuses it with one error."""
    model = tiny(["hybrid", "gla"])
    H, hf = _hf(model)
    ids, mask = torch.randint(V, (2, 4)), torch.tensor(mask)
    decoding = {message(lambda: DecodeState(model, 2).feed(ids, mask)),
                message(lambda: model.generate(ids, 1, attention_mask=mask)),
                message(lambda: hf(ids, attention_mask=mask, use_cache=True)),
                message(lambda: hf.generate(ids, attention_mask=mask, max_new_tokens=1, do_sample=False))}
    assert len(decoding) == 1, decoding
    if mask[0, -1] == 0:  # right padding
        assert "after a real token" in decoding.pop()[1]
        with torch.no_grad():
            got = hf(ids, attention_mask=mask).logits
        assert torch.equal(got, model(ids)[0])
    else:
        assert decoding == {message(lambda: hf(ids, attention_mask=mask))}


def test_a_key_rule_block_holds_in_its_own_thread_only():
    """decode_window in one thread changes that thread's forwards and no other thread's: the open
    blocks are kept per thread."""
    import threading

    from attnlab.models.decode import decode_window

    model = tiny()
    x = torch.randint(0, V, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        exact = model(x)[0]  # the logits
        with decode_window(model, 2):
            windowed = model(x)[0]
    assert (exact - windowed).abs().max() > 1e-3  # the window changes what the model reads
    inside, done, got = threading.Event(), threading.Event(), {}

    def hold_a_window():
        with decode_window(model, 2):
            inside.set()
            done.wait(60)
            with torch.no_grad():
                got["in block"] = model(x)[0]

    t = threading.Thread(target=hold_a_window)
    t.start()
    assert inside.wait(60)
    try:
        with torch.no_grad():
            got["other thread"] = model(x)[0]  # while the other thread's block is open
    finally:
        done.set()
        t.join(60)
    assert torch.equal(got["other thread"], exact) and torch.equal(got["in block"], windowed)
