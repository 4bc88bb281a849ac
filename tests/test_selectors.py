"""Key selectors on one attnlab model (eval.selectors): the window method against decode_window,
every method against exact attention at full budget, Quest's page bound against the logits it
bounds, the kept keys and the tally against per-query brute force, and the windowed_attention
hook they run through (the learned projections' training: test_selector_training.py)."""

from __future__ import annotations

import math

import pytest
import torch

from attnlab.eval.selectors import (
    METHODS, SelectionTally, quest_page_bounds, select_keys,
)
from attnlab.cache.options import KeyRule
from attnlab.eval.window import decode_window
from attnlab.index.keep import IndexedKeep, learned_indices, learned_keep
from attnlab.testing import rel_rms
from attnlab.ops import hybrid_logits, scalar_logits, window_indices, window_mask, windowed_attention
from attnlab.index.projections import SearchProjections
from attnlab.models.decode import key_rule_of

from test_window import _model  # the same tiny LMs (learned positions: no tied keys)

pytestmark = pytest.mark.usefixtures("one_thread")

CONFIGS = [
    ("hybrid", {}),
    ("hybrid", {"sink": True, "sink_key": 0.3, "n_kv_heads": 2}),
    ("scalar", {}),
    ("scalar", {"sink": True, "n_scalar_heads": 2}),
]

IDS = ["hybrid", "hybrid-sink-gqa", "scalar", "scalar-sink-mixed"]


def _projections(model, seed=0):
    """Untrained search projections (one space per head) for every scalar/hybrid layer."""
    layers = [i for i, blk in enumerate(model.blocks) if blk.attn.n_scalar]
    torch.manual_seed(seed)
    return SearchProjections(layers, model.cfg.d_model, 8, groups=model.blocks[layers[0]].attn.n_scalar)


def _tokens(T=28, B=2, seed=1):
    return torch.randint(0, 50, (B, T), generator=torch.Generator().manual_seed(seed))


def _kw(method, model):
    return {"projections": _projections(model)} if method == "learned" else {"page": 4} if method == "quest" else {}


def _untouched(model):
    for blk in model.blocks:
        assert key_rule_of(blk.attn) is None  # no key rule left behind
        assert not blk.attn._forward_pre_hooks


# --------------------------------------------------------------------------- against other routes


