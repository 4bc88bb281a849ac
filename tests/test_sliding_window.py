"""Sliding-window attention (`window=` on the ops, `AttentionConfig.sliding_window` on the layers):
every fast path equals its naive reference on outputs and every gradient (window boundary, w = 1,
w >= T, decode offsets, a sink kept beside the window), never builds T x T, and a layer decodes
through a cache of constant size that equals its forward token by token and prefilled in pieces."""

import pytest
import torch

from attnlab.cache.kv import KVCache
from attnlab.masks import key_counts, visible_keys
from attnlab.layers import Attention, AttentionConfig
from attnlab.models import LM, ModelConfig
from attnlab.ops import goat_attention, hybrid_attention, principled_attention, scalar_attention, softmax_attention
from attnlab.testing import LargestTensor, compare_fwd_bwd, rel_rms

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64


def qkv(B=2, H=4, Tq=37, Tk=37, D=8, G=2, Dv=6):
    return (torch.randn(B, H, Tq, D, dtype=F64, requires_grad=True), torch.randn(B, G, Tk, D, dtype=F64, requires_grad=True),
            torch.randn(B, G, Tk, Dv, dtype=F64, requires_grad=True))


def scalars(B=2, H=4, Tq=37, Tk=37):
    return torch.randn(B, H, Tq, dtype=F64, requires_grad=True), torch.randn(B, H, Tk, dtype=F64, requires_grad=True)


def _ops(Tq, Tk):
    """name -> (fn(impl, window), inputs) for every op that takes a window."""
    q, k, v = qkv(Tq=Tq, Tk=Tk)
    qs, ks = scalars(Tq=Tq, Tk=Tk)
    qg, kg = torch.randn(2, 4, Tq, 3, dtype=F64, requires_grad=True), torch.randn(2, 1, Tk, 3, dtype=F64, requires_grad=True)
    tau = torch.full((4,), 0.4, dtype=F64, requires_grad=True)
    freqs = torch.rand(3, dtype=F64)
    lam_s, lam_a = torch.randn(2, 3, dtype=F64, requires_grad=True), torch.randn(2, 3, dtype=F64, requires_grad=True)
    u = torch.randn(1, 2, Tk, dtype=F64, requires_grad=True)
    gam = torch.randn(2, 4, Tq, dtype=F64, requires_grad=True)
    return {
        "softmax": (lambda impl, w, q, k, v: softmax_attention(q, k, v, impl=impl, window=w), (q, k, v)),
        "softmax-ktotal": (lambda impl, w, q, k, v: softmax_attention(q, k, v, scale="ktotal", impl=impl, window=w), (q, k, v)),
        "softmax-krms": (lambda impl, w, q, k, v: softmax_attention(q, k, v, scale="krms", impl=impl, window=w), (q, k, v)),
        "softmax-pnorm": (lambda impl, w, q, k, v: softmax_attention(q, k, v, scale="pnorm", p=3.0, impl=impl, window=w),
                          (q, k, v)),
        "scalar": (lambda impl, w, qs, ks, v, tau: scalar_attention(qs, ks, v, tau, impl=impl, window=w), (qs, ks, v, tau)),
        "scalar-cauchy": (lambda impl, w, qs, ks, v, tau: scalar_attention(qs, ks, v, tau, impl=impl, window=w,
                                                                           kernel="cauchy"), (qs, ks, v, tau)),
        "hybrid-sink": (lambda impl, w, q, k, v, qs, ks, tau: hybrid_attention(q, k, v, qs, ks, tau, impl=impl, window=w,
                                                                               n_prefix=1), (q, k, v, qs, ks, tau)),
        "hybrid-cauchy": (lambda impl, w, q, k, v, qs, ks, tau: hybrid_attention(q, k, v, qs, ks, tau, impl=impl, window=w,
                                                                                 kernel="cauchy", n_prefix=2),
                          (q, k, v, qs, ks, tau)),
        "goat": (lambda impl, w, q, k, v, a, b, u: goat_attention(q, k, v, freqs, a, b, u, impl=impl, window=w),
                 (q, k, v, lam_s, lam_a, u)),
        "goat_hybrid": (lambda impl, w, q, k, v, a, b, u, qs, ks: goat_attention(q, k, v, freqs, a, b, u, qs=qs, ks=ks,
                                                                                 tau=0.3, impl=impl, window=w),
                        (q, k, v, lam_s, lam_a, u, qs, ks)),
        "principled": (lambda impl, w, q, k, qg, kg, v, g: principled_attention(
            q, k, qg, kg, v, alpha=0.5, beta=0.2, gamma=g, v0=torch.ones(6, dtype=v.dtype), impl=impl, window=w,
            return_ground=True), (q, k, qg, kg, v, gam)),
    }


