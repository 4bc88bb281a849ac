"""The scalar and hybrid mechanisms' decoding (`ScalarDecode`, a base of `ScalarAttention`): the
plain, exact or sorted scalar cache, the ring of a window-trained layer's last tokens, a learned key
selector's plain cache (`attnlab.cache.selected`), prefill and the single-token step. The module
docstring of scalar.py describes the caches' rules."""

from __future__ import annotations

from dataclasses import replace

import torch

from ...checks import trusted
from ...cache.exact import ExactScalarCache
from ...cache.kv import KVCache
from ...cache.options import KeyRule
from ...cache.ring import Ring
from ...cache.selected import gather_selected, learned_select, masked_readout, prompt_search, selected_positions
from ...cache.sorted import SortedScalarCache
from ...cache.sorted_read import check_step_values
from ...index.pages import scalar_term
from ...ops import softmax_attention
from ...ops.common.heads import expand_heads
from ...ops.scalar import hybrid_scores, scalar_scores
from ..record import Projected
from ..sink import mix_sink, sink_weight_value, split_sink_values, token_values


def exact_impl(impl: str) -> str:
    """The impl of the exact ops beside the scalar heads' own (dot-product heads of a mixed layer):
    impl="approx" approximates only the scalar heads, and "triton" names their kernel; both run "auto"."""
    return "auto" if impl in ("approx", "triton") else impl



# Longest prompt the CPU takes through the windowed op in one pass rather than token by token
# through the caches (O(T log T), about 4 ms a token: the window's decode step in
# benchmarks/results/decode_speed.json). Measured on the windowed model (configs/windowed.toml's
# shape): with every key scored in the selection (O(T^2), one thread), 8K tokens 15.4 s against
# 56.8 s stepped and 16K 61 s against about 115 s; since the selection reads sorted candidates past
# 4,096 keys (ops/scalar/nearest.py) and gathers its keys, benchmarks/decode_speed.py (two threads
# for prompts, benchmarks/results/decode_speed_logs) took 16K in 7.2 s, 32K in 29.1 s and 64K in
# 67.2 s, against about 4.5 minutes stepped at 64K.
CPU_BULK_PREFILL = 131072

