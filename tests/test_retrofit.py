"""Retrofit: tiny random Llama and Qwen2 models given attnlab layers, with exact starts."""

import json

import pytest
import torch

pytest.importorskip("transformers")

from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config, Qwen3Config  # noqa: E402

import attnlab.hf  # noqa: E402,F401
from attnlab.cli import main  # noqa: E402
from attnlab.layers import Attention, AttentionConfig  # noqa: E402
from attnlab.retrofit import (  # noqa: E402
    RetrofitError, convert, logit_error, new_parameters, plan, principled_logit_bound, save,
)

V = 97


def tiny(family: str, n_layers: int = 3, **kw):
    cls = {"llama": LlamaConfig, "qwen2": Qwen2Config, "qwen3": Qwen3Config}[family]
    cfg = cls(vocab_size=V, hidden_size=64, intermediate_size=96, num_hidden_layers=n_layers, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rope_theta=5000.0, rms_norm_eps=1e-6,
              tie_word_embeddings=family != "llama", bos_token_id=1, eos_token_id=2, **kw)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(cfg, attn_implementation="eager", dtype=torch.float32).eval()
    if family == "qwen2":  # give the q/k/v biases values, so their copy is tested
        with torch.no_grad():
            for layer in model.model.layers:
                for proj in (layer.self_attn.q_proj, layer.self_attn.k_proj, layer.self_attn.v_proj):
                    proj.bias.normal_(std=0.1)
    return model


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def base(request):
    model = tiny(request.param)
    idx = torch.randint(V, (2, 12), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = model(idx).logits
    return model, idx, ref


# mechanism, --set, new parameters whose gradient must be nonzero at the start
EXACT = {
    "softmax": ("softmax", {}, []),
    "gate-elementwise": ("softmax", {"output_gate": "elementwise"}, ["gate.proj.weight"]),
    "gate-headwise": ("softmax", {"output_gate": "headwise"}, ["gate.proj.weight"]),
    "hybrid": ("hybrid", {}, ["scalar_scale"]),
    "hybrid-gate": ("hybrid", {"output_gate": "elementwise"}, ["scalar_scale", "gate.proj.weight"]),
    "hybrid-sink": ("hybrid", {"sink": True}, ["scalar_scale", "sink_weight"]),
    "goat": ("goat", {}, ["prior.lam_sym", "prior.lam_asym", "prior.bump", "prior.slope_raw", "prior.fc2.weight"]),
}


@pytest.mark.parametrize("start", EXACT)
def test_exact_start_equals_original(base, start):
    model, idx, ref = base
    mech, settings, learnable = EXACT[start]
    r = convert(model, "1,2", mech, settings)
    out = r(idx).logits
    assert logit_error(out, ref) < 1e-5
    assert r.config.attn == ["softmax", mech, mech]
    targets = torch.randint(V, idx.shape, generator=torch.Generator().manual_seed(2))
    torch.nn.functional.cross_entropy(out.flatten(0, 1), targets.flatten()).backward()
    new = new_parameters(r.model, r.retrofit_plan)
    for layer in (1, 2):
        for name in learnable:
            g = new[f"blocks.{layer}.attn.{name}"].grad
            assert g is not None and float(g.abs().max()) > 0, name


def test_principled_start_within_stated_error(base):
    model, idx, ref = base
    r = convert(model, "all", "principled")
    with torch.no_grad():
        err = logit_error(r(idx).logits, ref)
    assert err < 1e-5  # measured ~3e-7 relative; the stated bound (docs/retrofit.md) on the logit shift:
    assert principled_logit_bound() < 1e-3


def test_new_parameters_change_the_model(base):
    """The starts are not dead ends: one nudge of the new parameters moves the logits."""
    model, idx, ref = base
    r = convert(model, "1", "hybrid", {"output_gate": "elementwise"})
    with torch.no_grad():
        r.model.blocks[1].attn.scalar_scale.fill_(0.5)
        assert logit_error(r(idx).logits, ref) > 1e-4


def test_sink_start_has_no_mass_and_weight_one_would(base):
    """The retrofit starts a learned sink at weight 0 (sink_weight=0.0, exact); at weight 1 (a plain
    sink key) it would take mass from the model's keys at the hybrid's silent start."""
    model, idx, ref = base
    r = convert(model, "1", "hybrid", {"sink": True})
    assert r.model.blocks[1].attn.config.options.sink_weight == 0.0
    with torch.no_grad():
        assert logit_error(r(idx).logits, ref) < 1e-5
        assert logit_error(convert(model, "1", "hybrid", {"sink": True, "sink_weight": 1.0})(idx).logits, ref) > 1e-3


def test_save_round_trip_and_generate(base, tmp_path):
    model, idx, ref = base
    r = convert(model, "1,2", "hybrid", {"output_gate": "elementwise"})
    out = save(r, tmp_path / "out")
    assert json.loads((out / "retrofit.json").read_text())["mechanism"] == "hybrid"
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert logit_error(loaded(idx).logits, ref) < 1e-5
    prompt = idx[:1, :6]
    want = model.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    got = loaded.generate(prompt, max_new_tokens=6, do_sample=False, pad_token_id=0)
    assert torch.equal(got, want)
    with pytest.raises(RetrofitError, match="not empty"):
        save(r, out)


def test_bad_input_is_one_error_before_weights():
    cfg = tiny("llama", n_layers=2).config
    with pytest.raises(RetrofitError, match="--attn must be one of"):
        plan(cfg, "all", "nope")
    with pytest.raises(RetrofitError, match="--layers"):
        plan(cfg, "middle6", "softmax")
    with pytest.raises(RetrofitError, match="model family 'qwen3'"):
        plan(tiny("qwen3", n_layers=1).config, "all", "softmax")
    with pytest.raises(RetrofitError, match="cannot carry"):
        plan(cfg, "all", "goat", {"goat_width": "shared", "goat_rope": False, "goat_rank": 2})
    with pytest.raises(RetrofitError, match="goat_rank"):
        plan(cfg, "all", "goat", {"goat_width": "shared", "goat_rope": False})
    with pytest.raises(RetrofitError, match="not a settable"):
        plan(cfg, "all", "softmax", {"head_dim": 8})
    with pytest.raises(RetrofitError, match="goat_rank"):
        plan(cfg, "all", "softmax", {"goat_rank": 2})
    scaled = tiny("llama", n_layers=1, rope_scaling={"rope_type": "linear", "factor": 2.0}).config
    with pytest.raises(RetrofitError, match="rope scaling type 'linear'"):
        plan(scaled, "all", "softmax")


def test_cli_writes_folder_and_rejects_bad_input(tmp_path, capsys, monkeypatch):
    src = tmp_path / "llama"
    tiny("llama", n_layers=2).save_pretrained(src)
    out = tmp_path / "out"
    assert main(["retrofit", "--model", str(src), "--layers", "1", "--attn", "softmax",
                 "--set", "output_gate=elementwise", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["attn"] == ["softmax", "softmax"]

    import attnlab.retrofit as rt

    def no_weights(*a, **k):
        raise AssertionError("weights loaded before the input was checked")

    monkeypatch.setattr(rt, "load_source", no_weights)
    for args, msg in [
        (["--attn", "nope"], "--attn must be one of"),
        (["--attn", "softmax", "--layers", "9"], "out of range"),
        (["--attn", "goat", "--layers", "all", "--set", "goat_width=shared"], "goat_rank"),
        (["--attn", "softmax", "--set", "bogus=1"], "unknown AttentionConfig field"),
        (["--attn", "softmax", "--model", str(tmp_path / "missing")], "is not 'smollm2'"),
        (["--attn", "softmax", "--dtype", "float16"], "--dtype must be one of ('float32', 'bfloat16')"),
        (["--attn", "softmax", "--device", "tpu"], "--device must be one of ('auto', 'cpu', 'cuda')"),
        *([(["--attn", "softmax", "--device", "cuda"], "--device is 'cuda' but no CUDA device")]
          if not torch.cuda.is_available() else []),
    ]:
        capsys.readouterr()
        assert main(["retrofit", "--model", str(src), *args, "--out", str(tmp_path / "new")]
                    if "--model" not in args else ["retrofit", *args, "--out", str(tmp_path / "new")]) == 2
        err = capsys.readouterr().err.strip()
        assert err.startswith("error: ") and msg in err and "\n" not in err
    assert main(["retrofit", "--model", str(src), "--attn", "softmax", "--out", str(out)]) == 2
    assert "not empty" in capsys.readouterr().err
    assert not (tmp_path / "new").exists()


def test_layer_options_default_off():
    """The new options leave today's layers as they were: no new parameters unless set."""
    for mech, extra in (("hybrid", {}), ("goat", {"goat_rank": 2}), ("softmax", {})):
        a = Attention(AttentionConfig(d_model=32, n_heads=2, mechanism=mech, output_gate="elementwise", **extra))
        names = {n for n, _ in a.named_parameters()}
        assert "scalar_scale" not in names and (mech != "goat" or a.rope is None)
    torch.manual_seed(0)
    g = Attention(AttentionConfig(d_model=32, n_heads=2, mechanism="softmax", output_gate="elementwise",
                                  output_gate_scale=2.0))
    x = torch.randn(1, 5, 32)
    assert torch.allclose(g.gate(x), torch.ones(1, 2, 5, 16))
    with pytest.raises(ValueError, match="output_gate_scale"):
        AttentionConfig(d_model=32, n_heads=2, output_gate_scale=2.0)
    with pytest.raises(ValueError, match="scalar_gain"):
        AttentionConfig(d_model=32, n_heads=2, mechanism="scalar", scalar_gain=0.0)


@pytest.mark.slow
@pytest.mark.parametrize("attn,settings", [("softmax", {"output_gate": "elementwise"}), ("hybrid", {}), ("goat", {}),
                                           ("principled", {}), ("hybrid", {"sink": True})],
                         ids=["gate", "hybrid", "goat", "principled", "hybrid-sink"])
def test_smollm2_exact_starts(attn, settings):
    from attnlab.retrofit import load_source, plan_source

    source, _ = plan_source("smollm2", "middle6", attn, settings)
    model, tok = load_source(source)
    idx = torch.tensor([tok("def fibonacci(n):\n    if n < 2:\n        return n\n")["input_ids"]])
    with torch.no_grad():
        ref = model(idx).logits
        got = convert(model, "middle6", attn, settings)(idx).logits
    assert logit_error(got, ref) < 1e-4
    assert torch.equal(got[0, -1].argmax(), ref[0, -1].argmax())


@pytest.mark.parametrize("scale", [0.0, 0.7, "tensor"])
def test_hybrid_scalar_scale_fast_equals_naive(scale):
    """hybrid_attention's scalar_scale: fast path equals the naive reference, outputs and every gradient."""
    from attnlab.ops import hybrid_attention
    from attnlab.testing import rel_rms

    g = torch.Generator().manual_seed(0)
    B, H, G, T, D = 2, 4, 2, 9, 8
    q, k, v = (torch.randn(B, n, T, D, generator=g, dtype=torch.float64, requires_grad=True) for n in (H, G, G))
    qs, ks = (torch.randn(B, H, T, generator=g, dtype=torch.float64, requires_grad=True) for _ in range(2))
    tau = torch.rand(H, generator=g, dtype=torch.float64) + 0.5
    lam = torch.rand(H, generator=g, dtype=torch.float64).requires_grad_() if scale == "tensor" else scale
    outs = []
    for impl in ("naive", "fast"):
        o = hybrid_attention(q, k, v, qs, ks, tau, impl=impl, scalar_scale=lam)
        leaves = [q, k, v, qs, ks] + ([lam] if scale == "tensor" else [])
        outs.append([o, *torch.autograd.grad(o.pow(2).sum(), leaves)])
    for a, b in zip(*outs):
        assert rel_rms(b, a) < 1e-10
    if scale == 0.0:  # exactly softmax attention: the scalar inputs get no gradient
        assert float(outs[0][4].abs().max()) == 0.0


@pytest.mark.parametrize("T", [0, 1, 63])
def test_hybrid_scalar_scale_hostile_inputs(T):
    """scalar_scale: NaN/inf, negative, wrong shape or dtype are errors naming it; T = 0, 1, 63 agree
    between the paths; a huge later key never changes an earlier row (causal)."""
    from attnlab.ops import hybrid_attention
    from attnlab.testing import rel_rms

    g = torch.Generator().manual_seed(1)
    B, H, D = 1, 2, 4
    q, k, v = (torch.randn(B, H, T, D, generator=g) for _ in range(3))
    qs, ks = (torch.randn(B, H, T, generator=g) for _ in range(2))
    lam = torch.tensor([0.3, 0.0])
    for bad, words in ((torch.tensor([float("nan"), 1.0]), "scalar_scale"), (torch.tensor([float("inf"), 1.0]), "scalar_scale"),
                       (-0.5, "scalar_scale"), (torch.ones(3), "scalar_scale"), (torch.ones(2, dtype=torch.long), "scalar_scale"),
                       (True, "scalar_scale")):
        with pytest.raises(ValueError, match=words):
            hybrid_attention(q, k, v, qs, ks, 1.0, impl="fast", scalar_scale=bad)
    a = hybrid_attention(q, k, v, qs, ks, 1.0, impl="naive", scalar_scale=lam)
    b = hybrid_attention(q, k, v, qs, ks, 1.0, impl="fast", scalar_scale=lam)
    assert a.shape == (B, H, T, D) and (T == 0 or rel_rms(b, a) < 1e-5)
    if T > 1:
        ks2 = ks.clone()
        ks2[..., -1] = 1e4  # an extreme last key: every earlier row stays as it was
        c = hybrid_attention(q, k, v, qs, ks2, 1.0, impl="fast", scalar_scale=lam)
        assert torch.allclose(c[:, :, :-1], b[:, :, :-1], atol=1e-6)


def test_cli_bf16_original_on_the_cpu(tmp_path):
    """--dtype bfloat16 --device cpu: the original model loads in bf16, the retrofitted one is float32
    and is written (its layers' weights copied from the bf16 original)."""
    src = tmp_path / "llama"
    tiny("llama", n_layers=2).save_pretrained(src)
    out = tmp_path / "out"
    assert main(["retrofit", "--model", str(src), "--layers", "1", "--attn", "hybrid", "--device", "cpu",
                 "--dtype", "bfloat16", "--eval-contexts", "1", "--eval-context", "16", "--out", str(out)]) == 0
    assert json.loads((out / "config.json").read_text())["attn"] == ["softmax", "hybrid"]