OPS = list(_ops(2, 2))
SHAPES = [(1, 1, 1), (63, 63, 5), (63, 63, 1), (300, 300, 48), (20, 20, 64), (3, 300, 17), (1, 90, 90)]


@pytest.mark.parametrize("Tq,Tk,w", SHAPES, ids=[f"Tq{a}-Tk{b}-w{c}" for a, b, c in SHAPES])
@pytest.mark.parametrize("name", OPS)
def test_fast_equals_naive_outputs_and_gradients(name, Tq, Tk, w):
    fn, inputs = _ops(Tq, Tk)[name]
    errs = compare_fwd_bwd(lambda *x: fn("fast", w, *x), lambda *x: fn("naive", w, *x), inputs)
    assert max(errs.values()) < 1e-10, errs


@pytest.mark.parametrize("name", OPS)
def test_a_window_that_covers_every_key_is_the_plain_op(name):
    fn, inputs = _ops(40, 40)[name]
    a, b = fn("naive", 40, *inputs), fn("naive", None, *inputs)
    a, b = (a[0], b[0]) if isinstance(a, tuple) else (a, b)
    assert torch.allclose(a, b, atol=1e-12)


@pytest.mark.parametrize("name", ["softmax", "scalar", "hybrid-sink", "goat", "principled"])
def test_a_query_reads_nothing_outside_its_window(name):
    """Changing every key and value before t - w + 1 (and after the sink) leaves query t's output as it was."""
    T, w, t = 50, 7, 40
    fn, inputs = _ops(T, T)[name]
    base = fn("fast", w, *inputs)
    base = base[0] if isinstance(base, tuple) else base
    moved = []
    for x in inputs:
        x = x.detach().clone()
        if x.dim() >= 3 and x.shape[2] == T:  # per-position tensors (keys, values, queries): scramble the far past
            x[:, :, 2 : t - w + 1] = torch.randn_like(x[:, :, 2 : t - w + 1])
        moved.append(x)
    out = fn("fast", w, *moved)
    out = out[0] if isinstance(out, tuple) else out
    assert torch.allclose(out[:, :, t], base[:, :, t], atol=1e-12)


def test_fast_paths_never_build_a_T_by_T_matrix():
    T, w = 1024, 32
    for name in ("softmax", "scalar", "hybrid-sink", "goat", "principled", "softmax-ktotal", "scalar-cauchy"):
        fn, inputs = _ops(T, T)[name]
        with torch.no_grad(), LargestTensor() as seen:
            fn("fast", w, *[x.detach() for x in inputs])
        assert seen.numel < T * T, (name, seen.numel)


def test_visible_keys_and_counts():
    vis = visible_keys(3, 6, True, "cpu", window=2, n_prefix=1)  # queries at positions 3, 4, 5
    want = [[s <= t and (s > t - 2 or s < 1) for s in range(6)] for t in (3, 4, 5)]
    assert vis.tolist() == want
    assert key_counts(4, 6, True, "cpu", F64, window=3).tolist() == [3, 3, 3, 3]
    assert key_counts(4, 4, True, "cpu", F64, window=3).tolist() == [1, 2, 3, 3]


@pytest.mark.parametrize("bad", [0, -1, 2.0, True, "4"])
def test_bad_windows_are_named(bad):
    q, k, v = qkv(Tq=4, Tk=4)
    with pytest.raises((ValueError, TypeError), match="window"):
        softmax_attention(q, k, v, window=bad)
    qs, ks = scalars(Tq=4, Tk=4)
    with pytest.raises((ValueError, TypeError), match="window"):
        scalar_attention(qs, ks, v, 0.5, window=bad)


def test_a_window_needs_causal_masking():
    q, k, v = qkv(Tq=4, Tk=4)
    with pytest.raises(ValueError, match="causal"):
        softmax_attention(q, k, v, causal=False, window=2)


def test_windowed_inputs_are_still_checked():
    q, k, v = qkv(Tq=4, Tk=4)
    k = k.detach().clone()
    k[0, 0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="NaN"):
        softmax_attention(q, k, v, window=2)


