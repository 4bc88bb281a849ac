"""scalar_attention / hybrid_attention: fast vs naive on outputs and every gradient, the tau
limits, low-precision stress, the fused-kernel route, the logits helpers and argument errors."""

import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.ops import hybrid_attention, scalar_attention, softmax_attention
from attnlab.ops.scalar import hybrid_logits, scalar_logits
from attnlab.testing import LargestTensor, compare_fwd_bwd, rel_rms

B, H, D, DV = 2, 4, 16, 24
TAU_FORMS = ["float", "per-head", "per-query"]


def _tau(form, T, dtype=torch.float32):
    if form == "float":
        return 0.7
    shape = (H,) if form == "per-head" else (B, H, T)
    return (torch.rand(shape, dtype=dtype) + 0.5).requires_grad_()


def _scalars(T, dtype=torch.float32):
    qs = torch.randn(B, H, T, dtype=dtype, requires_grad=True)
    ks = torch.randn(B, H, T, dtype=dtype, requires_grad=True)
    return qs, ks


def _vectors(T, G, dtype=torch.float32, Dv=DV):
    q = torch.randn(B, H, T, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, G, T, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, G, T, Dv, dtype=dtype, requires_grad=True)
    return q, k, v


CASES = pytest.mark.parametrize("T", [1, 63, 257], ids=lambda t: f"T={t}")
CAUSAL = pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
GROUPS = pytest.mark.parametrize("G", [4, 2], ids=["G=H", "G<H"])
TAUS = pytest.mark.parametrize("tau_form", TAU_FORMS, ids=lambda f: f"tau={f}")


@TAUS
@GROUPS
@CAUSAL
@CASES
def test_scalar_fast_matches_naive(T, causal, G, tau_form):
    qs, ks = _scalars(T)
    v = _vectors(T, G)[2]
    tau = _tau(tau_form, T)
    errs = compare_fwd_bwd(
        lambda qs, ks, v, tau: scalar_attention(qs, ks, v, tau, causal=causal, impl="fast"),
        lambda qs, ks, v, tau: scalar_attention(qs, ks, v, tau, causal=causal, impl="naive"),
        [qs, ks, v, tau],
    )
    assert len(errs) == (4 if tau_form == "float" else 5)  # out + grads of qs, ks, v (, tau)
    assert max(errs.values()) <= 1e-4, errs


@TAUS
@GROUPS
@CAUSAL
@CASES
def test_hybrid_fast_matches_naive(T, causal, G, tau_form):
    q, k, v = _vectors(T, G)
    qs, ks = _scalars(T)
    tau = _tau(tau_form, T)
    errs = compare_fwd_bwd(
        lambda *a: hybrid_attention(*a, causal=causal, impl="fast"),
        lambda *a: hybrid_attention(*a, causal=causal, impl="naive"),
        [q, k, v, qs, ks, tau],
    )
    assert len(errs) == (6 if tau_form == "float" else 7)
    assert max(errs.values()) <= 1e-4, errs


