"""mechanism = "principled": a learned ground state v0 with threshold γ, a suppress-only gate β
from gate vectors qg·kg, and log K margin amplification α (docs/mechanisms.md#principled-attention).

α, β, γ each take a form ("constant", "layer", "head", "query"; `HeadParam`), the query form read
off the un-rotated q; v0 is "zero", "layer" or "head" (`GroundValue`).

Static decoding (`attnlab.models.StaticDecoder`) keeps each token's key, gate key and value in a
`KeyedState` and reads them through `principled_naive` under the mask of the slots each query sees
(K counts the keys it marks).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from ...checks import IMPLS, trusted
from ...ops import principled_attention
from ...ops.common.heads import expand_heads
from ...ops.common.precision import upcast
from ...ops.principled.attention import check_param
from ...ops.principled.naive import principled_naive
from ..attention import Attention, heads
from ..options import MechanismOptions
from ..params import GroundValue, HeadParam
from ..record import Projected
from ..registry import register
from .keyed_static import KeyedState, kv_entries


PARAM_FORMS = ("constant", "layer", "head", "query")
V0_FORMS = ("zero", "layer", "head")


@dataclass
class PrincipledOptions(MechanismOptions):
    """Mechanism "principled"'s options (docs/mechanisms.md#principled-attention).

    Args:
        alpha: the form of α, "constant" (the alpha_init value), "layer" (one learned scalar),
            "head" (one per head) or "query" (learned from q_i per head).
        beta: the form of β, as alpha.
        gamma: the form of γ, as alpha.
        alpha_init: α's initial value (standard attention is the limit of α, β and γ at -inf;
            large negative values approach it).
        beta_init: β's initial value.
        gamma_init: γ's initial value.
        v0: the ground value, "zero", "layer" (one learned vector) or "head" (one per head).
        gate_dim: width of the gate projections qg, kg (derived: head_dim).
    """

    alpha: str = "head"
    beta: str = "head"
    gamma: str = "head"
    alpha_init: float = 0.0
    beta_init: float = 0.0
    gamma_init: float = 0.0
    v0: str = "zero"
    gate_dim: int | None = None

    def check(self, config) -> None:
        for name in ("alpha", "beta", "gamma"):
            if getattr(self, name) not in PARAM_FORMS:
                raise config.error(name, getattr(self, name), f"one of {PARAM_FORMS}")
        if self.v0 not in V0_FORMS:
            raise config.error("v0", self.v0, f"one of {V0_FORMS}")
        if self.gate_dim is not None:
            config.require_int("gate_dim")


@register
class PrincipledAttention(Attention):
    mechanism = "principled"
    Options = PrincipledOptions
    uses = ("n_kv_heads", "rope", "rope_base", "sliding_window")
    impls = (*IMPLS, "triton")  # ops.principled.triton_kernel

    @classmethod
    def configure(cls, config) -> None:
        config.set_vector_heads(config.n_heads)
        if config.options.gate_dim is None:
            config.options.gate_dim = config.head_dim

    def build(self, c) -> None:
        H, D, o = c.n_heads, c.head_dim, c.options
        self.build_vectors(c, H)
        self.wqg = nn.Linear(c.d_model, H * o.gate_dim, bias=c.bias)
        self.wkg = nn.Linear(c.d_model, self.n_kv * o.gate_dim, bias=c.bias)
        self.alpha = HeadParam(o.alpha, H, D, o.alpha_init)
        self.beta = HeadParam(o.beta, H, D, o.beta_init)
        self.gamma = HeadParam(o.gamma, H, D, o.gamma_init)
        self.ground = GroundValue(o.v0, H, D)

    def project(self, x, start_pos: int = 0, qkv=None) -> Projected:
        self.check_start(start_pos)
        c = self.config
        q, k, v = self.vectors(x, c.n_heads, qkv)
        p = Projected(start_pos=start_pos, v=v)
        p.alpha, p.beta, p.gamma = self.alpha(q), self.beta(q), self.gamma(q)  # from the un-rotated q
        p.qg = heads(self.wqg(x), c.n_heads, c.options.gate_dim)  # (B, H, T, Dg)
        p.kg = heads(self.wkg(x), self.n_kv, c.options.gate_dim)
        v0 = self.ground()
        p.v0 = None if v0 is None else v0.to(v.dtype)
        p.q, p.k = self.rotate(q, k, start_pos)
        return p

    def _op(self, p: Projected, k, kg, v, v0, impl):
        return principled_attention(p.q, k, p.qg, kg, v, alpha=p.alpha, beta=p.beta, gamma=p.gamma, v0=v0,
                                    causal=True, impl=impl, window=self.config.sliding_window, docs=p.docs)

    def takes_documents(self, device) -> bool:
        """Packed documents in one pass on every route (K counts each query's document), without a
        sliding window."""
        return self.config.sliding_window is None

    def attend(self, p: Projected, values=None, impl: str | None = None):
        v, v0 = (p.v, p.v0) if values is None else (values, None)  # weights leave the ground value out
        return self._op(p, p.k, p.kg, v, v0, impl or self.config.impl), None

    def step_readout(self, p: Projected, cache):
        full = cache.kv.append(k=p.k, kg=p.kg, v=p.v)  # one query, all n keys: the op's offset form
        with trusted(*full.values()):  # checked token by token at append, not again each step
            return self._op(p, full["k"], full["kg"], full["v"], p.v0, self.config.impl)

    # ------------------------------------------------------------------ static decoding (keyed_static.py)

    def static_state(self, opts) -> KeyedState:
        return KeyedState(self, opts)

    def static_entries(self, dtype) -> dict:
        return {**kv_entries(self, dtype), "kg": (self.n_kv, self.config.options.gate_dim, dtype)}

    def static_values(self, p: Projected, positions) -> dict:
        return {"k": p.k, "v": p.v, "kg": p.kg}

    def static_readout(self, p: Projected, e: dict, kpos, positions, ok, chunk):
        B, H, T, _ = p.q.shape
        work = upcast(p.q.dtype)
        prm = [check_param(name, getattr(p, name), B, H, T, p.q.to(work)) for name in ("alpha", "beta", "gamma")]
        v0 = None if p.v0 is None else p.v0.to(work).view(-1, p.v0.shape[-1])
        k, kg, v = (expand_heads(e[name], H).to(work) for name in ("k", "kg", "v"))
        o, _ = principled_naive(p.q.to(work), k, p.qg.to(work), kg, v, *prm, v0, False, visible=ok)
        return o.to(p.q.dtype)
