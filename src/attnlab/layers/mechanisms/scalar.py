"""mechanism = "scalar": scalar sort attention (docs/mechanisms.md#scalar-attention).

Each scalar head scores keys by the Gaussian kernel −(qs − ks)²/τ on one scalar query/key per
token and reads grouped values (n_value_groups). With n_scalar_heads < n_heads the remaining
heads are standard dot-product heads (RoPE, GQA, the softmax scalings), and the outputs are
concatenated with the scalar heads first. This module also holds what the hybrid mechanism
shares with it (scalar projections, τ, the sink, the scalar decode cache): see hybrid.py.

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

import torch
from torch import nn

from ...cache.exact import ExactScalarCache
from ...cache.kv import KVCache
from ...cache.ring import Ring
from ...cache.selected import selected_step
from ...cache.sorted import QUERY_HISTORY, SortedScalarCache
from ...cache.sorted_read import check_step_values
from ...ops import (
    budget_evictions, hybrid_logits, scalar_attention, scalar_attention_approx, scalar_logits, softmax_attention, window_mask,
    windowed_attention,
)
from ...ops._sdpa import expand_heads
from ..attention import Attention, heads
from ...ops.scalar import hybrid_scores, scalar_scores
from ..params import Temperature
from ..sink import mix_sink, sink_weight_value, split_sink_values, token_values
from ..record import Projected
from . import register

def exact_impl(impl: str) -> str:
    """impl="approx" approximates only the scalar heads' full-sequence op; everything else runs "auto"."""
    return "auto" if impl == "approx" else impl


SCALAR_OPTIONS = ("tau", "tau_init", "tau_param", "tau_max", "sink", "sink_key", "sink_weight", "train_window",
                  "local_window")


