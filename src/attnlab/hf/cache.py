"""`AttnlabCache`: a transformers `Cache` holding attnlab's own decode state, for `generate`.

transformers' caches hold key/value tensors that the model's attention reads back; attnlab's
layers keep what each mechanism needs instead (plain KV, the exact scalar cache of augmented keys,
the sorted scalar cache with its window, recurrent states, GOAT's keys). So this class is a shell
around `attnlab.models.decode.DecodeState`: the model feeds it the next columns of the batch
(`feed`), and generate sees a Cache whose length is the number of columns consumed, pads
included (what generate slices its inputs with). Per-layer state: `layer_caches(i)`.

What a Cache must offer and attnlab's state cannot (rolling back or reordering rows: beam search,
assisted decoding, contrastive search, `crop`) raises `UnsupportedCacheOperation` (a ValueError, as
transformers refuses a cache it cannot crop) naming the method and the generation mode that needs
it, rather than corrupting a state silently; `AttnlabForCausalLM.generate` rejects num_beams > 1 up
front.

Version notes: transformers 4.56 made `Cache` a list of per-layer objects (`layers=`) and 5.x
renamed and moved several methods; this class calls none of the per-layer machinery and overrides
every method generate uses (get_seq_length, get_mask_sizes, is_compileable, reorder_cache, crop,
batch_repeat_interleave, batch_select_indices, reset). `_base_init` is the one version-specific
call. Tested with transformers 4.56.2 and 5.23.0.
"""

from __future__ import annotations

import inspect

import torch
from transformers.cache_utils import Cache

from attnlab.models.decode import DecodeOptions, DecodeState


# the Cache methods attnlab's decode states cannot carry out, and the generation mode that calls each
NEEDED_BY = {"reorder_cache": "beam search (num_beams > 1)", "crop": "assisted decoding (assistant_model, "
             "prompt_lookup_num_tokens)", "batch_select_indices": "contrastive search (penalty_alpha)",
             "batch_repeat_interleave": "repeating the batch's rows once decoding has begun"}


class UnsupportedCacheOperation(ValueError):
    """A transformers Cache method that attnlab's decode states cannot carry out (reordering or rolling
    back rows), naming the method, the generation mode that needs it and what to use instead."""

    def __init__(self, method: str):
        super().__init__(
            f"AttnlabCache.{method} ({NEEDED_BY[method]}): attnlab's decode states (recurrent states, sorted "
            f"scalar caches) cannot be reordered or rolled back, so beam search, assisted decoding and contrastive "
            f"search are not supported; use greedy decoding or sampling (num_beams=1)")
        self.method = method


def _base_init(cache: Cache) -> None:
    """Cache.__init__ across versions: >= 4.56 takes `layers=` (a list of layer objects; attnlab
    keeps none there), older ones take nothing."""
    params = inspect.signature(Cache.__init__).parameters
    if "layers" in params:
        Cache.__init__(cache, layers=[])
    else:  # pragma: no cover - transformers < 4.56
        Cache.__init__(cache)