def test_kv_cache_window_keeps_a_constant_size():
    c = KVCache(2, window=5, keep=1)
    xs = torch.randn(2, 3, 200, 4)
    c.append(k=xs[:, :, :1])
    out = None
    for t in range(1, 200):
        out = c.append(k=xs[:, :, t : t + 1])
        assert c.capacity == 64 and len(c) == 1 + min(t, 5)
    assert torch.equal(out["k"], torch.cat([xs[:, :, :1], xs[:, :, 195:200]], dim=2))  # the sink, then w - 1 old + the new
    out = c.append(k=torch.zeros(2, 3, 10, 4))  # a prefill of 10: every key their windows reach
    assert out["k"].shape[2] == 1 + 4 + 10 and torch.equal(out["k"][:, :, 1:5], xs[:, :, 196:200])
    assert c.view()["k"].shape[2] == 6 == len(c)
    plain = KVCache(1, keep=1)  # no window: every token is kept anyway
    assert plain.append(k=torch.zeros(1, 1, 70, 2))["k"].shape[2] == 70
    with pytest.raises(ValueError, match="window"):
        KVCache(1, window=0)


LAYERS = {
    "softmax": dict(mechanism="softmax", rope=True, n_kv_heads=2),
    "softmax-ktotal": dict(mechanism="softmax", scale="ktotal"),
    "goat": dict(mechanism="goat", goat_rank=2),
    "goat_hybrid": dict(mechanism="goat_hybrid", goat_rank=2),
    "principled": dict(mechanism="principled", alpha="query", gamma="head", v0="head"),
    "scalar": dict(mechanism="scalar", n_value_groups=2),
    "scalar-mixed-sink": dict(mechanism="scalar", n_scalar_heads=2, sink=True, rope=True),
    "hybrid": dict(mechanism="hybrid", rope=True),
    "hybrid-sink-weight": dict(mechanism="hybrid", sink=True, sink_weight=0.5, scalar_gain=0.7),
    "hybrid-cauchy": dict(mechanism="hybrid", kernel="cauchy", sink=True),
}


def layer(name, w=5, **kw):
    torch.manual_seed(0)
    return Attention(AttentionConfig(d_model=32, n_heads=4, sliding_window=w, **LAYERS[name], **kw)).double()


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_decode_equals_forward_with_a_constant_cache(name):
    lay = layer(name)
    x = torch.randn(2, 30, 32, dtype=F64)
    y = lay(x)
    cache = lay.make_cache(2)
    steps = torch.cat([lay.step(x[:, t : t + 1], cache) for t in range(30)], dim=1)
    assert torch.allclose(steps, y, atol=1e-10)
    kv = cache.kv if cache.kv is not None else cache.scalar
    assert isinstance(kv, KVCache) and len(kv) <= 5 + lay.prefix_keys and kv.capacity == 64
    cache = lay.make_cache(2)
    pieces = torch.cat([lay.prefill(x[:, :11], cache), lay.prefill(x[:, 11:12], cache), lay.prefill(x[:, 12:], cache)], 1)
    assert torch.allclose(pieces, y, atol=1e-10)


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_fast_equals_naive(name):
    fast, naive = layer(name), layer(name, impl="naive")
    naive.load_state_dict(fast.state_dict())
    x = torch.randn(2, 40, 32, dtype=F64, requires_grad=True)
    errs = compare_fwd_bwd(fast, naive, [x])
    assert max(errs.values()) < 1e-9, errs
    gf = torch.autograd.grad(fast(x).square().sum(), list(fast.parameters()), allow_unused=True)
    gn = torch.autograd.grad(naive(x).square().sum(), list(naive.parameters()), allow_unused=True)
    for a, b in zip(gf, gn):
        assert (a is None) == (b is None) and (a is None or torch.allclose(a, b, atol=1e-9))


def test_layer_sees_only_its_window_and_the_sink():
    lay = layer("hybrid-sink-weight", w=4)
    x = torch.randn(1, 20, 32, dtype=F64)
    x2 = x.clone()
    x2[:, :10] = torch.randn(1, 10, 32, dtype=F64)
    assert torch.allclose(lay(x)[:, 13:], lay(x2)[:, 13:], atol=1e-12)  # query 13 reads tokens 10..13 and the sink
    assert not torch.allclose(lay(x)[:, 12], lay(x2)[:, 12])