@register
class ScalarAttention(Attention):
    mechanism = "scalar"
    scalar = True
    options = ("n_scalar_heads", "n_value_groups", *SCALAR_OPTIONS, "n_kv_heads", "scale", "p", "rope", "rope_base")
    value_key = "vs"  # the name of the scalar heads' values in a plain decode cache
    sorted_decode = True  # decodes through the sorted scalar cache (window=k)
    # k: the full-sequence forward reads, per scalar head, only each query's k nearest keys in
    # scalar space (plus the sink), as decoding with SortedScalarCache(window=k) does. Set by
    # attnlab.eval.window.decode_window; None (default) is exact attention.
    decode_window: int | None = None
    decode_budget: int | None = None  # ... and keys beyond a memory budget evicted (SortedScalarCache.evict_to_budget)
    # Another key selector in place of the window (attnlab.eval.selectors.select_keys): a callable
    # select(qs, ks, tau, q, k, n_prefix) taking the scalar op's inputs (sink included) and
    # returning the keep_fn of `windowed_attention`; each scalar head then reads only the keys it
    # keeps. None (default): no selector. Not combined with decode_window / decode_budget.
    decode_select = None

    @classmethod
    def configure(cls, config) -> None:
        if config.n_scalar_heads is None:
            config.n_scalar_heads = config.n_heads
        n_s = config.require_int("n_scalar_heads")
        if n_s > config.n_heads:
            raise config.error("n_scalar_heads", n_s, f"at most n_heads={config.n_heads}")
        if config.n_value_groups is None:
            config.n_value_groups = n_s
        groups = config.require_int("n_value_groups")
        if n_s % groups:
            raise config.error(
                "n_value_groups", groups, f"a divisor of the {n_s} scalar heads (each group is read by the same number of heads)"
            )
        config.set_vector_heads(config.n_heads - n_s)

    @classmethod
    def scalar_heads(cls, config) -> int:
        return config.n_scalar_heads

    def build(self, c) -> None:
        self.wqs = nn.Linear(c.d_model, self.n_scalar, bias=c.bias)
        self.wks = nn.Linear(c.d_model, self.n_scalar, bias=c.bias)
        self.temperature = Temperature(c.tau, self.n_scalar, c.d_model, c.tau_init, c.tau_max, c.tau_param)
        self.build_values(c)
        if c.sink:
            self.sink_value = nn.Parameter(torch.zeros(self.value_groups, c.head_dim))  # (G, D)
        w = c.sink_weight if c.sink else None  # the sink's learned weight in the normaliser, (H_s,)
        self.register_parameter("sink_weight", None if w is None else nn.Parameter(torch.full((self.n_scalar,), float(w))))

    def build_values(self, c) -> None:
        """Grouped values of the scalar heads, and the dot-product heads of a mixed layer."""
        self.wvs = nn.Linear(c.d_model, c.n_value_groups * c.head_dim, bias=c.bias)
        if self.n_dot:
            self.build_vectors(c, self.n_dot)

    @property
    def value_groups(self) -> int:
        return self.config.n_value_groups

    # ------------------------------------------------------------------ full sequence

    def project(self, x, start_pos: int = 0) -> Projected:
        self.check_start(start_pos)
        p = Projected(start_pos=start_pos)
        if self.n_dot:
            q, k, p.v = self.vectors(x, self.n_dot)
            p.q, p.k = self.rotate(q, k, start_pos)
        p.qs = self.wqs(x).transpose(1, 2)  # (B, H_s, T)
        p.ks = self.wks(x).transpose(1, 2)
        p.tau = self.temperature(x)  # (H_s,) or (B, H_s, T)
        self.project_values(x, p)
        return p

    def project_values(self, x, p: Projected) -> None:
        p.vs = heads(self.wvs(x), self.config.n_value_groups, self.config.head_dim)  # (B, G, T, D)

    def scalar_values(self, p: Projected) -> torch.Tensor:
        return p.vs

    def score_vectors(self, p: Projected):
        """Vector queries/keys added to the scalar score (hybrid), or (None, None)."""
        return None, None

    def scalar_op(self, qs, ks, vals, tau, q, k, impl):
        if impl == "approx" and qs.shape[-1] == ks.shape[-1]:  # a whole sequence (decode steps stay exact)
            return scalar_attention_approx(qs, ks, vals, tau)
        return scalar_attention(qs, ks, vals, tau, causal=True, impl=exact_impl(impl))

    def with_sink(self, p: Projected):
        """The scalar op's inputs, with the sink prepended when on: (qs, ks, values, tau, q, k, n_prefix)."""
        c = self.config
        vals = self.scalar_values(p)
        q, k = self.score_vectors(p)
        if not c.sink:
            return p.qs, p.ks, vals, p.tau, q, k, 0
        B = p.qs.shape[0]
        key = p.ks.new_full((B, self.n_scalar, 1), c.sink_key)  # (B, H_s, 1)
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

    def scalar_readout(self, qs, ks, vals, tau, q, k, impl, n_prefix: int):
        """The scalar op, or its windowed form while `decode_window` (or a `decode_select`) is set,
        or under `train_window`."""
        c = self.config
        lam = getattr(self, "scalar_scale", None)  # the hybrid's learned gain on the scalar term, if any
        if self.decode_select is not None:
            return windowed_attention(qs, ks, vals, tau, None, q=q, k=k, n_prefix=n_prefix, scalar_scale=lam,
                                      keep_fn=self.selected_keys(qs, ks, tau, q, k, n_prefix))
        window = self.decode_window if self.decode_window is not None else c.train_window
        if window is None and self.decode_budget is None:
            return self.scalar_op(qs, ks, vals, tau, q, k, impl)
        return windowed_attention(qs, ks, vals, tau, window, q=q, k=k, n_prefix=n_prefix, local=c.local_window,
                                  budget=self.decode_budget, history=QUERY_HISTORY, scalar_scale=lam,
                                  impl="naive" if impl == "naive" else "auto")

    def sink_readout(self, qs, ks, vals, tau, q, k, impl, n_prefix: int):
        """`scalar_readout` on the op inputs of `with_sink`, weighing the sink by `sink_weight` when set."""
        if self.sink_weight is None or not n_prefix:
            return self.scalar_readout(qs, ks, vals, tau, q, k, impl, n_prefix)
        o = self.scalar_readout(qs, ks, split_sink_values(vals), tau, q, k, impl, n_prefix)
        return mix_sink(o, vals[:, :, :1], self.sink_weight)

    def selected_keys(self, qs, ks, tau, q, k, n_prefix: int):
        """The installed selector's keep_fn for these op inputs (see `decode_select`)."""
        if self.decode_window is not None or self.decode_budget is not None:
            raise ValueError(f"decode_select and decode_window/decode_budget are both set on this layer "
                             f"(window={self.decode_window!r}, budget={self.decode_budget!r}): choose one key rule")
        return self.decode_select(qs, ks, tau, q, k, n_prefix)

    def attend(self, p: Projected, values=None, impl: str | None = None):
        c = self.config
        impl = impl or c.impl
        scal = qs, ks, vals, tau, q, k, n_pre = self.with_sink(p)
        o = self.sink_readout(qs, ks, vals if values is None else values, tau, q, k, impl, n_pre)[:, :, n_pre:]
        if self.n_dot:  # the dot-product heads of a mixed layer
            vd = p.v if values is None else values[:, :1, n_pre:, n_pre:].expand(-1, self.n_kv, -1, -1)
            od = softmax_attention(p.q, p.k, vd, causal=True, scale=c.scale, p=c.p, impl=exact_impl(impl))
            if n_pre and values is not None:  # the sink column, never seen by dot heads
                od = torch.cat([od.new_zeros(od[..., :n_pre].shape), od], dim=-1)
            o = torch.cat([o, od], dim=1)  # (B, H, T, Dv): scalar heads first
        return o, scal

    def attention_weights(self, x: torch.Tensor) -> torch.Tensor:
        """As `Attention.attention_weights`, computed as the softmax of the mechanism's logits
        (O(T²) per head rather than the O(T³) of reading out an identity value matrix) when every
        head is a scalar/hybrid head (not a mixed layer, not goat_hybrid's prior); with
        `decode_window` set, the windowed weights, and with `decode_select` the selected ones."""
        if self.n_scalar < self.config.n_heads or not self.sorted_decode:
            return super().attention_weights(x)
        self.check_input(x)
        qs, ks, _, tau, q, k, n_pre = self.with_sink(self.project(x, 0))
        logits = scalar_logits(qs, ks, tau) if q is None else hybrid_logits(q, k, qs, ks, tau)
        if self.decode_select is not None:
            keep = self.selected_keys(qs, ks, tau, q, k, n_pre)(0, qs.shape[-1], logits)
            logits = logits.masked_fill(~keep, float("-inf"))
        elif self.decode_window is not None or self.decode_budget is not None or self.config.train_window is not None:
            evicted = None if self.decode_budget is None else budget_evictions(
                qs, ks, self.decode_budget, history=QUERY_HISTORY, n_prefix=n_pre)
            window = self.decode_window or self.config.train_window or qs.shape[-1] or 1
            keep = window_mask(qs, ks, window, n_prefix=n_pre, evicted_at=evicted, local=self.config.local_window)
            logits = logits.masked_fill(~keep, float("-inf"))
        if n_pre and self.sink_weight is not None:  # the sink's weight: log|w| on its column
            logw = sink_weight_value(self.sink_weight).log().to(logits.dtype).view(1, -1, 1, 1)
            logits = torch.cat([logits[..., :1] + logw, logits[..., 1:]], dim=-1)
        return torch.softmax(logits, dim=-1)[:, :, n_pre:].to(x.dtype)

    # ------------------------------------------------------------------ decode

    def init_cache(self, cache, window, max_len) -> None:
        if self.n_dot:
            cache.kv = KVCache(cache.batch_size)
        cache.scalar = self.scalar_cache(cache.batch_size, self.trained_window(cache, window))

    def trained_window(self, cache, window):
        """A window-trained layer decodes through its window by default (and its local ring)."""
        c = self.config
        if window is None and c.train_window is not None and not cache.exact:
            cache.window = window = c.train_window
        if window is not None and c.local_window:
            cache.ring = Ring(c.local_window)
        return window

    def scalar_cache(self, batch_size: int, window: int | None):
        """The plain cache of every scalar key (window None, exact) or the sorted scalar cache."""
        c = self.config
        if window is None and c.impl == "naive":  # the op's reference over the plain cache
            cache = KVCache(batch_size)
            if c.sink:
                cache.append(**self.sink_entry(batch_size))
            return cache
        if window is None:
            cache = ExactScalarCache(batch_size, self.n_scalar)
            if c.sink:
                e = self.sink_entry(batch_size)
                cache.append(e["ks"], e[self.value_key], k=e.get("k"))
            return cache
        return SortedScalarCache(
            batch_size, self.n_scalar, self.value_groups, c.head_dim, d_k=self.hybrid_key_dim,
            dtype=self.wo.weight.dtype, device=self.wo.weight.device, **self.sorted_sink(),
        )

    def sorted_sink(self) -> dict:
        """The sorted cache's sink arguments: its key, value (G, D) and log-weight (H_s,), or none."""
        c = self.config
        if not c.sink:
            return {}
        logw = None if self.sink_weight is None else sink_weight_value(self.sink_weight.detach()).log()
        return {"sink_key": c.sink_key, "sink_value": self.sink_value.detach(), "sink_logw": logw}

    hybrid_key_dim = None  # vector key width the sorted cache keeps (hybrid: head_dim)

    def sink_entry(self, batch_size: int) -> dict:
        """The sink as one plain-cache entry: ks (B, H_s, 1) and values (B, G, 1, D), or
        (B, G, 1, D + 2) in the weighted-sink layout when `sink_weight` is set."""
        w = self.sink_value.detach()  # (G, D)
        v = w[None, :, None, :].expand(batch_size, -1, 1, -1)
        if self.sink_weight is not None:
            v = split_sink_values(v)
        return {"ks": w.new_full((batch_size, self.n_scalar, 1), self.config.sink_key), self.value_key: v}

    def plain_step(self, op, vals: torch.Tensor) -> torch.Tensor:
        """op(values) over a plain cache (sink first) with this step's values (B, G, T, D): the
        weighted-sink layout in and `mix_sink` out when `sink_weight` is set."""
        if self.sink_weight is None:
            return op(vals)
        o = op(token_values(vals))
        return mix_sink(o, self.sink_value.detach()[None, :, None, :], self.sink_weight.detach())

    def scalar_step(self, p: Projected, cache) -> torch.Tensor:
        """Readout (B, H_s, 1, D) of the scalar heads for one token."""
        vals = self.scalar_values(p)  # (B, G, 1, D)
        q, k = self.score_vectors(p)
        if cache.selector is not None:  # a learned key selector (cache/selected.py)
            return self.plain_step(lambda v: selected_step(self, p, cache, v, q, k), vals)
        if isinstance(cache.scalar, ExactScalarCache):  # every cached key, each augmented once (cache/exact.py)
            def exact(v):
                cache.scalar.append(p.ks, v, k=k)
                return cache.scalar.attend(p.qs, p.tau, q=q)
            return self.plain_step(exact, vals)
        if cache.window is None:  # impl="naive": the op's reference, one query against every cached key
            def naive(v):
                full = cache.scalar.append(**{"ks": p.ks, self.value_key: v, **({"k": k} if k is not None else {})})
                return self.scalar_op(p.qs, full["ks"], full[self.value_key], p.tau, q, full.get("k"), self.config.impl)
            return self.plain_step(naive, vals)
        k_t = expand_heads(k, self.n_scalar)[:, :, 0] if k is not None else None  # (B, H, D)
        tau = p.tau if p.tau.dim() == 1 else p.tau[..., 0]  # (H,) or (B, H)
        q_t = q[:, :, 0] if q is not None else None
        check_step_values(p.qs, p.ks, vals, q, k)  # once here; the cache's calls skip their own value checks
        extra = None
        if cache.ring is None:
            cache.scalar.append(p.ks[..., 0], vals[:, :, 0], k=k_t, check_values=False)
        else:
            extra = self.ring_step(cache, p, vals, k_t)
        o = cache.scalar.attend(p.qs[..., 0], tau, q=q_t, window=cache.window, extra=extra, check_values=False,
                                scalar_scale=getattr(self, "scalar_scale", None)).unsqueeze(2)  # (B, H, 1, D)
        if cache.budget is not None:
            cache.scalar.evict_to_budget(cache.budget)
        if cache.compress is not None:
            cache.scalar.compress_density(cache.compress)
        return o

    def ring_step(self, cache, p: Projected, vals, k_t):
        """Push this token into the ring of the last `local_window` tokens (the one leaving it goes
        into the sorted cache) and score the ring for this step's query: the sorted cache's `extra`
        columns, logits (B, H, w) and values (B, H, w, D)."""
        ring, H = cache.ring, self.n_scalar
        ring.push(p.ks[..., 0], vals[:, :, 0], k_t,  # a token leaving the ring enters the sorted cache (checked already)
                  lambda ks, v, k: cache.scalar.append(ks, v, k=k, check_values=False))
        rks, rv, rk = ring.view()  # (B, H, w), (B, G, w, D), (B, H, w, Dk)
        rv = expand_heads(rv, H)  # (B, H, w, D)
        tau = p.tau.view(1, H, 1) if p.tau.dim() == 1 else p.tau[..., :1]  # checked by the projection's Temperature
        if getattr(self, "scalar_scale", None) is not None:  # the hybrid's gain: -lam d^2 / tau = -d^2 / (tau / lam)
            tau = tau / self.scalar_scale.view(1, H, 1)
        if rk is None:  # the ops' score formula; the ring's keys were projected (and are finite) like the query
            logits = scalar_scores(p.qs[..., :1], rks, tau)
        else:
            logits = hybrid_scores(p.q, rk, p.qs[..., :1], rks, tau)
        return logits[:, :, 0], rv

    def prefill_readout(self, p: Projected, cache):
        """T tokens at once. Exact caches take them through the op's offset form (`step_readout`).
        An empty sorted cache (window=k, no budget, no compression): the prompt's readout is the
        windowed op (`windowed_attention`, equal to stepping the sorted cache), and the cache is
        bulk-loaded from the prompt's keys (one sort per head, `SortedScalarCache.from_tensors`).
        A sorted cache that already holds keys, evicts or compresses takes one token at a time."""
        if not isinstance(cache.scalar, SortedScalarCache):
            return None if cache.selector is not None else self.step_readout(p, cache)
        if (len(cache.scalar) or cache.budget is not None or cache.compress is not None or self.decode_select is not None
                or cache.ring is not None):
            return None
        saved = self.decode_window, self.decode_budget
        self.decode_window, self.decode_budget = cache.window, None
        try:
            o, _ = self.attend(p)  # (B, H, T, D): scalar heads windowed, dot heads of a mixed layer exact
        finally:
            self.decode_window, self.decode_budget = saved
        cache.scalar = self.sorted_from_prompt(p, cache.batch_size)
        if cache.kv is not None:  # the dot-product heads of a mixed layer
            cache.kv.append(k=p.k, v=p.v)
        return o

    def sorted_from_prompt(self, p: Projected, batch_size: int) -> SortedScalarCache:
        """The sorted scalar cache holding the T keys of `p` (and the sink), built in bulk."""
        _, k = self.score_vectors(p)
        return SortedScalarCache.from_tensors(
            p.ks, self.scalar_values(p), k=None if k is None else expand_heads(k, self.n_scalar), **self.sorted_sink(),
        )

    def step_readout(self, p: Projected, cache) -> torch.Tensor:
        o = self.scalar_step(p, cache)
        if self.n_dot:
            c = self.config
            full = cache.kv.append(k=p.k, v=p.v)
            od = softmax_attention(p.q, full["k"], full["v"], scale=c.scale, p=c.p, impl=exact_impl(c.impl))
            o = torch.cat([o, od.to(o.dtype)], dim=1)  # scalar heads first
        return o