class AttnlabCache(Cache):
    """Decode state of an attnlab model for a batch (made on the first forward).

    window: scalar/hybrid layers decode from the sorted scalar cache over the `window` nearest
    keys (None: exact caches everywhere). selector: an `attnlab.cache.selected.DecodeSelector`:
    scalar/hybrid layers read the K keys its search projections pick (not with a window). Both
    are checked as `attnlab.models.decode.DecodeOptions` (`options`), against the model on the
    first forward. static=max_len: decode through the model's compiled `StaticDecoder` for that
    many positions instead (`LM.static_decoder`; every key, a trained window through it, or the
    `window` nearest keys): the prompt unpadded, then one token per forward, the last position's
    logits only."""

    is_compileable = False  # generate must not compile the forward: a static cache compiles its own step

    def __init__(self, window: int | None = None, selector=None, static: int | None = None):
        self.options = DecodeOptions(window=window, selector=selector)
        if static is not None and selector is not None:
            raise ValueError("a static cache decodes through static buffers: give no selector")
        _base_init(self)
        self.state: DecodeState | None = None
        self.static, self.decoder, self.seen = static, None, 0

    @property
    def window(self) -> int | None:
        return self.options.window

    @property
    def selector(self):
        return self.options.selector

    def __repr__(self) -> str:
        rows = "empty" if self.state is None else f"batch={self.state.batch_size}, columns={self.state.seen}"
        return f"AttnlabCache({rows}, window={self.window})"

    # ------------------------------------------------------------------ attnlab side

    def feed(self, model, input_ids: torch.Tensor, mask: torch.Tensor | None, last: int | None = None) -> torch.Tensor:
        """Run `model` (an attnlab LM) on the next columns input_ids (B, T), mask (B, T) or None,
        advancing every row's caches -> logits (B, T or last, V); zeros at pad positions."""
        if self.static is not None:
            return self._feed_static(model, input_ids, mask, last)
        if self.state is None:
            self.state = DecodeState(model, input_ids.shape[0], self.options)
        elif input_ids.shape[0] != self.state.batch_size:
            raise ValueError(f"input_ids has batch {input_ids.shape[0]}, this cache holds {self.state.batch_size} rows; "
                             f"use a new cache for a new batch")
        return self.state.feed(input_ids, mask, last=last)

    def _feed_static(self, model, input_ids: torch.Tensor, mask: torch.Tensor | None, last: int | None) -> torch.Tensor:
        B, T = input_ids.shape
        if self.decoder is None:
            if mask is not None and not bool(mask.all()):
                raise ValueError("a static cache (compile=True) decodes unpadded rows: a left-padded batch needs the "
                                 "growing caches (compile=False)")
            if T > 1 and last != 1:
                raise ValueError("a static cache returns the last position's logits only: call with logits_to_keep=1")
            self.decoder = model.static_decoder(B, self.static, self.window)
            logits = self.decoder.prefill(input_ids)
        elif T != 1 or B != self.decoder.batch_size:
            raise ValueError(f"after the prompt a static cache takes one token per row and call, got {tuple(input_ids.shape)}")
        else:
            logits = self.decoder.step(input_ids)
        self.seen += T
        return logits[:, None]  # (B, 1, V)

    def layer_caches(self, layer_idx: int) -> list:
        """The `LayerCache` of layer `layer_idx` of every row group (rows of equal length share one)."""
        return [] if self.state is None else [g.caches[layer_idx] for g in self.state.groups]

    def lengths(self) -> torch.Tensor | None:
        """Real tokens held per row (B,), or None before the first forward."""
        return None if self.state is None else self.state.lengths()

    # ------------------------------------------------------------------ what generate asks of a Cache

    def get_seq_length(self, layer_idx: int | None = 0) -> int:
        """Tokens seen so far (0 before the first forward)."""
        return self.seen if self.static is not None else 0 if self.state is None else self.state.seen

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0, *args, **kwargs) -> tuple[int, int]:
        """(key length, offset) of the attention mask transformers builds for the next forward."""
        return self.get_seq_length() + query_length, 0

    def get_max_length(self, layer_idx: int | None = None) -> int:
        """-1: no maximum length (the caches grow, or stay bounded by their window)."""
        return -1

    def __len__(self) -> int:
        return 0 if self.state is None else len(self.state.model.blocks)

    @property
    def is_initialized(self) -> bool:
        return self.state is not None or self.decoder is not None

    @property
    def is_croppable(self) -> bool:
        return False

    @property
    def batch_size(self) -> int:
        if self.decoder is not None:
            return self.decoder.batch_size
        return -1 if self.state is None else self.state.batch_size

    def reset(self) -> None:
        """Drop the decode state; the next forward starts a new one."""
        self.state, self.decoder, self.seen = None, None, 0

    def reorder_cache(self, beam_idx: torch.LongTensor):
        """Not supported (beam search): raises UnsupportedCacheOperation."""
        raise UnsupportedCacheOperation("reorder_cache")

    def crop(self, max_length: int):
        """Not supported (assisted decoding): raises UnsupportedCacheOperation."""
        raise UnsupportedCacheOperation("crop")

    def batch_repeat_interleave(self, repeats: int):
        """Allowed before the first forward only (then a no-op: the state is made for the batch the
        forward brings); raises UnsupportedCacheOperation after it."""
        if self.is_initialized:
            raise UnsupportedCacheOperation("batch_repeat_interleave")

    def batch_select_indices(self, indices: torch.Tensor):
        """Not supported (contrastive search): raises UnsupportedCacheOperation."""
        raise UnsupportedCacheOperation("batch_select_indices")
