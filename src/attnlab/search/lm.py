"""A frozen LM bundled with its tokenizer, and the validated setup shared by training and evaluation.

`prepare` checks everything cheap first (family, layer indices, corpus length) and loads the
weights last, so bad input fails before any heavy work.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from .capture import Packed, load_texts, pack_contexts
from .hf_model import (ModelDims, encoding, load_hf_config, load_model, load_tokenizer, model_dims,
                       resolve_layers, resolve_source, tiny_model)



@dataclass
class FrozenLM:
    """A frozen pretrained causal LM (transformers) with its encode function, EOS id, name and shapes:
    what search training and evaluation run on (not attnlab.models.LM, the trainable model)."""

    model: object
    encode: Callable[[str], list[int]]
    eos_id: int
    name: str
    dims: ModelDims


def tiny_lm(family: str = "llama", n_layers: int = 8, seed: int = 0) -> FrozenLM:
    """A tiny random Llama/Qwen3 with the byte-level encoding of hf_model.byte_encode (ids 3..258; 2 is EOS)."""
    model = tiny_model(family, n_layers=n_layers, seed=seed)
    encode, eos = encoding(model.config)
    return FrozenLM(model, encode, eos, f"tiny-{family}", model_dims(model.config))


def load_lm(spec: str) -> FrozenLM:
    """The frozen model, its tokenizer's encode function and EOS id for a model spec ('smollm2', a hub
    id, a folder or a .gguf file). Raises ValueError for an unsupported model family or a tokenizer
    without an EOS token."""
    source = resolve_source(spec)
    config = load_hf_config(source)
    encode, eos = encoding(config, load_tokenizer(source))
    return FrozenLM(load_model(source), encode, eos, spec, model_dims(config))


def prepare(model: str, layer_sets, corpus: str, split: str, context: int, n_contexts: int, seed: int | None,
            lm: FrozenLM | None = None, check: Callable | None = None) -> tuple[FrozenLM, list[list[int]], Packed]:
    """Validate, pack the corpus into contexts, then load the model (unless `lm` is given).

    layer_sets: a list of layer specs (see resolve_layers), each resolved to indices; `check`, if
    given, is called with the resolved sets and the model's ModelDims before the corpus is read or
    weights are loaded.
    """
    if lm is not None:
        sets = [resolve_layers(s, lm.dims.n_layers) for s in layer_sets]
        if check is not None:
            check(sets, lm.dims)
        packed = pack_contexts(load_texts(corpus, split), lm.encode, lm.eos_id, context, n_contexts, seed)
        return lm, sets, packed
    source = resolve_source(model)
    config = load_hf_config(source)
    dims = model_dims(config)
    sets = [resolve_layers(s, dims.n_layers) for s in layer_sets]
    if check is not None:
        check(sets, dims)
    max_pos = getattr(config, "max_position_embeddings", None)
    if isinstance(max_pos, int) and context > max_pos:
        raise ValueError(f"context={context} exceeds the model's max_position_embeddings={max_pos}")
    encode, eos = encoding(config, load_tokenizer(source))
    packed = pack_contexts(load_texts(corpus, split), encode, eos, context, n_contexts, seed)
    return FrozenLM(load_model(source), encode, eos, model, dims), sets, packed
