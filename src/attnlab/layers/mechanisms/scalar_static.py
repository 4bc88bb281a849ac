"""The scalar family's static decode state (`ScalarState`, what `ScalarAttention.static_state` and so
`HybridAttention`'s return): scalar and hybrid heads (Gaussian or Cauchy, GQA, the gain, value
groups, the sink and its weight) in buffers of max_len positions, and a mixed layer's dot-product
heads in a `KeyStore` of their own, read as softmax heads.

The layer says what the buffers hold: vector keys when it scores q·k besides the scalar term
(`hybrid_key_dim` set), its `value_groups` rows of values (`scalar_values`), one scalar key per
scalar head. A step reads them in one of four ways: every key (split over the buffer in chunks
on long caches, `cache.static.split`), a trained or decode window (`cache.static.window`: sorted
codes merged between steps, or every live slot under a budget), or learned selection (the K keys
a `DecodeSelector`'s search projections score highest). Every readout's scalar logits are the
family's score, `ops.scalar.scores.scalar_scores`, over the keys read.
"""

from __future__ import annotations

import math

import torch

from ...cache.options import KeyRule
from ...cache.selected import KEY_DTYPES
from ...cache.sorted import QUERY_HISTORY
from ...cache.static import (LAST, KeyStore, StaticState, budget_keep, extend_codes, extend_scratch_size, merge_codes,
                             nearest_alive, split_attention, window_keys)
from ...ops.scalar.budget import NEVER, budget_evictions
from ...ops.scalar.scores import scalar_scores
from ..sink import sink_weight_value
from .keyed_static import kv_entries
from .softmax import softmax_step

__all__ = ["ScalarState"]