class ScalarDecode:
    """Decode methods of `ScalarAttention` (and so of `HybridAttention`)."""

    def init_cache(self, cache, window, max_len) -> None:
        if self.n_mixed:
            cache.kv = KVCache(cache.batch_size, window=self.config.sliding_window)
        cache.scalar = self.scalar_cache(cache.batch_size, self.trained_window(cache, window))

    def trained_window(self, cache, window):
        """A window-trained layer decodes through its window by default (and its local ring)."""
        c = self.config
        if window is not None and c.sliding_window is not None:
            raise ValueError(f"window={window}: this layer reads a sliding window of {c.sliding_window} keys "
                             f"(model.attention.sliding_window), not a sorted cache's window; decode it with window=None")
        if window is None and c.options.train_window is not None and not cache.exact:
            cache.window = window = c.options.train_window
        if window is not None and c.options.local_window:
            cache.ring = Ring(c.options.local_window)
        return window

    def scalar_cache(self, batch_size: int, window: int | None):
        """The plain cache of every scalar key (window None, exact) or the sorted scalar cache. A
        hybrid's learned gain, which the exact cache does not apply, takes the plain cache."""
        c = self.config
        if window is None and (c.impl == "naive" or c.options.kernel != "gaussian" or c.sliding_window is not None
                               or self.scalar_scale is not None):
            cache = KVCache(batch_size, window=c.sliding_window, keep=int(c.options.sink))  # the op over the plain cache (a sliding window's)
            if c.options.sink:
                cache.append(**self.sink_entry(batch_size))
            return cache
        if window is None:
            cache = ExactScalarCache(batch_size, self.n_scalar)
            if c.options.sink:
                e = self.sink_entry(batch_size)
                cache.append(e["ks"], e[self.value_key], k=e.get("k"))
            return cache
        return SortedScalarCache(
            batch_size, self.n_scalar, self.value_groups, c.head_dim, d_k=self.hybrid_key_dim,
            dtype=self.wo.weight.dtype, device=self.wo.weight.device, kernel=c.options.kernel, **self.sorted_sink(),
        )

    def sorted_sink(self) -> dict:
        """The sorted cache's sink arguments: its key, value (G, D) and log-weight (H_s,), or none."""
        c = self.config
        if not c.options.sink:
            return {}
        logw = None if self.sink_weight is None else sink_weight_value(self.sink_weight.detach()).log()
        return {"sink_key": c.options.sink_key, "sink_value": self.sink_value.detach(), "sink_logw": logw}

    def sink_entry(self, batch_size: int) -> dict:
        """The sink as one plain-cache entry: ks (B, H_s, 1) and values (B, G, 1, D), or
        (B, G, 1, D + 2) in the weighted-sink layout when `sink_weight` is set; and a hybrid's zero
        vector key (B, G, 1, D)."""
        w = self.sink_value.detach()  # (G, D)
        v = w[None, :, None, :].expand(batch_size, -1, 1, -1)
        if self.sink_weight is not None:
            v = split_sink_values(v)
        entry = {"ks": w.new_full((batch_size, self.n_scalar, 1), self.config.options.sink_key), self.value_key: v}
        if self.hybrid_key_dim is not None:
            entry["k"] = self.sink_value.new_zeros(batch_size, self.n_kv, 1, self.hybrid_key_dim)
        return entry

    def attach_selector(self, cache, selector, index: int) -> None:
        """Make `cache` (an exact decode cache of this layer, block `index`) decode through `selector`
        (an `attnlab.cache.selected.DecodeSelector`): a plain cache of every key, the sink first."""
        cache.scalar = KVCache(cache.batch_size)
        if self.config.options.sink:
            cache.scalar.append(**self.sink_entry(cache.batch_size))
        cache.selector = selector.layer_state(index)

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
            return self.plain_step(lambda v: self.selected_step(p, cache, v, q, k), vals)
        if isinstance(cache.scalar, ExactScalarCache):  # every cached key, each augmented once (cache/exact.py)
            def exact(v):
                cache.scalar.append(p.ks, v, k=k)
                return cache.scalar.attend(p.qs, p.tau, q=q)
            return self.plain_step(exact, vals)
        if cache.window is None:  # impl="naive": the op's reference, one query against every cached key
            def naive(v):
                full = cache.scalar.append(**{"ks": p.ks, self.value_key: v, **({"k": k} if k is not None else {})})
                return self.scalar_op(p.qs, full["ks"], full[self.value_key], p.tau, q, full.get("k"), self.config.impl,
                                      int(self.config.options.sink))
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
                                scalar_scale=self.scalar_scale).unsqueeze(2)  # (B, H, 1, D)
        if cache.budget is not None:
            cache.scalar.evict_to_budget(cache.budget)
        if cache.compress is not None:
            cache.scalar.compress_density(cache.compress)
        return o

    def selected_step(self, p: Projected, cache, vals: torch.Tensor, q, k) -> torch.Tensor:
        """Readout (B, H_s, 1, D) of one token through `cache.selector`: the token's keys appended to
        the plain cache (the sink first), then the op over the sink and the selected keys."""
        if p.qs.shape[-1] != 1:
            raise RuntimeError("a selector cache decodes one token at a time")
        full = cache.scalar.append(**{"ks": p.ks, self.value_key: vals, **({"k": k} if k is not None else {})})
        idx, valid = cache.selector.select(p, q, k, *scalar_term(self))  # (B, H, k)
        pick, ok = selected_positions(idx, valid, int(self.config.options.sink))  # the sink, then the selection
        ks, vv, kk = gather_selected(full, self.value_key, pick, self.n_scalar)
        if bool(ok.all()):
            return self.scalar_op(p.qs, ks, vv, p.tau, q, kk, self.config.impl)
        return masked_readout(p.qs, ks, vv, p.tau, q, kk, ok, self.config.options.kernel, self.scalar_scale)

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
        lam = self.scalar_scale  # the hybrid's gain on the scalar term
        lam, kernel = None if lam is None else lam.view(1, H, 1), self.config.options.kernel
        if rk is None:  # the ops' score formula; the ring's keys were projected (and are finite) like the query
            logits = scalar_scores(p.qs[..., :1], rks, tau, kernel, lam)
        else:
            logits = hybrid_scores(p.q, rk, p.qs[..., :1], rks, tau, kernel, lam)
        return logits[:, :, 0], rv

    def prefill_readout(self, p: Projected, cache):
        """T tokens at once. Exact caches take them through the op's offset form (`step_readout`).
        An empty sorted cache (window=k, no budget, no compression): the prompt's readout is the
        windowed op (`windowed_attention`, equal to stepping the sorted cache), and the cache is
        bulk-loaded from the prompt's keys (one sort per head, `SortedScalarCache.from_tensors`); with a
        local window the last w tokens fill the ring instead (`Ring.fill`) and only the older ones go
        into the sorted cache, as stepping would leave them. A sorted cache that already holds keys,
        evicts or compresses takes one token at a time."""
        if not isinstance(cache.scalar, SortedScalarCache):
            return self.selected_prefill(p, cache) if cache.selector is not None else self.step_readout(p, cache)
        if (len(cache.scalar) or cache.budget is not None or cache.compress is not None
                or (cache.ring is not None and len(cache.ring))):
            return None
        if p.ks.device.type == "cpu" and p.ks.shape[-1] > CPU_BULK_PREFILL:
            return None  # the windowed op's selection is O(T^2): past this, stepping (O(T log T)) is faster
        # (B, H, T, D): scalar heads windowed, dot heads of a mixed layer exact
        o, _ = self.attend(replace(p, key_rule=KeyRule(window=cache.window)))
        if cache.ring is None:
            cache.scalar = self.sorted_from_prompt(p, cache.batch_size)
        else:  # the last w tokens into the ring, the older ones (those that left it) into the sorted cache
            T = p.ks.shape[-1]
            old = max(0, T - cache.ring.size)
            if old:
                cache.scalar = self.sorted_from_prompt(p, cache.batch_size, end=old)
            _, k = self.score_vectors(p)
            cache.ring.fill(p.ks[..., old:], self.scalar_values(p)[:, :, old:],
                            None if k is None else expand_heads(k, self.n_scalar)[:, :, old:], start=old)
        if cache.kv is not None:  # the dot-product heads of a mixed layer
            cache.kv.append(k=p.k, v=p.v)
        return o

    def selected_prefill(self, p: Projected, cache):
        """Readout (B, H, T, D) of a whole prompt through an exact-index learned selector in one pass, or
        None when `cache` must take it token by token (`cache.selected.prompt_search`). The layer's own
        op reads, per query, the K causal keys its search query scores highest (what stepping the
        index selects); then the plain cache and the index take every prompt key, as T steps would."""
        search = prompt_search(cache.selector, p.qs.shape[-1])
        if search is None:
            return None
        sq, sk = search  # (B, H, T, d), the positions the layer decodes
        rule = KeyRule(select=learned_select(sq, sk, cache.selector.spec.K))
        o, _ = self.attend(replace(p, key_rule=rule))  # scalar heads through the selection (and a mixed layer's dot heads)
        vals = self.scalar_values(p)
        _, k = self.score_vectors(p)
        cache.scalar.append(**{"ks": p.ks, self.value_key: vals if self.sink_weight is None else token_values(vals),
                               **({"k": k} if k is not None else {})})
        cache.selector.add_prompt(sk)
        if cache.kv is not None:  # the dot-product heads of a mixed layer
            cache.kv.append(k=p.k, v=p.v)
        return o

    def sorted_from_prompt(self, p: Projected, batch_size: int, end: int | None = None) -> SortedScalarCache:
        """The sorted scalar cache holding the keys of `p` (its first `end`; all T when None) and the
        sink, built in bulk."""
        _, k = self.score_vectors(p)
        T = p.ks.shape[-1] if end is None else end
        return SortedScalarCache.from_tensors(
            p.ks[..., :T], self.scalar_values(p)[:, :, :T], k=None if k is None else expand_heads(k, self.n_scalar)[:, :, :T],
            kernel=self.config.options.kernel, **self.sorted_sink(),
        )

    def step_readout(self, p: Projected, cache) -> torch.Tensor:
        o = self.scalar_step(p, cache)
        if self.n_mixed:
            c = self.config
            full = cache.kv.append(k=p.k, v=p.v)
            with trusted(full["k"], full["v"]):  # checked token by token at append
                od = softmax_attention(p.q, full["k"], full["v"], scale=c.scale, p=c.p, impl=exact_impl(c.impl),
                                       window=c.sliding_window)
            o = torch.cat([o, od.to(o.dtype)], dim=1)  # scalar heads first
        return o

