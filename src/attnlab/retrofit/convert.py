"""A pretrained Llama / Qwen2 model as an attnlab LM whose chosen layers run another mechanism.

The whole model becomes `attnlab.hf.AttnlabForCausalLM` (an `attnlab.models.LM` inside): embeddings,
RMSNorms (their eps), SwiGLU MLPs (their width), the tied or untied head and, in every layer, the
attention as an attnlab layer that reuses the model's q/k/v/o weights, its GQA layout and its RoPE
(theta). Layers not chosen become attnlab's softmax layer, which computes what the model's own
attention computes. So `generate()` decodes through attnlab's caches and lm-eval scores the result
through the existing HF classes; no second model exists.

The chosen layers start exactly where the math allows (`START`, docs/retrofit.md): a gate at the
identity (2σ(0) = 1), the hybrid's scalar term silent behind a learned gain at 0, GOAT's log-prior
at 0, principled attention near its softmax limit. A `--set` value the user gives wins over these.

Everything that can be checked from the model's config alone (family, RoPE scaling, layer spec,
mechanism, overrides, whether the layer's shapes can carry the model's weights) is checked by
`plan()` before any weight is read.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from attnlab.layers import MECHANISMS, mechanism_class
from attnlab.layers.config import option_keys
from attnlab.models.config import ConfigError, ModelConfig, build_dataclass
from attnlab.search.hf_model import RETROFIT_FAMILIES as FAMILIES  # noqa: F401 (from hf_model.FAMILIES)
from attnlab.search.hf_model import check_family

PRINCIPLED_START = -16.0  # α, β, γ: softplus(−16) ≈ 1.1e-7 (docs/retrofit.md#principled)

# Each start is an option of the layer (docs/retrofit.md#exact-starts): a mechanism whose class reads
# the key (`options`) starts at the values beside it.
START = {
    "scalar_gain": {"scalar_gain": 0.0},  # hybrid: −0·(qs − ks)²/τ, silent, with a nonzero gradient on the gain
    "goat_prior_init": {"goat_width": "extra", "goat_prior_init": "zero", "goat_rope": True},  # goat: its prior at 0
    "alpha_init": {"alpha_init": PRINCIPLED_START, "beta_init": PRINCIPLED_START, "gamma_init": PRINCIPLED_START},
}


class RetrofitError(ValueError):
    """Bad input to a retrofit (family, layers, mechanism, overrides, shapes): one line, before any weights load."""


def start_overrides(mechanism: str, settings: dict) -> dict:
    """The exact (or near) start this mechanism takes in a retrofit, for the fields `settings` leaves unset."""
    start = {}
    if settings.get("output_gate") in ("elementwise", "headwise"):
        start["output_gate_scale"] = 2.0  # 2σ(0) = 1: the identity
    if settings.get("sink") in (True, "true"):
        start["sink_weight"] = 0.0  # w·e^score with w = 0: no mass, a nonzero gradient on w
    reads = mechanism_class(mechanism).options
    for option, values in START.items():
        if option in reads:
            start.update(values)
    return {k: v for k, v in start.items() if k not in settings}


@dataclass
class Plan:
    """What a retrofit builds: the attnlab ModelConfig and where each weight comes from."""

    family: str
    layers: list[int]
    mechanism: str
    model: ModelConfig
    settings: dict = field(default_factory=dict)
    token_ids: dict = field(default_factory=dict)


def _rope(config) -> float:
    """RoPE theta of an HF config (transformers 4.x rope_theta/rope_scaling or 5.x rope_parameters);
    RetrofitError for a scaling type attnlab's RotaryEmbedding does not implement."""
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict) and "rope_theta" in params:
        theta, kind = params["rope_theta"], params.get("rope_type", "default")
    else:
        theta = getattr(config, "rope_theta", 10000.0)
        scaling = getattr(config, "rope_scaling", None) or {}
        kind = scaling.get("rope_type", scaling.get("type", "default"))
    if kind not in (None, "default"):
        raise RetrofitError(f"rope scaling type {kind!r} is not supported (attnlab's RoPE is plain theta^(-2i/D)); "
                            f"retrofit a model without rope scaling")
    return float(theta)


