"""Windowed attention (ops.scalar.window) and windowed decoding measured in one forward (eval.window):
against a per-query reference that sorts the visible keys, and against stepping the model
through SortedScalarCache."""

from __future__ import annotations

import pytest
import torch

from attnlab.eval.window import decode_window, next_token_loss, stepped_logits
from attnlab.models import LM, ModelConfig
from attnlab.ops import hybrid_attention, scalar_attention, window_mask, windowed_attention


def _reference(qs, ks, v, tau, window, q=None, k=None, n_prefix=0):
    """Per query: the visible non-prefix keys sorted by |qs - ks|, the first `window` of them plus
    the prefix, softmax of the mechanism's score over those, times the values (float64)."""
    B, H, T = qs.shape
    G = v.shape[1]
    out = torch.zeros(B, H, T, v.shape[-1], dtype=torch.float64)
    qs, ks, v = qs.double(), ks.double(), v.double()
    for b in range(B):
        for h in range(H):
            t_h = tau[h] if tau.dim() == 1 else tau[b, h]
            for t in range(T):
                cand = list(range(n_prefix, t + 1))
                cand.sort(key=lambda s: (float((qs[b, h, t] - ks[b, h, s]).abs().detach()), -s))  # newest first on ties
                sel = torch.tensor(list(range(n_prefix)) + cand[:window], dtype=torch.long)
                tt = t_h if t_h.dim() == 0 else t_h[t]
                score = -(qs[b, h, t] - ks[b, h, sel]) ** 2 / tt.double()
                if q is not None:
                    kk = k[b, h // (H // k.shape[1]), sel].double()
                    score = score + kk @ q[b, h, t].double() / q.shape[-1] ** 0.5
                w = torch.softmax(score, dim=0)
                out[b, h, t] = w @ v[b, h // (H // G), sel]
    return out


def _inputs(B=2, H=4, T=23, D=8, G=2, seed=0):
    g = torch.Generator().manual_seed(seed)
    qs, ks = torch.randn(B, H, T, generator=g), torch.randn(B, H, T, generator=g)
    v = torch.randn(B, G, T, D, generator=g)
    q, k = torch.randn(B, H, T, D, generator=g), torch.randn(B, G, T, D, generator=g)
    return qs, ks, v, q, k


@pytest.mark.parametrize("hybrid", [False, True])
@pytest.mark.parametrize("n_prefix", [0, 1])
@pytest.mark.parametrize("per_query_tau", [False, True])
def test_windowed_attention_matches_reference(hybrid, n_prefix, per_query_tau):
    qs, ks, v, q, k = _inputs()
    B, H, T = qs.shape
    tau = torch.rand(B, H, T) * 0.5 + 0.1 if per_query_tau else torch.tensor([0.1, 0.3, 1.0, 2.0])
    kw = {"q": q, "k": k} if hybrid else {}
    for window, chunk in ((1, 512), (5, 7), (40, 4)):
        want = _reference(qs, ks, v, tau, window, n_prefix=n_prefix, **kw)
        got = windowed_attention(qs, ks, v, tau, window, n_prefix=n_prefix, query_chunk=chunk, impl="naive", **kw)
        torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-6)
        # the selected-keys path scores through the fused path's augmented dot products (float32 here)
        fast = windowed_attention(qs, ks, v, tau, window, n_prefix=n_prefix, query_chunk=chunk, impl="fast", **kw)
        torch.testing.assert_close(fast.double(), want, rtol=1e-4, atol=2e-5)
        fast64 = windowed_attention(qs.double(), ks.double(), v.double(), tau.double(), window, n_prefix=n_prefix,
                                    query_chunk=chunk, impl="fast", **{n: x.double() for n, x in kw.items()})
        torch.testing.assert_close(fast64, want, rtol=1e-9, atol=1e-10)


def test_windowed_gradients_match_reference():
    qs, ks, v, q, k = _inputs(B=1, T=12)
    tau = torch.tensor([0.2, 0.5, 1.0, 3.0])
    leaves = [t.clone().double().requires_grad_() for t in (qs, ks, v, q, k)]
    got = windowed_attention(leaves[0], leaves[1], leaves[2], tau.double(), 4, q=leaves[3], k=leaves[4], query_chunk=5)
    grads = torch.autograd.grad(got.square().sum(), leaves)
    ref_leaves = [t.clone().double().requires_grad_() for t in (qs, ks, v, q, k)]
    want = _reference(ref_leaves[0], ref_leaves[1], ref_leaves[2], tau, 4, q=ref_leaves[3], k=ref_leaves[4])
    ref_grads = torch.autograd.grad(want.square().sum(), ref_leaves)
    for name, a, b in zip(("qs", "ks", "v", "q", "k"), grads, ref_grads):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9, msg=f"grad of {name}")


