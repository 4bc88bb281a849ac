"""GOAT attention: fast (one fused SDPA call on augmented vectors) against naive (explicit log-prior)
on outputs and every gradient, the hybrid combination, fewer queries than keys, and equality with
the authors' reference implementation (`goat-attention`, GoatAttention) given the same weights."""

from __future__ import annotations

import pytest
import torch

from attnlab.layers.mechanisms.goat import GoatPrior, alibi_slopes
from attnlab.ops import goat_attention, goat_prior
from attnlab.testing import compare_fwd_bwd, rel_rms

B, H, G, D, R = 2, 4, 2, 8, 3


def _inputs(Tq, Tk, dtype=torch.float64, seed=0, scalar=False):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype)  # noqa: E731
    a = dict(q=r(B, H, Tq, D), k=r(B, G, Tk, D), v=r(B, G, Tk, 5), freqs=torch.rand(R, generator=g, dtype=torch.float64).to(dtype),
             lam_sym=r(G, R), lam_asym=r(G, R), u=r(B, G, Tk))
    if scalar:
        a.update(qs=r(B, H, Tq), ks=r(B, H, Tk), tau=(0.2 + torch.rand(B, H, Tq, generator=g, dtype=torch.float64)).to(dtype))
    return a


def _run(a, impl, causal=True):
    extra = {n: a[n] for n in ("qs", "ks", "tau") if n in a}
    return goat_attention(a["q"], a["k"], a["v"], a["freqs"], a["lam_sym"], a["lam_asym"], a["u"], causal=causal, impl=impl, **extra)


