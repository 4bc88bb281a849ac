"""L_align, L_spread, L_tau: the fast align path against the T x T formula, and where gradients go."""

import math

import pytest
import torch

from attnlab.layers import Attention, AttentionConfig
from attnlab.regularizers import align_loss, regularization, spread_loss, tau_loss
from attnlab.testing import compare_fwd_bwd, rel_rms

B, H = 2, 4


def _inputs(T, hybrid, tau_form, dtype=torch.float32, ks_shift=0.0, G=2):
    g = torch.Generator().manual_seed(T)
    qs = torch.randn(B, H, T, generator=g, dtype=dtype) + ks_shift
    ks = torch.randn(B, H, T, generator=g, dtype=dtype) + ks_shift
    tau = {"float": 0.3, "head": torch.rand(H, generator=g, dtype=dtype) + 0.05,
           "token": torch.rand(B, H, T, generator=g, dtype=dtype) + 0.05}[tau_form]
    ins = [qs.requires_grad_(), ks.requires_grad_()]
    if isinstance(tau, torch.Tensor):
        tau.requires_grad_()
    q = torch.randn(B, H, T, 8, generator=g, dtype=dtype).requires_grad_() if hybrid else None
    k = torch.randn(B, G, T, 8, generator=g, dtype=dtype).requires_grad_() if hybrid else None
    return ins, tau, q, k


SHAPES = [(1, 0, "pairs"), (63, 0, "pairs"), (130, 0, "pairs"), (63, 1, "queries"), (130, 1, "queries")]


@pytest.mark.parametrize("T,n_prefix,reduction", SHAPES, ids=[f"T{t}-prefix{p}-{r}" for t, p, r in SHAPES])
@pytest.mark.parametrize("hybrid", [False, True], ids=["scalar", "hybrid"])
@pytest.mark.parametrize("tau_form", ["float", "head", "token"])
def test_align_fast_equals_naive(T, n_prefix, reduction, hybrid, tau_form):
    (qs, ks), tau, q, k = _inputs(T, hybrid, tau_form)

    def loss(impl):
        return lambda qs, ks: align_loss(qs, ks, tau, q=q, k=k, n_prefix=n_prefix, reduction=reduction, impl=impl)

    errs = compare_fwd_bwd(loss("fast"), loss("naive"), [qs, ks])
    assert set(errs) == {"out", "grad0", "grad1"}
    assert max(errs.values()) < 1e-4, errs


@pytest.mark.parametrize("impl", ["fast", "naive"])
@pytest.mark.parametrize("hybrid", [False, True], ids=["scalar", "hybrid"])
def test_align_gradient_reaches_only_qs_and_ks(impl, hybrid):
    """stopgrad(w): q, k and τ (the weights' inputs) get no gradient; qs, ks get the analytic one."""
    T = 9
    (qs, ks), tau, q, k = _inputs(T, hybrid, "token", torch.float64)
    loss = align_loss(qs, ks, tau, q=q, k=k, impl=impl)
    loss.backward()
    assert tau.grad is None
    if hybrid:
        assert q.grad is None and k.grad is None
    # d/dqs_t = 2 Σ_s w_ts (qs_t − ks_s) / n_pairs, d/dks_s = −2 Σ_t w_ts (qs_t − ks_s) / n_pairs
    with torch.no_grad():
        logits = -(qs[..., :, None] - ks[..., None, :]) ** 2 / tau[..., None]
        if hybrid:
            logits = logits + q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) / math.sqrt(8)
        logits = logits.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
        w = torch.softmax(logits, -1)
        diff = qs[..., :, None] - ks[..., None, :]
        n = B * H * T * (T + 1) / 2
        assert rel_rms(qs.grad, 2 * (w * diff).sum(-1) / n) < 1e-10
        assert rel_rms(ks.grad, -2 * (w * diff).sum(-2) / n) < 1e-10
        assert abs(loss.item() - (w * diff**2).sum().item() / n) < 1e-12


def test_align_tiny_example_by_hand():
    """T = 2, one head: row 0 sees only itself (distance 0.25); row 1 splits weight 0.5/0.5."""
    qs = torch.tensor([[[0.5, 1.0]]], dtype=torch.float64)
    ks = torch.tensor([[[0.0, 2.0]]], dtype=torch.float64)
    # row 1: logits −(1−0)²/τ and −(1−2)²/τ are equal -> weights 1/2, 1/2; distances 1 and 1
    for impl in ("fast", "naive"):
        loss = align_loss(qs, ks, 1.0, impl=impl)
        assert abs(loss.item() - (0.25 + 0.5 + 0.5) / 3) < 1e-12
        per_query = align_loss(qs, ks, 1.0, impl=impl, reduction="queries")
        assert abs(per_query.item() - (0.25 + 1.0) / 2) < 1e-12