def test_full_window_is_exact_attention():
    qs, ks, v, q, k = _inputs()
    tau = torch.tensor([0.1, 0.3, 1.0, 2.0])
    T = qs.shape[-1]
    for impl, tol in (("naive", dict(rtol=1e-5, atol=1e-6)), ("fast", dict(rtol=1e-4, atol=2e-5))):
        torch.testing.assert_close(windowed_attention(qs, ks, v, tau, T, impl=impl),
                                   scalar_attention(qs, ks, v, tau, impl=impl), **tol)
        torch.testing.assert_close(windowed_attention(qs, ks, v, tau, T, q=q, k=k, impl=impl),
                                   hybrid_attention(q, k, v, qs, ks, tau, impl=impl), **tol)


def test_window_mask_counts_and_offset():
    qs, ks, *_ = _inputs(T=30)
    m = window_mask(qs[..., 20:], ks, 6, n_prefix=1)  # the last 10 queries of 30 positions
    assert m.shape == (2, 4, 10, 30)
    assert bool(m[..., 0].all())  # the prefix entry is always in
    assert bool((m[..., 1:].sum(-1) == 6).all())  # every query sees >= 6 non-prefix keys
    t = torch.arange(20, 30)[:, None]
    assert not bool((m & (torch.arange(30)[None, :] > t)).any())  # never a future key
    with pytest.raises(ValueError, match="window"):
        window_mask(qs, ks, 0)


def _model(attn, pos_embedding="learned", **attention):
    """With learned position embeddings no two tokens share a scalar key (no ties to break)."""
    cfg = ModelConfig(vocab_size=50, d_model=32, n_layers=2, n_heads=4, attn=attn, max_seq_len=64,
                      attention=attention, pos_embedding=pos_embedding)
    torch.manual_seed(0)
    model = LM(cfg).eval()
    for name, p in model.named_parameters():  # a trained-looking sink value, not the zero init
        if name.endswith("sink_value"):
            p.data.normal_()
    return model


@pytest.mark.parametrize("attn,attention", [
    ("scalar", {}),
    ("hybrid", {}),
    ("hybrid", {"sink": True, "sink_key": 0.3}),
    ("scalar", {"sink": True, "n_scalar_heads": 2}),
    (["hybrid", "softmax"], {}),
])
def test_decode_window_equals_stepping_sorted_cache(attn, attention):
    model = _model(attn, **attention)
    idx = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(1))
    for window in (3, 8):
        with torch.no_grad(), decode_window(model, window):
            batched = model(idx)[0]
        stepped = stepped_logits(model, idx, window)
        torch.testing.assert_close(batched, stepped, rtol=1e-4, atol=1e-4)
    with torch.no_grad():
        exact = model(idx)[0]  # the context manager restored exact attention
    torch.testing.assert_close(exact, stepped_logits(model, idx, None), rtol=1e-4, atol=1e-4)
    y = idx[:, 1:]
    assert next_token_loss(exact[:, :-1], y) != next_token_loss(batched[:, :-1], y)  # the window changes something