@pytest.mark.parametrize("scalar", [False, True], ids=["goat", "goat+hybrid"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("Tq,Tk", [(1, 1), (63, 63), (257, 257), (1, 40), (7, 40)], ids=lambda x: str(x))
def test_fast_equals_naive_outputs_and_gradients(Tq, Tk, causal, scalar):
    a = {n: x.requires_grad_(n != "freqs") for n, x in _inputs(Tq, Tk, scalar=scalar).items()}
    names = list(a)
    errs = compare_fwd_bwd(lambda *xs: _run(dict(zip(names, xs)), "fast", causal),
                           lambda *xs: _run(dict(zip(names, xs)), "naive", causal), list(a.values()))
    assert max(errs.values()) <= 1e-10, errs


@pytest.mark.parametrize("scalar", [False, True], ids=["goat", "goat+hybrid"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("Tq,Tk", [(65, 65), (7, 40)], ids=lambda x: str(x))
def test_float32_fast_path_against_float64_naive(Tq, Tk, causal, scalar):
    """float32 fast path against the float64 formula, on the output and every gradient
    (the float64 leaves receive the gradients of the float32 call through the cast)."""
    a = {n: x.requires_grad_(n != "freqs") for n, x in _inputs(Tq, Tk, scalar=scalar).items()}
    names = list(a)
    errs = compare_fwd_bwd(lambda *xs: _run({n: x.float() for n, x in zip(names, xs)}, "fast", causal),
                           lambda *xs: _run(dict(zip(names, xs)), "naive", causal), list(a.values()))
    assert max(errs.values()) <= 1e-5, errs


def test_decode_query_is_the_last_row_and_prior_depends_on_offsets_only():
    a = _inputs(30, 30, scalar=True)
    full = _run(a, "fast")
    tail = {n: (x[:, :, -1:] if n in ("q", "qs", "tau") else x) for n, x in a.items()}
    assert rel_rms(_run(tail, "fast"), full[:, :, -1:]) <= 1e-12
    p = goat_prior(a["freqs"], a["lam_sym"], a["lam_asym"], torch.zeros(1, G, 30, dtype=torch.float64), 30, causal=False)
    assert torch.allclose(p[..., 5, 2], p[..., 9, 6]) and torch.allclose(p[..., 3, 8], p[..., 20, 25])  # i - j only


def test_bad_inputs_name_the_argument():
    a = _inputs(6, 6, dtype=torch.float32)
    for name in ("q", "k", "v", "lam_sym", "lam_asym", "u", "freqs"):
        bad = dict(a)
        bad[name] = a[name].clone()
        bad[name].view(-1)[0] = float("nan")
        with pytest.raises(ValueError, match=rf"^{name} must be finite"):
            _run(bad, "fast")
    with pytest.raises(ValueError, match=r"lam_sym must have shape \(G, R\)"):
        _run(dict(a, lam_sym=a["lam_sym"][:1]), "fast")
    with pytest.raises(ValueError, match=r"u must have shape"):
        _run(dict(a, u=a["u"][..., :3]), "fast")
    h = _inputs(6, 6, dtype=torch.float32, scalar=True)
    for name in ("qs", "ks", "tau"):
        for value in (float("nan"), float("inf")):
            bad = dict(h)
            bad[name] = h[name].clone()
            bad[name].view(-1)[0] = value
            with pytest.raises(ValueError, match=rf"^{name} must be finite"):
                _run(bad, "fast")
    for name in ("k", "v"):
        with pytest.raises(TypeError, match=f"^{name} must have the dtype of q"):
            _run(dict(a, **{name: a[name].double()}), "fast")
    for name in ("qs", "ks"):
        with pytest.raises(TypeError, match=f"^{name} must have the dtype of q"):
            _run(dict(h, **{name: h[name].double()}), "fast")
    with pytest.raises(TypeError, match="^u must be a floating-point tensor"):
        _run(dict(a, u=a["u"].long()), "fast")
    with pytest.raises(ValueError, match="qs, ks and tau go together"):
        goat_attention(a["q"], a["k"], a["v"], a["freqs"], a["lam_sym"], a["lam_asym"], a["u"], qs=a["q"][..., 0])
    empty = _run(_inputs(0, 0, dtype=torch.float32), "fast")
    assert empty.shape == (B, H, 0, 5)


def test_alibi_slopes():
    assert torch.allclose(alibi_slopes(4), torch.tensor([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8]))
    s6 = alibi_slopes(6)  # the 4 slopes of 4 heads, then the 1st and 3rd of 8 heads
    assert torch.allclose(s6, torch.tensor([2 ** -2, 2 ** -4, 2 ** -6, 2 ** -8, 2 ** -1, 2 ** -3]))


@pytest.mark.parametrize("kv_heads", [4, 2], ids=["mha", "gqa"])
def test_equals_the_authors_reference_with_the_same_weights(kv_heads):
    goat = pytest.importorskip("goat")
    torch.manual_seed(0)
    E, T, heads = 64, 23, 4
    ref = goat.GoatAttention(E, heads, kv_num_heads=kv_heads, batch_first=True, pos_rank=4, abs_rank=3,
                             training_seq_len=32, bias=True)
    with torch.no_grad():  # move every prior parameter off its (mostly neutral) initial value
        for prm in (ref.lambda_sym, ref.lambda_asym, ref.sink_bump, ref.sink_gain):
            prm.normal_(0, 0.3)
        for prm in ref.key_bias.parameters():
            prm.normal_(0, 0.5)
    prior = GoatPrior(kv_heads, 4, 3, 10000.0, 32)
    with torch.no_grad():
        prior.lam_sym.copy_(ref.lambda_sym)
        prior.lam_asym.copy_(ref.lambda_asym)
        prior.fc1.load_state_dict(ref.key_bias.fc1.state_dict())
        prior.fc2.weight.copy_(ref.key_bias.fc2.weight)  # its output bias shifts every u_j alike: a no-op
        prior.gain.copy_(ref.sink_gain)
        prior.bump.copy_(ref.sink_bump)
        prior.slope_raw.copy_(ref.recency_slope_raw)
    x = torch.randn(2, T, E)
    x_ref, x_ours = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
    y_ref, _ = ref(x_ref, x_ref, x_ref, is_causal=True, need_weights=False)

    # the reference keeps the first head_dim - (2R + 1) projected dims of q and k for content
    Dh, Dc = E // heads, ref.content_dim
    q = ref.q_proj(x_ours).view(2, T, heads, Dh).transpose(1, 2)[..., :Dc]
    k = ref.k_proj(x_ours).view(2, T, kv_heads, Dh).transpose(1, 2)[..., :Dc]
    v = ref.v_proj(x_ours).view(2, T, kv_heads, Dh).transpose(1, 2)
    o = goat_attention(q, k, v, prior.freqs, prior.lam_sym, prior.lam_asym, prior.key_term(T))
    y = ref.out_proj(o.transpose(1, 2).reshape(2, T, E))
    assert rel_rms(y, y_ref) <= 1e-5
    cot = torch.randn_like(y)
    y_ref.backward(cot)
    y.backward(cot)
    assert rel_rms(x_ours.grad, x_ref.grad) <= 1e-5


@pytest.mark.parametrize("width", ["shared", "extra"])
def test_goat_hybrid_width_fast_naive_decode(width):
    """goat_hybrid with the prior on extra columns (goat_width="extra": the content q·k keeps all of
    head_dim, as wide as softmax's): fast equals naive, outputs and every gradient, and decoding equals forward."""
    from attnlab.layers import Attention, AttentionConfig
    from attnlab.testing import rel_rms

    cfg = dict(d_model=64, n_heads=2, mechanism="goat_hybrid", goat_rank=4, goat_width=width, goat_train_len=32)
    torch.manual_seed(0)
    fast = Attention(AttentionConfig(**cfg)).double()
    naive = Attention(AttentionConfig(**cfg, impl="naive")).double()
    naive.load_state_dict(fast.state_dict())
    assert fast.qk_dim == (32 if width == "extra" else 32 - 2 * 4 - 1 - 2)
    x = torch.randn(2, 13, 64, dtype=torch.float64, requires_grad=True)
    y = fast(x)
    g1 = torch.autograd.grad(y.square().sum(), [x, *fast.parameters()])
    g2 = torch.autograd.grad(naive(x).square().sum(), [x, *naive.parameters()])
    assert max(rel_rms(b, a) for a, b in zip(g1, g2)) < 1e-12
    cache = fast.make_cache(2)
    with torch.no_grad():
        steps = torch.cat([fast.step(x[:, t : t + 1].detach(), cache) for t in range(13)], 1)
    assert rel_rms(steps, y.detach()) < 1e-12
