"""Retrieve-then-attend and capture inside tiny randomly initialised Llama / Qwen3 models."""

import json

import pytest
import torch

from attnlab.data.packing import doc_causal_mask
from attnlab.search.capture import capture, forward_packed, pack_contexts, teacher_attention
from attnlab.search.hf_model import attention_modules, check_family, load_hf_config, resolve_layers, resolve_source
from attnlab.search.lm import prepare, tiny_lm
from attnlab.search.patch import RetrieveThenAttend, SelectorConfig, generate, substitute
from attnlab.index.projections import SearchProjections
from attnlab.search.retrieval import METHODS
from attnlab.testing import rel_rms

FAMILIES = ("llama", "qwen3")


@pytest.fixture(scope="module", params=FAMILIES)
def lm(request):
    return tiny_lm(request.param)


@pytest.fixture(scope="module")
def packed(lm):
    texts = ["def f(x):\n    return x\n" * 2, "print('hi')\n", "class A:\n    pass\n" * 3]
    return pack_contexts(texts, lm.encode, lm.eos_id, context=48, n_contexts=2, seed=None)


@pytest.fixture(scope="module")
def proj(lm):
    torch.manual_seed(0)
    return SearchProjections(list(range(lm.dims.n_layers)), lm.dims.d_model, 16)


@pytest.fixture(scope="module")
def proj_kv(lm):
    """One candidate set per KV head (the tiny models have 4 query heads over 2 KV heads)."""
    torch.manual_seed(0)
    return SearchProjections(list(range(lm.dims.n_layers)), lm.dims.d_model, 16, rope=True, groups=lm.dims.n_kv_heads)


@pytest.mark.parametrize("grouped", [False, True], ids=["shared", "per-kv-head"])
@pytest.mark.parametrize("method", METHODS)
def test_full_budget_equals_full_attention(lm, packed, proj, proj_kv, method, grouped):
    p, G = (proj_kv, lm.dims.n_kv_heads) if grouped else (proj, 1)
    ref = forward_packed(lm.model, packed)
    with substitute(lm.model, [0, 3, 4, 7], SelectorConfig(method, K=48, groups=G), p):
        out = forward_packed(lm.model, packed)
    assert rel_rms(out, ref) < 1e-5
    with substitute(lm.model, [0, 3, 4, 7], SelectorConfig(method, K=3, groups=G), p):
        small = forward_packed(lm.model, packed)
    assert rel_rms(small, ref) > 1e-4  # the substitution is really active
    assert lm.model.config._attn_implementation == "sdpa"  # restored on exit


def test_capture_matches_eager_attention_and_layer_input(lm, packed):
    layers = [1, 5]
    caps = capture(lm.model, packed, layers)
    allowed = doc_causal_mask(packed.segments)
    lm.model.set_attn_implementation("eager")
    try:
        additive = torch.zeros(allowed.shape).masked_fill(~allowed, torch.finfo(torch.float32).min)
        out = lm.model(input_ids=packed.input_ids, attention_mask=additive, position_ids=packed.position_ids,
                       output_attentions=True, output_hidden_states=True, use_cache=False)
    finally:
        lm.model.set_attn_implementation("sdpa")
    for i in layers:
        c = caps[i]
        assert c.q.shape == (2, 4, 48, 16) and c.k.shape == (2, 2, 48, 16)  # GQA: 4 query heads over 2 KV heads
        want = out.attentions[i].mean(1)  # head-averaged eager weights (B, T, T)
        assert rel_rms(teacher_attention(c.q, c.k, allowed, c.scaling), want) < 1e-5
        h_in = lm.model.model.layers[i].input_layernorm(out.hidden_states[i])
        assert rel_rms(c.hidden, h_in) < 1e-6


@pytest.mark.parametrize("grouped", [False, True], ids=["shared", "per-kv-head"])
@pytest.mark.parametrize("method", ["learned", "learned-hnsw", "learned-ivf", "native", "native-hnsw", "quest",
                                    "streaming"])