def test_window_ties_break_newest_first():
    qs = torch.zeros(1, 1, 6)
    ks = torch.tensor([[[1.0, 1.0, 1.0, 1.0, 5.0, 1.0]]])  # five keys tie at distance 1
    m = window_mask(qs, ks, 3)
    assert m[0, 0, 5].tolist() == [False, False, True, True, False, True]
    assert m[0, 0, 3].tolist() == [False, True, True, True, False, False]


def test_scalar_ties_do_not_matter():
    """No position embedding: repeated tokens give identical first-layer keys and values, so
    whichever tied entries a window holds, scalar heads read the same output."""
    model = _model("scalar", pos_embedding="none")
    idx = torch.randint(0, 5, (1, 30), generator=torch.Generator().manual_seed(2))  # many repeats
    with torch.no_grad(), decode_window(model, 4):
        batched = model(idx)[0]
    torch.testing.assert_close(batched, stepped_logits(model, idx, 4), rtol=1e-4, atol=1e-4)


def test_decode_window_needs_a_scalar_layer():
    with pytest.raises(ValueError, match="window=8 selects the sorted scalar cache, but no layer"):
        with decode_window(_model("softmax"), 8):
            pass
    with pytest.raises(ValueError, match="window"):
        with decode_window(_model("hybrid"), 0):
            pass


@pytest.mark.parametrize("attn,attention,window", [
    (attn, attention, window)
    for attn, attention in [("scalar", {}), ("hybrid", {"sink": True}), ("scalar", {"n_scalar_heads": 2})]
    for window in (None, 5)
] + [("goat_hybrid", {"goat_rank": 1, "goat_abs_rank": 2}, None)])  # goat_hybrid has no windowed decode
def test_attention_weights_from_logits_equal_the_identity_readout(attn, attention, window):
    from attnlab.layers import Attention

    model = _model(attn, **attention)
    layer = model.blocks[0].attn
    x = torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(3))
    with torch.no_grad(), decode_window(model, window) as rules:
        got = layer.attention_weights(x, rules.get(0))
        want = Attention.attention_weights(layer, x, rules.get(0))  # the generic path: the op with v = I
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    if window:
        n_s = layer.n_scalar  # the windowed heads (a mixed layer's dot-product heads read every key)
        assert bool(((got[:, :n_s, :, 1:] > 0).sum(-1) <= window).all())


@pytest.mark.parametrize("attn,attention", [("scalar", {}), ("hybrid", {"sink": True}), (["hybrid", "softmax"], {})])
@pytest.mark.parametrize("window,budget", [(4, 9), (64, 7)])
def test_budget_decode_equals_stepping_the_capped_cache(attn, attention, window, budget):
    """A sorted cache capped at `budget` keys per head (evict_to_budget after every step), for a
    whole sequence at once, equals stepping it; with a short query history the range moves."""
    import attnlab.layers.mechanisms.scalar as scalar_mod

    model = _model(attn, **attention)
    idx = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(4))
    with torch.no_grad(), decode_window(model, window, budget):
        batched = model(idx)[0]
    stepped = stepped_logits(model, idx, window, budget)
    torch.testing.assert_close(batched, stepped, rtol=1e-4, atol=1e-4)
    with torch.no_grad(), decode_window(model, window):
        unbounded = model(idx)[0]
    assert not torch.allclose(batched, unbounded, atol=1e-4)  # the budget evicted keys that mattered
    assert scalar_mod.QUERY_HISTORY == 256