def test_naive_follows_the_formula():
    """scalar_logits / hybrid_logits entry by entry against a loop over (t, s)."""
    T = 5
    qs, ks = _scalars(T)
    q, k, _ = _vectors(T, 2)
    tau = _tau("per-query", T).detach()
    sl, hl = scalar_logits(qs, ks, tau), hybrid_logits(q, k, qs, ks, tau, causal=False)
    for b, h, t, s in [(0, 0, 3, 1), (1, 3, 4, 4), (1, 2, 0, 0), (0, 1, 2, 0)]:
        expect = -((qs[b, h, t] - ks[b, h, s]) ** 2) / tau[b, h, t]
        assert torch.allclose(sl[b, h, t, s], expect)
        dot = q[b, h, t] @ k[b, h // 2, s] / math.sqrt(D)
        assert torch.allclose(hl[b, h, t, s], dot + expect)
    assert torch.isinf(sl[0, 0, 1, 2]) and sl[0, 0, 1, 2] < 0  # future key masked
    assert torch.isfinite(hl).all()  # non-causal: nothing masked


@pytest.mark.parametrize("impl", ["naive", "fast"])
@CAUSAL
def test_tau_to_zero_is_nearest_key_lookup(impl, causal):
    """Keys a permutation of 0..T-1, queries an integer plus an offset 0.1 <= |u| <= 0.4: squared
    distances to distinct keys a, b differ by |a - b| |a + b - 2 qs| >= 0.2, so tau = 0.2 / 60
    leaves every key but the nearest visible one below e^-60 of it."""
    T = 40
    ks = torch.stack([torch.randperm(T) for _ in range(B * H)]).view(B, H, T).double()
    offset = (0.1 + 0.3 * torch.rand(B, H, T, dtype=torch.float64)) * (torch.randint(0, 2, (B, H, T)) * 2 - 1)
    qs = torch.randint(0, T, (B, H, T)).double() + offset
    v = torch.randn(B, 2, T, DV, dtype=torch.float64)
    out = scalar_attention(qs, ks, v, 0.2 / 60, causal=causal, impl=impl)
    dist = (qs.unsqueeze(-1) - ks.unsqueeze(-2)).abs()  # (B, H, T, T)
    if causal:
        dist = dist.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("inf"))
    nearest = dist.argmin(-1)  # (B, H, T)
    v_h = v.repeat_interleave(2, dim=1)  # (B, H, T, Dv)
    expect = torch.gather(v_h, 2, nearest.unsqueeze(-1).expand(-1, -1, -1, DV))
    assert rel_rms(out, expect) <= 1e-12


@pytest.mark.parametrize("impl", ["naive", "fast"])
@CAUSAL
def test_tau_to_infinity_is_uniform_averaging(impl, causal):
    T = 63
    qs, ks = _scalars(T)
    v = _vectors(T, 2)[2]
    out = scalar_attention(qs, ks, v, 1e9, causal=causal, impl=impl)
    v_h = v.detach().repeat_interleave(2, dim=1)
    if causal:
        expect = v_h.cumsum(2) / torch.arange(1, T + 1).view(1, 1, T, 1)
    else:
        expect = v_h.mean(2, keepdim=True).expand_as(v_h)
    assert rel_rms(out, expect) <= 1e-5


@pytest.mark.parametrize("impl", ["naive", "fast"])
@CAUSAL
def test_hybrid_tau_to_infinity_is_softmax_attention(impl, causal):
    T = 63
    q, k, v = _vectors(T, 2)
    qs, ks = _scalars(T)
    out = hybrid_attention(q, k, v, qs, ks, 1e9, causal=causal, impl=impl)
    assert rel_rms(out, softmax_attention(q, k, v, causal=causal, impl="naive")) <= 1e-5


def _far_keys(T, dtype):
    """|ks| ~ 10 with spread 0.5; each query sits near some key, so tau = 0.01 gives sharp
    but not one-hot weights. The expanded terms 2 qs ks / tau, ks^2 / tau are ~1e4."""
    ks = 10 + 0.5 * torch.randn(B, H, T)
    qs = ks[:, :, torch.randperm(T)] + 0.05 * torch.randn(B, H, T)
    return qs.to(dtype), ks.to(dtype)


def _fwd_bwd(fn, inputs):
    leaves = [x.detach().clone().requires_grad_() for x in inputs]
    out = fn(*leaves)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    out.backward(cot.to(out.dtype))
    return [out] + [x.grad for x in leaves]


@pytest.mark.parametrize("dtype, tol", [(torch.bfloat16, 1e-2), (torch.float32, 1e-4)], ids=["bf16", "fp32"])
@pytest.mark.parametrize("op", ["scalar", "hybrid"])
def test_large_keys_small_tau_stay_accurate(op, dtype, tol):
    """Fast path on low-precision inputs against the naive formula in float64 on the same values.
    Measured: bf16 ~2.5e-3 on outputs and gradients (the bf16 rounding of the result itself),
    fp32 ~1e-5 (benchmarks/precision.py measures both)."""
    T, tau = 257, 0.01
    qs, ks = _far_keys(T, dtype)
    q, k, v = (x.detach() for x in _vectors(T, 2, dtype=dtype))
    if op == "scalar":
        inputs = [qs, ks, v]
        fn = lambda qs, ks, v, impl="fast": scalar_attention(qs, ks, v, tau, impl=impl)  # noqa: E731
    else:
        inputs = [q, k, v, qs, ks]
        fn = lambda q, k, v, qs, ks, impl="fast": hybrid_attention(q, k, v, qs, ks, tau, impl=impl)  # noqa: E731
    fast = _fwd_bwd(fn, inputs)
    ref = _fwd_bwd(lambda *a: fn(*a, impl="naive"), [x.double() for x in inputs])
    assert fast[0].dtype == dtype
    errs = [rel_rms(a, b) for a, b in zip(fast, ref)]
    assert max(errs) <= tol, errs


