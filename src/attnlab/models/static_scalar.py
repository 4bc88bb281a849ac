"""The scalar family's readouts in a `StaticDecoder`: scalar and hybrid heads (Gaussian or Cauchy, GQA,
the gain, value groups, the sink and its weight) read from the decoder's own buffers, in one of four
ways: every key (split over the cache in chunks on long caches, `static_split`), a trained or decode
window (`static_window`: sorted codes, or every live slot under a budget), or learned selection (the
K keys a `DecodeSelector`'s search projections score highest). A mixin of `StaticDecoder`: its methods
read the decoder's buffers (k{i}, v{i}, ks{i}, ...) and options (chunk, selector, windowed, budget)."""

from __future__ import annotations

import math

import torch

from ..cache.sorted import QUERY_HISTORY
from ..layers.sink import sink_weight_value
from .static_split import split_attention
from .static_state import scalar_term
from .static_window import budget_keep, nearest_alive, window_keys

__all__ = ["ScalarReadouts"]


class ScalarReadouts:
    """The scalar and hybrid heads' readouts of `StaticDecoder` (module docstring)."""

    window_impl = "auto"  # a trained window's choice of keys: one Triton kernel on CUDA (`window_keys`' impl)

    def _scalar_attend(self, i: int, a, p, h: torch.Tensor, positions: torch.Tensor, visible: torch.Tensor):
        """The scalar or hybrid heads' readout (B, H_s, T, D) of layer i's tokens p, their entries written."""
        n = visible.shape[-1]
        kb, vb = getattr(self, f"k{i}", None), getattr(self, f"v{i}")
        if kb is not None:
            kb.index_copy_(2, positions, p.k.to(kb.dtype))
        vals = a.scalar_values(p)
        vb.index_copy_(2, positions, vals.to(vb.dtype))
        H = p.qs.shape[1]
        ksb = getattr(self, f"ks{i}")
        ksb.index_copy_(2, positions, p.ks.float() + 0.0)  # + 0.0: every zero +0.0 (static_window.float_order)
        if self.selector is not None:
            return self._learned_readout(i, a, p, h, positions, visible)
        if self.windowed[i]:
            return self._window_readout(i, a, p, positions[0])  # a budget: then its evictions
        vb, ksb = vb[:, :, :n], ksb[:, :, :n]
        B, T = p.qs.shape[0], p.qs.shape[2]
        s = -scalar_term(a, p, ksb[:, :, None, :])  # (B, H, T, n)
        if kb is not None:  # hybrid heads: + q·k / √d, each head against its group's keys (no copy of them)
            G = kb.shape[1]
            qk = torch.einsum("bgrtd,bgnd->bgrtn", p.q.float().view(B, G, H // G, T, -1), kb[:, :, :n].float())
            s = s + qk.reshape(B, H, T, n) / math.sqrt(p.q.shape[-1])
        if a.config.sliding_window is not None:  # each query reads its last w keys (and the sink)
            visible = visible & (self.slots[None, :n] > positions[:, None] - a.config.sliding_window)
        s = s.masked_fill(~visible, float("-inf"))
        if self.chunk is not None and T == 1 and n % self.chunk == 0:  # a step: split over the cache (split-K)
            return self._split(a, p, s, vb).to(vb.dtype)
        G = vb.shape[1]  # each head reads its value group's rows: (B, G, r·T, n) @ (B, G, n, D)
        return self._mix(a, p, s, lambda w: (w.reshape(B, G, -1, n) @ vb.float()).view(B, H, T, -1)).to(vb.dtype)

    def _split(self, a, p, s: torch.Tensor, vb: torch.Tensor) -> torch.Tensor:
        """`_mix` of one query per head over the whole buffer, by chunks (`static_split`): s (B, H, 1, N)
        the masked scores, vb (B, G, N, D) the values of the heads' groups -> (B, H, 1, D), float32."""
        B, H, _, N = s.shape
        G, S = vb.shape[1], N // self.chunk
        extra = None
        if a.config.sink:  # the sink as one more partial: its logit, its value
            col, sink_v = self._sink(a, p, H)
            extra = (col.view(B, G, H // G), sink_v.expand(B, -1, -1, -1).reshape(B, G, H // G, -1))
        o = split_attention(s.view(B, G, H // G, S, self.chunk), vb.view(B, G, S, self.chunk, vb.shape[-1]), extra)
        return o.view(B, H, 1, -1)

    def _sink(self, a, p, H: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The sink's logit (B, H, T, 1) for the tokens p (scalar key sink_key, zero vector key, log|w|
        added with a sink weight) and its value (1, H, 1, D), float32."""
        c = a.config
        col = -scalar_term(a, p, p.qs.new_full((1, 1, 1, 1), c.sink_key, dtype=torch.float32))  # (B, H, T, 1)
        if a.sink_weight is not None:
            col = col + sink_weight_value(a.sink_weight).float().log()[None, :, None, None]
        return col, a.sink_value.float().repeat_interleave(H // a.sink_value.shape[0], dim=0)[None, :, None, :]

    def _mix(self, a, p, s: torch.Tensor, weigh) -> torch.Tensor:
        """softmax over the scores s (B, H, T, m) of the keys read, and the sink's column when the layer
        has one (`_sink`); weigh(w) reads the keys' values with their weights w (B, H, T, m) -> the
        readout (B, H, T, D), float32."""
        if not a.config.sink:
            return weigh(torch.softmax(s, dim=-1))
        col, sink_v = self._sink(a, p, s.shape[1])
        w = torch.softmax(torch.cat([col, s], dim=-1), dim=-1)
        return weigh(w[..., 1:]) + w[..., :1] * sink_v

    def _window_readout(self, i: int, a, p, t: torch.Tensor) -> torch.Tensor:
        """Layer i's hybrid readout (B, H, 1, D) for the token at position t (a 0-dim tensor) through
        its trained window: the last w keys and the k nearest older ones (`static_window.window_keys`)."""
        ksb = getattr(self, f"ks{i}")
        w, kwin = a.config.local_window, self.kwin[i]
        B, H, N = ksb.shape
        qs = p.qs[..., 0].float()
        if self.budget is None:
            idx, ok = window_keys(qs, ksb, getattr(self, f"codes{i}"), getattr(self, f"m{i}"), t - w, kwin, self.tail,
                                  impl=self.window_impl)
        else:  # the live older keys, then the step's evictions (the cache's order: read, then evict)
            alive, qh = getattr(self, f"alive{i}"), getattr(self, f"qh{i}")
            older = alive & (self.slots <= t - w)
            idx, ok = nearest_alive(qs, ksb, older, kwin)
            qh.index_copy_(2, (t % QUERY_HISTORY)[None], qs[..., None])
            seen = torch.arange(QUERY_HISTORY, device=t.device) <= t  # the queries recorded so far
            lo = qh.masked_fill(~seen, float("inf")).amin(-1)
            hi = qh.masked_fill(~seen, float("-inf")).amax(-1)
            alive.copy_(alive & (~older | budget_keep(ksb, older, lo, hi, self.budget)))
        if w:  # the ring: positions t, t - 1, ..., t - w + 1
            ring = t - torch.arange(w, device=t.device)
            idx = torch.cat([ring.clamp(min=0).expand(B, H, w), idx], -1)
            ok = torch.cat([(ring >= 0).expand(B, H, w), ok], -1)
        return self._read(i, a, p, idx[:, :, None], ok[:, :, None])

    def _learned_readout(self, i: int, a, p, h: torch.Tensor, positions: torch.Tensor,
                         visible: torch.Tensor) -> torch.Tensor:
        """Layer i's hybrid readout (B, H, T, D) through learned selection: each token's search key
        stored, every visible stored key scored by its search query (one matmul), the K best read."""
        skb = getattr(self, f"sk{i}")
        sq, sk = self.selector.projections(i, h, start=positions[0])  # (B, H, T, d)
        skb.index_copy_(2, positions, sk.to(skb.dtype))
        n = visible.shape[-1]
        scores = (sq.to(skb.dtype) @ skb[:, :, :n].transpose(-1, -2)).float()  # (B, H, T, n)
        best = scores.masked_fill(~visible, float("-inf")).topk(min(self.selector.K, n), dim=-1)
        return self._read(i, a, p, best.indices, best.values > float("-inf"))

    def _read(self, i: int, a, p, idx: torch.Tensor, ok: torch.Tensor) -> torch.Tensor:
        """The hybrid op of layer i's tokens p (T of them) over the stored keys idx (B, H, T, m) where ok
        -> (B, H, T, D): each head's keys and values gathered from its group, nothing else read."""
        kb, vb, ksb = getattr(self, f"k{i}", None), getattr(self, f"v{i}"), getattr(self, f"ks{i}")
        B, H, T, m = idx.shape
        N = ksb.shape[-1]

        def pick(buf):  # (B, G, N, D) -> (B, H, T, m, D): each head's entries from its group
            group = torch.arange(H, device=idx.device) // (H // buf.shape[1])
            flat = (group[None, :, None, None] * N + idx).view(B, H * T * m, 1)
            return buf.reshape(B, -1, buf.shape[-1]).gather(1, flat.expand(-1, -1, buf.shape[-1])).view(B, H, T, m, -1)

        s = -scalar_term(a, p, ksb.gather(-1, idx.view(B, H, T * m)).view(B, H, T, m))  # (B, H, T, m)
        if kb is not None:  # hybrid heads: + q·k / √d
            s = s + (p.q.float()[..., None, :] * pick(kb).float()).sum(-1) / math.sqrt(p.q.shape[-1])
        vals = pick(vb).float()
        return self._mix(a, p, s.masked_fill(~ok, float("-inf")),
                         lambda w: (w[..., None] * vals).sum(-2)).to(vb.dtype)
