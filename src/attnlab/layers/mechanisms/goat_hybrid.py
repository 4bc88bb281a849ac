"""mechanism = "goat_hybrid": the hybrid score plus GOAT's log-prior, in one fused call
(docs/mechanisms.md#goat): q·k/√d − (qs − ks)²/τ + log π. It answers whether the scalar term and
the learned position prior are complementary. The scalar part (projections, τ) is the hybrid
mechanism's; the sink is not offered (its extra key at position −1 would shift GOAT's positions),
and decoding is exact (the sorted cache knows nothing of the prior). Static decoding keeps GOAT's
entries and each head's scalar key in a `KeyedState`, read by GOAT's readout plus the scalar logits."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar

from ...cache.kv import KVCache
from ...checks import IMPLS
from ...data.packing import positions_in_doc
import torch

from ...ops import goat_attention
from ...ops.scalar.naive import scalar_logits
from ..registry import register
from .goat import GoatPrior, GoatPriorOptions, content_dim, goat_readout, goat_values
from .scalar import HybridAttention
from .scalar_options import HybridOptions
from .keyed_static import KeyedState, kv_entries


@dataclass
class GoatHybridOptions(HybridOptions, GoatPriorOptions):
    """Mechanism "goat_hybrid"'s options: the temperature of the hybrid's scalar term
    (`TemperatureOptions`: tau, tau_init, tau_param, tau_max) and GOAT's prior (`GoatPriorOptions`).
    The hybrid's other options keep their defaults (they are not options here): no sink, no
    trained window, the Gaussian kernel, no gain."""

    extra: ClassVar[int] = 2  # the scalar term's two columns share the head width too

    sink: bool = field(default=False, init=False)
    sink_key: float = field(default=0.0, init=False)
    sink_weight: float | None = field(default=None, init=False)
    train_window: int | None = field(default=None, init=False)
    local_window: int = field(default=0, init=False)
    kernel: str = field(default="gaussian", init=False)
    scalar_gain: float | None = field(default=None, init=False)


@register
class GoatHybridAttention(HybridAttention):
    mechanism = "goat_hybrid"
    Options = GoatHybridOptions
    uses = ("n_kv_heads", "sliding_window")
    sorted_decode = False
    impls = IMPLS  # GOAT's fused op has no Triton kernel

    @classmethod
    def model_defaults(cls, max_seq_len: int) -> dict:
        return {**super().model_defaults(max_seq_len), **({"goat_train_len": max_seq_len} if max_seq_len else {})}

    def build_values(self, c) -> None:
        self.build_vectors(c, c.n_heads, content_dim(c))

    def build(self, c) -> None:
        super().build(c)
        o = c.options
        self.prior = GoatPrior(self.n_kv, o.goat_rank, o.goat_abs_rank, o.goat_base, o.goat_train_len)

    def takes_documents(self, device) -> bool:
        """Packed documents in one pass, as the goat mechanism takes them (`GoatAttention.goat`)."""
        return True

    def scalar_op(self, qs, ks, vals, tau, q, k, impl, n_prefix: int = 0, start: int = 0, docs=None):
        pr = self.prior  # keys at positions start .. (a sliding window's cache holds the last ones only)
        u = pr.key_term(k.shape[2], start) if docs is None else pr.key_term_in_docs(positions_in_doc(docs))
        return goat_attention(q, k, vals, pr.freqs, pr.lam_sym, pr.lam_asym, u, qs=qs, ks=ks, tau=tau, causal=True,
                              impl=impl, window=self.config.sliding_window, docs=docs)

    def step_readout(self, p, cache):
        full = cache.scalar.append(ks=p.ks, v=p.v, k=p.k)  # no sink: the op's offset form over the cached keys
        start = cache.pos + p.ks.shape[-1] - full["ks"].shape[-1]
        return self.scalar_op(p.qs, full["ks"], full["v"], p.tau, p.q, full["k"], self.config.impl, start=start)

    def init_cache(self, cache, window, max_len) -> None:
        if window is not None:
            raise ValueError(
                f"window={window}: the sorted scalar cache cannot apply GOAT's prior; decode goat_hybrid exactly (window=None)"
            )
        cache.scalar = KVCache(cache.batch_size, window=self.config.sliding_window)

    # ------------------------------------------------------------------ static decoding (keyed_static.py)

    def static_state(self, opts) -> KeyedState:
        return KeyedState(self, opts)

    def static_entries(self, dtype) -> dict:
        return {**kv_entries(self, dtype), "u": (self.n_kv, 1, torch.float32),
                "ks": (self.config.n_heads, 1, torch.float32)}

    def static_values(self, p, positions) -> dict:
        return {**goat_values(self, p, positions), "ks": p.ks[..., None]}

    def static_readout(self, p, e: dict, kpos, positions, ok, chunk):
        def scalar_term(work):
            return scalar_logits(p.qs.to(work), e["ks"][..., 0].to(work), p.tau, causal=False)
        return goat_readout(self, p, e, kpos, positions, ok, scalar_term)