def test_bf16_stress_breaks_the_unshifted_expanded_form():
    """Guard that the stress test is a real one: the textbook expansion in bf16 is far off."""
    T, tau = 257, 0.01
    qs, ks = _far_keys(T, torch.bfloat16)
    v = torch.randn(B, H, T, DV).bfloat16()
    qa = torch.stack([2 * qs / tau, -torch.ones_like(qs) / tau], -1)
    ka = torch.stack([ks, ks * ks], -1)
    qa, ka = F.pad(qa, (0, DV - 2)), F.pad(ka, (0, DV - 2))
    careless = F.scaled_dot_product_attention(qa, ka, v, is_causal=True, scale=1.0)
    ref = scalar_attention(qs.double(), ks.double(), v.double(), tau, impl="naive")
    assert rel_rms(careless, ref) > 0.3
    assert rel_rms(scalar_attention(qs, ks, v, tau), ref) <= 1e-2


@pytest.mark.parametrize("impl", ["naive", "fast"])
def test_causal_outputs_ignore_future_keys(impl):
    T, t0 = 50, 30
    qs, ks = _scalars(T)
    v = _vectors(T, 2)[2]
    out = scalar_attention(qs, ks, v, 0.5, impl=impl)
    ks2, v2 = ks.detach().clone(), v.detach().clone()
    ks2[:, :, t0:] += 3.0
    v2[:, :, t0:] += 1.0
    out2 = scalar_attention(qs, ks2, v2, 0.5, impl=impl)
    # the fast path shifts by the first key, which every row sees: earlier rows do not move at all
    torch.testing.assert_close(out2[:, :, :t0], out[:, :, :t0], rtol=0, atol=0)
    assert (out2[:, :, t0:] - out[:, :, t0:]).abs().max() > 1e-2