def test_budget_evictions_rule():
    from attnlab.cache.sorted import SortedScalarCache
    from attnlab.ops import budget_evictions

    g = torch.Generator().manual_seed(5)
    ks, qs = torch.randn(1, 3, 30, generator=g), torch.randn(1, 3, 30, generator=g) * 0.3
    ks[0, 0, 10:14] = 0.0  # ties at distance 0: the oldest go first
    ev = budget_evictions(qs, ks, 6, history=5)
    assert int((ev == torch.iinfo(torch.int64).max).sum(-1).max()) == 6  # 6 keys survive per head
    cache = SortedScalarCache(1, 3, 3, 2, query_history=5)
    for t in range(30):
        cache.append(ks[..., t], torch.zeros(1, 3, 2))
        cache.attend(qs[..., t], 0.5, window=4)
        cache.evict_to_budget(6)
        held = sorted(cache.index.all_entries()[1][:, :6].tolist()[0])  # slots = positions (no reclaim yet)
        assert int(cache.n_entries().max()) == min(t + 1, 6)
        assert held == sorted(j for j in range(t + 1) if ev[0, 0, j] > t)



def test_budget_evictions_leave_the_local_ring_alone():
    """local=w: key s enters the budgeted set at step s + w (when it leaves the cache's ring), so the
    last w keys are never evicted or counted; local=0 is the rule above; a bad local is refused."""
    from attnlab.ops import budget_evictions

    g = torch.Generator().manual_seed(6)
    ks, qs = torch.randn(1, 2, 30, generator=g), torch.randn(1, 2, 30, generator=g) * 0.3
    never = torch.iinfo(torch.int64).max
    ev0, ev3 = budget_evictions(qs, ks, 5, local=0), budget_evictions(qs, ks, 5, local=3)
    assert torch.equal(ev0, budget_evictions(qs, ks, 5))
    pos = torch.arange(30)
    assert bool((ev3[..., 27:] == never).all())  # still in the ring at the end
    hit = ev3 != never
    assert bool((ev3[hit] >= (pos + 3).expand_as(ev3)[hit]).all())  # evicted only after leaving the ring
    for t in range(3, 30):  # at most 5 budgeted keys (those that left the ring) survive each step
        left = pos <= t - 3
        assert int(((ev3 > t) & left).sum(-1).max()) <= 5
    with pytest.raises(ValueError, match="local"):
        budget_evictions(qs, ks, 5, local=-1)


# --------------------------------------------------------------------------- hostile inputs


def test_windowed_attention_hostile_inputs():
    qs, ks, v, q, k = _inputs(B=1, T=12)
    tau = torch.tensor([0.2, 0.5, 1.0, 3.0])
    for name, bad in (("qs", qs), ("ks", ks), ("v", v), ("q", q), ("k", k)):
        args = {"qs": qs, "ks": ks, "v": v, "q": q, "k": k}
        hurt = bad.clone()
        hurt.view(-1)[-1] = float("nan")
        args[name] = hurt
        with pytest.raises(ValueError, match=name):
            windowed_attention(args["qs"], args["ks"], args["v"], tau, 4, q=args["q"], k=args["k"])
    with pytest.raises(ValueError, match="tau"):
        windowed_attention(qs, ks, v, torch.tensor([0.2, float("inf"), 1.0, 1.0]), 4)
    with pytest.raises(TypeError, match="v"):
        windowed_attention(qs, ks, v.double(), tau, 4)  # mixed dtypes
    with pytest.raises(ValueError, match="sequence length"):
        windowed_attention(qs[..., 2:], ks, v, tau, 4)
    for bad in (qs, ks, v):  # the selected-keys path with a local window checks the same, before any work
        hurt = bad.clone()
        hurt.view(-1)[0] = float("inf")
        args = [hurt if x is bad else x for x in (qs, ks, v)]
        with pytest.raises(ValueError):
            windowed_attention(*args, tau, 4, local=2, impl="fast")


