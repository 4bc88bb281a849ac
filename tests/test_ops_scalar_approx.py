"""scalar_attention_approx: against the naive formula on outputs and every gradient (spread and
clustered keys, large and small tau, every tau form, grouped values, awkward T), the stated
elementwise bound with a loose tol, the exact-row fallback, argument errors, and an LM trained
with impl="approx"."""

import math
from pathlib import Path

import pytest
import torch

import attnlab.layers.mechanisms.scalar as scalar_mechanism
import attnlab.ops.scalar.approx as sa
from attnlab.layers import Attention, AttentionConfig
from attnlab.ops import approx_plan, scalar_attention, scalar_attention_approx
from attnlab.testing import compare_fwd_bwd

B, H, DV = 2, 4, 8
TINY = Path(__file__).resolve().parents[1] / "configs" / "tiny.toml"


def _inputs(T, keys="spread", tau_form="per-head", tau=1.0, G=H, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    if keys == "spread":  # uniform over +-3 sqrt(T): a fixed density of keys per unit of the scalar axis
        qs = (torch.rand(B, H, T, generator=g, dtype=dtype) * 2 - 1) * 3 * math.sqrt(T)
        ks = (torch.rand(B, H, T, generator=g, dtype=dtype) * 2 - 1) * 3 * math.sqrt(T)
    else:  # clustered: every key within reach of every query
        qs = torch.randn(B, H, T, generator=g, dtype=dtype) * 0.1
        ks = torch.randn(B, H, T, generator=g, dtype=dtype) * 0.1
    v = torch.randn(B, G, T, DV, generator=g, dtype=dtype)
    if tau_form == "float":
        t = tau
    else:
        shape = (H,) if tau_form == "per-head" else (B, H, T)
        t = tau * (torch.rand(shape, generator=g, dtype=dtype) + 0.5)
    return [x.requires_grad_() if torch.is_tensor(x) else x for x in (qs, ks, v, t)]


def _approx(**kw):
    return lambda qs, ks, v, tau: scalar_attention_approx(qs, ks, v, tau, **kw)


def _naive(qs, ks, v, tau):
    return scalar_attention(qs, ks, v, tau, impl="naive")


def _check(errs, limit=1e-3):
    assert errs and all(e < limit for e in errs.values()), errs


@pytest.mark.parametrize("T", [1, 63, 130], ids=lambda t: f"T={t}")
@pytest.mark.parametrize("keys", ["spread", "clustered"])
@pytest.mark.parametrize("tau", [0.02, 1.0, 50.0], ids=lambda t: f"tau={t}")
def test_runs_match_naive(T, keys, tau):
    """max_window=T forces the sorted-run path whatever width W the keys need."""
    _check(compare_fwd_bwd(_approx(block=16, max_window=T), _naive, _inputs(T, keys, tau=tau)))


@pytest.mark.parametrize("keys", ["spread", "clustered"])
@pytest.mark.parametrize("tau", [0.02, 50.0], ids=lambda t: f"tau={t}")
def test_default_routing_matches_naive(keys, tau):
    """At this length the default routing mostly takes the exact fused path; compared in float64,
    because in float32 the fused path's expanded score loses ~(3 sqrt(T))^2 / tau * 6e-8 in every
    logit on spread keys (its own precision, not the approximation's)."""
    _check(compare_fwd_bwd(_approx(), _naive, _inputs(130, keys, tau=tau, dtype=torch.float64)))


@pytest.mark.parametrize("tau_form, G", [("float", 4), ("per-head", 2), ("per-query", 1), ("per-query", 2)])
def test_tau_forms_and_groups(tau_form, G):
    T = 150  # not a multiple of the block
    _check(compare_fwd_bwd(_approx(block=16), _naive, _inputs(T, tau_form=tau_form, G=G)))


def test_long_spread_keys_use_runs_and_stay_within_tolerance():
    T = 700
    inputs = _inputs(T, tau_form="per-query", G=2)
    plan = approx_plan(*inputs[:2], inputs[3])
    assert plan["window"] <= plan["max_window"]  # this case takes the sorted-run path by default
    _check(compare_fwd_bwd(_approx(), _naive, inputs))


@pytest.mark.parametrize("tol", [1e-1, 1e-3])
def test_error_within_stated_bound(tol):
    """|o - o_exact| <= 2 tol max|v| elementwise, in float64 so rounding cannot hide a violation."""
    T = 160
    for keys, tau in (("spread", 0.3), ("spread", 20.0), ("clustered", 1.0)):
        qs, ks, v, t = (x.detach().double() for x in _inputs(T, keys, tau=tau))
        approx = scalar_attention_approx(qs, ks, v, t, tol=tol, block=8, max_window=T)
        exact = scalar_attention(qs, ks, v, t, impl="naive")
        assert (approx - exact).abs().max() <= 2 * tol * v.abs().max()


def test_failing_queries_get_exact_rows(monkeypatch):
    """A query far from every key of its run has no mass there: its row must come from the exact formula."""
    calls = []

    def spy(out, fail, *args):
        calls.append(int(fail.sum()))
        return exact_rows(out, fail, *args)

    exact_rows = sa._exact_rows
    monkeypatch.setattr(sa, "_exact_rows", spy)
    T = 200
    qs, ks, v, tau = _inputs(T, tau=0.05)
    with torch.no_grad():
        qs[:, :, 150] = ks[:, :, 3] + 0.01  # its nearest key is early; the block's run is elsewhere
        qs[:, :, 5] = 1e3  # no key within reach at all
    _check(compare_fwd_bwd(_approx(block=16, max_window=T), _naive, [qs, ks, v, tau]))
    assert calls and calls[0] > 0


def test_dense_keys_fall_back_to_the_exact_path():
    qs, ks, v, tau = (x.detach() for x in _inputs(256, "clustered"))
    assert approx_plan(qs, ks, tau)["window"] > 256 // 4
    assert torch.equal(scalar_attention_approx(qs, ks, v, tau), scalar_attention(qs, ks, v, tau, impl="fast"))


def _doc_ids(lengths) -> torch.Tensor:
    """(B, T) document ids, one row per entry of lengths."""
    return torch.tensor([[i for i, n in enumerate(row) for _ in range(n)] for row in lengths])


def _alone(lengths):
    """The naive op run on each document of each row alone, put back in place (the reference)."""
    def fn(qs, ks, v, tau):
        def cut(x, b, lo, hi):  # a row's document; a per-head tau (or a float) as it is
            if not torch.is_tensor(x) or x.dim() < 3:
                return x
            return x[b:b + 1, ..., lo:hi] if x.dim() == 3 else x[b:b + 1, :, lo:hi]

        rows = []
        for b, row in enumerate(lengths):
            edges = [sum(row[:i]) for i in range(len(row) + 1)]
            rows.append(torch.cat([_naive(*(cut(x, b, lo, hi) for x in (qs, ks, v, tau)))
                                   for lo, hi in zip(edges[:-1], edges[1:])], dim=2))
        return torch.cat(rows)
    return fn


DOC_LENGTHS = [[5, 1, 63, 61], [130]]  # a one-token document, a row that is one document


@pytest.mark.parametrize("keys, tau", [("spread", 0.3), ("spread", 20.0), ("clustered", 1.0)])
@pytest.mark.parametrize("tau_form", ["per-head", "per-query"])
def test_documents_match_each_document_alone(keys, tau, tau_form):
    """Packed documents (docs) through the sorted runs: another document's keys hidden, outputs and
    every gradient equal to each document alone up to the tolerance."""
    _check(compare_fwd_bwd(_approx(block=16, max_window=130, docs=_doc_ids(DOC_LENGTHS)), _alone(DOC_LENGTHS),
                           _inputs(130, keys, tau_form=tau_form, tau=tau, G=2)))


def test_documents_within_the_bound_exact_rows_and_fallback(monkeypatch):
    """cu_seqlens (B = 1) in float64: within 2 tol max|v| of each document alone; a query far from its
    run gets its exact row, inside its document; dense keys fall back to the exact path with docs."""
    T, tol, lengths = 130, 1e-3, [[5, 1, 63, 61]]
    cu = torch.tensor([0, 5, 6, 69, 130])
    qs, ks, v, t = (x.detach().double() for x in _inputs(T, "spread", tau=0.3))
    qs, ks, v = qs[:1], ks[:1], v[:1]
    approx = scalar_attention_approx(qs, ks, v, t, tol=tol, block=8, max_window=T, cu_seqlens=cu)
    assert (approx - _alone(lengths)(qs, ks, v, t)).abs().max() <= 2 * tol * v.abs().max()
    calls, exact_rows = [], sa._exact_rows
    monkeypatch.setattr(sa, "_exact_rows", lambda out, fail, *a: calls.append(int(fail.sum())) or exact_rows(out, fail, *a))
    qs = qs.clone()
    qs[:, :, 100] = ks[:, :, 80] + 0.01  # its nearest key (of its document) is far from its block's run
    qs[:, :, 3] = 1e3  # no key within reach
    _check(compare_fwd_bwd(_approx(block=16, max_window=T, cu_seqlens=cu), _alone(lengths),
                           [x.requires_grad_() for x in (qs, ks, v, t)]), 1e-6)
    assert calls and calls[0] > 0
    qd, kd, vd, td = (x.detach()[:1] if torch.is_tensor(x) else x for x in _inputs(256, "clustered", tau_form="float"))
    cu = torch.tensor([0, 100, 256])
    assert torch.equal(scalar_attention_approx(qd, kd, vd, td, cu_seqlens=cu),
                       scalar_attention(qd, kd, vd, td, impl="fast", cu_seqlens=cu))


def test_bf16_inputs():
    qs, ks, v, tau = (x.detach() for x in _inputs(300))
    out = scalar_attention_approx(qs.bfloat16(), ks.bfloat16(), v.bfloat16(), tau.bfloat16(), max_window=300)
    ref = scalar_attention(qs.bfloat16().double(), ks.bfloat16().double(), v.bfloat16().double(),
                           tau.bfloat16().double(), impl="naive")
    assert out.dtype == torch.bfloat16
    assert ((out.double() - ref).pow(2).mean().sqrt() / ref.pow(2).mean().sqrt()) < 1e-2


@pytest.mark.parametrize("name", ["qs", "ks", "v", "tau"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf")], ids=["nan", "inf"])
def test_non_finite_inputs_raise(name, bad):
    inputs = dict(zip(("qs", "ks", "v", "tau"), (x.detach().clone() for x in _inputs(20))))
    inputs[name].view(-1)[3] = bad
    with pytest.raises(ValueError, match=name):
        scalar_attention_approx(**inputs)


@pytest.mark.parametrize("kw, exc, match", [
    (dict(tol=0.0), ValueError, "tol"), (dict(tol=1.0), ValueError, "tol"), (dict(tol=-1e-3), ValueError, "tol"),
    (dict(tol=float("nan")), ValueError, "tol"), (dict(tol="1e-4"), TypeError, "tol"), (dict(tol=True), TypeError, "tol"),
    (dict(block=0), ValueError, "block"), (dict(max_window=0), ValueError, "max_window"),
    (dict(tau=-1.0), ValueError, "tau"), (dict(tau=torch.ones(3)), ValueError, "tau"),
    (dict(tau=torch.ones(B, H, 5)), ValueError, "tau"),
    (dict(v=torch.randn(B, 3, 20, DV)), ValueError, "v"), (dict(ks=torch.randn(B, H, 19)), ValueError, "ks"),
    (dict(cu_seqlens=[0, 20]), ValueError, "batch size must be 1"),
    (dict(docs=torch.zeros(B, 19, dtype=torch.long)), ValueError, "docs must have shape"),
    (dict(docs=torch.zeros(B, 20)), TypeError, "docs must be an integer"),
])
def test_bad_arguments_raise(kw, exc, match):
    qs, ks, v, tau = (x.detach() for x in _inputs(20))
    args = {**dict(qs=qs, ks=ks, v=v, tau=tau), **kw}
    with pytest.raises(exc, match=match):
        scalar_attention_approx(**args)


def test_layer_configs():
    x = torch.randn(2, 40, 32)
    for extra in ({}, dict(n_scalar_heads=2, sink=True), dict(n_value_groups=2, tau="token")):
        a = Attention(AttentionConfig(32, 4, mechanism="scalar", impl="approx", **extra))
        b = Attention(AttentionConfig(32, 4, mechanism="scalar", impl="fast", **extra))
        b.load_state_dict(a.state_dict())
        assert torch.allclose(a(x), b(x), atol=1e-5)
    with pytest.raises(ValueError, match="impl.*hybrid"):
        AttentionConfig(32, 4, mechanism="hybrid", impl="approx")
    with pytest.raises(ValueError, match="impl"):
        AttentionConfig(32, 4, mechanism="softmax", impl="approx")


def test_lm_trains_with_approx(tmp_path, monkeypatch):
    """The tiny LM with scalar layers: impl="approx" (forced onto the sorted-run path) follows impl="fast"."""
    from attnlab.train import load_config, train

    calls = []

    def forced(qs, ks, v, tau):
        calls.append(qs.shape[-1])
        return scalar_attention_approx(qs, ks, v, tau, block=4, max_window=qs.shape[-1])

    monkeypatch.setattr(scalar_mechanism, "scalar_attention_approx", forced)
    losses = {}
    for impl in ("fast", "approx"):
        cfg = load_config(TINY, [f"run.out_dir={tmp_path}", "run.threads=1", "model.attn=scalar",
                                 f"model.attention.impl={impl}", "train.steps=4", "train.eval_every=4",
                                 "train.ckpt_every=4", f"run.name={impl}"])
        losses[impl] = [row["loss"] for row in train(cfg)["history"]["train"]]
    assert calls  # the approximate op ran
    assert len(losses["approx"]) == 4 and losses["approx"][-1] < losses["approx"][0]
    assert losses["approx"] == pytest.approx(losses["fast"], rel=1e-4)


def test_decode_steps_match_the_approximate_forward(monkeypatch):
    """Decode steps run the exact ops; the forward (forced onto the sorted runs) agrees with them."""
    def forced(qs, ks, v, tau):
        return scalar_attention_approx(qs, ks, v, tau, block=4, max_window=qs.shape[-1])

    monkeypatch.setattr(scalar_mechanism, "scalar_attention_approx", forced)
    layer = Attention(AttentionConfig(32, 4, mechanism="scalar", impl="approx", n_scalar_heads=2, sink=True,
                                      tau="token")).double()
    x = torch.randn(2, 24, 32, dtype=torch.float64)
    cache = layer.make_cache(2)
    with torch.no_grad():
        y = layer(x)
        ys = torch.cat([layer.step(x[:, t:t + 1], cache) for t in range(x.shape[1])], dim=1)
    assert (ys - y).abs().max() < 1e-10