class ScalarState(StaticState):
    """A scalar or hybrid layer's static state (module docstring); opts a `cache.static.StaticOptions`.

    Buffers: k (B, G, N, Dk) vector keys (hybrid heads) or None, v (B, value groups, N, D), ks
    (B, H_s, N) float32 scalar keys; with a selector sk (B, H_s, N, d_search) search keys; through a
    window codes (B, H_s, 2, N) and their merge point m, or under a budget alive (B, H_s, N) and the
    recent scalar queries qh (B, H_s, QUERY_HISTORY)."""

    def __init__(self, layer, opts):
        super().__init__(layer)
        a, c = layer, layer.config
        B, N, dev, dt = opts.batch_size, opts.max_len, opts.device, opts.dtype
        self.chunk, self.selector, self.index = opts.chunk, opts.selector, opts.layer
        self.budget, self.tail, self.window_impl = opts.budget, opts.tail, opts.window_impl
        self.kwin = opts.window or c.options.train_window  # the k nearest keys, or None: every key
        self.windowed = self.whole_prompt = not opts.exact and opts.selector is None and self.kwin is not None
        given = opts.window is not None and c.sliding_window is None  # a decode window (decode_window's rule)
        self.rule = KeyRule(window=opts.window, budget=opts.budget) if given else None  # the prompt's, in fill
        self.dots = None  # a mixed layer's dot-product heads, after the scalar heads
        if a.n_scalar < c.n_heads:
            self.dots = KeyStore(kv_entries(a, dt), B, N, c.sliding_window, dev)
        H = a.n_scalar
        buf = lambda name, x: self.register_buffer(name, x, persistent=False)  # noqa: E731
        buf("slots", torch.arange(N, device=dev))
        buf("k", None if a.hybrid_key_dim is None else torch.zeros(B, a.n_kv, N, a.qk_dim, dtype=dt, device=dev))
        buf("v", torch.zeros(B, a.value_groups, N, c.head_dim, dtype=dt, device=dev))
        buf("ks", torch.zeros(B, H, N, dtype=torch.float32, device=dev))
        sel = opts.selector
        buf("sk", None if sel is None else torch.zeros(B, H, N, sel.projections.d_search, dtype=KEY_DTYPES[sel.key_dtype],
                                                        device=dev))
        budgeted = self.windowed and self.budget is not None
        buf("alive", torch.ones(B, H, N, dtype=torch.bool, device=dev) if budgeted else None)  # live older keys
        buf("qh", torch.zeros(B, H, QUERY_HISTORY, device=dev) if budgeted else None)
        coded = self.windowed and self.budget is None
        buf("codes", torch.full((B, H, 2, N), LAST, device=dev) if coded else None)  # sorted codes, low and high
        buf("m", torch.zeros((), dtype=torch.long, device=dev) if coded else None)
        if coded:
            self.scratch_size = extend_scratch_size(self.codes)

    def reset(self) -> None:
        if self.dots is not None:
            self.dots.reset()

    def attend(self, p, positions: torch.Tensor, n: int, h: torch.Tensor) -> torch.Tensor:
        visible = self.slots[None, :n] <= positions[:, None]  # (T, n): the slots each token reads
        o = self._scalar_attend(p, h, positions, visible)
        if self.dots is not None:  # a mixed layer: its dot-product heads after the scalar heads
            c = self.layer.config
            e, _, ok = self.dots.read({"k": p.k, "v": p.v}, positions, n)
            od = softmax_step(p.q, e, ok, c.scale, c.p, None if self.dots.ring else self.chunk)
            o = torch.cat([o, od.to(o.dtype)], dim=1)
        return o

    def fill(self, p, T: int) -> torch.Tensor:
        """A whole prompt of T tokens from position 0: every entry written, under a budget the older
        keys its evictions keep; the layer's own op (its window's, when windowed) for the readout."""
        a, positions = self.layer, self.slots[:T]
        if self.dots is not None:
            self.dots.keep({"k": p.k, "v": p.v}, positions)
        if self.k is not None:
            self.k[:, :, :T] = p.k
        self.v[:, :, :T] = a.scalar_values(p)
        self.ks[:, :, :T] = p.ks.float() + 0.0
        if self.windowed and self.budget is not None:
            self._budget_prompt(p, T)
        p.key_rule = self.rule
        return a.attend(p)[0]

    def _budget_prompt(self, p, T: int) -> None:
        """The budget state after a prompt of T tokens, as T steps leave it: the older keys its
        evictions kept (`budget_evictions`, the rule `budget_keep` applies step by step; the sink,
        outside these buffers, is never evicted) and its last QUERY_HISTORY scalar queries."""
        evicted = budget_evictions(p.qs, p.ks, self.budget, history=QUERY_HISTORY, local=self.layer.config.options.local_window)
        self.alive.fill_(True)
        self.alive[:, :, :T] = evicted == NEVER  # (B, H, T): every key not evicted by the prompt's last step
        first = max(0, T - QUERY_HISTORY)
        self.qh.index_copy_(2, self.slots[first:T] % QUERY_HISTORY, p.qs[..., first:T].float())

    def merge(self, t: int, force: bool = False, scratch: torch.Tensor | None = None) -> None:
        """Before the step at position t: when the directly scored older keys would pass `tail` (or
        force), the codes come up to t - w: the keys since the last merge sorted in (`extend_codes`,
        its temporaries in scratch), or every key sorted again when forced. A budget keeps no codes."""
        if self.codes is None:
            return
        w = self.layer.config.options.local_window
        if force or t - w + 1 - self.merged > self.tail:
            upto = max(0, min(t - w + 1, t))  # every position below it written already
            if force:
                self.codes.copy_(merge_codes(self.ks, upto))
            else:  # keys below the merge point never change: only the new ones are sorted in
                extend_codes(self.codes, self.ks, self.merged, upto, scratch)
            self.m.fill_(upto)
            self.merged = upto

    def _logits(self, p, ks: torch.Tensor) -> torch.Tensor:
        """The scalar logits -λ φ((qs - ks)² / τ) of the tokens p against keys ks: (B, H, n) read by
        every token, or (B, H, T, m) each token's own -> (B, H, T, n | m), float32."""
        tau, lam = p.tau.float(), self.layer.scalar_scale
        tau = tau[None, :, None] if tau.dim() == 1 else tau
        return scalar_scores(p.qs.float(), ks, tau, self.layer.config.options.kernel,
                             None if lam is None else lam.float()[None, :, None])

    def _scalar_attend(self, p, h: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """The scalar or hybrid heads' readout (B, H_s, T, D) of the tokens p, their entries written."""
        a, n = self.layer, visible.shape[-1]
        kb, vb, ksb = self.k, self.v, self.ks
        if kb is not None:
            kb.index_copy_(2, positions, p.k.to(kb.dtype))
        vb.index_copy_(2, positions, a.scalar_values(p).to(vb.dtype))
        H = p.qs.shape[1]
        ksb.index_copy_(2, positions, p.ks.float() + 0.0)  # + 0.0: every zero +0.0 (window.float_order)
        if self.selector is not None:
            return self._learned_readout(p, h, positions, visible)
        if self.windowed:
            return self._window_readout(p, positions[0])  # a budget: then its evictions
        vb, ksb = vb[:, :, :n], ksb[:, :, :n]
        B, T = p.qs.shape[0], p.qs.shape[2]
        s = self._logits(p, ksb)  # (B, H, T, n)
        if kb is not None:  # hybrid heads: + q·k / √d, each head against its group's keys (no copy of them)
            G = kb.shape[1]
            qk = torch.einsum("bgrtd,bgnd->bgrtn", p.q.float().view(B, G, H // G, T, -1), kb[:, :, :n].float())
            s = s + qk.reshape(B, H, T, n) / math.sqrt(p.q.shape[-1])
        if a.config.sliding_window is not None:  # each query reads its last w keys (and the sink)
            visible = visible & (self.slots[None, :n] > positions[:, None] - a.config.sliding_window)
        s = s.masked_fill(~visible, float("-inf"))
        if self.chunk is not None and T == 1 and n % self.chunk == 0:  # a step: split over the cache (split-K)
            return self._split(p, s, vb).to(vb.dtype)
        G = vb.shape[1]  # each head reads its value group's rows: (B, G, r·T, n) @ (B, G, n, D)
        return self._mix(p, s, lambda w: (w.reshape(B, G, -1, n) @ vb.float()).view(B, H, T, -1)).to(vb.dtype)

    def _split(self, p, s: torch.Tensor, vb: torch.Tensor) -> torch.Tensor:
        """`_mix` of one query per head over the whole buffer, by chunks (`cache.static.split`): s
        (B, H, 1, N) the masked scores, vb (B, G, N, D) the values of the heads' groups -> (B, H, 1, D),
        float32."""
        B, H, _, N = s.shape
        G, S = vb.shape[1], N // self.chunk
        extra = None
        if self.layer.config.options.sink:  # the sink as one more partial: its logit, its value
            col, sink_v = self._sink(p, H)
            extra = (col.view(B, G, H // G), sink_v.expand(B, -1, -1, -1).reshape(B, G, H // G, -1))
        o = split_attention(s.view(B, G, H // G, S, self.chunk), vb.view(B, G, S, self.chunk, vb.shape[-1]), extra)
        return o.view(B, H, 1, -1)

    def _sink(self, p, H: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sink's logit (B, H, T, 1) for the tokens p (scalar key sink_key, zero vector key, log|w|
        added with a sink weight) and its value (1, H, 1, D), float32."""
        a = self.layer
        col = self._logits(p, p.qs.new_full((1, 1, 1, 1), a.config.options.sink_key, dtype=torch.float32))  # (B, H, T, 1)
        if a.sink_weight is not None:
            col = col + sink_weight_value(a.sink_weight).float().log()[None, :, None, None]
        return col, a.sink_value.float().repeat_interleave(H // a.sink_value.shape[0], dim=0)[None, :, None, :]

    def _mix(self, p, s: torch.Tensor, weigh) -> torch.Tensor:
        """softmax over the scores s (B, H, T, m) of the keys read, and the sink's column when the layer
        has one (`_sink`); weigh(w) reads the keys' values with their weights w (B, H, T, m) -> the
        readout (B, H, T, D), float32."""
        if not self.layer.config.options.sink:
            return weigh(torch.softmax(s, dim=-1))
        col, sink_v = self._sink(p, s.shape[1])
        w = torch.softmax(torch.cat([col, s], dim=-1), dim=-1)
        return weigh(w[..., 1:]) + w[..., :1] * sink_v

    def _window_readout(self, p, t: torch.Tensor) -> torch.Tensor:
        """The readout (B, H, 1, D) of the token at position t (a 0-dim tensor) through the window:
        the last w keys and the k nearest older ones (`cache.static.window_keys`; under a budget
        `nearest_alive` among the live ones, then the step's evictions)."""
        ksb, w = self.ks, self.layer.config.options.local_window
        B, H, N = ksb.shape
        qs = p.qs[..., 0].float()
        if self.budget is None:
            idx, ok = window_keys(qs, ksb, self.codes, self.m, t - w, self.kwin, self.tail, impl=self.window_impl)
        else:  # the live older keys, then the step's evictions (the cache's order: read, then evict)
            alive, qh = self.alive, self.qh
            older = alive & (self.slots <= t - w)
            idx, ok = nearest_alive(qs, ksb, older, self.kwin)
            qh.index_copy_(2, (t % QUERY_HISTORY)[None], qs[..., None])
            seen = torch.arange(QUERY_HISTORY, device=t.device) <= t  # the queries recorded so far
            lo = qh.masked_fill(~seen, float("inf")).amin(-1)
            hi = qh.masked_fill(~seen, float("-inf")).amax(-1)
            alive.copy_(alive & (~older | budget_keep(ksb, older, lo, hi, self.budget)))
        if w:  # the ring: positions t, t - 1, ..., t - w + 1
            ring = t - torch.arange(w, device=t.device)
            idx = torch.cat([ring.clamp(min=0).expand(B, H, w), idx], -1)
            ok = torch.cat([(ring >= 0).expand(B, H, w), ok], -1)
        return self._read(p, idx[:, :, None], ok[:, :, None])

    def _learned_readout(self, p, h: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
        """The readout (B, H, T, D) through learned selection: each token's search key stored, every
        visible stored key scored by its search query (one matmul), the K best read."""
        skb = self.sk
        sq, sk = self.selector.projections(self.index, h, start=positions[0])  # (B, H, T, d)
        skb.index_copy_(2, positions, sk.to(skb.dtype))
        n = visible.shape[-1]
        scores = (sq.to(skb.dtype) @ skb[:, :, :n].transpose(-1, -2)).float()  # (B, H, T, n)
        best = scores.masked_fill(~visible, float("-inf")).topk(min(self.selector.K, n), dim=-1)
        return self._read(p, best.indices, best.values > float("-inf"))

    def _read(self, p, idx: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        """The hybrid op of the tokens p (T of them) over the stored keys idx (B, H, T, m) where ok
        -> (B, H, T, D): each head's keys and values gathered from its group, nothing else read."""
        kb, vb, ksb = self.k, self.v, self.ks
        B, H, T, m = idx.shape
        N = ksb.shape[-1]

        def pick(buf):  # (B, G, N, D) -> (B, H, T, m, D): each head's entries from its group
            group = torch.arange(H, device=idx.device) // (H // buf.shape[1])
            flat = (group[None, :, None, None] * N + idx).view(B, H * T * m, 1)
            return buf.reshape(B, -1, buf.shape[-1]).gather(1, flat.expand(-1, -1, buf.shape[-1])).view(B, H, T, m, -1)

        s = self._logits(p, ksb.gather(-1, idx.view(B, H, T * m)).view(B, H, T, m))  # (B, H, T, m)
        if kb is not None:  # hybrid heads: + q·k / √d
            s = s + (p.q.float()[..., None, :] * pick(kb).float()).sum(-1) / math.sqrt(p.q.shape[-1])
        vals = pick(vb).float()
        return self._mix(p, s.masked_fill(~ok, float("-inf")), lambda w: (w[..., None] * vals).sum(-2)).to(vb.dtype)
