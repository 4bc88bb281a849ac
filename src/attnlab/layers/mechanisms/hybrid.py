"""mechanism = "hybrid": every head scores q·k/√d − (qs − ks)²/τ (docs/mechanisms.md#hybrid-attention).

The scalar part (projections, τ, sink, the plain or sorted decode cache) is the scalar
mechanism's; this class adds the vector queries/keys to the score and reads the vector values.
As τ → ∞ it is standard scaled dot-product attention.

`scalar_gain` (None by default) adds a learned per-head scale λ on the scalar term,
q·k/√d − λ(qs − ks)²/τ; at λ = 0 the layer is exactly standard attention, yet λ's gradient is not
zero there (docs/retrofit.md). Exact decoding reads every key through the op (and its gain); the sorted
cache, the whole-sequence windows and the key selections carry λ into the scores of the keys they
choose by scalar distance.
"""

from __future__ import annotations

import torch
from torch import nn

from ...cache.kv import KVCache
from ...ops import hybrid_attention
from ..record import Projected
from ..registry import register
from .scalar import SCALAR_OPTIONS, ScalarAttention


@register
class HybridAttention(ScalarAttention):
    mechanism = "hybrid"
    options = (*SCALAR_OPTIONS, "scalar_gain", "n_kv_heads", "rope", "rope_base")
    value_key = "v"

    def build(self, c) -> None:
        super().build(c)
        gain = getattr(c, "scalar_gain", None)  # the learned λ, (H,); None (no parameter) when not configured
        self.register_parameter("scalar_scale", None if gain is None else nn.Parameter(torch.full((self.n_scalar,), float(gain))))

    @classmethod
    def configure(cls, config) -> None:
        config.set_vector_heads(config.n_heads)

    @classmethod
    def scalar_heads(cls, config) -> int:
        return config.n_heads

    @property
    def hybrid_key_dim(self) -> int:
        return self.config.head_dim

    def build_values(self, c) -> None:
        self.build_vectors(c, c.n_heads)

    @property
    def value_groups(self) -> int:
        return self.n_kv

    def project_values(self, x, p: Projected) -> None:
        pass  # the vector values, projected with q and k

    def scalar_values(self, p: Projected):
        return p.v

    def score_vectors(self, p: Projected):
        return p.q, p.k

    def scalar_op(self, qs, ks, vals, tau, q, k, impl, n_prefix: int = 0, docs=None):
        return hybrid_attention(q, k, vals, qs, ks, tau, causal=True, impl=impl, scalar_scale=self.scalar_scale,
                                kernel=self.config.kernel, window=self.config.sliding_window, n_prefix=n_prefix,
                                docs=docs)

    def attention_weights(self, x):
        if self.scalar_scale is not None:  # the readout of identity values, through scalar_op and its gain
            return super(ScalarAttention, self).attention_weights(x)
        return super().attention_weights(x)

    def scalar_cache(self, batch_size: int, window):
        if self.scalar_scale is None or window is not None:  # the sorted cache scales its scores by the gain
            return super().scalar_cache(batch_size, window)
        cache = KVCache(batch_size, window=self.config.sliding_window, keep=int(self.config.sink))  # each step is the op (and its gain) in its offset form
        if self.config.sink:
            cache.append(**self.sink_entry(batch_size))
        return cache

    def attend(self, p: Projected, values=None, impl: str | None = None):
        scal = qs, ks, vals, tau, q, k, n_pre = self.with_sink(p)
        if p.docs is not None:  # packed documents (takes_documents): no sink, no window
            return self.scalar_op(qs, ks, vals if values is None else values, tau, q, k, impl or self.config.impl,
                                  docs=p.docs), scal
        o = self.sink_readout(qs, ks, vals if values is None else values, tau, q, k, impl or self.config.impl, n_pre)
        return o[:, :, n_pre:], scal

    def sink_entry(self, batch_size: int) -> dict:
        entry = super().sink_entry(batch_size)
        entry["k"] = self.sink_value.new_zeros(batch_size, self.n_kv, 1, self.config.head_dim)  # zero sink key vector
        return entry

    def init_cache(self, cache, window, max_len) -> None:
        cache.scalar = self.scalar_cache(cache.batch_size, self.trained_window(cache, window))

    def step_readout(self, p: Projected, cache):
        return self.scalar_step(p, cache)
