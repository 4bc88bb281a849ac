"""The Attention layer: every configuration runs, and the numbers equal hand-written formulas."""

import math

import pytest
import torch
import torch.nn.functional as F

from attnlab.layers import Attention, AttentionConfig, HeadParam, RotaryEmbedding, Temperature
from attnlab.ops.principled import principled_attention
from attnlab.testing import rel_rms

C, H, T, B = 32, 4, 11, 2
D = C // H

CONFIGS = {
    "softmax": dict(mechanism="softmax"),
    "softmax-gqa-rope": dict(mechanism="softmax", n_kv_heads=2, rope=True),
    "softmax-ktotal": dict(mechanism="softmax", scale="ktotal"),
    "softmax-pnorm": dict(mechanism="softmax", scale="pnorm", p=3.0, n_kv_heads=1),
    "softmax-float-gate": dict(mechanism="softmax", scale=0.2, output_gate="elementwise"),
    "scalar": dict(mechanism="scalar"),
    "scalar-gva": dict(mechanism="scalar", n_value_groups=2, tau="global"),
    "scalar-token-tau-cap": dict(mechanism="scalar", n_value_groups=1, tau="token", tau_max=0.5),
    "scalar-sink-gate": dict(mechanism="scalar", n_value_groups=2, sink=True, output_gate="headwise"),
    "mixed": dict(mechanism="scalar", n_scalar_heads=2, n_value_groups=1, rope=True, n_kv_heads=1),
    "mixed-sink": dict(mechanism="scalar", n_scalar_heads=3, sink=True, tau="token"),
    "hybrid": dict(mechanism="hybrid"),
    "hybrid-gqa-sink-rope": dict(mechanism="hybrid", n_kv_heads=2, sink=True, rope=True, tau="token"),
    "principled-head": dict(mechanism="principled", v0="head"),
    "principled-query-gqa": dict(mechanism="principled", alpha="query", beta="query", gamma="query", v0="layer", n_kv_heads=2),
    "principled-layer-const": dict(mechanism="principled", alpha="layer", beta="constant", gamma="layer", gate_dim=4),
    "cosformer": dict(mechanism="cosformer", output_gate="elementwise"),
    "cosformer-plain": dict(mechanism="cosformer", cosformer_normalize=False, cosformer_max_len=32),
    "gla": dict(mechanism="gla", gla_rank=4, output_gate="headwise"),
    "ssd": dict(mechanism="ssd", rope=True),
    "goat-gqa": dict(mechanism="goat", n_kv_heads=2, goat_rank=3, goat_abs_rank=2, goat_train_len=16),
    "goat-hybrid-token-tau": dict(mechanism="goat_hybrid", tau="token", goat_rank=2, goat_train_len=16),
}


def make(kw, dtype=torch.float64):
    layer = Attention(AttentionConfig(C, H, **kw)).to(dtype)
    with torch.no_grad():  # move zero-initialised extras off zero so they matter in comparisons
        if layer.prefix_keys:
            layer.sink_value.normal_()
        if layer.gate is not None:
            layer.gate.proj.weight.normal_(0, 0.3)
        if hasattr(layer, "prior"):  # GOAT's key-term network starts at ~1e-3 weights: its gradients cancel to ~1e-7
            for prm in (layer.prior.fc1.weight, layer.prior.fc2.weight, layer.prior.bump, layer.prior.lam_asym):
                prm.normal_(0, 0.5)
    return layer