def test_windowed_attention_never_sees_the_future():
    """Rows before a change of later keys, values or queries are bit-identical (causal isolation),
    however large the later outliers."""
    qs, ks, v, q, k = _inputs(B=1, T=16)
    tau = torch.tensor([0.2, 0.5, 1.0, 3.0])
    base = windowed_attention(qs, ks, v, tau, 3, q=q, k=k, budget=6)
    qs2, ks2, v2, k2 = qs.clone(), ks.clone(), v.clone(), k.clone()
    qs2[..., 8:], ks2[..., 8:], v2[:, :, 8:], k2[:, :, 8:] = 1e4, -1e4, 1e4, 1e4
    out = windowed_attention(qs2, ks2, v2, tau, 3, q=q, k=k2, budget=6)
    assert torch.equal(out[:, :, :8], base[:, :, :8])


@pytest.mark.parametrize("local", [0, 3])
@pytest.mark.parametrize("impl", ["naive", "fast"])
def test_windowed_attention_selected_path_never_sees_the_future(impl, local):
    """The same causal isolation for both paths of the window rule, with and without a local window:
    later outliers (keys, values, queries at 1e4) leave earlier rows and their gradients unchanged."""
    qs, ks, v, q, k = _inputs(B=1, T=16)
    tau = torch.tensor([0.2, 0.5, 1.0, 3.0])
    base = windowed_attention(qs, ks, v, tau, 3, q=q, k=k, local=local, impl=impl)
    qs2, ks2, v2, k2 = qs.clone(), ks.clone(), v.clone(), k.clone()
    qs2[..., 8:], ks2[..., 8:], v2[:, :, 8:], k2[:, :, 8:] = 1e4, -1e4, 1e4, 1e4
    out = windowed_attention(qs2, ks2, v2, tau, 3, q=q, k=k2, local=local, impl=impl)
    torch.testing.assert_close(out[:, :, :8], base[:, :, :8], rtol=0, atol=1e-6)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("kernel", ["gaussian", "cauchy"])
@pytest.mark.parametrize("local", [0, 2])
@pytest.mark.parametrize("impl", ["naive", "fast"])
@pytest.mark.parametrize("T", [0, 1])
def test_windowed_attention_tiny_lengths(T, impl, local, kernel):
    qs, ks, v, q, k = _inputs(B=1, T=T)
    tau = torch.tensor([0.2, 0.5, 1.0, 3.0])
    out = windowed_attention(qs, ks, v, tau, 4, q=q, k=k, impl=impl, local=local, kernel=kernel)
    assert out.shape == (1, 4, T, v.shape[-1])
    if T:  # one key: the output is its value
        torch.testing.assert_close(out, expand_heads_ref(v, 4))


