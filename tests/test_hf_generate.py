"""transformers' generate() through attnlab's caches: greedy output equals LM.generate token for
token (exact and windowed, the window from the call, the GenerationConfig or the model config);
a left-padded batch gives, for every mechanism, each prompt's own tokens and logits; sampling,
max_new_tokens, eos_token_id, stopping criteria and chunked prefill work; beam search, assisted decoding
and contrastive search are refused."""

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, GenerationConfig, StoppingCriteria, StoppingCriteriaList  # noqa: E402

import attnlab.hf as H  # noqa: E402
from attnlab.cache.selected import DecodeSelector  # noqa: E402
from attnlab.cache.sorted import SortedScalarCache  # noqa: E402
from attnlab.data.tokenizer import ByteTokenizer  # noqa: E402
from attnlab.models import LM, MECHANISMS, ModelConfig  # noqa: E402
from attnlab.testing import rel_rms  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")

V, PAD = 257, 256


def tiny(attn="softmax", **kw) -> LM:
    kw.setdefault("max_seq_len", 32)
    if any(a.startswith("goat") for a in ([attn] if isinstance(attn, str) else attn)):
        kw.setdefault("attention", {"goat_rank": 2})
    torch.manual_seed(0)
    return LM(ModelConfig(vocab_size=V, d_model=32, n_layers=2, n_heads=4, attn=attn, **kw)).eval()


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    """Each model exported once per module: {name: (attnlab LM, transformers model)}."""
    root, made = tmp_path_factory.mktemp("hf"), {}

    def get(attn):
        key = str(attn)
        if key not in made:
            lm = tiny(attn)
            H.export.save_folder(lm, root / key, ByteTokenizer())
            made[key] = lm, AutoModelForCausalLM.from_pretrained(root / key).eval()
        return made[key]
    return get


def greedy(hf, ids, n, **kw):
    return hf.generate(ids, max_new_tokens=n, do_sample=False, attention_mask=torch.ones_like(ids), **kw)


@pytest.mark.parametrize("attn", ["softmax", "gla", ["softmax", "hybrid"]], ids=["softmax", "gla", "softmax+hybrid"])
def test_greedy_generate_equals_lm_generate(attn, folder):
    lm, hf = folder(attn)
    ids = torch.randint(256, (2, 7))
    out = greedy(hf, ids, 9)
    assert torch.equal(out, lm.generate(ids, 9))


@pytest.mark.parametrize("window", [64, 3])
def test_windowed_generate_equals_lm_generate(window, folder):
    """The window reaches the sorted caches from generate(window=), a GenerationConfig or the config."""
    lm, hf = folder(["softmax", "hybrid"])
    ids = torch.randint(256, (2, 12))
    want = lm.generate(ids, 8, window=window)
    assert torch.equal(greedy(hf, ids, 8, window=window), want)
    gc = GenerationConfig(max_new_tokens=8, do_sample=False, eos_token_id=None, pad_token_id=PAD, window=window)
    assert torch.equal(hf.generate(ids, generation_config=gc, attention_mask=torch.ones_like(ids)), want)
    if window == 64:
        assert torch.equal(want, lm.generate(ids, 8))  # the window covers everything: exact
    out = greedy(hf, ids, 3, window=window, return_dict_in_generate=True)
    cache = out.past_key_values
    assert isinstance(cache, H.AttnlabCache) and cache.window == window
    assert isinstance(cache.layer_caches(1)[0].scalar, SortedScalarCache) and cache.get_seq_length() == 14
    hf.config.window = window
    try:
        assert torch.equal(greedy(hf, ids, 8), want)
    finally:
        hf.config.window = None
    with pytest.raises(ValueError, match="no layer has scalar heads"):
        greedy(folder("softmax")[1], ids, 2, window=4)


