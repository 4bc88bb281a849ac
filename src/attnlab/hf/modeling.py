"""`AttnlabForCausalLM`: an `attnlab.models.LM` as a transformers `PreTrainedModel` + `GenerationMixin`.

A shell, not a second model: `self.model` is the attnlab LM (weights `model.tok_emb.weight`, ...),
its forward is the LM's forward, and decoding goes through the LM's own caches (`AttnlabCache`).

- forward without a cache: the LM's forward. An `attention_mask` with left padding becomes the LM's
  `doc_ids` (pads and real tokens are separate segments, so the real tokens start at position 0
  with fresh states, exactly as if alone); right padding changes nothing (the model is strictly
  causal: a real token never sees a later pad); anything else (a 0 between 1s) is a ValueError.
  One rule with the cached path below (`attnlab.models.decode.padding_mask`), which takes left padding only.
  `labels` give the LM's own loss (`attnlab.models.lm.token_loss`), shifted here; with
  `num_items_in_batch` (transformers' Trainer, under gradient accumulation) the summed token
  losses divided by it.
- forward with a cache (`generate`, or `use_cache=True`): the next columns go through
  `AttnlabCache.feed`: the prompt in one parallel forward per distinct length (prefill), then one
  step per token; pads enter no cache or state and positions count from each row's first token.
- `generate(..., window=k)` (or `window` in the GenerationConfig or the model config): scalar and
  hybrid layers decode from the sorted scalar cache over the k nearest keys. Beam search is
  rejected up front (attnlab's states cannot be reordered); greedy, sampling, max_new_tokens,
  eos_token_id, stopping criteria and the logits processors work as for any causal LM.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import transformers
from transformers import GenerationConfig, GenerationMixin, PreTrainedModel
from transformers.cache_utils import Cache
from transformers.modeling_outputs import CausalLMOutputWithPast

from attnlab.layers.rope import RotaryEmbedding
from attnlab.models import LM
from attnlab.models.decode import DecodeOptions, padding_mask
from attnlab.models.lm import token_loss

from .cache import AttnlabCache

# transformers 5.24 renamed the decode state from `past_key_values` to `cache` (in forward's
# arguments, generate's and the output classes); attnlab accepts either name and answers in the
# installed version's own.
CACHE_NAME = "cache" if "cache" in getattr(CausalLMOutputWithPast, "__dataclass_fields__", {}) else "past_key_values"
from .configuration import AttnlabConfig

_TF_MAJOR = int(transformers.__version__.split(".")[0])


def padding_doc_ids(attention_mask: torch.Tensor) -> torch.Tensor | None:
    """doc_ids for the LM's forward from a (B, T) 0/1 mask, checked by `padding_mask` (left or right
    padding): None when no row starts with a pad (all real, or right padding: causal attention never
    reads a later pad), else the mask itself (each row's pad runs and its real run become separate
    segments, so the real tokens start at position 0 with fresh states)."""
    m = padding_mask(attention_mask, right=True)
    return m.long() if bool((~m[:, 0] & m.any(1)).any()) else None


class AttnlabPreTrainedModel(PreTrainedModel):
    """The transformers base class of attnlab models: config class, weight initialisation and the
    facts transformers reads (stateful decoding: no assisted decoding; gradient checkpointing sets the
    LM's own flag, which recomputes each block in the backward pass)."""

    config_class = AttnlabConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    _no_split_modules = ["Block"]
    _is_stateful = True  # recurrent and sorted states cannot be rolled back: no assisted decoding
    supports_gradient_checkpointing = True

    def _init_weights(self, module):
        """attnlab's layers initialise their own parameters when built (gates, τ, sinks and priors
        have meaningful starts), and a checkpoint overwrites every one of them. What no checkpoint
        holds is recomputed: RoPE's non-persistent inv_freq, left unset by transformers' meta-device
        loading (transformers >= 5 calls this for it)."""
        if isinstance(module, RotaryEmbedding):
            module.reset_buffers()


class AttnlabForCausalLM(AttnlabPreTrainedModel, GenerationMixin):
    """An `attnlab.models.LM` (as `.model`) as a transformers causal LM: `from_pretrained` /
    `save_pretrained`, `forward` returning CausalLMOutputWithPast, and `generate` decoding through
    attnlab's own caches (`AttnlabCache`): greedy and sampled, left-padded batches decoded as if each
    row were alone, `window=k` for the sorted scalar cache. Beam search and assisted decoding raise,
    since recurrent and sorted states cannot be reordered.
    """

    # tied head: transformers >= 5 maps target -> source, 4.x lists the tied keys
    _tied_weights_keys = {"model.head.weight": "model.tok_emb.weight"} if _TF_MAJOR >= 5 else ["model.head.weight"]

    def __init__(self, config: AttnlabConfig):
        super().__init__(config)
        self.model = LM(config.model_config())
        self.post_init()

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # attnlab makes its own cache (AttnlabCache), never a DynamicCache

    def get_input_embeddings(self):
        """The token embedding (`model.tok_emb`)."""
        return self.model.tok_emb

    def set_input_embeddings(self, value):
        """Replace the token embedding."""
        self.model.tok_emb = value

    def get_output_embeddings(self):
        """The output head (`model.head`), tied to the embedding by default."""
        return self.model.head

    def set_output_embeddings(self, value):
        """Replace the output head."""
        self.model.head = value

    # ------------------------------------------------------------------ forward

    def forward(
        self,
        input_ids: torch.LongTensor | None = None,
        attention_mask: torch.Tensor | None = None,
        past_key_values: Cache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        inputs_embeds: torch.Tensor | None = None,
        logits_to_keep: int = 0,
        return_dict: bool | None = None,
        num_items_in_batch: int | torch.Tensor | None = None,
        **kwargs,
    ):
        """input_ids (B, T) -> CausalLMOutputWithPast(loss, logits (B, T, V), past_key_values).

        attention_mask (B, T) without a cache, (B, past + T) with one. position_ids, if given, are
        not read: positions come from the mask (each row counts from its first real token).
        use_cache=True without past_key_values starts an AttnlabCache (plain forwards, such as
        lm-eval's loglikelihood calls, build none). labels: shifted inside, -100 ignored; the loss is
        their mean cross-entropy, or the sum over num_items_in_batch when that is given (`token_loss`)."""
        if inputs_embeds is not None:
            raise ValueError("inputs_embeds is not supported by attnlab models; pass input_ids")
        for name in ("output_attentions", "output_hidden_states"):
            if kwargs.get(name):
                raise ValueError(f"{name}=True is not supported by attnlab models (use attnlab's own "
                                 f"layer.attention_weights / forward hooks)")
        if kwargs.get("cache") is not None:
            if past_key_values is not None:
                raise ValueError("pass the decode state as cache or as past_key_values, not both")
            past_key_values = kwargs.pop("cache")
        if input_ids is None or input_ids.dim() != 2:
            raise ValueError(f"input_ids must be a (B, T) tensor of token ids, got "
                             f"{None if input_ids is None else tuple(input_ids.shape)}")
        T = input_ids.shape[1]
        if past_key_values is not None and not isinstance(past_key_values, AttnlabCache):
            if past_key_values.get_seq_length() != 0:
                raise TypeError(f"past_key_values must be an AttnlabCache (attnlab's decode state), got a non-empty "
                                f"{type(past_key_values).__name__}")
            past_key_values = None
            use_cache = True
        if past_key_values is None and use_cache:
            past_key_values = AttnlabCache(window=getattr(self.config, "window", None))
        last = logits_to_keep if isinstance(logits_to_keep, int) and logits_to_keep > 0 else None
        if past_key_values is not None:
            mask = None
            if attention_mask is not None:
                want = past_key_values.get_seq_length() + T
                if attention_mask.dim() != 2 or attention_mask.shape != (input_ids.shape[0], want):
                    raise ValueError(f"attention_mask must be (B, past + T) = ({input_ids.shape[0]}, {want}) with a cache, "
                                     f"got {tuple(attention_mask.shape)}")
                mask = attention_mask[:, -T:]
            logits = past_key_values.feed(self.model, input_ids, mask, last=last)
        else:
            doc_ids = None
            if attention_mask is not None:
                if tuple(attention_mask.shape) != tuple(input_ids.shape):
                    raise ValueError(f"attention_mask must have the shape of input_ids {tuple(input_ids.shape)}, "
                                     f"got {tuple(attention_mask.shape)}")
                doc_ids = padding_doc_ids(attention_mask)
            logits = self.model(input_ids, doc_ids=doc_ids)[0]
            if doc_ids is not None:
                logits = logits.masked_fill(~doc_ids.bool()[..., None], 0.0)
            if last is not None:
                logits = logits[:, -last:]
        loss = None
        if labels is not None:
            if labels.shape != input_ids.shape or logits.shape[1] != T:
                raise ValueError(f"labels must have the shape of input_ids {tuple(input_ids.shape)} "
                                 f"(and logits_to_keep=0), got {tuple(labels.shape)}")
            targets = F.pad(labels[:, 1:], (0, 1), value=-100)  # (B, T): the next token, none after the last
            loss = token_loss(logits, targets, num_items_in_batch)  # as LM.forward(input_ids, targets)
        out = CausalLMOutputWithPast(loss=loss, logits=logits, **{CACHE_NAME: past_key_values})
        return out if return_dict is not False else out.to_tuple()

    # ------------------------------------------------------------------ generate

    def generate(self, inputs: torch.Tensor | None = None, generation_config: GenerationConfig | None = None,
                 window: int | None = None, selector=None, compile: bool = False, **kwargs):
        """transformers' generate, decoding through attnlab's caches.

        window (or `generation_config.window`, or `config.window`): the sorted scalar cache's
        window for scalar/hybrid layers. selector (an `attnlab.cache.selected.DecodeSelector`):
        scalar/hybrid layers read the K keys its search projections pick, from an index that grows
        per token (not with a window). compile=True: through static buffers and a compiled step
        (`LM.generate(compile=True)`'s decoder, kept on the model; CUDA graphs on the GPU), sized
        for the prompt plus max_new_tokens (or max_length); unpadded batches, a window but no selector.
        num_beams > 1 is a ValueError (see `AttnlabCache`)."""
        gc = generation_config if generation_config is not None else self.generation_config
        if compile:
            return self._generate_static(inputs, gc, window, selector, generation_config, kwargs)
        if window is None:
            window = getattr(gc, "window", None)
        if window is None and selector is None:
            window = getattr(self.config, "window", None)
        DecodeOptions(window=window, selector=selector).check(self.model)  # bad options: their error, before any work
        beams = kwargs.get("num_beams", getattr(gc, "num_beams", 1)) or 1
        if beams > 1:
            raise ValueError(f"num_beams={beams}: beam search reorders cache rows, which attnlab's decode states "
                             f"(recurrent, sorted scalar) do not support; use greedy decoding or sampling")
        given = kwargs.get("cache", kwargs.get("past_key_values"))
        caching = kwargs.get("use_cache", getattr(gc, "use_cache", True)) is not False
        if selector is not None and (given is not None or not caching):
            raise ValueError("selector decodes through the cache generate makes: pass no cache and leave use_cache on")
        if given is None and caching:
            kwargs.pop("past_key_values", None)
            kwargs[CACHE_NAME] = AttnlabCache(window=window, selector=selector)
        return super().generate(inputs, generation_config=generation_config, **kwargs)

    def _generate_static(self, inputs, gc, window, selector, generation_config, kwargs):
        if selector is not None:
            raise ValueError("compile=True decodes through static buffers: give no selector (pass it to a "
                             "StaticDecoder)")
        if kwargs.get("cache", kwargs.get("past_key_values")) is not None or kwargs.get("use_cache") is False:
            raise ValueError("compile=True decodes through the static cache generate makes: pass no cache and "
                             "leave use_cache on")
        if (kwargs.get("num_beams", getattr(gc, "num_beams", 1)) or 1) > 1:
            raise ValueError("num_beams > 1 is not supported (see AttnlabCache)")
        ids = inputs if inputs is not None else kwargs.get("input_ids")
        if ids is None or ids.dim() != 2:
            raise ValueError("compile=True needs the prompt's input_ids (B, T)")
        new = kwargs.get("max_new_tokens", getattr(gc, "max_new_tokens", None))
        total = ids.shape[1] + new if new is not None else kwargs.get("max_length", getattr(gc, "max_length", None))
        if total is None or total <= ids.shape[1]:
            raise ValueError("compile=True sizes its buffers from max_new_tokens (or max_length): give one")
        kwargs[CACHE_NAME] = AttnlabCache(window=window, static=int(total))
        return super().generate(inputs, generation_config=generation_config, **kwargs)
