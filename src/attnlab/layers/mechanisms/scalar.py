"""mechanism = "scalar": scalar sort attention (docs/mechanisms.md#scalar-attention), and mechanism =
"hybrid": every head scores q·k/√d − (qs − ks)²/τ (docs/mechanisms.md#hybrid-attention).

Each scalar head scores keys by the Gaussian kernel −(qs − ks)²/τ on one scalar query/key per
token and reads grouped values (n_value_groups). With n_scalar_heads < n_heads the remaining
heads are standard dot-product heads (RoPE, GQA, the softmax scalings), and the outputs are
concatenated with the scalar heads first.

Hybrid. One class holds both mechanisms; `hybrid = True` (`HybridAttention`) adds each head's
vector query/key to its scalar score and reads the vector values (GQA) in place of grouped ones.
As τ → ∞ a hybrid head is standard scaled dot-product attention. `scalar_gain` (None by default)
adds a learned per-head scale λ on the scalar term, q·k/√d − λ(qs − ks)²/τ; at λ = 0 the layer is
exactly standard attention, yet λ's gradient is not zero there (docs/retrofit.md). Exact decoding
reads every key through the op (and its gain); the sorted cache, the whole-sequence windows and the
key selections carry λ into the scores of the keys they choose by scalar distance.

Position. Scalar heads get no position signal of their own: a scalar has no rotation, and a
position term would break the kernel's dependence on qs − ks alone (and with it the sorted
cache). They see position through the causal mask and the residual stream.

Approximate. With impl="approx" the scalar heads' full-sequence op is `scalar_attention_approx`
(docs/mechanisms.md#approximate-scalar-attention: each query's dropped softmax mass at most 1e-4);
the dot-product heads of a mixed layer and every decode step run the exact ops. The hybrid
mechanism has no approximate path: its config rejects impl="approx".

Sink. With `sink=True`, scalar heads see one extra key at position "−1": scalar key `sink_key`
(a zero vector key for hybrid scores) and a learned value per value group, initialised to zero.
It is prepended with an extra leading query whose output is dropped, so the op runs unchanged
on T + 1 positions. Decoding keeps it as the plain cache's first entry or as the sorted cache's
built-in sink entry, a candidate at every step besides the window.

Key rules. A call's `KeyRule` (`attnlab.cache.options`) makes the full-sequence forward read, per
scalar head, only each query's k nearest keys in scalar space (plus the sink), as decoding with
SortedScalarCache(window=k) does, or the keys a selector keeps; without one a layer reads every
key, or its trained window.

Training through the window. With `train_window = k` (and `local_window = w`) the full-sequence
forward reads, per scalar head, each query's k nearest keys in scalar space among those older
than its last w, the last w, and the sink: `ops.windowed_attention`'s gather path, O(T·(k + w))
memory. A decode cache then defaults to the sorted cache with window k and a ring buffer of the
last w tokens (a token leaving the ring enters the sorted cache), which reads the same keys.

Sink weight. With `sink_weight` set, the sink's term in the normaliser is w·e^score with a
learned per-head w (|w| is used), so w = 0 is a sink with no mass whose w still gets a gradient.
The ops take no per-key weight, so the readout runs on values with two extra channels: the
sink's value is zeroed, channel D is 1 for the model's keys and channel D + 1 is 1 for the sink.
The op then returns o' = N/(Z + E), q0 = Z/(Z + E) and p = E/(Z + E) (N, Z: the numerator and
normaliser over the model's keys, E: the sink's e^score), each a sum of positive terms, and
`mix_sink` forms (o' + w·p·v_sink)/(q0 + w·p) = (N + wE·v_sink)/(Z + wE) without cancellation.
Plain decode caches store values in that layout; the sorted cache adds log w to the sink's logit.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ...cache.options import KeyRule, check_key_rule
from ...checks import IMPLS
from ...cache.sorted import QUERY_HISTORY
from ...ops import (
    budget_evictions, hybrid_attention, hybrid_logits, scalar_attention, scalar_attention_approx, scalar_logits,
    softmax_attention, window_mask, windowed_attention,
)
from ..attention import Attention, heads
from ..params import Temperature
from ..record import Projected
from ..sink import mix_sink, sink_weight_value, split_sink_values
from ..registry import register
from .scalar_decode import ScalarDecode, exact_impl
from .scalar_options import HybridOptions, ScalarOptions
from .scalar_static import ScalarState

EVERY_KEY = KeyRule()  # no key rule: every key, or the layer's trained window


class ScalarProjection(nn.Linear):
    """The scalar query / key projection, summed in float64 and rounded once to the input's dtype.

    Which keys a window reads is decided by comparing scalar keys, ties by position (newest first),
    so a token's key must be the same bits however it was computed: in a prompt of T rows or in a
    decode step of one. A float32 matmul's summation order depends on the number of rows and on the
    CPU's vector width (the same row differs by an ulp between a 9-row and a 1-row product), and two
    mathematically equal keys (a repeated token in the first layer) then compare as unequal in one
    decoder and equal in the other. Summed in float64 (each float32 product is exact there) and
    rounded once, a row's result no longer depends on the rows beside it, except where the float64
    sums straddle a float32 rounding boundary (they differ by a few units of 2^-53: about once in
    10^7 values). The projection is d_model x heads: its cost is negligible beside the layer's."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        kind = x.device.type
        # the dtype nn.Linear would return: autocast's where it is on, else the inputs' promoted
        dtype = (torch.get_autocast_dtype(kind) if torch.is_autocast_enabled(kind)
                 else torch.promote_types(x.dtype, self.weight.dtype))
        bias = None if self.bias is None else self.bias.double()
        with torch.autocast(kind, enabled=False):
            return F.linear(x.double(), self.weight.double(), bias).to(dtype)


