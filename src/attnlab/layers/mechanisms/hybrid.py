"""mechanism = "hybrid": every head scores q·k/√d − (qs − ks)²/τ (docs/mechanisms.md#hybrid-attention).

The scalar part (projections, τ, sink, the plain or sorted decode cache) is the scalar
mechanism's; this class adds the vector queries/keys to the score and reads the vector values.
As τ → ∞ it is standard scaled dot-product attention.
"""

from __future__ import annotations

from ...ops import hybrid_attention
from ..record import Projected
from . import register
from .scalar import SCALAR_OPTIONS, ScalarAttention


@register
class HybridAttention(ScalarAttention):
    mechanism = "hybrid"
    options = (*SCALAR_OPTIONS, "n_kv_heads", "rope", "rope_base")
    value_key = "v"

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

    def scalar_op(self, qs, ks, vals, tau, q, k, impl):
        return hybrid_attention(q, k, vals, qs, ks, tau, causal=True, impl=impl)

    def attend(self, p: Projected, values=None, impl: str | None = None):
        scal = qs, ks, vals, tau, q, k, n_pre = self.with_sink(p)
        o = self.scalar_readout(qs, ks, vals if values is None else values, tau, q, k, impl or self.config.impl, n_pre)
        return o[:, :, n_pre:], scal

    def sink_entry(self, batch_size: int) -> dict:
        entry = super().sink_entry(batch_size)
        entry["k"] = self.sink_value.new_zeros(batch_size, self.n_kv, 1, self.config.head_dim)  # zero sink key vector
        return entry

    def init_cache(self, cache, window, max_len) -> None:
        cache.scalar = self.scalar_cache(cache.batch_size, window)

    def step_readout(self, p: Projected, cache):
        return self.scalar_step(p, cache)