def test_align_fast_stays_accurate_with_large_keys_and_small_tau():
    """|ks| ≈ 10, τ ≈ 0.01 in fp32: centring keeps qs² − 2qs·E[ks] + E[ks²] from cancelling."""
    T = 63
    (qs, ks), tau, _, _ = _inputs(T, False, "head", torch.float32, ks_shift=10.0)
    tau = (torch.full((H,), 0.01) + 0.0).requires_grad_()
    ref = [x.detach().double().requires_grad_() for x in (qs, ks)]
    ref_loss = align_loss(*ref, tau.detach().double(), impl="naive")
    ref_loss.backward()
    loss = align_loss(qs, ks, tau, impl="fast")
    loss.backward()
    assert abs(loss.item() - ref_loss.item()) / ref_loss.item() < 1e-4
    assert rel_rms(qs.grad, ref[0].grad) < 1e-4 and rel_rms(ks.grad, ref[1].grad) < 1e-4


def test_align_bad_input():
    qs, ks = torch.randn(1, 2, 5), torch.randn(1, 2, 5)
    with pytest.raises(ValueError, match="qs and ks"):
        align_loss(qs, ks[..., :4], 1.0)
    with pytest.raises(ValueError, match="q and k"):
        align_loss(qs, ks, 1.0, q=torch.randn(1, 2, 5, 4))
    with pytest.raises(ValueError, match="n_prefix"):
        align_loss(qs, ks, 1.0, n_prefix=5)
    with pytest.raises(ValueError, match="reduction"):
        align_loss(qs, ks, 1.0, reduction="sum")
    with pytest.raises(ValueError, match="tau"):
        align_loss(qs, ks, torch.tensor([1.0, -1.0]))
    with pytest.raises(ValueError, match="impl"):
        align_loss(qs, ks, 1.0, impl="cuda")


def test_spread_gradient_flows_through_values_not_sort_order():
    T = 7
    ks = torch.randn(B, H, T, dtype=torch.float64, requires_grad=True)
    loss = spread_loss(ks, target=(-3.0, 3.0))
    loss.backward()
    targets = torch.linspace(-3, 3, T, dtype=torch.float64)
    order = ks.detach().argsort(-1)
    sorted_ks = ks.detach().gather(-1, order)
    assert abs(loss.item() - ((sorted_ks - targets) ** 2).mean().item()) < 1e-12
    # the permutation is a constant: each key gets 2 (its sorted value − its target) / N
    expect = torch.zeros_like(ks).scatter(-1, order, 2 * (sorted_ks - targets) / ks.numel())
    assert rel_rms(ks.grad, expect) < 1e-12


def test_spread_adaptive_targets_are_detached():
    """Targets mean ± 3σ of the keys carry no gradient: the keys get only 2(sorted − target)/N."""
    T = 9
    ks = (torch.randn(B, H, T, dtype=torch.float64) * 2 + 1).requires_grad_()
    loss = spread_loss(ks)
    loss.backward()
    kd = ks.detach()
    m, s = kd.mean(-1, keepdim=True), kd.std(-1, keepdim=True, unbiased=False)
    targets = m - 3 * s + 6 * s * torch.linspace(0, 1, T, dtype=torch.float64)  # (B, H, T)
    order = kd.argsort(-1)
    sorted_ks = kd.gather(-1, order)
    assert abs(loss.item() - ((sorted_ks - targets) ** 2).mean().item()) < 1e-12
    expect = torch.zeros_like(kd).scatter(-1, order, 2 * (sorted_ks - targets) / kd.numel())
    assert rel_rms(ks.grad, expect) < 1e-12


def test_spread_is_zero_on_a_shuffled_uniform_ladder():
    T = 9
    ladder = torch.linspace(-3, 3, T, dtype=torch.float64)[torch.randperm(T)].view(1, 1, T)
    assert spread_loss(ladder, target=(-3, 3)).item() < 1e-24
    assert spread_loss(ladder, target=(-2, 2)).item() > 0.1