def test_generation_with_full_budget_equals_full_generation(lm, proj, proj_kv, method, grouped):
    p, G = (proj_kv, lm.dims.n_kv_heads) if grouped else (proj, 1)
    ids = torch.randint(3, 250, (2, 9), generator=torch.Generator().manual_seed(3))
    ref = generate(lm.model, ids, 10)
    got = generate(lm.model, ids, 10, [1, 2, 6], SelectorConfig(method, K=19, groups=G), p)
    assert torch.equal(got, ref)
    if method.endswith("-hnsw"):  # an fp16 graph too: every key while they fit in K
        half = SelectorConfig(method, K=19, groups=G, hnsw_dtype="float16")
        assert torch.equal(generate(lm.model, ids, 10, [1, 2, 6], half, p), ref)


@pytest.mark.parametrize("method,rope,groups", [("learned", False, 1), ("learned", True, 1), ("learned", True, 2),
                                                ("native", True, 1), ("native", True, 2)],
                         ids=["plain", "search-rope", "per-kv-head", "native", "native-per-kv-head"])
def test_decode_index_growth_matches_prefill(lm, method, rope, groups):
    """Token-by-token decoding with a growing exact index selects what one prefill selects."""
    from transformers import DynamicCache

    from attnlab.hf.modeling import CACHE_NAME

    torch.manual_seed(1)
    proj = SearchProjections([2, 3, 5], lm.dims.d_model, 16, rope=rope, groups=groups)
    ids = torch.randint(3, 250, (1, 30), generator=torch.Generator().manual_seed(4))
    cfg = SelectorConfig(method, K=5, groups=groups)
    with substitute(lm.model, [2, 3, 5], cfg, proj):
        full = lm.model(input_ids=ids, use_cache=False).logits
        cache = DynamicCache(config=lm.model.config)
        steps = [lm.model(input_ids=ids[:, :10], use_cache=True, **{CACHE_NAME: cache}).logits]
        for t in range(10, 30):
            steps.append(lm.model(input_ids=ids[:, t:t + 1], use_cache=True, **{CACHE_NAME: cache}).logits)
    assert rel_rms(torch.cat(steps, 1), full) < 1e-5


def test_fp16_hnsw_graph_selects_close_to_the_float32_graph(lm, proj):
    """Past K keys the graph is searched: the fp16 graph's logits stay close to the float32 graph's."""
    ids = torch.randint(3, 250, (1, 40), generator=torch.Generator().manual_seed(5))
    out = {}
    for dtype in ("float32", "float16"):
        with substitute(lm.model, [1, 2, 6], SelectorConfig("learned-hnsw", K=6, hnsw_dtype=dtype), proj):
            out[dtype] = lm.model(input_ids=ids, use_cache=False).logits
    assert rel_rms(out["float16"], out["float32"]) < 1e-2
    assert rel_rms(out["float32"], lm.model(input_ids=ids, use_cache=False).logits) > 0.05  # K = 6 of 40: selective
    half = SelectorConfig("learned-hnsw", K=6, hnsw_dtype="float16")
    assert RetrieveThenAttend(1, half, proj)._index(proj.d_search).dtype == torch.float16


def test_bad_input_fails_before_heavy_work(lm, tmp_path, proj):
    with pytest.raises(ValueError, match="K must be a positive int"):
        SelectorConfig("learned", K=0)
    with pytest.raises(ValueError, match="K must be a positive int"):
        SelectorConfig("quest", K=-4)
    with pytest.raises(ValueError, match="method must be one of"):
        SelectorConfig("random", K=4)
    with pytest.raises(ValueError, match="hnsw_dtype"):
        SelectorConfig("learned-hnsw", K=4, hnsw_dtype="int8")
    with pytest.raises(ValueError, match="layer index 30 is out of range: the model has 30 layers"):
        resolve_layers([3, 30], 30)
    with pytest.raises(ValueError, match="out of range"):
        resolve_layers("2,99", 30)
    with pytest.raises(ValueError, match="layer indices in 0..7"):
        substitute(lm.model, [8], SelectorConfig("oracle", 4))
    with pytest.raises(ValueError, match="needs trained search projections"):
        substitute(lm.model, [1], SelectorConfig("learned", 4))
    with pytest.raises(ValueError, match="groups must be a positive divisor of the 4 query heads"):
        substitute(lm.model, [1], SelectorConfig("oracle", 4, groups=3))
    with pytest.raises(ValueError, match="groups must be a positive int"):
        SelectorConfig("oracle", 4, groups=0)
    with pytest.raises(ValueError, match="trained with groups=1"):
        substitute(lm.model, [1], SelectorConfig("learned", 4, groups=2), proj)
    assert lm.model.config._attn_implementation == "sdpa"  # nothing was installed
    (tmp_path / "short.txt").write_text("tiny corpus")
    with pytest.raises(ValueError, match="corpus too short for the context"):
        prepare("tiny", ["middle6"], str(tmp_path / "short.txt"), "all", 64, 4, 0, lm=lm)
    with pytest.raises(ValueError, match="out of range"):
        prepare("tiny", ["0,8"], str(tmp_path / "short.txt"), "all", 64, 4, 0, lm=lm)


