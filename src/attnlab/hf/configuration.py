"""`AttnlabConfig`: an `attnlab.models.ModelConfig` as a transformers config (model_type "attnlab").

The ModelConfig's fields are stored under their own names (d_model, n_layers, n_heads, attn,
attention, layer_attention, ...), so config.json reads like attnlab's TOML `[model]` table; the
standard transformers names (hidden_size, num_hidden_layers, num_attention_heads,
max_position_embeddings) are aliases of them. Every registered mechanism and every per-layer list
that attnlab accepts is accepted here: the config is checked by `ModelConfig` itself, so an unknown
mechanism is the same error naming model.attn that `attnlab train` gives.

`window` (optional) is the default decode window of the sorted scalar cache for `generate`; it
may also be given per call (`generate(..., window=64)`) or in a GenerationConfig.
"""

from __future__ import annotations

import dataclasses

from transformers import PretrainedConfig

from attnlab.models.config import ModelConfig, build_dataclass
from attnlab.models.decode import DecodeOptions

MODEL_TYPE = "attnlab"
MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.init)


def _defaults() -> dict:
    """ModelConfig's init fields and their defaults (a fresh list or dict for a table field)."""
    out = {}
    for f in dataclasses.fields(ModelConfig):
        if f.init:
            out[f.name] = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    return out


def _copied(value):
    """A copy of a config value that shares no list or dict with the caller's (tuples become lists)."""
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_copied(v) for v in value]
    return value


class AttnlabConfig(PretrainedConfig):
    """The transformers config of an attnlab model (model_type "attnlab"): every init field of
    `attnlab.models.ModelConfig` as a keyword with its default (vocab_size, d_model, n_layers,
    n_heads, attn, attention, layer_attention, ...; None for a table or list field takes its empty
    default), plus `window`, the default decode window of `generate` (None: exact caches).
    hidden_size, num_hidden_layers, num_attention_heads and max_position_embeddings map to attnlab's
    names. Raises ConfigError (a ValueError) naming model.<key> for anything `attnlab train` would
    reject, ValueError for a window that is not an int >= 1.
    """

    model_type = MODEL_TYPE
    attribute_map = {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "max_position_embeddings": "max_seq_len",
    }
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(self, *, window: int | None = None, **kwargs):
        for name, default in _defaults().items():
            value = kwargs.pop(name, default)
            if value is None and isinstance(default, (list, dict)):
                value = default
            setattr(self, name, _copied(value))
        self.window = DecodeOptions(window=window).window  # ValueError unless an int >= 1 or None
        self.model_config()  # ConfigError (a ValueError) naming model.<key> for anything attnlab rejects
        kwargs["tie_word_embeddings"] = self.tie_embeddings
        kwargs.setdefault("use_cache", True)
        super().__init__(**kwargs)

    def model_config(self) -> ModelConfig:
        """The attnlab ModelConfig these fields describe (checked as `attnlab train` checks it)."""
        return build_dataclass(ModelConfig, {name: getattr(self, name) for name in MODEL_FIELDS}, "model.")

    @classmethod
    def from_model_config(cls, cfg: ModelConfig, **kwargs) -> "AttnlabConfig":
        """The transformers config of an attnlab ModelConfig (token ids etc. in kwargs)."""
        if not isinstance(cfg, ModelConfig):
            raise TypeError(f"cfg must be an attnlab ModelConfig, got {type(cfg).__name__}")
        plain = {name: getattr(cfg, name) for name in MODEL_FIELDS}
        return cls(**plain, **kwargs)
