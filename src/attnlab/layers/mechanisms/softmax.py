"""mechanism = "softmax": scaled dot-product attention with GQA, RoPE and the q·k scalings of
`attnlab.ops.softmax_attention` (docs/mechanisms.md#softmax-attention)."""

from __future__ import annotations

from ...checks import trusted
from ...ops import softmax_attention
from ..attention import Attention
from ..record import Projected
from ..registry import register


@register
class SoftmaxAttention(Attention):
    mechanism = "softmax"
    options = ("n_kv_heads", "scale", "p", "rope", "rope_base", "sliding_window")

    @classmethod
    def configure(cls, config) -> None:
        config.set_vector_heads(config.n_heads)

    def takes_documents(self, device) -> bool:
        """Packed documents in one pass, with every scaling and sliding window: the op's `docs`
        (FlexAttention's block mask on CUDA, a same-document mask over query chunks elsewhere; the
        key-norm divisors restart in each document)."""
        return True

    def attend(self, p: Projected, values=None, impl: str | None = None):
        c = self.config
        v = p.v if values is None else values
        return softmax_attention(p.q, p.k, v, causal=True, scale=c.scale, p=c.p, impl=impl or c.impl,
                                 window=c.sliding_window, docs=p.docs), None

    def step_readout(self, p: Projected, cache):
        full = cache.kv.append(k=p.k, v=p.v)  # one query against every cached key: the op's offset form
        c = self.config
        with trusted(full["k"], full["v"]):  # checked token by token at append, not again each step
            return softmax_attention(p.q, full["k"], full["v"], scale=c.scale, p=c.p, impl=c.impl,
                                     window=c.sliding_window)
