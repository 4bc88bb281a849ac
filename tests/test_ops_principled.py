"""principled_attention: the tiled fast path against the naive reference (outputs, ground weight
and every gradient), the standard-attention limit, ground-state behaviour, ties at the
threshold, grouped heads, memory that stays linear in T, and argument errors."""

import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.ops import principled_attention
from attnlab.testing import LargestTensor, compare_fwd_bwd, rel_rms

TOL = 1e-4
B, H, D, DG, DV = 2, 2, 8, 4, 6


pytestmark = pytest.mark.usefixtures("one_thread")


def make_inputs(T, *, form="head", v0="head", Tk=None, heads=H, groups=None, dtype=torch.float32, seed=0):
    """Leaf tensors [q, k, qg, kg, v, alpha, beta, gamma, v0]; gamma is set so that a good share of
    keys falls below the threshold (the ground state matters and its gradients are not tiny)."""
    g = torch.Generator().manual_seed(seed)
    Tk = Tk or T
    G = groups or heads

    def rand(*shape, scale=1.0, shift=0.0):
        return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift).to(dtype).requires_grad_()

    q, k = rand(B, heads, T, D), rand(B, G, Tk, D)
    qg, kg = rand(B, heads, T, DG), rand(B, G, Tk, DG, scale=0.5)
    v = rand(B, G, Tk, DV)
    shape = {"float": None, "head": (heads,), "query": (B, heads, T)}[form]
    if shape is None:
        alpha, beta, gamma = 0.3, -0.5, 0.4
    else:
        alpha, beta, gamma = rand(*shape, scale=0.5), rand(*shape, scale=0.5), rand(*shape, scale=0.3, shift=0.4)
    v0_t = {"none": None, "shared": rand(DV), "head": rand(heads, DV)}[v0]
    return [q, k, qg, kg, v, alpha, beta, gamma, v0_t]


def principled(impl, causal=True, **kw):
    """fn(*inputs) -> o and w0 flattened into one tensor, so one cotangent reaches both outputs."""
    def fn(q, k, qg, kg, v, alpha, beta, gamma, v0):
        o, w0 = principled_attention(q, k, qg, kg, v, alpha=alpha, beta=beta, gamma=gamma, v0=v0,
                                     causal=causal, impl=impl, return_ground=True, **kw)
        return torch.cat([o.flatten(), w0.flatten()])
    return fn


def assert_close(errs, tol=TOL):
    bad = {k: v for k, v in errs.items() if not v <= tol}
    assert not bad, f"relative RMS errors above {tol}: {bad}"


def ground(impl, inputs, causal=True, **kw):
    q, k, qg, kg, v, alpha, beta, gamma, v0 = inputs
    return principled_attention(q, k, qg, kg, v, alpha=alpha, beta=beta, gamma=gamma, v0=v0,
                                causal=causal, impl=impl, return_ground=True, **kw)[1]