def test_config_errors_name_the_field():
    with pytest.raises(ValueError, match="sliding_window"):
        AttentionConfig(d_model=32, n_heads=4, mechanism="hybrid", sliding_window=8, train_window=4)
    with pytest.raises(ValueError, match="sliding_window"):
        AttentionConfig(d_model=32, n_heads=4, mechanism="gla", sliding_window=8)
    with pytest.raises(ValueError, match="sliding_window"):
        AttentionConfig(d_model=32, n_heads=4, mechanism="softmax", sliding_window=0)
    with pytest.raises(ValueError, match="sliding window"):
        layer("hybrid").make_cache(1, window=4)


def test_model_generate_and_lengths_through_the_window():
    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4, attn=["softmax", "hybrid"], max_seq_len=32,
                      pos_embedding="none", attention={"sliding_window": 6, "rope": True})
    lm = LM(cfg).double().eval()
    idx = torch.randint(64, (2, 40))  # past max_seq_len: a window has no horizon
    with torch.no_grad():
        logits = lm(idx)[0]
        caches = lm.make_caches(2)
        stepped = torch.stack([lm.step(idx[:, t : t + 1], caches, t) for t in range(40)], dim=1)
    assert torch.allclose(stepped, logits, atol=1e-9)
    out = lm.generate(idx[:, :5], 30)
    assert out.shape == (2, 35)


def test_hf_generate_left_padded_through_the_window(tmp_path):
    """The Hugging Face generate() of a sliding-window model: a left-padded batch gives each prompt's
    own greedy tokens, which equal LM.generate's (the caches hold w keys per layer)."""
    pytest.importorskip("transformers")
    from transformers import AutoModelForCausalLM

    import attnlab.hf as H
    from attnlab.data.tokenizer import ByteTokenizer

    torch.manual_seed(0)
    cfg = ModelConfig(vocab_size=257, d_model=32, n_layers=2, n_heads=4, attn=["softmax", "hybrid"], max_seq_len=32,
                      attention={"sliding_window": 4})
    lm = LM(cfg).eval()
    H.export.save_folder(lm, tmp_path / "swa", ByteTokenizer())
    hf = AutoModelForCausalLM.from_pretrained(tmp_path / "swa").eval()
    prompts = [torch.randint(256, (n,)) for n in (3, 9, 1)]
    T = 9
    ids = torch.stack([torch.cat([torch.full((T - len(p),), 256), p]) for p in prompts])
    mask = (torch.arange(T)[None] >= torch.tensor([T - len(p) for p in prompts])[:, None]).long()
    out = hf.generate(ids, attention_mask=mask, max_new_tokens=12, do_sample=False, eos_token_id=None,
                      return_dict_in_generate=True)
    for i, p in enumerate(prompts):
        assert torch.equal(out.sequences[i, T:], lm.generate(p[None], 12)[0, len(p):])
    assert len(out.past_key_values.layer_caches(0)[0].kv) == 4  # row 0's first layer: the last w keys


@pytest.mark.parametrize("name", ["scalar", "hybrid"])
def test_an_outlier_key_outside_every_later_window_changes_nothing(name):
    """float32: key 0 made a huge outlier (the reference of the unwindowed fast path's expansion)
    leaves every query that cannot see it exactly as it was."""
    T, w = 300, 16
    qs, ks, v = torch.randn(1, 2, T), torch.randn(1, 2, T), torch.randn(1, 2, T, 8)
    q, k = torch.randn(1, 2, T, 8), torch.randn(1, 2, T, 8)

    def run(ks):
        if name == "scalar":
            return scalar_attention(qs, ks, v, 0.05, window=w)
        return hybrid_attention(q, k, v, qs, ks, 0.05, window=w)

    far = ks.clone()
    far[..., 0] = 1e4
    assert torch.equal(run(far)[:, :, w:], run(ks)[:, :, w:])


@pytest.mark.parametrize("name", ["softmax", "scalar", "hybrid-sink", "goat", "principled"])
def test_empty_and_bf16_inputs_through_the_window(name):
    """T = 0 gives an empty output; bf16 inputs give the float64 reference to bf16 precision."""
    fn, inputs = _ops(0, 0)[name]
    out = fn("fast", 4, *inputs)
    out = out[0] if isinstance(out, tuple) else out
    assert out.shape[2] == 0
    fn, inputs = _ops(70, 70)[name]
    ref = fn("naive", 9, *inputs)
    low = fn("fast", 9, *[x.detach().to(torch.bfloat16) if x.is_floating_point() and x.dim() > 1 else x for x in inputs])
    ref, low = (ref[0], low[0]) if isinstance(ref, tuple) else (ref, low)
    assert low.dtype == torch.bfloat16 and rel_rms(low.double(), ref.detach()) < 2e-2