def _graph_names(out):
    seen, stack = set(), [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return {type(fn).__name__ for fn in seen}


@pytest.mark.parametrize("Dv", [1, 24], ids=["Dv=1", "Dv=24"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_fast_paths_use_fused_kernel(dtype, Dv):
    T = 16
    qs, ks = _scalars(T, dtype)
    q, k, v = _vectors(T, 2, dtype, Dv=Dv)
    for out in (scalar_attention(qs, ks, v, 0.5), hybrid_attention(q, k, v, qs, ks, 0.5)):
        assert out.shape == (B, H, T, Dv) and out.dtype == dtype
        assert "ScaledDotProductFlashAttentionForCpuBackward0" in _graph_names(out)


def _scalar_call(**over):
    T = 8
    args = dict(qs=torch.randn(B, H, T), ks=torch.randn(B, H, T), v=torch.randn(B, 2, T, DV), tau=0.5)
    args.update(over)
    impl = args.pop("impl", "auto")
    return lambda: scalar_attention(args["qs"], args["ks"], args["v"], args["tau"], impl=impl)


@pytest.mark.parametrize(
    "over, match",
    [
        ({"ks": torch.randn(B, H, 7)}, "at least as many keys as queries: qs has 8 positions, ks has 7"),
        ({"ks": torch.randn(B, H + 1, 8)}, "ks must have the \\(B, H\\) of qs"),
        ({"v": torch.randn(B, 2, 9, DV)}, "sequence length"),
        ({"v": torch.randn(B + 1, 2, 8, DV)}, "batch size"),
        ({"v": torch.randn(B, 3, 8, DV)}, "divisible"),
        ({"tau": 0.0}, "tau must be > 0"),
        ({"tau": -1.0}, "tau must be > 0"),
        ({"tau": torch.tensor([0.5, 0.5, -0.1, 0.5])}, "tau must be > 0"),
        ({"tau": torch.ones(H + 1)}, "tau of shape"),
        ({"tau": torch.ones(B, H, 7)}, "tau of shape"),
        ({"impl": "slow"}, "impl"),
        ({"qs": torch.randn(B, H, 8, 1)}, "qs must have 3 dims"),
    ],
    ids=["ks-shorter", "ks-heads", "v-length", "v-batch", "H%G", "tau=0", "tau<0", "tau-head<0",
         "tau-head-shape", "tau-query-shape", "unknown-impl", "qs-ndim"],
)
def test_scalar_bad_input(over, match):
    with pytest.raises(ValueError, match=match):
        _scalar_call(**over)()


def test_scalar_bad_types():
    with pytest.raises(TypeError, match="ks must have the dtype"):
        _scalar_call(ks=torch.randn(B, H, 8).double())()
    with pytest.raises(TypeError, match="tau must be a floating-point"):
        _scalar_call(tau=torch.ones(H, dtype=torch.long))()
    with pytest.raises(TypeError, match="tau must be a float or a tensor"):
        _scalar_call(tau="0.5")()


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((B, H, 8, D), (B, 2, 8, D + 1), (B, 2, 8, DV), (B, H, 8)), "head dimension"),
        (((B, H, 8, D), (B, 3, 8, D), (B, 3, 8, DV), (B, H, 8)), "divisible"),
        (((B, H, 8, D), (B, 2, 8, D), (B, 2, 8, DV), (B, 2, 8)), "qs must have shape"),
        (((B, H, 8, D), (B, 2, 8, D), (B, 2, 7, DV), (B, H, 8)), "sequence length"),
    ],
    ids=["k-dim", "H%G", "qs-heads", "v-length"],
)
def test_hybrid_bad_input(shapes, match):
    q, k, v, s = (torch.randn(sh) for sh in shapes)
    with pytest.raises(ValueError, match=match):
        hybrid_attention(q, k, v, s, s.clone(), 0.5)
    with pytest.raises(ValueError, match="tau must be > 0"):
        hybrid_attention(*(torch.randn(sh) for sh in ((B, H, 8, D), (B, 2, 8, D), (B, 2, 8, DV))),
                         torch.randn(B, H, 8), torch.randn(B, H, 8), 0.0)


@pytest.mark.parametrize("op", ["scalar", "hybrid"])
def test_grouped_values_are_not_copied_to_every_head(op):
    """G < H: the fast path reads the G value groups in place (SDPA's enable_gqa), so nothing of the
    size of values for every head is built, forward or backward."""
    Tq, Tk, G = 4, 300, 1
    qs, ks = torch.randn(B, H, Tq), torch.randn(B, H, Tk)
    q, k, v = torch.randn(B, H, Tq, D), torch.randn(B, G, Tk, D), torch.randn(B, G, Tk, DV, requires_grad=True)
    with LargestTensor() as seen:
        if op == "scalar":
            out = scalar_attention(qs, ks, v, 0.5)
        else:
            out = hybrid_attention(q, k, v, qs, ks, 0.5)
        out.sum().backward()
    assert seen.numel < B * H * Tk * DV


@CAUSAL
def test_hybrid_mixed_key_and_value_groups(causal):
    """k with 1 group and v with 2 (H = 4): SDPA runs on the 2 groups both refine."""
    T = 40
    q, qs, ks = torch.randn(B, H, T, D), torch.randn(B, H, T), torch.randn(B, H, T)
    k, v = torch.randn(B, 1, T, D), torch.randn(B, 2, T, DV)
    tau = _tau("per-head", T)
    inputs = [x.requires_grad_() for x in (q, k, v, qs, ks)] + [tau]
    errs = compare_fwd_bwd(
        lambda *a: hybrid_attention(*a, causal=causal, impl="fast"),
        lambda *a: hybrid_attention(*a, causal=causal, impl="naive"),
        inputs,
    )
    assert len(errs) == 7 and max(errs.values()) <= 1e-4, errs