@pytest.mark.parametrize("attn,attention", CONFIGS, ids=IDS)
def test_window_method_equals_decode_window(attn, attention):
    model = _model(attn, **attention)
    idx = _tokens()
    x = torch.randn(2, 20, 32, generator=torch.Generator().manual_seed(3))
    layer = model.blocks[0].attn
    for K in (1, 5, 16):
        with torch.no_grad():
            with decode_window(model, K) as rules:
                want, want_w = model(idx)[0], layer.attention_weights(x, rules[0])
            with select_keys(model, "window", K) as rules:
                got, got_w = model(idx)[0], layer.attention_weights(x, rules[0])
        # the same keys (the window method hands them over as indices); a mixed layer reads its
        # weights out through the op, whose two routes round differently
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(got_w, want_w, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("attn,attention", CONFIGS, ids=IDS)
def test_full_budget_is_exact_attention(attn, attention, method):
    model = _model(attn, **attention)
    idx = _tokens()
    with torch.no_grad():
        exact = model(idx)[0]
        for K in (idx.shape[1], 100):
            with select_keys(model, method, K, **_kw(method, model)):
                got = model(idx)[0]
            torch.testing.assert_close(got, exact, rtol=1e-5, atol=1e-5)
        with select_keys(model, method, 3, **_kw(method, model)):
            assert not torch.allclose(model(idx)[0], exact, atol=1e-3)  # a small budget changes something


@pytest.mark.parametrize("method", METHODS)
def test_selection_never_sees_the_future(method):
    model = _model("hybrid", sink=True)
    idx = _tokens(T=40)
    later = idx.clone()
    later[:, 20:] = (later[:, 20:] + 7) % 50
    with torch.no_grad(), select_keys(model, method, 6, **_kw(method, model)):
        a, b = model(idx)[0], model(later)[0]
    assert torch.equal(a[:, :20], b[:, :20])
    assert not torch.equal(a[:, 20:], b[:, 20:])


# --------------------------------------------------------------------------- Quest's bound


@pytest.mark.parametrize("hybrid", [True, False, "gain"], ids=["hybrid", "scalar", "hybrid-gain"])
@pytest.mark.parametrize("n_prefix", [0, 1])
@pytest.mark.parametrize("per_query_tau", [False, True])
@pytest.mark.parametrize("kernel", ["gaussian", "cauchy"])
def test_quest_bound_is_an_upper_bound_on_every_logit_of_its_page(hybrid, n_prefix, per_query_tau, kernel):
    g = torch.Generator().manual_seed(4)
    B, H, T, D, page = 2, 4, 23, 8, 4
    qs, ks = torch.randn(B, H, T, generator=g), torch.randn(B, H, T, generator=g)
    q, k = (torch.randn(B, H, T, D, generator=g), torch.randn(B, 2, T, D, generator=g)) if hybrid else (None, None)
    tau = torch.rand(B, H, T, generator=g) * 0.5 + 0.05 if per_query_tau else torch.tensor([0.05, 0.2, 1.0, 3.0])
    lam = torch.tensor([1.5, -0.7, 0.0, 0.3]) if hybrid == "gain" else None  # a hybrid's learned gain, any sign
    logits = (hybrid_logits(q, k, qs, ks, tau, scalar_scale=lam, kernel=kernel) if hybrid
              else scalar_logits(qs, ks, tau, kernel=kernel))  # (B, H, T, T)
    bound = quest_page_bounds(qs, ks, tau, q, k, page=page, n_prefix=n_prefix, kernel=kernel, lam=lam)
    P = math.ceil((T - n_prefix) / page)
    assert bound.shape == (B, H, T, P)
    for t in range(T):
        for j in range(P):
            keys = [s for s in range(n_prefix + j * page, n_prefix + (j + 1) * page) if s <= t]
            if not keys:  # a page the query cannot see
                assert bool((bound[:, :, t, j] == float("-inf")).all())
                continue
            best = logits[:, :, t, keys].amax(-1)
            assert bool((best <= bound[:, :, t, j] + 1e-5).all()), (t, j)
    # one key per page: the bound is the logit itself (both terms are tight on a point)
    tight = quest_page_bounds(qs, ks, tau, q, k, page=1, n_prefix=n_prefix, kernel=kernel, lam=lam)
    seen = logits[..., n_prefix:] > float("-inf")
    torch.testing.assert_close(tight[seen], logits[..., n_prefix:][seen], rtol=1e-5, atol=1e-5)
    # rows of a chunk are the same rows of the whole
    part = quest_page_bounds(qs, ks, tau, q, k, page=page, n_prefix=n_prefix, rows=(5, 17), kernel=kernel, lam=lam)
    assert torch.equal(part, bound[:, :, 5:17])
    with pytest.raises(ValueError, match="page"):
        quest_page_bounds(qs, ks, tau, q, k, page=0)
    with pytest.raises(ValueError, match="ks must"):
        quest_page_bounds(qs, ks[..., 1:], tau, q, k)
    with pytest.raises(ValueError, match="rows"):
        quest_page_bounds(qs, ks, tau, q, k, rows=(3, T + 1))
    with pytest.raises(ValueError, match="kernel"):
        quest_page_bounds(qs, ks, tau, q, k, kernel="laplace")


def test_quest_bound_scalar_term_is_the_interval_maximum():
    qs = torch.tensor([[[0.0, 0.0, 0.0, 0.0, 5.0, -2.0]]])
    ks = torch.tensor([[[1.0, 3.0, -1.0, 2.0, 4.0, 0.5]]])
    b = quest_page_bounds(qs, ks, 2.0, page=2)  # pages {0, 1}, {2, 3}, {4, 5}
    assert b[0, 0, 1, 0].item() == pytest.approx(-1.0 / 2.0)  # qs 0 below [1, 3]: -(1)^2 / 2
    assert b[0, 0, 3, 1].item() == 0.0  # qs 0 inside [-1, 2]
    assert b[0, 0, 2, 1].item() == pytest.approx(-1.0 / 2.0)  # the page it sits in, over its keys so far: [-1, -1]
    assert b[0, 0, 4, 2].item() == pytest.approx(-(1.0 ** 2) / 2.0)  # qs 5, its page so far holds ks 4
    assert b[0, 0, 5, 2].item() == pytest.approx(-(2.5 ** 2) / 2.0)  # qs -2, page [0.5, 4]


# --------------------------------------------------------------------------- brute force


def _layer_inputs(model, idx):
    inputs = {}
    hooks = [blk.attn.register_forward_pre_hook(lambda m, args, i=i: inputs.__setitem__(i, args[0]))
             for i, blk in enumerate(model.blocks)]
    with torch.no_grad():
        model(idx)
    for h in hooks:
        h.remove()
    return inputs


def _brute_selection(method, K, page, t, cand, b, h, logits, qs, ks, q, k, tau, search, n_prefix):
    """The keys one query reads, past the prefix, by the method's rule, one key at a time."""
    if method == "window":
        return sorted(cand, key=lambda s: (abs(float(qs[b, h, t] - ks[b, h, s])), -s))[:K]
    if method == "oracle":
        return sorted(cand, key=lambda s: -float(logits[b, h, t, s]))[:K]
    if method == "learned":
        sq, sk = search
        return sorted(cand, key=lambda s: -float(sq[b, h, t - n_prefix] @ sk[b, h, s - n_prefix]))[:K]
    pages = {}
    for s in cand:
        pages.setdefault((s - n_prefix) // page, []).append(s)
    tt = float(tau[h] if tau.dim() == 1 else tau[b, h, t])

    def bound(keys):
        lo, hi = min(float(ks[b, h, s]) for s in keys), max(float(ks[b, h, s]) for s in keys)
        d = max(lo - float(qs[b, h, t]), float(qs[b, h, t]) - hi, 0.0)
        out = -d * d / tt
        if q is not None:
            kk = k[b, h // (q.shape[1] // k.shape[1]), keys]  # (n, D)
            qq = q[b, h, t]
            out += float(torch.maximum(qq * kk.amin(0), qq * kk.amax(0)).sum()) / math.sqrt(q.shape[-1])
        return out

    ranked = sorted(pages, key=lambda j: (-bound(pages[j]), -j))[: math.ceil(K / page)]  # ties: the newest page
    return [s for j in ranked for s in pages[j]][:K]


@pytest.mark.parametrize("method", METHODS)
@pytest.mark.parametrize("attn,attention", [CONFIGS[1], CONFIGS[3]], ids=[IDS[1], IDS[3]])
def test_kept_keys_and_tally_equal_brute_force(attn, attention, method):
    """Mass@K and Recall@K from the tally equal a loop over every (query, head) that sees more than K
    keys past the prefix, whose kept keys follow the method's rule one query at a time; and the
    selected attention weights are nonzero on exactly those keys."""
    model = _model(attn, **attention)
    idx = _tokens(T=22, B=1)
    K, page = 5, 3
    kw = {"projections": _projections(model)} if method == "learned" else {"page": page} if method == "quest" else {}
    tally = SelectionTally()
    with torch.no_grad(), select_keys(model, method, K, tally=tally, **kw):
        inputs = _layer_inputs(model, idx)  # what each layer receives under selection
    for i, blk in enumerate(model.blocks):
        layer = blk.attn
        with torch.no_grad():
            qs, ks, _, tau, q, k, p = layer.with_sink(layer.project(inputs[i], 0))
            logits = scalar_logits(qs, ks, tau) if q is None else hybrid_logits(q, k, qs, ks, tau)
            w = torch.softmax(logits, -1)
            search = kw["projections"](i, inputs[i]) if method == "learned" else None
            selected = None
            if method != "learned":  # (learned reads the layer input through a call, not attention_weights)
                with select_keys(model, method, K, **kw) as rules:
                    selected = layer.attention_weights(inputs[i], rules[i])  # (B, H, T, T + p)
        n, mass, recall = 0, 0.0, 0.0
        B, H, T_op = qs.shape
        for b in range(B):
            for h in range(H):
                for t in range(T_op):
                    cand = list(range(p, t + 1))
                    sel = _brute_selection(method, K, page, t, cand, b, h, logits, qs, ks, q, k, tau, search, p)
                    if selected is not None and t >= p:
                        kept = (selected[b, h, t - p] > 0).nonzero().squeeze(-1).tolist()
                        assert kept == sorted(list(range(p)) + sel), (i, b, h, t)
                    if len(cand) <= K:
                        continue
                    best = sorted(cand, key=lambda s: -float(logits[b, h, t, s]))[:K]
                    n += 1
                    mass += float(w[b, h, t, list(range(p)) + sel].sum())
                    recall += len(set(sel) & set(best)) / K
        got = tally.layers[i]
        assert got["n"] == n
        assert got["mass"] == pytest.approx(mass, rel=1e-5)
        assert got["recall"] == pytest.approx(recall, rel=1e-9)
    s = tally.summary()
    assert s["n"] == tally.n and s["mass"] == pytest.approx(tally.mass)


def test_oracle_keeps_at_least_the_mass_of_every_method():
    model = _model("hybrid", sink=True)
    idx = _tokens(T=48)
    result = {}
    for method in METHODS:
        for K in (4, 16):
            tally = SelectionTally()
            with torch.no_grad(), select_keys(model, method, K, tally=tally, **_kw(method, model)):
                model(idx)
            result[method, K] = tally
    for K in (4, 16):
        oracle = result["oracle", K]
        assert oracle.recall == 1.0
        for method in METHODS:
            assert result[method, K].n == oracle.n > 0
            assert oracle.mass >= result[method, K].mass - 1e-6, method
            for i, row in result[method, K].layers.items():  # per layer too
                assert oracle.layers[i]["mass"] >= row["mass"] - 1e-5
        assert result["oracle", 16].mass > result["oracle", 4].mass


# --------------------------------------------------------------------------- arguments and restoring


@pytest.mark.parametrize("case", ["method", "K", "K-bool", "page", "learned-without", "projections-elsewhere",
                                  "projections-groups", "projections-type", "tally", "model-softmax", "model-type"])
def test_bad_input_raises_before_changing_the_model(case):
    model = _model("hybrid", sink=True)
    idx = _tokens()
    with torch.no_grad():
        exact = model(idx)[0]
    wrong_groups = SearchProjections([0, 1], 32, 8, groups=2)
    target, args, kw, err, match = {
        "method": (model, ("topk", 4), {}, ValueError, "method"),
        "K": (model, ("oracle", 0), {}, ValueError, "K must"),
        "K-bool": (model, ("oracle", True), {}, TypeError, "K must"),
        "page": (model, ("quest", 4), {"page": 0}, ValueError, "page"),
        "learned-without": (model, ("learned", 4), {}, ValueError, "projections"),
        "projections-elsewhere": (model, ("oracle", 4), {"projections": _projections(model)}, ValueError, "projections"),
        "projections-groups": (model, ("learned", 4), {"projections": wrong_groups}, ValueError, "projections"),
        "projections-type": (model, ("learned", 4), {"projections": object()}, TypeError, "projections"),
        "tally": (model, ("oracle", 4), {"tally": {}}, TypeError, "tally"),
        "model-softmax": (_model("softmax"), ("oracle", 4), {}, ValueError, "model"),
        "model-type": (torch.nn.Linear(2, 2), ("oracle", 4), {}, TypeError, "model"),
    }[case]
    with pytest.raises(err, match=match):
        with select_keys(target, *args, **kw):
            pass
    _untouched(model)
    with torch.no_grad():
        assert torch.equal(model(idx)[0], exact)


@pytest.mark.parametrize("method", METHODS)
def test_model_restored_after_the_block_and_after_an_exception(method):
    model = _model("hybrid", sink=True)
    idx = _tokens()
    with torch.no_grad():
        exact = model(idx)[0]
        with select_keys(model, method, 3, **_kw(method, model)):
            model(idx)
        _untouched(model)
        assert torch.equal(model(idx)[0], exact)
        with pytest.raises(KeyError, match="inside"):
            with select_keys(model, method, 3, **_kw(method, model)):
                model(idx)
                raise KeyError("inside")
        _untouched(model)
        assert torch.equal(model(idx)[0], exact)


def test_one_key_rule_at_a_time():
    model = _model("hybrid")
    with select_keys(model, "oracle", 4):
        with pytest.raises(ValueError, match="model: layer 0 already"):
            with select_keys(model, "quest", 4):
                pass
    with decode_window(model, 4):
        with pytest.raises(ValueError, match="model: layer 0 already"):
            with select_keys(model, "oracle", 4):
                pass
    with select_keys(model, "oracle", 4):
        with pytest.raises(ValueError, match="select and window/budget are both set"):
            with decode_window(model, 4):
                pass
    _untouched(model)
    with pytest.raises(ValueError, match="select and window/budget are both set"):
        KeyRule(window=4, select=lambda *a: None)  # both in one rule


def test_learned_reads_the_layer_input_only_through_a_call():
    model = _model("hybrid")
    x = torch.randn(1, 12, 32)
    with select_keys(model, "learned", 4, projections=_projections(model)) as rules:
        with pytest.raises(RuntimeError, match="pre-hook"):
            model.blocks[0].attn.attention_weights(x, rules[0])
        model.blocks[0].attn(x)  # a call captures its input


# --------------------------------------------------------------------------- the windowed_attention hook


def test_windowed_attention_keep_fn_hook():
    g = torch.Generator().manual_seed(0)
    B, H, T, D = 2, 4, 23, 8
    qs, ks = torch.randn(B, H, T, generator=g), torch.randn(B, H, T, generator=g)
    v, q, k = torch.randn(B, 2, T, D, generator=g), torch.randn(B, H, T, D, generator=g), torch.randn(B, 2, T, D, generator=g)
    tau = torch.tensor([0.1, 0.3, 1.0, 2.0])
    calls = []

    def keep(a, b, logits):
        calls.append((a, b, tuple(logits.shape), bool(torch.isinf(logits).any())))
        return window_mask(qs[..., a:b], ks[..., :b], 5, n_prefix=1)

    want = windowed_attention(qs, ks, v, tau, 5, q=q, k=k, n_prefix=1, query_chunk=7, impl="naive")
    got = windowed_attention(qs, ks, v, tau, None, q=q, k=k, n_prefix=1, query_chunk=7, keep_fn=keep)
    assert torch.equal(got, want)
    assert [c[:3] for c in calls] == [(a, min(T, a + 7), (B, H, min(T, a + 7) - a, min(T, a + 7))) for a in range(0, T, 7)]
    assert all(c[3] for c in calls)  # hidden keys arrive as -inf logits
    with pytest.raises(ValueError, match="keep_fn replaces"):
        windowed_attention(qs, ks, v, tau, 5, q=q, k=k, keep_fn=keep)
    with pytest.raises(ValueError, match="keep_fn replaces"):
        windowed_attention(qs, ks, v, tau, None, q=q, k=k, budget=6, keep_fn=keep)
    with pytest.raises(TypeError, match="keep_fn"):
        windowed_attention(qs, ks, v, tau, None, keep_fn=3)
    with pytest.raises(ValueError, match="keep_fn must return"):
        windowed_attention(qs, ks, v, tau, None, keep_fn=lambda a, b, logits: (logits > 0.5).float())
    with pytest.raises(ValueError, match="keep_fn must return"):
        windowed_attention(qs, ks, v, tau, None, keep_fn=lambda a, b, logits: torch.ones(1, dtype=torch.bool))
    with pytest.raises(ValueError, match="at least one key"):  # only future keys: nothing a query sees
        windowed_attention(qs, ks, v, tau, None, keep_fn=lambda a, b, logits: logits == float("-inf"))


# --------------------------------------------------------------------------- keys as indices


def _mask_of(idx, ok, T):
    """(B, H, T, T) bool: the keys idx / ok hold."""
    spare = idx.masked_fill(~ok, T)  # unused columns land on a spare column, cut off
    return torch.zeros(*idx.shape[:3], T + 1, dtype=torch.bool).scatter_(-1, spare, True)[..., :T]


@pytest.mark.parametrize("n_prefix", [0, 1, 2])
@pytest.mark.parametrize("K", [1, 5, 40])
def test_learned_indices_are_the_keys_of_learned_keep(n_prefix, K):
    """The same keys as the mask, chunk by chunk, ties included (search vectors rounded to a coarse
    grid tie often), the prefix from its own position on, K beyond the keys a query sees."""
    g = torch.Generator().manual_seed(K + n_prefix)
    B, H, T, d, chunk = 2, 3, 37, 4, 8
    sq, sk = ((torch.randn(B, H, T, d, generator=g) * 2).round() / 2 for _ in range(2))
    idx, ok = learned_indices(sq, sk, K, n_prefix, query_chunk=chunk)
    assert idx.shape == ok.shape == (B, H, T, n_prefix + min(K, T))
    keep = learned_keep(sq, sk, K, n_prefix)
    want = torch.cat([torch.nn.functional.pad(keep(a, b, None), (0, T - b)) for a in range(0, T, chunk)
                      for b in [min(T, a + chunk)]], dim=2)
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    assert torch.equal(_mask_of(idx, ok, T), want & causal)  # the mask keeps the prefix for every row
    assert bool(((idx <= torch.arange(T).view(1, 1, T, 1)) | ~ok).all())


def _op_inputs(hybrid, kernel_seed=0):
    g = torch.Generator().manual_seed(kernel_seed)
    B, H, T, D = 2, 4, 41, 8
    qs, ks = torch.randn(B, H, T, generator=g), torch.randn(B, H, T, generator=g)
    v = torch.randn(B, 2, T, D, generator=g)
    q, k = (torch.randn(B, H, T, D, generator=g), torch.randn(B, 2, T, D, generator=g)) if hybrid else (None, None)
    return qs, ks, v, q, k, torch.tensor([0.1, 0.3, 1.0, 2.0])


@pytest.mark.parametrize("hybrid", [True, False], ids=["hybrid", "scalar"])
@pytest.mark.parametrize("kernel", ["gaussian", "cauchy"])
@pytest.mark.parametrize("rule", ["window", "learned"])
def test_an_indexed_keep_reads_the_selected_keys_only(hybrid, kernel, rule, monkeypatch):
    """windowed_attention reads an IndexedKeep through the selected-keys path without calling its mask;
    outputs and every gradient equal the dense path masked by the same keep_fn (impl="naive"), on
    the compiled CPU kernels and on the PyTorch path."""
    from attnlab.ops.scalar import window_cpu

    qs, ks, v, q, k, tau = _op_inputs(hybrid)
    K, n_prefix = 6, 1
    if rule == "window":
        mask = lambda a, b, logits: window_mask(qs[..., a:b], ks[..., :b], K, n_prefix=n_prefix)  # noqa: E731
        indices = lambda: window_indices(qs, ks, K, n_prefix=n_prefix)  # noqa: E731
    else:
        g = torch.Generator().manual_seed(5)
        sq, sk = (torch.randn(*qs.shape, 4, generator=g) for _ in range(2))
        mask, indices = learned_keep(sq, sk, K, n_prefix), lambda: learned_indices(sq, sk, K, n_prefix)
    calls = []
    counted = IndexedKeep(lambda a, b, logits: calls.append(a) or mask(a, b, logits), indices)
    leaves = [x.clone().requires_grad_() for x in (qs, ks, v, tau) + ((q, k) if hybrid else ())]
    lam = torch.tensor([0.5, 1.0, 2.0, -0.3], requires_grad=True) if hybrid else None

    def run(keep, impl="auto"):
        o = windowed_attention(*leaves[:4], None, q=leaves[4] if hybrid else None, k=leaves[5] if hybrid else None,
                               n_prefix=n_prefix, keep_fn=keep, impl=impl, kernel=kernel, scalar_scale=lam)
        cot = torch.randn(o.shape, generator=torch.Generator().manual_seed(9))
        return o, torch.autograd.grad((o * cot).sum(), leaves + ([lam] if hybrid else []))

    want, want_g = run(mask, "naive")
    for compiled in (True, False):
        with monkeypatch.context() as m:
            if not compiled:
                m.setattr(window_cpu, "available", lambda *a: False)
            got, got_g = run(counted)
        assert not calls  # the selected-keys path: the mask is never built
        # float32 sums in another order, and exp rounded per instruction set: at tau 0.1 the logits reach
        # ~100, so a weight's relative error reaches ~100 * 2^-24 = 6e-6, and an output element near zero
        # (a sum of terms of both signs) may differ relatively by much more: compared in relative RMS
        assert rel_rms(got, want) < 1e-5
        for a, b in zip(got_g, want_g):
            assert rel_rms(a, b) < 1e-5
    ref, _ = run(counted, "naive")  # the reference path masks with the keep function itself
    assert calls and torch.equal(ref, want)


@pytest.mark.parametrize("T", [0, 1, 2])
@pytest.mark.parametrize("n_prefix", [0, 1])
def test_an_indexed_keep_at_the_shortest_lengths(T, n_prefix):
    """T = 0, 1, 2 (fewer keys than K, a sink that is the only key): the indices route gives what the
    dense path masked by the same keep function gives."""
    if T == 0 and n_prefix:
        pytest.skip("a prefix needs a position")
    g = torch.Generator().manual_seed(T)
    qs, ks, v = torch.randn(1, 2, T, generator=g), torch.randn(1, 2, T, generator=g), torch.randn(1, 1, T, 4, generator=g)
    sq, sk = torch.randn(1, 2, T, 3, generator=g), torch.randn(1, 2, T, 3, generator=g)
    keep = IndexedKeep(learned_keep(sq, sk, 3, n_prefix), lambda: learned_indices(sq, sk, 3, n_prefix))
    got = windowed_attention(qs, ks, v, 0.5, None, n_prefix=n_prefix, keep_fn=keep)
    assert got.shape == (1, 2, T, 4)
    torch.testing.assert_close(got, windowed_attention(qs, ks, v, 0.5, None, n_prefix=n_prefix, keep_fn=keep,
                                                       impl="naive"))


def test_bad_indices_are_refused_before_any_work():
    qs, ks, v, q, k, tau = _op_inputs(True)
    B, H, T = qs.shape
    idx, ok = window_indices(qs, ks, 4, n_prefix=1)
    mask = lambda a, b, logits: window_mask(qs[..., a:b], ks[..., :b], 4, n_prefix=1)  # noqa: E731
    future = idx.clone()
    future[:, :, 3, 1] = 10
    nothing = ok.clone()
    nothing[0, 0, 5] = False
    for bad, msg in [((idx.int(), ok), "must return"), ((idx, ok.float()), "must return"),
                     ((idx[:, :, :-1], ok[:, :, :-1]), "must return"), (idx, "must return"),
                     ((idx + T, ok), "outside 0 .. T - 1"), ((future, ok), "after its query"),
                     ((idx, nothing), "at least one key")]:
        with pytest.raises(ValueError, match=msg):
            windowed_attention(qs, ks, v, tau, None, q=q, k=k, n_prefix=1, keep_fn=IndexedKeep(mask, lambda: bad))
    with pytest.raises(ValueError, match="nor a keep_fn without indices"):
        windowed_attention(qs, ks, v, tau, None, q=q, k=k, n_prefix=1, keep_fn=mask, impl="fast")
    fast = windowed_attention(qs, ks, v, tau, None, q=q, k=k, n_prefix=1, keep_fn=IndexedKeep(mask, lambda: (idx, ok)),
                              impl="fast")
    torch.testing.assert_close(fast, windowed_attention(qs, ks, v, tau, 4, q=q, k=k, n_prefix=1))


@pytest.mark.parametrize("method", ["window", "learned"])
@pytest.mark.parametrize("attn,attention", [CONFIGS[1], CONFIGS[3]], ids=[IDS[1], IDS[3]])
def test_a_model_reads_the_same_keys_as_indices_as_through_the_mask(attn, attention, method, monkeypatch):
    """select_keys' window and learned rules through their indices give what masking the dense scores
    with the same rules gives (the route before indices), to float rounding."""
    import attnlab.eval.selectors as selectors

    model, idx = _model(attn, **attention), _tokens()
    kw = _kw(method, model)
    calls = []

    class Counted(IndexedKeep):  # which form of the keys the layers read
        def __call__(self, a, b, logits):
            calls.append("mask")
            return super().__call__(a, b, logits)

        def indices(self):
            calls.append("indices")
            return super().indices()

    monkeypatch.setattr(selectors, "IndexedKeep", Counted)
    with torch.no_grad():
        with select_keys(model, method, 5, **kw):
            got = model(idx)[0]
        assert calls and set(calls) == {"indices"}  # one call per scalar/hybrid layer, no mask built
        with select_keys(model, method, 5, tally=SelectionTally(), **kw):  # a tally reads the dense scores
            calls.clear()
            torch.testing.assert_close(model(idx)[0], got, rtol=1e-5, atol=1e-5)
            assert "indices" not in calls
        monkeypatch.setattr(selectors, "IndexedKeep", lambda mask, indices: mask)
        with select_keys(model, method, 5, **kw):
            want = model(idx)[0]
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_route_benchmark_runs_and_finds_the_routes_equal(tmp_path, monkeypatch):
    """benchmarks/selector_route.py at a tiny size: one row per (rule, K, T), the two routes equal."""
    import json
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "benchmarks"
    monkeypatch.syspath_prepend(str(bench))
    sys.modules.pop("selector_route", None)
    import selector_route

    selector_route.main(["--T", "40", "--K", "4", "--rounds", "1", "--out", str(tmp_path / "r.json")])
    rows = json.loads((tmp_path / "r.json").read_text())["rows"]
    assert [(r["rule"], r["K"], r["T"]) for r in rows] == [("window", 4, 40), ("learned", 4, 40)]
    assert all(r["max_abs_diff"] < 1e-4 and r["mask_s"] > 0 and r["indices_s"] > 0 for r in rows)
