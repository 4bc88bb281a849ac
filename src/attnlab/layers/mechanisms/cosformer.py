"""mechanism = "cosformer": ReLU feature maps with the cos reweighting cos(π(i − j)/2M) and an
optional normaliser (docs/mechanisms.md#cosformer).

The horizon M is `cosformer_max_len`; without it each forward call takes M = T, and decoding
needs `make_cache(..., max_len=M)` (it equals forward on sequences of length M)."""

from __future__ import annotations

from ...ops import cosformer_attention, cosformer_step
from ..record import Projected
from ..registry import register
from ._recurrent import RecurrentAttention


@register
class CosformerAttention(RecurrentAttention):
    mechanism = "cosformer"
    options = ("cosformer_normalize", "cosformer_max_len", "n_kv_heads", "rope", "rope_base")

    @classmethod
    def model_defaults(cls, max_seq_len: int) -> dict:
        # one fixed horizon M for training and decoding (None would make M the length of each call)
        return {**super().model_defaults(max_seq_len), **({"cosformer_max_len": max_seq_len} if max_seq_len else {})}

    @classmethod
    def horizon(cls, config) -> int | None:
        return config.cosformer_max_len

    def attend(self, p: Projected, values=None, impl: str | None = None):
        c = self.config
        v = p.v if values is None else values
        if p.docs is not None:  # each document's own length is its horizon unless one is configured
            max_len = c.cosformer_max_len
        else:
            max_len = c.cosformer_max_len or max(p.q.shape[2], 1)
        o, _ = cosformer_attention(p.q, p.k, v, causal=True, max_len=max_len, normalize=c.cosformer_normalize,
                                   impl=impl or c.impl, docs=p.docs)
        return o, None

    def init_cache(self, cache, window, max_len) -> None:
        super().init_cache(cache, window, max_len)
        cache.max_len = max_len or self.config.cosformer_max_len
        if cache.max_len is None:
            raise ValueError(
                "max_len is needed to decode cosformer (the horizon M of its cos reweighting): "
                "pass make_cache(..., max_len=M) or set AttentionConfig.cosformer_max_len"
            )

    def chunk_op(self, p: Projected, state, cache):
        c = self.config
        return cosformer_attention(p.q, p.k, p.v, causal=True, max_len=cache.max_len, normalize=c.cosformer_normalize,
                                   initial_state=state, impl=c.impl)

    def step_op(self, q, k, v, p: Projected, state, cache):
        return cosformer_step(q, k, v, state, max_len=cache.max_len, normalize=self.config.cosformer_normalize)
