"""ExactScalarCache: exact scalar/hybrid decoding with each key augmented once equals the op
over the growing context (to float64 rounding) and the naive formula, for scalar and hybrid
heads, grouped values and keys, per-query tau, several queries per call; bad input is a named
error that leaves the cache as it was."""

from __future__ import annotations

import pytest
import torch

from attnlab.cache.exact import ExactScalarCache
from attnlab.ops import hybrid_attention, scalar_attention

B, H, T, D = 2, 4, 37, 8


def inputs(G=2, Gk=2, dtype=torch.float64, seed=0):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=dtype)  # noqa: E731
    return dict(qs=r(B, H, T) * 2, ks=r(B, H, T) * 2 + 5.0, v=r(B, G, T, D), q=r(B, H, T, D), k=r(B, Gk, T, D),
                tau=torch.rand(B, H, T, generator=g, dtype=dtype) + 0.05)


def step_through(x, hybrid: bool, chunk: int = 1):
    cache = ExactScalarCache(B, H)
    outs = []
    for t in range(0, T, chunk):
        s = slice(t, t + chunk)
        cache.append(x["ks"][..., s], x["v"][:, :, s], k=x["k"][:, :, s] if hybrid else None)
        outs.append(cache.attend(x["qs"][..., s], x["tau"][..., s], q=x["q"][:, :, s] if hybrid else None))
    return torch.cat(outs, dim=2), cache


@pytest.mark.parametrize("hybrid", [False, True], ids=["scalar", "hybrid"])
@pytest.mark.parametrize("chunk", [1, 5], ids=["one-token", "five-tokens"])
@pytest.mark.parametrize("impl", ["fast", "naive"])
def test_equals_the_op_over_the_growing_context(hybrid, chunk, impl):
    x = inputs()
    got, cache = step_through(x, hybrid, chunk)
    if hybrid:
        ref = hybrid_attention(x["q"], x["k"], x["v"], x["qs"], x["ks"], x["tau"], impl=impl)
    else:
        ref = scalar_attention(x["qs"], x["ks"], x["v"], x["tau"], impl=impl)
    assert (got - ref).abs().max().item() <= 1e-12 * ref.abs().max().item()
    assert len(cache) == T and cache.nbytes() > 0


def test_low_precision_reads_out_in_the_values_dtype():
    x = inputs(dtype=torch.bfloat16)
    got, _ = step_through(x, hybrid=True)
    ref = hybrid_attention(*(x[n].double() for n in ("q", "k", "v", "qs", "ks", "tau")), impl="naive")
    assert got.dtype == torch.bfloat16
    assert ((got.double() - ref).norm() / ref.norm()).item() < 1e-2


def test_float_and_per_head_tau():
    x = inputs(G=4, Gk=1)
    for tau in (0.3, torch.full((H,), 0.3, dtype=torch.float64)):
        cache = ExactScalarCache(B, H)
        cache.append(x["ks"], x["v"], k=x["k"])
        got = cache.attend(x["qs"], tau, q=x["q"])
        ref = hybrid_attention(x["q"], x["k"], x["v"], x["qs"], x["ks"], 0.3, impl="naive")
        assert (got - ref).abs().max().item() < 1e-12


def snapshot(cache):
    return {n: t.clone() for n, t in cache.kv.view().items()}, len(cache)


@pytest.mark.parametrize("what, words", [
    ("nan-ks", "ks"), ("inf-v", "v"), ("nan-k", "k"), ("heads", "append needs ks"), ("mixed-dtype", "v"),
    ("width", "k width"),
], ids=lambda x: x if isinstance(x, str) and "-" in x or x in ("heads", "width") else "")
def test_bad_append_names_the_argument_and_changes_nothing(what, words):
    x = inputs()
    cache = ExactScalarCache(B, H)
    cache.append(x["ks"][..., :3], x["v"][:, :, :3], k=x["k"][:, :, :3])
    before = snapshot(cache)
    ks, v, k = x["ks"][..., 3:4].clone(), x["v"][:, :, 3:4].clone(), x["k"][:, :, 3:4].clone()
    if what == "nan-ks":
        ks[0, 0, 0] = float("nan")
    elif what == "inf-v":
        v[1, 1, 0, 2] = float("inf")
    elif what == "nan-k":
        k[0, 1, 0, 0] = float("nan")
    elif what == "heads":
        ks = ks[:, :3]
    elif what == "mixed-dtype":
        v = v.float()
    elif what == "width":
        k = torch.cat([k, k], dim=-1)
    with pytest.raises((ValueError, TypeError), match=words):
        cache.append(ks, v, k=k)
    after = snapshot(cache)
    assert after[1] == before[1] and all(torch.equal(after[0][n], before[0][n]) for n in before[0])


def test_bad_attend_names_the_argument():
    x = inputs()
    cache = ExactScalarCache(B, H)
    with pytest.raises(ValueError, match="append first"):
        cache.attend(x["qs"][..., :1], 0.5)
    cache.append(x["ks"][..., :2], x["v"][:, :, :2], k=x["k"][:, :, :2])
    qs, q = x["qs"][..., 1:2].clone(), x["q"][:, :, 1:2]
    with pytest.raises(ValueError, match="q must be"):
        cache.attend(qs, 0.5)  # hybrid cache needs q
    with pytest.raises(ValueError, match="Tq <= 2"):
        cache.attend(x["qs"][..., :3], 0.5, q=x["q"][:, :, :3])
    with pytest.raises(ValueError, match="tau"):
        cache.attend(qs, -1.0, q=q)
    qs[0, 0, 0] = float("nan")
    with pytest.raises(ValueError, match="qs"):
        cache.attend(qs, 0.5, q=q)