@pytest.mark.parametrize("attn", MECHANISMS)
def test_left_padded_batch_equals_each_prompt_alone(attn, folder):
    """Left padding for every mechanism: the same greedy tokens as each prompt alone, and the
    logits of every generated step within 2e-3 (they agree to float rounding)."""
    lm, hf = folder(attn)
    prompts = [torch.randint(256, (n,)) for n in (4, 9, 1)]
    T = 9
    ids = torch.stack([torch.cat([torch.full((T - len(p),), PAD), p]) for p in prompts])
    mask = torch.stack([torch.cat([torch.zeros(T - len(p), dtype=torch.long), torch.ones(len(p), dtype=torch.long)])
                        for p in prompts])
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None,
                      return_dict_in_generate=True, output_logits=True)
    batch_logits = torch.stack(out.logits, 1)  # (B, 6, V)
    for i, p in enumerate(prompts):
        alone = hf.generate(p[None], attention_mask=torch.ones(1, len(p), dtype=torch.long), max_new_tokens=6,
                            do_sample=False, eos_token_id=None, return_dict_in_generate=True, output_logits=True)
        assert torch.equal(out.sequences[i, T:], alone.sequences[0, len(p):])
        assert (batch_logits[i] - torch.stack(alone.logits, 1)[0]).abs().max() < 2e-3
        assert torch.equal(alone.sequences, lm.generate(p[None], 6))
    if attn in ("hybrid", "gla"):  # without a cache, every step is a plain forward of the left-padded batch
        assert torch.equal(hf.generate(ids, attention_mask=mask, max_new_tokens=6, do_sample=False, eos_token_id=None,
                                       use_cache=False), out.sequences)


def test_sampling_eos_and_stopping_criteria(folder):
    lm, hf = folder(["softmax", "hybrid"])
    ids = torch.randint(256, (2, 5))
    mask = torch.ones_like(ids)
    torch.manual_seed(3)
    a = hf.generate(ids, attention_mask=mask, do_sample=True, temperature=0.8, top_k=20, max_new_tokens=7)
    torch.manual_seed(3)
    b = hf.generate(ids, attention_mask=mask, do_sample=True, temperature=0.8, top_k=20, max_new_tokens=7)
    assert torch.equal(a, b) and a.shape == (2, 12)
    ref = lm.generate(ids, 7)
    new = ref[0, 5:].tolist()
    stop = max(j for j in range(len(new)) if new[j] not in new[:j])  # row 0 emits this token first here
    out = greedy(hf, ids, 7, eos_token_id=new[stop], pad_token_id=PAD)
    assert torch.equal(out[0, :6 + stop], ref[0, :6 + stop]) and bool((out[0, 6 + stop:] == PAD).all())

    class AfterFour(StoppingCriteria):
        def __call__(self, input_ids, scores, **kw):
            return torch.full((input_ids.shape[0],), input_ids.shape[1] >= 9, dtype=torch.bool)

    out = greedy(hf, ids, 7, stopping_criteria=StoppingCriteriaList([AfterFour()]))
    assert torch.equal(out, ref[:, :9])


def test_chunked_prefill_and_refused_modes(folder):
    lm, hf = folder(["gla", "hybrid"])
    ids = torch.randint(256, (2, 11))
    assert torch.equal(greedy(hf, ids, 5, prefill_chunk_size=4), lm.generate(ids, 5))
    with pytest.raises(ValueError, match="num_beams=2"):
        greedy(hf, ids, 3, num_beams=2)
    with pytest.raises(ValueError, match="window"):
        H.AttnlabCache(window=0)


def test_cache_refuses_what_its_decode_states_cannot_do(folder):
    """Reordering or rolling back rows (beam search, assisted decoding, contrastive search) is an
    UnsupportedCacheOperation naming the method, the mode that needs it and what to use; repeating
    rows is a no-op before the first forward only, and a refused call leaves the state as it was."""
    lm, _ = folder(["gla", "hybrid"])
    ids = torch.randint(256, (2, 5))
    cache = H.AttnlabCache()
    cache.batch_repeat_interleave(2)  # before any state: the first forward makes it for its batch
    cache.feed(lm, ids, None)
    calls = {"reorder_cache": lambda: cache.reorder_cache(torch.tensor([1, 0])), "crop": lambda: cache.crop(3),
             "batch_select_indices": lambda: cache.batch_select_indices(torch.tensor([0])),
             "batch_repeat_interleave": lambda: cache.batch_repeat_interleave(2)}
    for method, call in calls.items():
        with pytest.raises(H.UnsupportedCacheOperation) as e:
            call()
        assert isinstance(e.value, ValueError) and e.value.method == method
        assert str(e.value) == (f"AttnlabCache.{method} ({H.cache.NEEDED_BY[method]}): attnlab's decode states (recurrent "
                                "states, sorted scalar caches) cannot be reordered or rolled back, so beam search, "
                                "assisted decoding and contrastive search are not supported; use greedy decoding or "
                                "sampling (num_beams=1)")
    assert (cache.batch_size, cache.get_seq_length()) == (2, 5)
    step = torch.randint(256, (2, 1))
    fresh = H.AttnlabCache()
    fresh.feed(lm, ids, None)
    assert torch.equal(cache.feed(lm, step, None), fresh.feed(lm, step, None))