def expand_heads_ref(v, H):
    return v.repeat_interleave(H // v.shape[1], dim=1)


@pytest.mark.parametrize("attn,attention", [("scalar", {}), ("hybrid", {"sink": True})])
def test_density_compression_in_decoding(attn, attention):
    """span 0 merges only equal keys (none with learned positions): the decode is the plain window's;
    a wide span merges, keeps fewer entries and still decodes finite logits."""
    from attnlab.eval.window import compressed_loss

    model = _model(attn, **attention)
    idx = torch.randint(0, 50, (2, 40), generator=torch.Generator().manual_seed(1))
    x, y = idx[:, :-1], idx[:, 1:]
    plain = stepped_logits(model, x, 8)
    torch.testing.assert_close(stepped_logits(model, x, 8, compress=0.0), plain, rtol=0, atol=0)
    same = compressed_loss(model, x, y, 8, 0.0)
    assert same["kept"] == 1.0 and same["tokens"] == y.numel()
    assert same["loss"] == pytest.approx(next_token_loss(plain, y), rel=1e-6)
    with torch.no_grad():
        assert same["exact"] == pytest.approx(next_token_loss(model(x)[0], y), rel=1e-6)
    wide = compressed_loss(model, x, y, 8, 1e3)
    assert wide["kept"] < 0.5 and torch.isfinite(torch.tensor(wide["loss"]))
    with pytest.raises(ValueError, match="compress.*window"):
        model.blocks[0].attn.make_cache(1, compress=0.1)
    for bad in (-1.0, float("inf"), True):
        with pytest.raises(ValueError, match="compress must be"):
            model.blocks[0].attn.make_cache(1, window=4, compress=bad)


@pytest.mark.parametrize("impl", ["naive", "fast"])
def test_windowed_attention_scalar_scale(impl):
    """The hybrid's learned gain lam on the scalar term (any sign, zero included): both paths equal the
    reference with lam folded into tau (1/tau -> lam/tau), in the outputs and every gradient, lam's too."""
    qs, ks, v, q, k = (x.double() for x in _inputs(B=1, T=14))
    tau = torch.tensor([0.2, 0.5, 1.0, 3.0], dtype=torch.float64)
    lam = torch.tensor([0.7, 0.0, -0.4, 2.0], dtype=torch.float64)
    leaves = [t.clone().requires_grad_() for t in (qs, ks, v, q, k, lam)]
    got = windowed_attention(*leaves[:3], tau, 5, q=leaves[3], k=leaves[4], query_chunk=6, impl=impl,
                             scalar_scale=leaves[5])
    # reference: per head, -lam (qs - ks)^2 / tau = -(sqrt|lam| qs - sqrt|lam| ks)^2 / tau * sign(lam); the
    # window (nearest |qs - ks|) is unchanged by lam, so compare with a masked softmax over hybrid_logits
    from attnlab.ops.scalar import hybrid_logits

    ref = [t.clone().requires_grad_() for t in (qs, ks, v, q, k, lam)]
    logits = hybrid_logits(ref[3], ref[4], ref[0], ref[1], tau, scalar_scale=ref[5])
    keep = window_mask(qs, ks, 5)
    want = torch.softmax(logits.masked_fill(~keep, float("-inf")), -1) @ ref[2].repeat_interleave(2, dim=1)
    torch.testing.assert_close(got, want, rtol=1e-9, atol=1e-10)
    for name, a, b in zip(("qs", "ks", "v", "q", "k", "lam"), torch.autograd.grad(got.square().sum(), leaves),
                          torch.autograd.grad(want.square().sum(), ref)):
        torch.testing.assert_close(a, b, rtol=1e-7, atol=1e-9, msg=f"grad of {name}")
    with pytest.raises(ValueError, match="give q and k"):
        windowed_attention(qs, ks, v, tau, 5, scalar_scale=lam)
    with pytest.raises(ValueError, match="scalar_scale"):
        windowed_attention(qs, ks, v, tau, 5, q=q, k=k, scalar_scale=lam[:2])


def test_gained_hybrid_layer_windows_through_its_gain():
    """A hybrid layer with a learned gain of 1 windows exactly as the same layer without a gain; with
    another gain its windowed forward changes (the gain reaches the scores)."""
    torch.manual_seed(0)
    plain = LM(ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=4, attn="hybrid", max_seq_len=64))
    gained = LM(ModelConfig(vocab_size=50, d_model=32, n_layers=1, n_heads=4, attn="hybrid", max_seq_len=64,
                            attention={"scalar_gain": 1.0}))
    gained.load_state_dict(plain.state_dict(), strict=False)
    idx = torch.randint(50, (2, 20))
    with torch.no_grad():
        with decode_window(plain, 4):
            want = plain(idx)[0]
        with decode_window(gained, 4):
            got = gained(idx)[0]
            gained.blocks[0].attn.scalar_scale.fill_(3.0)
            other = gained(idx)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert (other - want).abs().max() > 1e-3


@pytest.mark.parametrize("attention", [{}, {"sink": True, "sink_weight": 0.0}, {"train_window": 4, "local_window": 3}],
                         ids=["plain", "weighted-sink", "local-ring"])