@pytest.mark.parametrize("v0", ["none", "shared", "head"])
@pytest.mark.parametrize("form", ["float", "head", "query"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
@pytest.mark.parametrize("T", [1, 63, 257])
def test_fast_matches_naive(T, causal, form, v0):
    inputs = make_inputs(T, form=form, v0=v0)
    blocks = dict(block_q=32, block_k=16) if T == 63 else {}  # T=257 uses the default blocks
    errs = compare_fwd_bwd(principled("fast", causal, **blocks), principled("naive", causal), inputs)
    assert_close(errs)
    w0_fast, w0_naive = ground("fast", inputs, causal, **blocks), ground("naive", inputs, causal)
    assert rel_rms(w0_fast, w0_naive) <= TOL


@pytest.mark.parametrize("block_q,block_k", [(16, 16), (32, 8), (8, 32), (7, 13), (512, 512)])
def test_block_sizes(block_q, block_k):
    inputs = make_inputs(70, seed=1)
    assert_close(compare_fwd_bwd(principled("fast", block_q=block_q, block_k=block_k), principled("naive"), inputs))


@pytest.mark.parametrize("groups", [1, 2])
def test_grouped_heads(groups):
    """k, kg, v with G < H heads: head h reads group h // (H / G), as with repeated heads."""
    heads = 4
    inputs = make_inputs(40, heads=heads, groups=groups, seed=2)
    assert_close(compare_fwd_bwd(principled("fast", block_q=16, block_k=16), principled("naive"), inputs))

    def repeated(q, k, qg, kg, v, *rest):
        rep = [x.repeat_interleave(heads // groups, dim=1) for x in (k, kg, v)]
        return principled("naive")(q, rep[0], qg, rep[1], rep[2], *rest)
    assert_close(compare_fwd_bwd(principled("fast", block_q=16, block_k=16), repeated, inputs))


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_fewer_queries_than_keys(causal):
    inputs = make_inputs(20, Tk=53, seed=3, form="query")
    fast = principled("fast", causal, block_q=8, block_k=16)
    assert_close(compare_fwd_bwd(fast, principled("naive", causal), inputs))


def test_causal_suffix_matches_full_run():
    """Queries of a suffix see the same keys (and the same K) as the last rows of a full causal run."""
    q, k, qg, kg, v, alpha, beta, gamma, v0 = make_inputs(50, seed=4)
    full = principled_attention(q, k, qg, kg, v, alpha=alpha, beta=beta, gamma=gamma, v0=v0, block_q=16, block_k=16)
    tail = principled_attention(q[:, :, -9:], k, qg[:, :, -9:], kg, v, alpha=alpha, beta=beta, gamma=gamma, v0=v0,
                                block_q=16, block_k=16)
    assert rel_rms(tail, full[:, :, -9:]) <= 1e-6


def softmax_reference(q, k, v, causal):
    s = q @ k.transpose(-1, -2) / math.sqrt(q.shape[-1])
    if causal:
        T = q.shape[2]
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return torch.softmax(s, -1) @ v


@pytest.mark.parametrize("impl", ["fast", "naive"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "full"])
def test_limit_is_standard_attention(impl, causal):
    """alpha, beta, gamma -> -inf recovers softmax(q.k / sqrt(d)) v, whatever the gates and v0."""
    q, k, qg, kg, v, *_ = make_inputs(45, seed=5)
    v0 = torch.randn(H, DV)

    def fn(q, k, qg, kg, v):
        return principled_attention(q, k, qg, kg, v, alpha=-30.0, beta=-30.0, gamma=-30.0, v0=v0,
                                    causal=causal, impl=impl, block_q=16, block_k=16)
    errs = compare_fwd_bwd(fn, lambda q, k, qg, kg, v: softmax_reference(q, k, v, causal), [q, k, qg, kg, v])
    assert_close({key: errs[key] for key in ("out", "grad0", "grad1", "grad4")})
    w0 = principled_attention(q, k, qg, kg, v, alpha=-30.0, beta=-30.0, gamma=-30.0, causal=causal, impl=impl,
                              return_ground=True)[1]
    assert w0.abs().max() < 1e-6
    if impl == "fast":  # every key clears the threshold: nothing is grounded, exactly
        assert (w0 == 0).all()


def test_ground_weight_is_nonnegative():
    for seed, shift in enumerate([-2.0, 0.0, 1.0, 3.0]):
        inputs = make_inputs(64, form="query", seed=seed)
        gamma = torch.randn(B, H, 64) * 2 + shift
        inputs[7] = gamma
        w0_fast = ground("fast", inputs, block_q=16, block_k=16)
        w0_naive = ground("naive", inputs)
        assert (w0_fast >= 0).all() and (w0_fast <= 1).all()
        assert w0_naive.min() > -1e-6
        assert rel_rms(w0_fast, w0_naive) <= TOL


@pytest.mark.parametrize("impl", ["fast", "naive"])
def test_ground_state_absorbs_irrelevant_queries(impl):
    """Queries whose every logit lies below gamma give mass to the ground state, and the
    ground weight equals sum_j max(0, e^gamma - e^a_j) / z (seed, section 3.2.1)."""
    T = 30
    q, k, qg, kg, v, *_ = make_inputs(T, seed=6)
    gamma = torch.zeros(B, H, T)
    gamma[:, :, ::2] = 6.0  # far above every semantic score
    v0 = torch.randn(H, DV)
    o, w0 = principled_attention(q, k, qg, kg, v, alpha=0.0, beta=0.0, gamma=gamma, v0=v0, impl=impl,
                                 return_ground=True, block_q=8, block_k=8)
    assert (w0[:, :, ::2] > 0.5).all()
    # o = w0 v0 + sum_j w_j v_j with sum_j w_j = 1 - w0: the grounded queries lean on v0.
    keys_only = principled_attention(q, k, qg, kg, v, alpha=0.0, beta=0.0, gamma=gamma, impl=impl,
                                     block_q=8, block_k=8)
    assert rel_rms(o - keys_only, w0[..., None] * v0[:, None, :]) <= 1e-5

    s = q @ k.transpose(-1, -2) / math.sqrt(D)
    n_keys = torch.arange(1, T + 1, dtype=torch.float32)[:, None]
    a = (1 + math.log(2) * n_keys.log()) * (s - gamma[..., None]) + gamma[..., None]
    a = a - math.log(2) * F.softplus(-(qg @ kg.transpose(-1, -2)))
    visible = torch.ones(T, T, dtype=torch.bool).tril()
    e_a = torch.where(visible, a.exp(), 0.0)
    e_g = torch.where(visible, gamma[..., None].exp(), 0.0)
    expected = (e_g - e_a).clamp_min(0).sum(-1) / torch.maximum(e_g, e_a).sum(-1)
    assert rel_rms(w0, expected) <= 1e-5


def test_ties_split_the_gradient_like_torch_maximum():
    """Logits exactly at the threshold: q = 0 gives s = 0 = gamma, and strongly aligned gates give
    softplus(-g) = 0. torch.maximum splits a tie's gradient evenly; the fast path must too."""
    T = 12
    q, k, qg, kg, v, *_ = make_inputs(T, seed=7)
    with torch.no_grad():
        q[:, :, ::3] = 0.0
        qg.fill_(15.0)  # g = 900: softplus(-g) underflows to exactly 0, in float64 too
        kg.fill_(15.0)
    gamma = torch.zeros(H, requires_grad=True)
    inputs = [q, k, qg, kg, v, 0.5, 0.2, gamma, torch.randn(DV)]
    g = qg.detach() @ kg.detach().transpose(-1, -2)
    assert (F.softplus(-g) == 0).all()
    assert_close(compare_fwd_bwd(principled("fast", block_q=4, block_k=4), principled("naive"), inputs))

    # The tie's gradient for gamma is the mean of the one-sided gradients just above and below it.
    def dgamma(value):
        gam = torch.full((H,), value, dtype=torch.float64, requires_grad=True)
        o = principled_attention(*(x.detach().double() for x in (q, k, qg, kg, v)), alpha=0.5, beta=0.2,
                                 gamma=gam, block_q=4, block_k=4)
        o.sum().backward()
        return gam.grad
    above, below, at = dgamma(1e-9), dgamma(-1e-9), dgamma(0.0)
    assert not torch.allclose(above, below)
    assert torch.allclose(at, (above + below) / 2, rtol=1e-6, atol=1e-9)


@pytest.mark.heavy
def test_gradcheck_float64():
    inputs = [x.detach().double().requires_grad_() for x in make_inputs(7, form="query", v0="head", seed=8)]

    def fn(*xs):
        return principled("fast", block_q=3, block_k=2)(*xs)
    assert torch.autograd.gradcheck(fn, inputs, eps=1e-6, atol=1e-6)


def test_return_ground_shapes():
    q, k, qg, kg, v, *_ = make_inputs(9, Tk=11)
    o = principled_attention(q, k, qg, kg, v, alpha=0.0, beta=0.0, gamma=0.0)
    assert isinstance(o, torch.Tensor) and o.shape == (B, H, 9, DV)
    o2, w0 = principled_attention(q, k, qg, kg, v, alpha=0.0, beta=0.0, gamma=0.0, return_ground=True)
    assert o2.shape == (B, H, 9, DV) and w0.shape == (B, H, 9)
    assert torch.equal(o, o2)


def test_low_precision_inputs_are_computed_in_float32():
    inputs = make_inputs(33, seed=9)
    ref = principled("naive")(*inputs)
    half = [x.detach().bfloat16() if isinstance(x, torch.Tensor) else x for x in inputs]
    out = principled("fast")(*half)
    assert out.dtype == torch.bfloat16
    assert rel_rms(out.float(), ref) < 2e-2




def test_fast_path_never_builds_a_t_by_t_matrix():
    T, N = 512, B * H
    q, k, qg, kg, v, alpha, beta, gamma, v0 = make_inputs(T, form="query")
    with LargestTensor() as seen:
        o = principled_attention(q, k, qg, kg, v, alpha=alpha, beta=beta, gamma=gamma, v0=v0, block_q=64, block_k=64)
        o.sum().backward()
    assert seen.numel <= max(N * 64 * 64, N * T * (D + 1))
    assert seen.numel < N * T * T // 8


def test_bad_input_names_the_argument():
    q, k, qg, kg, v, *_ = (x.detach() if isinstance(x, torch.Tensor) else x for x in make_inputs(10))
    kw = dict(alpha=0.0, beta=0.0, gamma=0.0)
    cases = [
        (dict(k=k[..., :5]), "k", ValueError),
        (dict(v=v[:, :, :7]), "v", ValueError),
        (dict(qg=qg[:, :, :9]), "qg", ValueError),
        (dict(kg=kg[..., :3]), "kg", ValueError),
        (dict(k=torch.randn(B, 3, 10, D)), "k", ValueError),  # 3 groups do not divide 2 heads
        (dict(q=q.double()), "dtype", TypeError),
        (dict(q=q[0]), "q", ValueError),
        (dict(q=[1.0]), "q", TypeError),
        (dict(v0=torch.randn(DV + 1)), "v0", ValueError),
        (dict(v0=torch.randn(H + 1, DV)), "v0", ValueError),
        (dict(alpha=torch.randn(H + 1)), "alpha", ValueError),
        (dict(gamma=torch.randn(B, H, 3)), "gamma", ValueError),
        (dict(beta="big"), "beta", TypeError),
        (dict(impl="flash"), "impl", ValueError),
        (dict(block_q=0), "block_q", ValueError),
        (dict(q=q[:, :, :4], qg=qg[:, :, :4], k=k[:, :, :3], kg=kg[:, :, :3], v=v[:, :, :3]), "Tq", ValueError),
    ]
    for change, name, err in cases:
        args = dict(q=q, k=k, qg=qg, kg=kg, v=v, **kw) | change
        with pytest.raises(err, match=name):
            principled_attention(args.pop("q"), args.pop("k"), args.pop("qg"), args.pop("kg"), args.pop("v"), **args)
