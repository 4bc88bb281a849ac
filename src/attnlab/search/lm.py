"""A frozen LM bundled with its tokenizer, and the validated setup shared by training and evaluation.

`prepare` checks everything cheap first (family, layer indices, corpus length) and loads the
weights last, so bad input fails before any heavy work. The model loads on the device and in the
dtype asked for (`hf_model.resolve_device` / `resolve_dtype`); everything downstream follows it
(`hf_model.model_device`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

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


def tiny_lm(family: str = "llama", n_layers: int = 8, seed: int = 0, device=None,
            dtype: torch.dtype = torch.float32) -> FrozenLM:
    """A tiny random Llama/Qwen3 with the byte-level encoding of hf_model.byte_encode (ids 3..258; 2 is EOS),
    moved to `device` (None: the CPU) in `dtype` (the same random weights, rounded)."""
    model = tiny_model(family, n_layers=n_layers, seed=seed)
    if device is not None or dtype != torch.float32:
        model = model.to(device=device, dtype=dtype)
    encode, eos = encoding(model.config)
    return FrozenLM(model, encode, eos, f"tiny-{family}", model_dims(model.config))


def load_lm(spec: str, device=None, dtype: torch.dtype = torch.float32) -> FrozenLM:
    """The frozen model, its tokenizer's encode function and EOS id for a model spec ('smollm2', a hub
    id, a folder or a .gguf file); the weights load in `dtype` on `device` (None: the CPU). Raises
    ValueError for an unsupported model family or a tokenizer without an EOS token."""
    source = resolve_source(spec)
    config = load_hf_config(source)
    encode, eos = encoding(config, load_tokenizer(source))
    return FrozenLM(load_model(source, dtype, device), encode, eos, spec, model_dims(config))


def prepare(model: str, layer_sets, corpus: str, split: str, context: int, n_contexts: int, seed: int | None,
            lm: FrozenLM | None = None, check: Callable | None = None, device=None,
            dtype: torch.dtype = torch.float32) -> tuple[FrozenLM, list[list[int]], Packed]:
    """Validate, pack the corpus into contexts, then load the model (unless `lm` is given).

    layer_sets: a list of layer specs (see resolve_layers), each resolved to indices; `check`, if
    given, is called with the resolved sets and the model's ModelDims before the corpus is read or
    weights are loaded. device, dtype: where and in which dtype the weights load (None: the CPU);
    a given `lm` stays where it is. The packed contexts stay on the CPU.
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
    return FrozenLM(load_model(source, dtype, device), encode, eos, model, dims), sets, packed