def plan(hf_config, layers, mechanism: str, settings: dict | None = None) -> Plan:
    """Check everything from the HF config alone and return the Plan (RetrofitError naming what is wrong)."""
    from attnlab.search.hf_model import model_dims, resolve_layers

    settings = dict(settings or {})
    check_family(hf_config, "retrofit", RetrofitError)
    family = hf_config.model_type
    if mechanism not in MECHANISMS:
        raise RetrofitError(f"--attn must be one of {MECHANISMS}, got {mechanism!r}")
    if getattr(hf_config, "hidden_act", "silu") != "silu":
        raise RetrofitError(f"hidden_act {hf_config.hidden_act!r} is not supported: attnlab's MLP is SwiGLU (silu)")
    if getattr(hf_config, "mlp_bias", False):
        raise RetrofitError("mlp_bias=True is not supported: attnlab's SwiGLU has no biases")
    if getattr(hf_config, "use_sliding_window", False):
        raise RetrofitError("use_sliding_window=True is not supported: attnlab's softmax layer attends to every key")
    theta = _rope(hf_config)
    dims = model_dims(hf_config)
    L, C, H, D, G = dims.n_layers, dims.d_model, dims.n_heads, dims.head_dim, dims.n_kv_heads
    try:
        chosen = resolve_layers(layers, L)
    except ValueError as e:
        raise RetrofitError(f"--layers: {e}") from None
    bias = bool(getattr(hf_config, "attention_bias", False)) or family == "qwen2"
    fields = set(option_keys())
    owned = {"mechanism", "d_model", "n_heads", "head_dim", "bias"}
    for key in settings:
        if key not in fields or key in owned:
            allowed = sorted(fields - owned)
            raise RetrofitError(f"--set {key}: not a settable AttentionConfig field (the model fixes {sorted(owned)}); "
                                f"allowed: {', '.join(allowed)}")
    base = {"head_dim": D, "n_kv_heads": G, "rope": True, "rope_base": theta, "bias": bias}
    cls = mechanism_class(mechanism)
    reads = set(cls.options)
    new = {k: v for k, v in base.items() if k in reads or k in ("head_dim", "bias")}
    if "rope_base" in reads and "rope" not in reads:  # goat: its own RoPE switch
        new["rope_base"] = theta
    if cls.recurrent:
        new["n_kv_heads"] = H  # the linear family: no grouped keys/values, the model's kv heads are repeated
    if "n_value_groups" in reads:  # grouped value attention (scalar)
        new.pop("n_kv_heads", None)
        new["n_value_groups"] = G  # the scalar heads read the model's value heads in its GQA layout
    new.update(start_overrides(mechanism, settings))
    new.update(settings)
    layer_tables = [dict(new) if i in chosen else dict(base) for i in range(L)]
    attn = [mechanism if i in chosen else "softmax" for i in range(L)]
    raw = dict(vocab_size=hf_config.vocab_size, d_model=C, n_layers=L, n_heads=H, attn=attn,
               layer_attention=layer_tables, d_ff=hf_config.intermediate_size,
               tie_embeddings=bool(getattr(hf_config, "tie_word_embeddings", False)),
               norm_eps=float(hf_config.rms_norm_eps),
               max_seq_len=int(getattr(hf_config, "max_position_embeddings", 0) or 0))
    try:
        cfg = build_dataclass(ModelConfig, raw, "model.")
    except (ConfigError, ValueError, TypeError) as e:
        raise RetrofitError(f"--attn {mechanism} with --set {settings or '{}'}: {e}") from None
    _check_shapes(cfg, chosen, mechanism, C, H, G, D)
    ids = {k: getattr(hf_config, k, None) for k in ("bos_token_id", "eos_token_id", "pad_token_id")}
    return Plan(family, chosen, mechanism, cfg, settings, ids)


# ------------------------------------------------------------------------------------ weights

# attnlab layer weight -> (the HF attention's projection, its kind)
_SOURCES = (("wq", "q_proj", "q"), ("wk", "k_proj", "kv"), ("wv", "v_proj", "kv"), ("wvs", "v_proj", "kv"),
            ("wo", "o_proj", "o"))


def _expected(kind: str, C: int, H: int, G: int, D: int, n_kv: int) -> tuple[int, int]:
    return {"q": (H * D, C), "kv": (n_kv * D, C), "o": (C, H * D)}[kind]


def _check_shapes(cfg: ModelConfig, chosen: list[int], mechanism: str, C: int, H: int, G: int, D: int) -> None:
    """Build the layers on the meta device (no memory) and check that each can take the model's weights."""
    from attnlab.layers import Attention

    configs = cfg.attention_configs()
    for i in chosen:
        ac = configs[i]
        with torch.device("meta"):
            layer = Attention(ac)
        found = [name for name, _, _ in _SOURCES if hasattr(layer, name)]
        if "wo" not in found or not ({"wv", "wvs"} & set(found)):
            raise RetrofitError(f"layer {i}: mechanism {mechanism!r} has no value/output projections to take the model's")
        for name, src, kind in _SOURCES:
            mod = getattr(layer, name, None)
            if mod is None:
                continue
            want = tuple(mod.weight.shape)
            rows, cols = _expected(kind, C, H, G, D, G)
            if want == (rows, cols) or (kind == "kv" and want == (H * D, C)):  # repeated kv heads: fine
                continue
            raise RetrofitError(
                f"layer {i}: mechanism {mechanism!r} with these settings has {name} of shape {want}, which cannot carry "
                f"the model's {src} {(rows, cols)} (head_dim={D}, n_heads={H}, n_kv_heads={G})"
                + ("; goat needs goat_width='extra'" if "goat_width" in layer.options else ""))