def test_unsupported_family_is_rejected(tmp_path):
    from transformers import GPT2Config, GPT2LMHeadModel

    cfg = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=50)
    with pytest.raises(ValueError, match="model family 'gpt2' is not supported"):
        check_family(cfg)
    with pytest.raises(ValueError, match="not supported"):
        attention_modules(GPT2LMHeadModel(cfg))
    cfg.save_pretrained(tmp_path)  # a config only: the error comes before any weights are read
    with pytest.raises(ValueError, match="not supported"):
        load_hf_config(resolve_source(str(tmp_path)))
    with pytest.raises(ValueError, match="does not exist"):
        resolve_source(str(tmp_path / "missing.gguf"))
    assert json.loads((tmp_path / "config.json").read_text())["model_type"] == "gpt2"


def test_middle_layer_sets_nest_and_reject_bad_sizes():
    sets = [resolve_layers(f"middle{n}", 30) for n in (6, 12, 18, 24)]
    assert sets[0] == list(range(12, 18)) and sets[3] == list(range(3, 27))
    assert all(set(a) < set(b) for a, b in zip(sets, sets[1:]))
    assert set(sets[3]) < set(resolve_layers("reserved-edge", 30)) < set(resolve_layers("all", 30))
    assert resolve_layers("middle30", 30) == list(range(30))
    for bad in ("middle0", "middle31"):
        with pytest.raises(ValueError, match=f"layers='{bad}' needs 1 <="):
            resolve_layers(bad, 30)
    with pytest.raises(ValueError, match="comma list"):
        resolve_layers("middle-2", 30)


def test_layer_k_gives_chosen_layers_their_own_budget(lm, packed, proj):
    from attnlab.search.metrics import Tally

    ref = forward_packed(lm.model, packed)
    small = SelectorConfig("oracle", K=3)
    with substitute(lm.model, [0, 3], small, layer_k={0: 48, 3: 48}):  # every layer wide enough: exact
        assert rel_rms(forward_packed(lm.model, packed), ref) < 1e-5
    with substitute(lm.model, [3], small):
        only3 = forward_packed(lm.model, packed)
    with substitute(lm.model, [0, 3], small, layer_k={0: 48}):  # layer 0 exact, layer 3 narrow: = only 3
        assert rel_rms(forward_packed(lm.model, packed), only3) < 1e-5
    per = []
    for layer_k in ({}, {3: 12}):
        tally = Tally()
        with substitute(lm.model, [3], SelectorConfig("learned", K=3), proj, tally, layer_k=layer_k):
            forward_packed(lm.model, packed)
        per.append(tally.summary()["per_layer"]["3"])
    assert per[1]["mass"] > per[0]["mass"]  # the wide layer's exact top-12 holds its top-3 and more
    for bad, words in (({5: 8}, "not substituted"), ({3: 0}, "layer_k[3]")):
        with pytest.raises(ValueError, match=words.replace("[", r"\[").replace("]", r"\]")):
            substitute(lm.model, [0, 3], small, layer_k=bad)
    assert lm.model.config._attn_implementation == "sdpa"


def test_wide_search_config_checks():
    from attnlab.search.sweep import EvalConfig

    with pytest.raises(ValueError, match="wide_factor=4 needs wide_layers"):
        EvalConfig(model="tiny", wide_factor=4)
    with pytest.raises(ValueError, match="wide_factor must be a positive int"):
        EvalConfig(model="tiny", wide_layers="0", wide_factor=0)