@register
class ScalarAttention(ScalarDecode, Attention):
    mechanism = "scalar"
    scalar = True
    hybrid: ClassVar[bool] = False  # every head adds q·k/√d to its scalar score and reads the vector values
    Options = ScalarOptions
    uses = ("n_kv_heads", "scale", "p", "rope", "rope_base", "sliding_window")
    value_key = "vs"  # the name of the scalar heads' values in a plain decode cache
    sorted_decode = True  # decodes through the sorted scalar cache (window=k), reads keys by a KeyRule
    impls = (*IMPLS, "approx", "triton")  # approx: scalar_attention_approx on the scalar heads; triton: its kernels

    @classmethod
    def configure(cls, config) -> None:
        if cls.hybrid:
            config.set_vector_heads(config.n_heads)
            return
        if config.options.n_scalar_heads is None:
            config.options.n_scalar_heads = config.n_heads
        n_s = config.require_int("n_scalar_heads")
        if n_s > config.n_heads:
            raise config.error("n_scalar_heads", n_s, f"at most n_heads={config.n_heads}")
        if config.options.n_value_groups is None:
            config.options.n_value_groups = n_s
        groups = config.require_int("n_value_groups")
        if n_s % groups:
            raise config.error(
                "n_value_groups", groups, f"a divisor of the {n_s} scalar heads (each group is read by the same number of heads)"
            )
        config.set_vector_heads(config.n_heads - n_s)

    @classmethod
    def scalar_heads(cls, config) -> int:
        return config.n_heads if cls.hybrid else config.options.n_scalar_heads

    @classmethod
    def vector_heads(cls, config) -> int:
        return config.n_heads if cls.hybrid else config.n_heads - config.options.n_scalar_heads

    def build(self, c) -> None:
        self.wqs = ScalarProjection(c.d_model, self.n_scalar, bias=c.bias)
        self.wks = ScalarProjection(c.d_model, self.n_scalar, bias=c.bias)
        o = c.options
        self.temperature = Temperature(o.tau, self.n_scalar, c.d_model, o.tau_init, o.tau_max, o.tau_param)
        self.build_values(c)
        if o.sink:
            self.sink_value = nn.Parameter(torch.zeros(self.value_groups, c.head_dim))  # (G, D)
        w = o.sink_weight if o.sink else None  # the sink's learned weight in the normaliser, (H_s,)
        self.register_parameter("sink_weight", None if w is None else nn.Parameter(torch.full((self.n_scalar,), float(w))))
        gain = o.scalar_gain if self.hybrid else None  # the hybrid's learned λ on the scalar term, (H,); None: none
        self.register_parameter("scalar_scale", None if gain is None else nn.Parameter(torch.full((self.n_scalar,), float(gain))))

    def build_values(self, c) -> None:
        """The values the scalar heads read (grouped ones, or a hybrid's vector values) and the
        vector projections: a hybrid's for every head, a mixed layer's for its dot-product heads."""
        if not self.hybrid:
            self.wvs = nn.Linear(c.d_model, c.options.n_value_groups * c.head_dim, bias=c.bias)
        if self.n_dot:
            self.build_vectors(c, self.n_dot)

    @property
    def n_mixed(self) -> int:
        """The dot-product heads of a mixed layer, after the scalar heads (0 for hybrid heads, whose
        vectors enter their own scores)."""
        return self.config.n_heads - self.n_scalar

    @property
    def value_groups(self) -> int:
        return self.n_kv if self.hybrid else self.config.options.n_value_groups

    @property
    def prefix_keys(self) -> int:
        return int(self.config.options.sink)

    @property
    def hybrid_key_dim(self) -> int | None:
        """The vector key width the decode caches keep beside the scalar keys (hybrid: head_dim)."""
        return self.config.head_dim if self.hybrid else None

    def static_state(self, opts) -> ScalarState:
        """The layer's state for `attnlab.models.StaticDecoder` (scalar_static.py), hybrid layers' too."""
        return ScalarState(self, opts)

    # ------------------------------------------------------------------ full sequence

    def project(self, x, start_pos: int = 0, qkv=None) -> Projected:
        self.check_start(start_pos)
        p = Projected(start_pos=start_pos)
        if self.n_dot:
            q, k, p.v = self.vectors(x, self.n_dot, qkv)
            p.q, p.k = self.rotate(q, k, start_pos)
        p.qs = self.wqs(x).transpose(1, 2)  # (B, H_s, T)
        p.ks = self.wks(x).transpose(1, 2)
        p.tau = self.temperature(x)  # (H_s,) or (B, H_s, T)
        if not self.hybrid:  # a hybrid's values are the vector values, projected with q and k
            p.vs = heads(self.wvs(x), self.config.options.n_value_groups, self.config.head_dim)  # (B, G, T, D)
        return p

    def scalar_values(self, p: Projected) -> torch.Tensor:
        return p.v if self.hybrid else p.vs

    def score_vectors(self, p: Projected):
        """Vector queries/keys added to the scalar score (hybrid), or (None, None)."""
        return (p.q, p.k) if self.hybrid else (None, None)

    def scalar_op(self, qs, ks, vals, tau, q, k, impl, n_prefix: int = 0, docs=None):
        """The exact op over every key (n_prefix: the sink's leading entries, which a sliding window
        always reads; docs: packed documents' ids, see `takes_documents`)."""
        c = self.config
        if self.hybrid:
            return hybrid_attention(q, k, vals, qs, ks, tau, causal=True, impl=impl, scalar_scale=self.scalar_scale,
                                    kernel=c.options.kernel, window=c.sliding_window, n_prefix=n_prefix, docs=docs)
        if impl == "approx" and qs.shape[-1] == ks.shape[-1]:  # a whole sequence (decode steps stay exact)
            return scalar_attention_approx(qs, ks, vals, tau)
        return scalar_attention(qs, ks, vals, tau, causal=True, impl="auto" if impl == "approx" else impl,
                                kernel=c.options.kernel, window=c.sliding_window, n_prefix=n_prefix, docs=docs)

    def takes_documents(self, device) -> bool:
        """Packed documents in one pass, on every route of the exact op (the Triton kernel, the CPU's
        query chunks), for a layer of scalar (or hybrid) heads only that reads every key of its
        document (no sink, no trained window, no sliding window; a call with a key rule takes none)."""
        c = self.config
        return not (c.options.sink or self.n_mixed or c.options.train_window is not None or c.sliding_window is not None)

    def with_sink(self, p: Projected):
        """The scalar op's inputs, with the sink prepended when on: (qs, ks, values, tau, q, k, n_prefix)."""
        c = self.config
        vals = self.scalar_values(p)
        q, k = self.score_vectors(p)
        if not c.options.sink:
            return p.qs, p.ks, vals, p.tau, q, k, 0
        B = p.qs.shape[0]
        key = p.ks.new_full((B, self.n_scalar, 1), c.options.sink_key)  # (B, H_s, 1)
        qs = torch.cat([key, p.qs], dim=-1)  # extra leading query: its output is dropped
        ks = torch.cat([key, p.ks], dim=-1)  # (B, H_s, T+1)
        sink_v = self.sink_value.to(vals.dtype)[None, :, None, :].expand(B, -1, 1, -1)  # (B, G, 1, D)
        vals = torch.cat([sink_v, vals], dim=2)  # (B, G, T+1, D)
        if p.tau.dim() == 1:
            tau = p.tau
        else:  # the sink query's output is dropped; it borrows the first query's tau (any > 0 would do at T = 0)
            first = p.tau[..., :1] if p.tau.shape[-1] else p.tau.new_ones(B, self.n_scalar, 1)
            tau = torch.cat([first, p.tau], dim=-1)
        if q is not None:
            q = torch.cat([q.new_zeros(B, q.shape[1], 1, q.shape[3]), q], dim=2)  # (B, H, T+1, D)
            k = torch.cat([k.new_zeros(B, k.shape[1], 1, k.shape[3]), k], dim=2)  # zero sink key vector
        return qs, ks, vals, tau, q, k, 1

    def scalar_readout(self, qs, ks, vals, tau, q, k, impl, n_prefix: int, rule: KeyRule):
        """The scalar op, or its windowed form under a key rule's window or budget (or a selector's
        keys), or under `train_window`."""
        c = self.config
        if rule.select is not None:
            return windowed_attention(qs, ks, vals, tau, None, q=q, k=k, n_prefix=n_prefix, scalar_scale=self.scalar_scale,
                                      keep_fn=rule.select(qs, ks, tau, q, k, n_prefix), kernel=c.options.kernel)
        window = rule.window if rule.window is not None else c.options.train_window
        if window is None and rule.budget is None:
            return self.scalar_op(qs, ks, vals, tau, q, k, impl, n_prefix)
        if c.sliding_window is not None:
            raise ValueError(f"this layer reads a sliding window of {c.sliding_window} keys: it has no scalar window "
                             f"or budget to decode through (got window={window!r}, budget={rule.budget!r})")
        return windowed_attention(qs, ks, vals, tau, window, q=q, k=k, n_prefix=n_prefix, local=c.options.local_window,
                                  budget=rule.budget, history=QUERY_HISTORY, scalar_scale=self.scalar_scale,
                                  impl=impl if impl in ("naive", "triton") else "auto", kernel=c.options.kernel)

    def sink_readout(self, qs, ks, vals, tau, q, k, impl, n_prefix: int, rule: KeyRule):
        """`scalar_readout` on the op inputs of `with_sink`, weighing the sink by `sink_weight` when set."""
        if self.sink_weight is None or not n_prefix:
            return self.scalar_readout(qs, ks, vals, tau, q, k, impl, n_prefix, rule)
        o = self.scalar_readout(qs, ks, split_sink_values(vals), tau, q, k, impl, n_prefix, rule)
        return mix_sink(o, vals[:, :, :1], self.sink_weight)

    def attend(self, p: Projected, values=None, impl: str | None = None):
        """As `Attention.attend`; the scalar heads read the keys of `p.key_rule` (None: every key, or
        the trained window)."""
        c = self.config
        impl = impl or c.impl
        scal = qs, ks, vals, tau, q, k, n_pre = self.with_sink(p)
        v = vals if values is None else values
        if p.docs is not None:  # packed documents (takes_documents): no sink, no window, scalar heads only
            return self.scalar_op(qs, ks, v, tau, q, k, impl, docs=p.docs), scal
        rule = EVERY_KEY if p.key_rule is None else p.key_rule
        o = self.sink_readout(qs, ks, v, tau, q, k, impl, n_pre, rule)[:, :, n_pre:]
        if self.n_mixed:  # the dot-product heads of a mixed layer
            vd = p.v if values is None else values[:, :1, n_pre:, n_pre:].expand(-1, self.n_kv, -1, -1)
            od = softmax_attention(p.q, p.k, vd, causal=True, scale=c.scale, p=c.p, impl=exact_impl(impl),
                                   window=c.sliding_window)
            if n_pre and values is not None:  # the sink column, never seen by dot heads
                od = torch.cat([od.new_zeros(od[..., :n_pre].shape), od], dim=-1)
            o = torch.cat([o, od], dim=1)  # (B, H, T, Dv): scalar heads first
        return o, scal

    def attention_weights(self, x: torch.Tensor, key_rule: KeyRule | None = None) -> torch.Tensor:
        """As `Attention.attention_weights`, computed as the softmax of the mechanism's logits
        (O(T²) per head rather than the O(T³) of reading out an identity value matrix) when every
        head is a scalar/hybrid head (not a mixed layer, not goat_hybrid's prior, no learned gain);
        under a key rule's window the windowed weights, and under its selector the selected ones."""
        if self.n_mixed or not self.sorted_decode or self.scalar_scale is not None:
            return super().attention_weights(x, key_rule)
        self.check_input(x)
        check_key_rule(key_rule, self)
        rule, c = EVERY_KEY if key_rule is None else key_rule, self.config
        qs, ks, _, tau, q, k, n_pre = self.with_sink(self.project(x, 0))
        kernel = c.options.kernel
        logits = scalar_logits(qs, ks, tau, kernel=kernel) if q is None else hybrid_logits(q, k, qs, ks, tau, kernel=kernel)
        if rule.select is not None:
            keep = rule.select(qs, ks, tau, q, k, n_pre)(0, qs.shape[-1], logits)
            logits = logits.masked_fill(~keep, float("-inf"))
        elif rule.window is not None or rule.budget is not None or c.options.train_window is not None:
            evicted = None if rule.budget is None else budget_evictions(
                qs, ks, rule.budget, history=QUERY_HISTORY, n_prefix=n_pre)
            window = rule.window or c.options.train_window or qs.shape[-1] or 1
            keep = window_mask(qs, ks, window, n_prefix=n_pre, evicted_at=evicted, local=c.options.local_window)
            logits = logits.masked_fill(~keep, float("-inf"))
        if n_pre and self.sink_weight is not None:  # the sink's weight: log|w| on its column
            logw = sink_weight_value(self.sink_weight).log().to(logits.dtype).view(1, -1, 1, 1)
            logits = torch.cat([logits[..., :1] + logw, logits[..., 1:]], dim=-1)
        return torch.softmax(logits, dim=-1)[:, :, n_pre:].to(x.dtype)


@register
class HybridAttention(ScalarAttention):
    """mechanism = "hybrid": `ScalarAttention` with `hybrid = True` (module docstring)."""

    mechanism = "hybrid"
    hybrid = True
    Options = HybridOptions
    uses = ("n_kv_heads", "rope", "rope_base", "sliding_window")
    impls = (*IMPLS, "triton")  # no approximate path
    value_key = "v"
