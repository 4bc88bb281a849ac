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

MODEL_TYPE = "attnlab"
MODEL_FIELDS = tuple(f.name for f in dataclasses.fields(ModelConfig) if f.init)


class AttnlabConfig(PretrainedConfig):
    """The transformers config of an attnlab model (model_type "attnlab"): the fields of
    `attnlab.models.ModelConfig` (vocab_size, d_model, n_layers, n_heads, attn, attention,
    layer_attention, d_ff, tie_embeddings, norm_eps, pos_embedding, max_seq_len, init_std) plus
    `window`, the default decode window of `generate` (None: exact caches). hidden_size,
    num_hidden_layers, num_attention_heads and max_position_embeddings map to attnlab's names.
    Raises ConfigError (a ValueError) naming model.<key> for anything `attnlab train` would reject,
    ValueError for a window that is not an int >= 1.
    """

    model_type = MODEL_TYPE
    attribute_map = {
        "hidden_size": "d_model",
        "num_hidden_layers": "n_layers",
        "num_attention_heads": "n_heads",
        "max_position_embeddings": "max_seq_len",
    }
    keys_to_ignore_at_inference = ["past_key_values"]

    def __init__(
        self,
        vocab_size: int = 0,
        d_model: int = 64,
        n_layers: int = 2,
        n_heads: int = 4,
        attn="softmax",
        attention: dict | None = None,
        layer_attention: list | None = None,
        d_ff: int = 0,
        tie_embeddings: bool = True,
        norm_eps: float = 1e-5,
        pos_embedding: str = "none",
        max_seq_len: int = 0,
        init_std: float = 0.02,
        window: int | None = None,
        **kwargs,
    ):
        self.vocab_size, self.d_model, self.n_layers, self.n_heads = vocab_size, d_model, n_layers, n_heads
        self.attn = list(attn) if isinstance(attn, (list, tuple)) else attn
        self.attention = dict(attention or {})
        self.layer_attention = [dict(t) for t in (layer_attention or [])]
        self.d_ff, self.tie_embeddings, self.norm_eps = d_ff, tie_embeddings, norm_eps
        self.pos_embedding, self.max_seq_len, self.init_std = pos_embedding, max_seq_len, init_std
        if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
            raise ValueError(f"window must be an int >= 1 or None, got {window!r}")
        self.window = window
        self.model_config()  # ConfigError (a ValueError) naming model.<key> for anything attnlab rejects
        kwargs["tie_word_embeddings"] = tie_embeddings
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