def _copy(dst: torch.nn.Linear, src: torch.nn.Linear, D: int, what: str) -> None:
    w, b = src.weight.detach(), None if src.bias is None else src.bias.detach()
    if dst.weight.shape != w.shape:  # kv heads repeated for a mechanism without grouped keys/values
        rep = dst.weight.shape[0] // w.shape[0]
        w = w.view(-1, D, w.shape[1]).repeat_interleave(rep, dim=0).reshape(dst.weight.shape)
        b = None if b is None else b.view(-1, D).repeat_interleave(rep, dim=0).reshape(-1)
    if dst.weight.shape != w.shape:
        raise RetrofitError(f"{what}: shape {tuple(dst.weight.shape)} cannot take {tuple(w.shape)}")
    with torch.no_grad():
        dst.weight.copy_(w)
        if dst.bias is not None:
            dst.bias.copy_(b) if b is not None else dst.bias.zero_()  # Qwen2's o_proj: no bias, a zero one


def load_weights(lm, hf_model, plan_: Plan) -> None:
    """Copy every weight of the HF model into attnlab LM `lm` (built from plan_.model)."""
    src = hf_model.model
    D = plan_.model.attention_configs()[0].head_dim
    with torch.no_grad():
        lm.tok_emb.weight.copy_(src.embed_tokens.weight)
        lm.norm_f.weight.copy_(src.norm.weight)
        if not plan_.model.tie_embeddings:
            lm.head.weight.copy_(hf_model.lm_head.weight)
        for i, (blk, layer) in enumerate(zip(lm.blocks, src.layers)):
            blk.norm1.weight.copy_(layer.input_layernorm.weight)
            blk.norm2.weight.copy_(layer.post_attention_layernorm.weight)
            blk.mlp.w1.weight.copy_(layer.mlp.gate_proj.weight)
            blk.mlp.w3.weight.copy_(layer.mlp.up_proj.weight)
            blk.mlp.w2.weight.copy_(layer.mlp.down_proj.weight)
            for name, proj, _ in _SOURCES:
                if hasattr(blk.attn, name):
                    _copy(getattr(blk.attn, name), getattr(layer.self_attn, proj), D, f"layer {i} {name}")


def new_parameters(lm, plan_: Plan) -> dict[str, torch.nn.Parameter]:
    """Parameters of the chosen layers that the HF model had no counterpart of (gates, scalar
    projections, τ, priors, ...), by name."""
    taken = {name for name, _, _ in _SOURCES}
    out = {}
    for i in plan_.layers:
        for name, p in lm.blocks[i].attn.named_parameters():
            if name.split(".")[0] not in taken:
                out[f"blocks.{i}.attn.{name}"] = p
    return out


def convert(hf_model, layers, mechanism: str | None = None, settings: dict | None = None, seed: int = 0):
    """The retrofitted model: an `attnlab.hf.AttnlabForCausalLM` in eval mode, float32.

    hf_model: a transformers LlamaForCausalLM / Qwen2ForCausalLM. layers: 'middle6', 'all', '3,4'
    or a list of ints, with `mechanism` (a registered name) and `settings` (AttentionConfig fields of
    the new layers, `--set`); or a `Plan` already made from this model's config (`plan`), with
    neither. seed: the random init of the new parameters."""
    from attnlab.hf import AttnlabConfig, AttnlabForCausalLM
    from transformers import GenerationConfig

    if isinstance(layers, Plan):
        if mechanism is not None or settings is not None:
            raise TypeError("convert(hf_model, plan) takes no mechanism or settings: the plan holds them")
        p = layers
    else:
        p = plan(hf_model.config, layers, mechanism, settings)
    ids = {k: v for k, v in p.token_ids.items() if v is not None}
    torch.manual_seed(seed)
    model = AttnlabForCausalLM(AttnlabConfig.from_model_config(p.model, **ids))
    load_weights(model.model, hf_model, p)  # copy_ casts to float32
    model.generation_config = GenerationConfig(**ids)
    model.retrofit_plan = p
    return model.eval()


def logit_error(a: torch.Tensor, b: torch.Tensor) -> float:
    """Relative RMS difference of two logit tensors (`attnlab.testing.rel_rms`)."""
    from attnlab.testing import rel_rms

    return rel_rms(a, b, floor=1e-30)


def principled_logit_bound(start: float = PRINCIPLED_START, max_keys: int = 8192, max_score: float = 30.0) -> float:
    """A bound on the logit shift of principled attention's near start at α = β = γ = `start`
    (docs/retrofit.md#principled): margin amplification adds softplus(α)·log K·(s − γ), the gate
    subtracts up to softplus(β)·softplus(−g) ≤ softplus(β)·(|g| + log 2), and keys below γ move
    at most K·e^γ of mass. Reported for |s|, |g| <= max_score and K <= max_keys."""
    sp = math.log1p(math.exp(start))
    return sp * math.log(max_keys) * (max_score - start) + sp * (max_score + math.log(2)) + max_keys * math.exp(start)
