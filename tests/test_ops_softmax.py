"""softmax_attention: every scaling's fast path against its naive reference, causality of the
key-norm scalings, the fused-kernel route, precision and argument errors."""

import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.ops import softmax_attention
from attnlab.testing import compare_fwd_bwd, rel_rms

SCALES = ["sqrt_d", "ktotal", "kmean", "krms", "pnorm", "n_sqrt_d", 0.3]
KEY_NORM_SCALES = ["ktotal", "kmean", "krms", "pnorm", "n_sqrt_d"]


def _inputs(B=2, H=4, G=4, T=63, D=16, Dv=24, dtype=torch.float32):
    q = torch.randn(B, H, T, D, dtype=dtype, requires_grad=True)
    k = torch.randn(B, G, T, D, dtype=dtype, requires_grad=True)
    v = torch.randn(B, G, T, Dv, dtype=dtype, requires_grad=True)
    return q, k, v


def _sdpa_reference(q, k, v, causal):
    """Standard attention straight from torch, with GQA groups repeated by hand."""
    H = q.shape[1]
    k = k.repeat_interleave(H // k.shape[1], dim=1)
    v = v.repeat_interleave(H // v.shape[1], dim=1)
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


@pytest.mark.parametrize("G", [4, 2], ids=["G=H", "G<H"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("T", [1, 63, 257], ids=lambda t: f"T={t}")
@pytest.mark.parametrize("scale", SCALES, ids=lambda s: f"scale={s}")
def test_fast_matches_naive(scale, T, causal, G):
    q, k, v = _inputs(G=G, T=T)
    errs = compare_fwd_bwd(
        lambda q, k, v: softmax_attention(q, k, v, causal=causal, scale=scale, p=3.0, impl="fast"),
        lambda q, k, v: softmax_attention(q, k, v, causal=causal, scale=scale, p=3.0, impl="naive"),
        [q, k, v],
    )
    assert set(errs) == {"out", "grad0", "grad1", "grad2"}
    assert max(errs.values()) <= 1e-4, errs


@pytest.mark.parametrize("impl", ["naive", "fast"])
@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
def test_sqrt_d_is_standard_attention(impl, causal):
    q, k, v = _inputs(G=2, Dv=16)
    out = softmax_attention(q, k, v, causal=causal, impl=impl)
    assert rel_rms(out, _sdpa_reference(q, k, v, causal)) <= 1e-5
    same = softmax_attention(q, k, v, causal=causal, scale=1 / math.sqrt(16), impl=impl)
    assert rel_rms(same, out) <= 1e-6


@pytest.mark.parametrize("impl", ["naive", "fast"])
def test_pnorm_p1_is_ktotal_and_p2_is_rms_times_sqrt_n(impl):
    q, k, v = _inputs(T=40)
    ktotal = softmax_attention(q, k, v, scale="ktotal", impl=impl)
    assert rel_rms(softmax_attention(q, k, v, scale="pnorm", p=1.0, impl=impl), ktotal) <= 1e-5
    # (sum ||k||^2)^(1/2) = sqrt(n_t) * krms, so krms equals pnorm(p=2) applied to q * sqrt(n_t)
    n = torch.arange(1, 41, dtype=q.dtype).sqrt().view(1, 1, 40, 1)
    krms = softmax_attention(q, k, v, scale="krms", impl=impl)
    assert rel_rms(softmax_attention(q * n, k, v, scale="pnorm", p=2.0, impl=impl), krms) <= 1e-5


def test_pnorm_large_p_stays_finite():
    """(sum ||k||^p)^(1/p) for p = 60 overflows float32 if formed directly; the fast path
    works in log space and must agree with a float64 reference."""
    q, k, v = _inputs(T=63)
    k = (k * 3).detach().requires_grad_()
    fast = softmax_attention(q, k, v, scale="pnorm", p=60.0, impl="fast")
    ref = softmax_attention(q.double(), k.double(), v.double(), scale="pnorm", p=60.0, impl="naive")
    assert torch.isfinite(fast).all()
    assert rel_rms(fast, ref) <= 1e-5
    fast.sum().backward()
    assert torch.isfinite(k.grad).all()


@pytest.mark.parametrize("impl", ["naive", "fast"])
@pytest.mark.parametrize("scale", KEY_NORM_SCALES)
def test_causal_key_norm_scalings_ignore_future_keys(scale, impl):
    """Changing key/value t0 and later leaves outputs before t0 unchanged, and changes later ones."""
    T, t0 = 50, 30
    q, k, v = _inputs(T=T, G=2)
    out = softmax_attention(q, k, v, scale=scale, impl=impl)
    k2, v2 = k.detach().clone(), v.detach().clone()
    k2[:, :, t0:] *= 5.0
    v2[:, :, t0:] += 1.0
    out2 = softmax_attention(q, k2, v2, scale=scale, impl=impl)
    torch.testing.assert_close(out2[:, :, :t0], out[:, :, :t0], rtol=1e-6, atol=1e-6)
    assert (out2[:, :, t0:] - out[:, :, t0:]).abs().max() > 1e-2


def test_noncausal_ktotal_uses_all_keys():
    """Without the mask every query divides by the norm sum of all T keys."""
    q, k, v = _inputs(T=20)
    k_h = k.detach()
    c = torch.linalg.vector_norm(k_h, dim=-1).sum(-1, keepdim=True)  # (B, H, 1)
    w = torch.softmax(q.detach() @ k_h.transpose(-1, -2) / c.unsqueeze(-1), dim=-1)
    out = softmax_attention(q, k, v, causal=False, scale="ktotal", impl="fast")
    assert rel_rms(out, w @ v.detach()) <= 1e-5


def _graph_names(out):
    seen, stack = set(), [out.grad_fn]
    while stack:
        fn = stack.pop()
        if fn is None or fn in seen:
            continue
        seen.add(fn)
        stack.extend(nxt for nxt, _ in fn.next_functions)
    return {type(fn).__name__ for fn in seen}


@pytest.mark.parametrize("G", [4, 2], ids=["G=H", "G<H"])
@pytest.mark.parametrize("scale", SCALES, ids=lambda s: f"scale={s}")
def test_fast_path_uses_fused_kernel(scale, G):
    q, k, v = _inputs(G=G, Dv=8)
    names = _graph_names(softmax_attention(q, k, v, scale=scale, impl="fast"))
    assert "ScaledDotProductFlashAttentionForCpuBackward0" in names, names


@pytest.mark.parametrize("scale", ["sqrt_d", "ktotal", "krms"])
def test_bf16_inputs(scale):
    q, k, v = _inputs(T=257, dtype=torch.bfloat16)
    out = softmax_attention(q, k, v, scale=scale, impl="fast")
    assert out.dtype == torch.bfloat16
    ref = softmax_attention(q.double(), k.double(), v.double(), scale=scale, impl="naive")
    assert rel_rms(out, ref) <= 1e-2


@pytest.mark.parametrize(
    "kwargs, match",
    [
        ({"scale": "l2"}, "scale"),
        ({"scale": -1.0}, "scale"),
        ({"scale": "pnorm", "p": 0.0}, "p must be > 0"),
        ({"impl": "slow"}, "impl"),
    ],
    ids=["unknown-scale", "negative-scale", "p<=0", "unknown-impl"],
)
def test_bad_options(kwargs, match):
    q, k, v = _inputs(T=8)
    with pytest.raises(ValueError, match=match):
        softmax_attention(q, k, v, **kwargs)


@pytest.mark.parametrize(
    "shapes, match",
    [
        (((2, 4, 8, 16), (2, 4, 8, 12), (2, 4, 8, 16)), "head dimension"),
        (((2, 4, 8, 16), (2, 4, 8, 16), (2, 4, 9, 16)), "sequence length"),
        (((2, 4, 8, 16), (3, 4, 8, 16), (3, 4, 8, 16)), "batch size"),
        (((2, 4, 8, 16), (2, 3, 8, 16), (2, 3, 8, 16)), "divisible"),
        (((2, 4, 8, 16), (2, 4, 8, 16), (2, 8, 8, 16)), "divisible"),
        (((2, 4, 8), (2, 4, 8, 16), (2, 4, 8, 16)), "q must have 4 dims"),
    ],
    ids=["k-dim", "v-length", "k-batch", "H%G", "G>H", "q-ndim"],
)
def test_bad_shapes(shapes, match):
    q, k, v = (torch.randn(s) for s in shapes)
    with pytest.raises(ValueError, match=match):
        softmax_attention(q, k, v)


def test_bad_types():
    q, k, v = _inputs(T=8)
    with pytest.raises(TypeError, match="k must have the dtype"):
        softmax_attention(q, k.double(), v)
    with pytest.raises(TypeError, match="scale"):
        softmax_attention(q, k, v, scale=None)
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        softmax_attention(q.tolist(), k, v)
    with pytest.raises(TypeError, match="causal must be a bool"):
        softmax_attention(q, k, v, causal="yes")