def test_gained_hybrid_decodes_through_the_sorted_cache(attention):
    """A hybrid with a learned gain on its scalar term (a retrofit's, here of mixed signs and 0): token
    by token through the sorted cache (and its ring of recent keys) equals the whole-sequence window,
    with prefill, and the exact decode equals the forward."""
    model = _model("hybrid", scalar_gain=1.0, **attention)
    with torch.no_grad():
        for blk in model.blocks:
            blk.attn.scalar_scale.copy_(torch.tensor([0.7, 0.0, -0.3, 2.5]))
    idx = torch.randint(0, 50, (2, 30), generator=torch.Generator().manual_seed(2))
    window = None if attention.get("train_window") else 5
    with torch.no_grad():
        if window is None:
            batched = model(idx)[0]  # trained through the window: the forward is the windowed readout
        else:
            with decode_window(model, window):
                batched = model(idx)[0]
        stepped = stepped_logits(model, idx, window or 4)
        exact = model(idx)[0] if window else None
    torch.testing.assert_close(stepped, batched, rtol=1e-4, atol=1e-4)
    if window:
        with torch.no_grad():
            got = stepped_logits(model, idx, None)
        torch.testing.assert_close(got, exact, rtol=1e-4, atol=1e-4)
        with torch.no_grad():
            caches = model.make_caches(2, window=window)
            pre = model.prefill(idx[:, :11], caches)
            rest = torch.stack([model.step(idx[:, t:t + 1], caches, pos=t) for t in range(11, 30)], 1)
        torch.testing.assert_close(torch.cat([pre, rest], 1), batched, rtol=1e-4, atol=1e-4)


def test_selected_path_chunks_by_device():
    """The selected-keys path scores 64 query rows at a time on the CPU (measured fastest there) and on
    CUDA as many as keep a chunk's scores within CUDA_CHUNK_ELEMENTS: fewer chunks, fewer launches."""
    from attnlab.ops.scalar.window import CUDA_CHUNK_ELEMENTS, SELECT_CHUNK, select_chunk

    assert select_chunk(512, 8, 8, 1024, torch.device("cpu")) == SELECT_CHUNK
    assert select_chunk(512, 8, 8, 1024, torch.device("cuda")) == 1024  # 64M scores: the whole sequence
    assert select_chunk(512, 4, 16, 32768, torch.device("cuda")) == SELECT_CHUNK  # the floor
    assert select_chunk(512, 1, 4, 8192, torch.device("cuda")) * 4 * 8192 <= CUDA_CHUNK_ELEMENTS


@pytest.mark.parametrize("hybrid", [False, True])
def test_cauchy_window_without_gradient_gathers_the_same_keys(hybrid):
    """The Cauchy window's evaluation path (no gradient: each query's m keys gathered) equals its
    training path (scores masked to those keys) in float64, with a sink, a local window, a signed
    gain, GQA, per-query tau, exact ties (repeated keys) and chunks that split the rows unevenly."""
    qs, ks, v, q, k = (x.double() for x in _inputs(B=2, T=29))
    ks[..., 15:25] = ks[..., 0:10]
    tau = torch.rand(2, 4, 29, dtype=torch.float64, generator=torch.Generator().manual_seed(2)) + 0.1
    lam = torch.tensor([0.7, 0.0, -0.4, 2.0], dtype=torch.float64) if hybrid else None
    kw = dict(q=q, k=k, scalar_scale=lam) if hybrid else {}
    for window, local, n_prefix, chunk in ((3, 4, 1, 7), (40, 0, 0, 512), (1, 2, 0, 5)):
        args = dict(n_prefix=n_prefix, local=local, query_chunk=chunk, kernel="cauchy", impl="fast", **kw)
        with torch.no_grad():
            gathered = windowed_attention(qs, ks, v, tau, window, **args)
        masked = windowed_attention(qs, ks, v.clone().requires_grad_(), tau, window, **args)
        naive = windowed_attention(qs, ks, v, tau, window, **{**args, "impl": "naive"})
        torch.testing.assert_close(gathered, masked.detach(), rtol=1e-12, atol=1e-13)
        torch.testing.assert_close(gathered, naive, rtol=1e-12, atol=1e-13)