@pytest.mark.parametrize("name", list(CONFIGS))
def test_readout_equals_attention_weights_times_values(name):
    """attention_weights (naive ops, v = I) applied to the layer's own values gives its readout."""
    layer = make(CONFIGS[name])
    x = torch.randn(B, T, C, dtype=torch.float64)
    layer(x, record=True)
    rec, p = layer.last, layer.last.heads
    w = layer.attention_weights(x)
    n_keys = T + layer.prefix_keys
    assert w.shape == (B, H, T, n_keys)
    m, sink = layer.config.mechanism, bool(layer.prefix_keys)
    sv = layer.sink_value if sink else None
    if m == "scalar":  # (values, heads reading them, sink value or None)
        vals = [(p.vs, layer.n_scalar, sv)] + ([(p.v, layer.n_dot, None)] if layer.n_dot else [])
    else:
        vals = [(p.v, H, sv)]
    outs, h0 = [], 0
    for v, n, s_val in vals:
        v = v.repeat_interleave(n // v.shape[1], dim=1)  # (B, n, T, D)
        if sink:  # column 0 of w is the sink: its value, or zero weight for dot-product heads
            first = v.new_zeros(B, n, 1, D) if s_val is None else \
                s_val.repeat_interleave(n // s_val.shape[0], dim=0)[None, :, None, :].expand(B, -1, 1, -1)
            v = torch.cat([first, v], dim=2)
        outs.append(w[:, h0:h0 + n] @ v)
        h0 += n
    expect = torch.cat(outs, dim=1)
    if m == "principled" and p.v0 is not None:
        w0 = 1 - w.sum(-1, keepdim=True)
        expect = expect + w0 * (p.v0 if p.v0.dim() == 1 else p.v0[:, None, :])
    assert rel_rms(rec.readout, expect) < 1e-10
    if m in ("softmax", "scalar", "hybrid"):
        assert torch.allclose(w.sum(-1), torch.ones(B, H, T, dtype=w.dtype))


def _causal_softmax(logits):
    t = logits.shape[-1]
    mask = torch.ones(logits.shape[-2], t, dtype=torch.bool).tril(t - logits.shape[-2])
    return torch.softmax(logits.masked_fill(~mask, float("-inf")), dim=-1)


def test_scalar_gva_equals_hand_written():
    """H = 4 scalar heads in G = 2 value groups, per-head τ, written out from the weights."""
    layer = make(dict(mechanism="scalar", n_value_groups=2))
    with torch.no_grad():
        layer.temperature.raw.copy_(torch.tensor([-2.0, -1.0, 0.0, 1.0]))
    x = torch.randn(B, T, C, dtype=torch.float64)
    qs = (x @ layer.wqs.weight.T).transpose(1, 2)  # (B, H, T)
    ks = (x @ layer.wks.weight.T).transpose(1, 2)
    vs = (x @ layer.wvs.weight.T).view(B, T, 2, D).transpose(1, 2)  # (B, G, T, D)
    tau = F.softplus(layer.temperature.raw) + 1e-6  # (H,)
    heads = []
    for h in range(H):
        logits = -(qs[:, h, :, None] - ks[:, h, None, :]) ** 2 / tau[h]  # (B, T, T)
        heads.append(_causal_softmax(logits) @ vs[:, h // 2])
    o = torch.stack(heads, dim=2).reshape(B, T, H * D)  # (B, T, H*D)
    assert rel_rms(layer(x), o @ layer.wo.weight.T) < 1e-12


def test_mixed_layer_is_concatenation_of_scalar_and_dot_heads():
    """2 scalar heads (1 value group) then 2 RoPE dot-product heads (1 kv head)."""
    layer = make(dict(mechanism="scalar", n_scalar_heads=2, n_value_groups=1, n_kv_heads=1, rope=True))
    x = torch.randn(B, T, C, dtype=torch.float64)
    qs = (x @ layer.wqs.weight.T).transpose(1, 2)
    ks = (x @ layer.wks.weight.T).transpose(1, 2)
    vs = x @ layer.wvs.weight.T  # (B, T, D), one group
    tau = F.softplus(layer.temperature.raw) + 1e-6
    q = (x @ layer.wq.weight.T).view(B, T, 2, D).transpose(1, 2)
    k = (x @ layer.wk.weight.T).view(B, T, 1, D).transpose(1, 2)
    v = x @ layer.wv.weight.T  # (B, T, D)
    rope = RotaryEmbedding(D).double()
    q, k = rope(q), rope(k)
    heads = [_causal_softmax(-(qs[:, h, :, None] - ks[:, h, None, :]) ** 2 / tau[h]) @ vs for h in range(2)]
    heads += [_causal_softmax(q[:, h] @ k[:, 0].transpose(-1, -2) / math.sqrt(D)) @ v for h in range(2)]
    o = torch.stack(heads, dim=2).reshape(B, T, H * D)
    assert rel_rms(layer(x), o @ layer.wo.weight.T) < 1e-12


def test_hybrid_with_sink_equals_hand_written():
    """The sink is one extra key (scalar key sink_key, zero vector key) visible to every query."""
    layer = make(dict(mechanism="hybrid", sink=True, sink_key=0.5, tau="global"))
    x = torch.randn(B, T, C, dtype=torch.float64)
    q = (x @ layer.wq.weight.T).view(B, T, H, D).transpose(1, 2)
    k = (x @ layer.wk.weight.T).view(B, T, H, D).transpose(1, 2)
    v = (x @ layer.wv.weight.T).view(B, T, H, D).transpose(1, 2)
    qs = (x @ layer.wqs.weight.T).transpose(1, 2)
    ks = (x @ layer.wks.weight.T).transpose(1, 2)
    tau = F.softplus(layer.temperature.raw) + 1e-6  # (1,)
    logits = q @ k.transpose(-1, -2) / math.sqrt(D) - (qs[..., :, None] - ks[..., None, :]) ** 2 / tau
    sink_logit = -(qs - 0.5) ** 2 / tau  # zero vector key: no dot-product term
    full = torch.cat([sink_logit[..., None], logits], dim=-1)  # (B, H, T, T+1)
    w = _causal_softmax(full)
    vals = torch.cat([layer.sink_value[None, :, None, :].expand(B, -1, 1, -1), v], dim=2)
    o = (w @ vals).transpose(1, 2).reshape(B, T, H * D)
    assert rel_rms(layer(x), o @ layer.wo.weight.T) < 1e-12
    assert (w[..., 0] > 0).all()


def test_sink_adds_exactly_one_attendable_key():
    layer = make(dict(mechanism="scalar", n_value_groups=2, sink=True))
    x = torch.randn(B, T, C, dtype=torch.float64)
    w = layer.attention_weights(x)  # (B, H, T, T+1)
    assert w.shape == (B, H, T, T + 1)
    assert (w[..., 0] > 0).all()  # every query sees the sink
    causal_zero = torch.ones(T, T, dtype=torch.bool).triu(1)
    assert (w[..., 1:][..., causal_zero] == 0).all()  # and nothing else beyond its causal keys
    no_sink = make(dict(mechanism="scalar", n_value_groups=2))
    assert sum(p.numel() for p in layer.parameters()) - sum(p.numel() for p in no_sink.parameters()) == 2 * D


def test_output_gate_zero_init_starts_at_half():
    for mode, width in (("elementwise", D), ("headwise", 1)):
        gated = Attention(AttentionConfig(C, H, mechanism="gla", output_gate=mode)).double()
        plain = Attention(AttentionConfig(C, H, mechanism="gla")).double()
        plain.load_state_dict({k: v for k, v in gated.state_dict().items() if not k.startswith("gate.")})
        assert (gated.gate.proj.weight == 0).all() and gated.gate.proj.bias is None
        x = torch.randn(B, T, C, dtype=torch.float64)
        gated(x, record=True)
        assert gated.last.gate.shape == (B, H, T, width)
        assert (gated.last.gate == 0.5).all()
        assert rel_rms(gated(x), 0.5 * plain(x)) < 1e-12


def test_output_gate_applies_before_output_projection():
    layer = make(dict(mechanism="softmax", output_gate="elementwise"))
    x = torch.randn(B, T, C, dtype=torch.float64)
    layer(x, record=True)
    rec = layer.last
    g = torch.sigmoid(x @ layer.gate.proj.weight.T).view(B, T, H, D).transpose(1, 2)
    assert rel_rms(rec.gate, g) < 1e-14
    y = (rec.readout * g).transpose(1, 2).reshape(B, T, H * D) @ layer.wo.weight.T
    assert rel_rms(layer(x), y) < 1e-12


def test_prenorm_gate_divides_the_numerator_gate_by_the_normaliser_gate():
    """cosFormer's readout is o / z, so (o ⊙ σ(g)) / (z σ(g')) is the readout times σ(g) / σ(g')."""
    layer = make(dict(mechanism="cosformer", output_gate="prenorm"))
    with torch.no_grad():
        layer.gate.proj.weight.normal_()
    x = torch.randn(B, T, C, dtype=torch.float64)
    layer(x, record=True)
    rec = layer.last
    raw = torch.sigmoid(x @ layer.gate.proj.weight.T).view(B, T, H, D + 1).transpose(1, 2)  # (B, H, T, D + 1)
    g = raw[..., :D] / raw[..., D:]
    assert rel_rms(rec.gate, g) < 1e-14
    y = (rec.readout * g).transpose(1, 2).reshape(B, T, H * D) @ layer.wo.weight.T
    assert rel_rms(layer(x), y) < 1e-12
    fresh = make(dict(mechanism="cosformer", output_gate="prenorm"))
    with torch.no_grad():
        fresh.gate.proj.weight.zero_()
    fresh(x, record=True)
    assert (fresh.last.gate == 1.0).all()  # zero-initialised: starts as the ungated layer
    with pytest.raises(ValueError, match="output_gate.*prenorm.*cosformer"):
        AttentionConfig(C, H, mechanism="gla", output_gate="prenorm")


@pytest.mark.parametrize("param", ["softplus", "log"])
@pytest.mark.parametrize("mode", ["global", "head", "token"])
@pytest.mark.parametrize("tau_max", [None, 0.3])
def test_tau_positive_capped_and_starts_at_init(mode, tau_max, param):
    temp = Temperature(mode, H, C, init=0.07, tau_max=tau_max, param=param).double()
    x = torch.randn(B, T, C, dtype=torch.float64)
    tau0 = temp(x)
    assert tau0.shape == ((B, H, T) if mode == "token" else (H,))
    assert torch.allclose(tau0, torch.full_like(tau0, 0.07))
    for raw in (-1e4, -50.0, 50.0, 1e4):
        with torch.no_grad():
            if mode == "token":
                temp.proj.bias.fill_(raw)
            else:
                temp.raw.fill_(raw)
        tau = temp(x)
        assert torch.isfinite(tau).all() and (tau > 0).all()
        if tau_max is not None:
            assert (tau <= tau_max).all()
    with torch.no_grad():  # gradient survives near the cap (no hard clamp)
        (temp.proj.bias if mode == "token" else temp.raw).fill_(3.0)
    temp.zero_grad()
    temp(x).sum().backward()
    grad = temp.proj.bias.grad if mode == "token" else temp.raw.grad
    assert (grad.abs() > 0).all()


@pytest.mark.parametrize("form", ["constant", "layer", "head", "query"])
@pytest.mark.parametrize("v0", ["zero", "layer", "head"])
def test_principled_parameter_forms_and_shapes(form, v0):
    layer = make(dict(mechanism="principled", alpha=form, beta=form, gamma=form, v0=v0,
                      alpha_init=0.5, beta_init=-1.0, gamma_init=0.25, n_kv_heads=2))
    x = torch.randn(B, T, C, dtype=torch.float64)
    p = layer.project(x)
    shape = {"constant": None, "layer": (H,), "head": (H,), "query": (B, H, T)}[form]
    for name, init in (("alpha", 0.5), ("beta", -1.0), ("gamma", 0.25)):
        val = getattr(p, name)
        if shape is None:
            assert val == init
        else:
            assert val.shape == shape and torch.allclose(val, torch.full_like(val, init))
    n_learned = {"constant": 0, "layer": 1, "head": H, "query": H * D + H}[form]
    assert sum(q.numel() for q in (layer.alpha.parameters())) == n_learned
    assert p.v0 is None if v0 == "zero" else p.v0.shape == ((D,) if v0 == "layer" else (H, D))
    assert p.qg.shape == (B, H, T, D) and p.kg.shape == (B, 2, T, D)
    # the layer calls the op with exactly these tensors
    o = principled_attention(p.q, p.k, p.qg, p.kg, p.v, alpha=p.alpha, beta=p.beta, gamma=p.gamma, v0=p.v0)
    layer(x, record=True)
    assert rel_rms(layer.last.readout, o) < 1e-12


def test_head_param_query_form_reads_the_query():
    hp = HeadParam("query", H, D, init=0.0).double()
    with torch.no_grad():
        hp.weight.normal_()
    q = torch.randn(B, H, T, D, dtype=torch.float64)
    expect = (q * hp.weight[None, :, None, :]).sum(-1)
    assert rel_rms(hp(q), expect) < 1e-14


def test_rope_scores_depend_on_relative_position_only():
    rope = RotaryEmbedding(D).double()
    q = torch.randn(1, 1, 1, D, dtype=torch.float64).expand(1, 1, 6, D)
    k = torch.randn(1, 1, 1, D, dtype=torch.float64).expand(1, 1, 6, D)
    s1 = rope(q) @ rope(k).transpose(-1, -2)
    s2 = rope(q, start_pos=40) @ rope(k, start_pos=40).transpose(-1, -2)
    assert rel_rms(s2, s1) < 1e-12
    full = rope(torch.randn(2, 3, 9, D, dtype=torch.float64))
    assert torch.allclose(rope.angles(4, 5)[0], RotaryEmbedding(D).angles(0, 9)[0][4:])
    assert full.shape == (2, 3, 9, D)


def test_record_carries_graph_for_regularizers():
    layer = make(dict(mechanism="hybrid", sink=True, tau="token"), torch.float32)
    x = torch.randn(B, T, C)
    layer(x, record=True)
    rec = layer.last
    assert rec.qs.shape == (B, H, T + 1) and rec.n_prefix == 1
    assert rec.tau.shape == (B, H, T + 1) and rec.q_score.shape == (B, H, T + 1, D)
    assert rec.qs.requires_grad and rec.ks.requires_grad and rec.tau.requires_grad
    layer(x)
    assert layer.last is rec  # record=False leaves the last record alone


BAD = [
    (dict(n_heads=6, mechanism="scalar", n_value_groups=4, head_dim=8), "n_value_groups"),
    (dict(n_heads=4, mechanism="softmax", n_kv_heads=3), "n_kv_heads"),
    (dict(n_heads=4, mechanism="gla", n_kv_heads=2), "n_kv_heads"),
    (dict(n_heads=4, mechanism="bogus"), "mechanism"),
    (dict(n_heads=4, mechanism="softmax", n_scalar_heads=2), "n_scalar_heads"),
    (dict(n_heads=4, mechanism="scalar", n_scalar_heads=5), "n_scalar_heads"),
    (dict(n_heads=5), "head_dim"),
    (dict(n_heads=4, scale="cube"), "scale"),
    (dict(n_heads=4, scale=-1.0), "scale"),
    (dict(n_heads=4, tau="layer"), "tau"),
    (dict(n_heads=4, mechanism="scalar", tau_init=0.0), "tau_init"),
    (dict(n_heads=4, mechanism="scalar", tau_init=0.5, tau_max=0.2), "tau_max"),
    (dict(n_heads=4, mechanism="softmax", sink=True), "sink"),
    (dict(n_heads=4, mechanism="principled", alpha="token"), "alpha"),
    (dict(n_heads=4, mechanism="principled", v0="query"), "v0"),
    (dict(n_heads=4, output_gate="channel"), "output_gate"),
    (dict(n_heads=4, rope=True, head_dim=7), "rope"),
    (dict(n_heads=4, impl="cuda"), "impl"),
    (dict(n_heads=0), "n_heads"),
]


@pytest.mark.parametrize("kw,field", BAD, ids=[f for _, f in BAD])
def test_bad_config_names_the_field(kw, field):
    with pytest.raises(ValueError, match=rf"AttentionConfig\.{field}\b"):
        AttentionConfig(d_model=C if kw.get("n_heads") != 5 else 33, **kw)


def test_bad_layer_input_raises():
    layer = make(dict(mechanism="softmax"))
    with pytest.raises(ValueError, match="x must be"):
        layer(torch.randn(B, T, C + 1, dtype=torch.float64))
    with pytest.raises(ValueError, match="start_pos"):
        layer.project(torch.randn(B, T, C, dtype=torch.float64), start_pos=-1)
    with pytest.raises(TypeError, match="AttentionConfig"):
        Attention({"d_model": C})


@pytest.mark.parametrize("name", list(CONFIGS))
def test_forward_backward_fast_equals_naive(name):
    """Shapes, finite gradients for x and every parameter, and impl="auto" (the fast ops, sink
    included) against impl="naive" on the output and every gradient."""
    fast = make(CONFIGS[name], torch.float32)
    naive = Attention(AttentionConfig(C, H, **{**CONFIGS[name], "impl": "naive"}))
    naive.load_state_dict(fast.state_dict())
    x, cot = torch.randn(B, T, C), torch.randn(B, T, C)
    runs = []
    for layer in (fast, naive):
        xi = x.clone().requires_grad_()
        y = layer(xi)
        assert y.shape == (B, T, C)
        (y * cot).sum().backward()
        runs.append((y, xi.grad, {n: p.grad for n, p in layer.named_parameters()}))
    (y_f, gx_f, gp_f), (y_n, gx_n, gp_n) = runs
    assert torch.isfinite(gx_f).all() and gx_f.abs().sum() > 0
    assert rel_rms(y_f, y_n) < 1e-4 and rel_rms(gx_f, gx_n) < 1e-4
    for pname, g in gp_f.items():
        assert g is not None and torch.isfinite(g).all(), pname
        assert rel_rms(g, gp_n[pname]) < 1e-4, pname


@pytest.mark.parametrize("init", [0.01, 0.1, 3.0])
def test_tau_slopes_of_the_two_parametrisations(init):
    """dτ/draw at initialisation: τ for the log form (a step moves log τ), 1 − exp(−τ) for softplus,
    which is within 5% of τ at τ ≤ 0.1 and far below it once τ is large."""
    x = torch.zeros(1, 1, C, dtype=torch.float64)
    slopes = {}
    for param in ("softplus", "log"):
        temp = Temperature("global", 1, C, init=init, param=param).double()
        temp(x).sum().backward()
        slopes[param] = temp.raw.grad.item()
    tau = init - 1e-6
    assert slopes["log"] == pytest.approx(tau, rel=1e-6)  # raw was rounded to float32 before .double()
    assert slopes["softplus"] == pytest.approx(-math.expm1(-tau), rel=1e-6)
    if init <= 0.1:
        assert slopes["softplus"] == pytest.approx(slopes["log"], rel=0.05)
    else:
        assert slopes["softplus"] < 0.4 * slopes["log"]


# which mechanisms take the choices only some do: the table the config checked by name before each
# mechanism class declared it (Attention.impls, Attention.prenorm_gate)
TAKES = {"triton": {"scalar", "hybrid", "principled"}, "approx": {"scalar"}, "prenorm": {"cosformer"}}


@pytest.mark.parametrize("choice", sorted(TAKES))
def test_only_the_mechanisms_that_declare_a_choice_take_it(choice):
    from attnlab.layers import MECHANISMS

    took, refused = set(), {}
    for name in MECHANISMS:
        kw = {"output_gate": "prenorm"} if choice == "prenorm" else {"impl": choice}
        try:
            AttentionConfig(d_model=32, n_heads=2, mechanism=name, **kw)
            took.add(name)
        except ValueError as e:
            refused[name] = str(e)
    assert took == TAKES[choice]
    field = "output_gate" if choice == "prenorm" else "impl"
    for name, msg in refused.items():
        assert f"AttentionConfig.{field}" in msg and all(repr(m) in msg for m in TAKES[choice]), (name, msg)
