"""Fewer queries than keys: the queries are the last Tq of the Tk positions. Every attention op
that a decode step calls takes this form; its rows equal the last rows of the full call, and
fast equals naive on outputs and every gradient."""

from __future__ import annotations

import pytest
import torch

from attnlab.ops import hybrid_attention, hybrid_logits, scalar_attention, scalar_logits, softmax_attention
from attnlab.ops.softmax import SCALES
from attnlab.testing import compare_fwd_bwd, rel_rms

B, H, G, D = 2, 4, 2, 8


def _inputs(Tq, Tk, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64)  # noqa: E731
    return dict(q=r(B, H, Tq, D), k=r(B, G, Tk, D), v=r(B, G, Tk, D), qs=r(B, H, Tq), ks=r(B, H, Tk),
                tau=0.3 + torch.rand(B, H, Tq, generator=g, dtype=torch.float64))


OPS = {
    **{f"softmax-{s}": (lambda s: lambda a, impl, causal: softmax_attention(a["q"], a["k"], a["v"], scale=s, impl=impl, causal=causal))(s)
       for s in (*SCALES, 0.4)},
    "scalar": lambda a, impl, causal: scalar_attention(a["qs"], a["ks"], a["v"], a["tau"], impl=impl, causal=causal),
    "hybrid": lambda a, impl, causal: hybrid_attention(a["q"], a["k"], a["v"], a["qs"], a["ks"], a["tau"], impl=impl, causal=causal),
}
QUERY_ARGS = ("q", "qs", "tau")


@pytest.mark.parametrize("Tq,Tk", [(1, 1), (1, 9), (5, 9), (9, 9), (3, 64)], ids=lambda x: str(x))
@pytest.mark.parametrize("name", list(OPS))
def test_last_rows_of_the_full_call(name, Tq, Tk):
    full = _inputs(Tk, Tk)
    tail = {n: (x[:, :, Tk - Tq:] if n in QUERY_ARGS else x) for n, x in full.items()}
    for impl in ("naive", "fast"):
        ref = OPS[name](full, impl, True)[:, :, Tk - Tq:]
        assert rel_rms(OPS[name](tail, impl, True), ref) <= 1e-12, impl


@pytest.mark.parametrize("causal", [True, False], ids=["causal", "noncausal"])
@pytest.mark.parametrize("name", list(OPS))
def test_fast_equals_naive_with_fewer_queries(name, causal):
    a = _inputs(5, 13)
    names = list(a)
    errs = compare_fwd_bwd(
        lambda *xs: OPS[name](dict(zip(names, xs)), "fast", causal),
        lambda *xs: OPS[name](dict(zip(names, xs)), "naive", causal),
        [x.requires_grad_(True) for x in a.values()],
    )
    assert max(errs.values()) <= 1e-10, errs


def test_noncausal_allows_more_queries_than_keys_and_causal_does_not():
    a = _inputs(7, 3)
    out = scalar_attention(a["qs"], a["ks"], a["v"], a["tau"], causal=False)
    assert out.shape == (B, H, 7, D)
    with pytest.raises(ValueError, match="at least as many keys as queries: qs has 7 positions, ks has 3"):
        scalar_attention(a["qs"], a["ks"], a["v"], a["tau"])
    with pytest.raises(ValueError, match="at least as many keys as queries: q has 7 positions, k has 3"):
        softmax_attention(a["q"], a["k"], a["v"])


def test_logits_mask_the_keys_each_query_cannot_see():
    a = _inputs(2, 5)
    s = scalar_logits(a["qs"], a["ks"], a["tau"])  # query 0 sees keys 0..3, query 1 all 5
    assert torch.isinf(s[..., 0, 4]).all() and torch.isfinite(s[..., 0, :4]).all() and torch.isfinite(s[..., 1, :]).all()
    h = hybrid_logits(a["q"], a["k"], a["qs"], a["ks"], a["tau"])
    assert torch.equal(torch.isinf(h), torch.isinf(s))