def test_spread_prefix_and_bad_target():
    ks = torch.randn(1, 2, 6)
    assert torch.equal(spread_loss(ks, n_prefix=1), spread_loss(ks[..., 1:]))
    with pytest.raises(ValueError, match="target"):
        spread_loss(ks, target=(1.0, -1.0))
    with pytest.raises(ValueError, match="target"):
        spread_loss(ks, target="uniform")


def test_tau_loss_values():
    tau = torch.tensor([0.0, 1.0, math.e - 1, 3.0])
    assert abs(tau_loss(tau).item() - (0 + math.log(2) + 1 + math.log(4))) < 1e-6
    tok = torch.tensor([[[1.0, 3.0], [0.0, 0.0]]])  # (B=1, H=2, T=2)
    assert abs(tau_loss(tok).item() - (math.log(2) + math.log(4)) / 2) < 1e-6
    with pytest.raises(TypeError, match="tau"):
        tau_loss(0.5)
    with pytest.raises(ValueError, match="tau"):
        tau_loss(torch.ones(2, 2))


def test_regularization_from_layer_records():
    torch.manual_seed(0)
    cfg = dict(d_model=32, n_heads=4)
    hyb = Attention(AttentionConfig(**cfg, mechanism="hybrid", sink=True, tau="token", sink_key=0.2)).double()
    soft = Attention(AttentionConfig(**cfg, mechanism="softmax")).double()
    x = torch.randn(2, 12, 32, dtype=torch.float64)
    hyb(x, record=True)
    soft(x, record=True)
    weights = {"align": 2.0, "spread": 0.5, "tau": 0.1}
    out = regularization([hyb.last, soft.last], weights)
    rec = hyb.last
    # L_align with the sink, from the layer's own weights (sink in column 0), by hand
    w = hyb.attention_weights(x).detach()  # (B, H, T, T+1)
    keys = torch.cat([torch.full_like(rec.heads.ks[..., :1], 0.2), rec.heads.ks], dim=-1)
    dist = (rec.heads.qs[..., :, None] - keys[..., None, :]) ** 2
    n_pairs = 2 * 4 * sum(t + 2 for t in range(12))
    assert abs(out["align"].item() - (w * dist).sum().item() / n_pairs) < 1e-10
    assert abs(out["spread"].item() - spread_loss(rec.heads.ks).item()) < 1e-12
    assert abs(out["tau"].item() - tau_loss(rec.heads.tau).item()) < 1e-12
    total = sum(weights[n] * out[n] for n in weights)
    assert abs(out["total"].item() - total.item()) < 1e-10
    out["total"].backward()
    assert hyb.wqs.weight.grad is not None and hyb.temperature.proj.bias.grad is not None
    assert hyb.wq.weight.grad is None  # align's weights are stop-gradiented; spread/tau do not touch q
    with pytest.raises(ValueError, match="weights"):
        regularization([rec], {"entropy": 1.0})
    assert regularization([soft.last], weights)["total"].item() == 0.0


def test_regularizer_weights_start_late_and_ramp():
    from attnlab.models.config import ConfigError
    from attnlab.train.config import RegularizersConfig

    r = RegularizersConfig(align=1.0, spread=0.5, tau=0.1, spread_start=10, ramp=4)
    assert r.weights_at(0) == {"align": 0.25, "spread": 0.0, "tau": pytest.approx(0.025)}
    assert r.weights_at(3)["align"] == 1.0 and r.weights_at(9)["spread"] == 0.0
    assert [r.weights_at(s)["spread"] for s in (10, 11, 13, 100)] == [0.125, 0.25, 0.5, 0.5]
    assert RegularizersConfig(align=2.0).weights_at(0) == {"align": 2.0, "spread": 0.0, "tau": 0.0}
    with pytest.raises(ConfigError, match="regularizers.spread_start"):
        RegularizersConfig(spread_start=-1)


def test_regularizers_on_a_layer_with_approximate_attention():
    """impl="approx" layers train with every regularizer: L_align uses its exact fast path."""
    from attnlab.layers import Attention, AttentionConfig
    from attnlab.regularizers import regularization

    torch.manual_seed(0)
    layers = [Attention(AttentionConfig(32, 4, mechanism="scalar", impl=impl)) for impl in ("approx", "fast")]
    layers[1].load_state_dict(layers[0].state_dict())
    x = torch.randn(2, 40, 32)
    totals = []
    for layer in layers:
        layer(x, record=True)
        out = regularization([layer.last], {"align": 1.0, "spread": 0.1, "tau": 0.01})
        out["total"].backward()
        totals.append(out["total"].item())
    assert totals[0] == pytest.approx(totals[1], rel=1e-5)