def test_generate_through_a_learned_selector(folder):
    """generate(selector=...) decodes through the learned key selection, as LM.generate does, left
    padding included; bad combinations are refused before any work."""
    from attnlab.cache.selected import DecodeSelector
    from test_selectors import _projections

    lm, hf = folder(["softmax", "hybrid"])
    sel = DecodeSelector(_projections(lm), 3)
    ids = torch.randint(256, (2, 12))
    out = greedy(hf, ids, 6, selector=sel)
    assert torch.equal(out, lm.generate(ids, 6, selector=sel))
    assert not torch.equal(out, lm.generate(ids, 6))  # 3 of up to 17 keys: not exact attention
    padded = torch.cat([torch.zeros(1, 4, dtype=torch.long), ids[1:]], 1)
    mask = torch.cat([torch.zeros(1, 4, dtype=torch.long), torch.ones(1, 12, dtype=torch.long)], 1)
    got = hf.generate(padded, max_new_tokens=6, do_sample=False, attention_mask=mask, selector=sel)
    assert torch.equal(got[:, 4:], out[1:])
    with pytest.raises(ValueError, match="not both|no window"):
        greedy(hf, ids, 2, selector=sel, window=4)
    with pytest.raises(ValueError, match="use_cache"):
        greedy(hf, ids, 2, selector=sel, use_cache=False)
    with pytest.raises(TypeError, match="DecodeSelector"):
        greedy(hf, ids, 2, selector="learned")


def test_a_batch_with_an_empty_prompt(folder):
    """A left-padded batch whose second prompt is empty (all pad): the first row generates as alone,
    and the empty row starts from the pad position's logits (zero: token 0) and decodes on its own."""
    lm, hf = folder(["softmax", "hybrid"])
    p = torch.randint(256, (4,))
    ids = torch.stack([p, torch.full((4,), PAD)])
    mask = torch.tensor([[1, 1, 1, 1], [0, 0, 0, 0]])
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=5, do_sample=False, eos_token_id=None)
    assert torch.equal(out[0, 4:], lm.generate(p[None], 5)[0, 4:])
    first = out[1, 4]
    assert first == 0 and torch.equal(out[1, 4:], lm.generate(first.view(1, 1), 4)[0])


@pytest.mark.parametrize("attn,attention", [("softmax", {}), ("hybrid", {}),
                                            ("hybrid", dict(train_window=3, local_window=2))],
                         ids=["softmax", "hybrid", "hybrid-trained-window"])
def test_compiled_generate_equals_lm_generate(attn, attention, tmp_path, monkeypatch):
    """generate(compile=True) decodes through the model's static decoder (torch.compile stubbed here: the
    compiled step itself is tested in test_static_decode): greedy tokens equal LM.generate's (a trained
    window through it), sampling equals the growing caches' under the same seed, the decoder is kept
    for the next call, a decode window passes through; padding, a given cache and no length are refused
    by name."""
    monkeypatch.setattr(torch, "compile", lambda fn, **kw: fn)
    lm = tiny(attn, attention=attention)
    H.export.save_folder(lm, tmp_path / "m", ByteTokenizer())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "m").eval()
    ids = torch.randint(256, (2, 7))
    assert torch.equal(greedy(hf, ids, 9, compile=True), lm.generate(ids, 9))
    dec = hf.model.__dict__["_static"]
    assert torch.equal(greedy(hf, ids[:, :5], 6, compile=True), lm.generate(ids[:, :5], 6))
    assert hf.model.__dict__["_static"] is dec  # 11 positions fit the decoder made for 16
    kw = dict(max_new_tokens=6, do_sample=True, temperature=0.8, attention_mask=torch.ones_like(ids))
    torch.manual_seed(5)
    a = hf.generate(ids, compile=True, **kw)
    torch.manual_seed(5)
    assert torch.equal(a, hf.generate(ids, **kw))
    mask = torch.ones_like(ids)
    mask[0, :2] = 0
    with pytest.raises(ValueError, match="unpadded"):
        hf.generate(ids, max_new_tokens=3, do_sample=False, attention_mask=mask, compile=True)
    if attn == "hybrid":  # a decode window: its nearest keys, as LM.generate(window=4)
        assert torch.equal(greedy(hf, ids, 9, compile=True, window=4), lm.generate(ids, 9, window=4))
    with pytest.raises(ValueError, match="pass no cache"):
        greedy(hf, ids, 3, compile=True, past_key_values=H.AttnlabCache())
    with pytest.raises(ValueError, match="give no selector"):
        H.AttnlabCache(selector=DecodeSelector(None, 4, index="quest"), static=16)
