"""mechanism = "gla": gated linear attention with a per-channel decay from a low-rank gate
(docs/mechanisms.md#gla): log_decay = logsigmoid(W_up W_down x) / gla_normalizer."""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import nn

from ...ops import gla_attention, gla_step
from ..attention import heads
from ..options import MechanismOptions
from ..record import Projected
from ..registry import register
from ._recurrent import RecurrentAttention, RecurrentStore


@dataclass
class GLAOptions(MechanismOptions):
    """Mechanism "gla"'s options.

    Args:
        gla_rank: rank of the low-rank decay gate.
        gla_normalizer: divides the gate's log-sigmoid (> 0).
    """

    gla_rank: int = 16
    gla_normalizer: float = 16.0

    def check(self, config) -> None:
        config.require_int("gla_rank")
        config.require_positive("gla_normalizer")


@register
class GLAAttention(RecurrentAttention):
    mechanism = "gla"
    Options = GLAOptions
    uses = ("n_kv_heads", "rope", "rope_base")

    def build(self, c) -> None:
        super().build(c)
        self.decay_down = nn.Linear(c.d_model, c.options.gla_rank, bias=False)
        self.decay_up = nn.Linear(c.options.gla_rank, c.n_heads * c.head_dim, bias=True)

    def project(self, x, start_pos: int = 0, qkv=None) -> Projected:
        p = super().project(x, start_pos, qkv)
        c = self.config
        raw = self.decay_up(self.decay_down(x))  # (B, T, H*D), low rank
        p.log_decay = heads(F.logsigmoid(raw) / c.options.gla_normalizer, c.n_heads, c.head_dim)  # (B, H, T, D)
        return p

    def attend(self, p: Projected, values=None, impl: str | None = None):
        v = p.v if values is None else values
        o, _ = gla_attention(p.q, p.k, v, p.log_decay, causal=True, impl=impl or self.config.impl, docs=p.docs)
        return o, None

    def chunk_op(self, p: Projected, state, cache, impl: str | None = None):
        return gla_attention(p.q, p.k, p.v, p.log_decay, initial_state=state, causal=True, impl=impl or self.config.impl)

    def step_op(self, q, k, v, p: Projected, state, cache):
        return gla_step(q, k, v, p.log_decay[:, :, 0], state)

    def static_state(self, opts) -> RecurrentStore:
        return RecurrentStore(self, opts)
