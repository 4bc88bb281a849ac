"""Exact decoding of scalar and hybrid heads without re-augmenting the context every step.

The fast path of `ops.scalar_attention` / `ops.hybrid_attention` scores a query against a key
through augmented vectors, q' = [q / sqrt(d), 2 (qs - r) / tau, -1 / tau] and
k' = [k, ks - r, (ks - r)^2] (docs/mechanisms.md; r the first key under causal masking).
Under causal decoding r is fixed once the first key is cached, so every key's k' can be built
once, when it arrives, and kept. `ExactScalarCache` does that: it stores k' and the values
padded to one head width (what the fused SDPA kernel needs), so a step is one SDPA call over
the cache, with no per-step copy of the context. The result is the op's on the same tokens
(tests compare it with stepping the op over the growing context, and with the naive formula).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..checks import check_finite, check_like, check_tensor
from ..ops.common.heads import expand_heads
from ..ops.common.precision import upcast
from ..ops.scalar.args import tau_tensor
from ..ops.scalar.fused import augment
from .kv import KVCache


class ExactScalarCache:
    """Every key of H scalar (or hybrid) heads, kept as the fast path's augmented key.

    >>> cache = ExactScalarCache(batch_size=1, n_heads=4)
    >>> cache.append(ks_t, v_t, k=k_t)             # ks_t (B, H, 1), v_t (B, G, 1, Dv), k_t (B, Gk, 1, D) or None
    >>> o = cache.attend(qs_t, tau, q=q_t)         # (B, H, 1, Dv): exact attention over every cached key

    Keys and values are checked (finite, one dtype) as they arrive; each is read by every later
    step. Sink entries go in first, like any key. The cached keys are detached: decoding does
    not differentiate through the cache.
    """

    def __init__(self, batch_size: int, n_heads: int):
        self.kv = KVCache(batch_size)
        self.n_heads = n_heads
        self.ref: torch.Tensor | None = None  # (B, H, 1): the first key, the shift r of the augmentation
        self.dv: int | None = None
        self.d_k: int | None = None  # hybrid key width, 0 for scalar heads
        self.out_dtype: torch.dtype | None = None  # the values' dtype, the readout's

    def __len__(self) -> int:
        return len(self.kv)

    def nbytes(self) -> int:
        """Bytes of the cached tokens (`KVCache.nbytes`)."""
        return self.kv.nbytes()

    def append(self, ks: torch.Tensor, v: torch.Tensor, k: torch.Tensor | None = None) -> None:
        """Cache T new tokens: ks (B, H, T), v (B, G, T, Dv), k (B, Gk, T, D) for hybrid heads."""
        check_tensor("ks", ks, 3)
        check_tensor("v", v, 4)
        check_like("v", v, ks, "ks")
        if k is not None:
            check_tensor("k", k, 4)
            check_like("k", k, ks, "ks")
        H = self.n_heads
        if ks.shape[1] != H or v.shape[2] != ks.shape[2] or H % v.shape[1] or (k is not None and (
                k.shape[2] != ks.shape[2] or H % k.shape[1])):
            raise ValueError(f"append needs ks (B, {H}, T), v (B, G, T, Dv) and k (B, Gk, T, D) with G, Gk dividing "
                             f"{H}; got ks {tuple(ks.shape)}, v {tuple(v.shape)}, k {None if k is None else tuple(k.shape)}")
        d_k = 0 if k is None else k.shape[3]
        if self.d_k is not None and (d_k, v.shape[3]) != (self.d_k, self.dv):
            raise ValueError(f"append must bring k width {self.d_k} and value width {self.dv} as before, "
                             f"got {d_k} and {v.shape[3]}")
        for name, x in (("ks", ks), ("v", v), ("k", k)):
            if x is not None:
                check_finite(name, x)
        cdt = upcast(ks.dtype)
        if self.ref is None:
            self.ref, self.d_k, self.dv, self.out_dtype = ks.detach()[..., :1].to(cdt), d_k, v.shape[3], v.dtype
        _, ka = augment(ks, ks, torch.ones((), dtype=cdt, device=ks.device), cdt, True, ref=self.ref)  # (B, H, T, 2)
        if k is not None:
            ka = torch.cat([expand_heads(k, H).to(cdt), ka], dim=-1)  # (B, H, T, D + 2)
        width = max(ka.shape[-1], self.dv)
        self.kv.append(ka=F.pad(ka, (0, width - ka.shape[-1])).detach(),
                       v=F.pad(expand_heads(v, H).to(cdt), (0, width - self.dv)).detach())

    def attend(self, qs: torch.Tensor, tau, q: torch.Tensor | None = None) -> torch.Tensor:
        """Exact attention of Tq new queries (the last Tq cached positions, causally masked) over
        every cached key: qs (B, H, Tq), tau a float, (H,) or (B, H, Tq), q (B, H, Tq, D) for
        hybrid heads. Returns (B, H, Tq, Dv) in the values' dtype."""
        if self.ref is None:
            raise ValueError("attend needs at least one cached key: append first")
        check_tensor("qs", qs, 3)
        B, H, Tq = qs.shape
        if (B, H) != tuple(self.ref.shape[:2]) or Tq > len(self):
            raise ValueError(f"qs must be (B, H, Tq) with (B, H) = {tuple(self.ref.shape[:2])} and Tq <= {len(self)} "
                             f"cached keys, got {tuple(qs.shape)}")
        if (q is None) != (self.d_k == 0) or (q is not None and (q.shape[:3] != qs.shape or q.shape[3] != self.d_k)):
            raise ValueError(f"q must be {'None (scalar heads)' if self.d_k == 0 else f'(B, H, Tq, {self.d_k})'}, "
                             f"got {None if q is None else tuple(q.shape)}")
        check_finite("qs", qs)
        if q is not None:
            check_like("q", q, qs, "qs")
            check_finite("q", q)
        cdt = self.ref.dtype
        inv_tau = 1.0 / tau_tensor(tau, B, H, Tq, cdt, qs.device)
        qa, _ = augment(qs, qs, inv_tau, cdt, True, ref=self.ref)  # (B, H, Tq, 2)
        if q is not None:
            qa = torch.cat([q.to(cdt) * (1.0 / math.sqrt(self.d_k)), qa], dim=-1)  # (B, H, Tq, D + 2)
        full = self.kv.view()
        ka, v = full["ka"], full["v"]  # (B, H, T, W)
        qa = F.pad(qa, (0, ka.shape[-1] - qa.shape[-1]))
        mask = None
        if Tq > 1:  # bottom-right causal alignment
            t = torch.arange(len(self), device=qs.device)
            mask = t[None, :] <= t[-Tq:, None]
        out = F.scaled_dot_product_attention(qa, ka, v, attn_mask=mask, scale=1.0)  # (B, H, Tq, W)
        return out[..., : self.dv].to(self.out_dtype)
