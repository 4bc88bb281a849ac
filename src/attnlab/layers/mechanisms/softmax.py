"""mechanism = "softmax": scaled dot-product attention with GQA, RoPE and the q·k scalings of
`attnlab.ops.softmax_attention` (docs/mechanisms.md#softmax-attention).

Static decoding (`attnlab.models.StaticDecoder`) reads a `KeyedState` of keys and values (a ring
under a sliding window) through `softmax_step`: SDPA under the mask of the slots each query sees,
with the scaling's divisor read off those keys, or split-K over a long buffer (`cache.static.split`);
the dot-product heads of a mixed scalar layer read theirs the same way.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ...cache.static import split_attention
from ...checks import trusted
from ...ops import softmax_attention
from ...ops.common.heads import expand_heads
from ...ops.common.precision import upcast
from ...ops.softmax import divisor_naive
from ..attention import Attention
from ..record import Projected
from ..registry import register
from .keyed_static import KeyedState, kv_entries


def softmax_readout(q: torch.Tensor, e: dict, ok: torch.Tensor, scale, p: float) -> torch.Tensor:
    """Softmax attention of the queries q (B, H, T, D) over the entries e ("k", "v": (B, G, m, .)) where
    ok (T, m), with the mechanism's scaling: q·k/√d, a float multiplier, or a divisor read off the
    keys each query sees (`ops.softmax.divisor_naive`, folded into the query)."""
    H, T = q.shape[1], q.shape[2]
    k, v = e["k"].to(q.dtype), e["v"].to(q.dtype)
    if scale == "sqrt_d" or not isinstance(scale, str):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=ok, enable_gqa=H != k.shape[1],
                                              scale=None if scale == "sqrt_d" else float(scale))
    c = divisor_naive(expand_heads(k, H).to(upcast(q.dtype)), ok, scale, float(p))  # (B, H, T) or (T,)
    q = (q.to(c.dtype) / (c[..., None] if c.dim() == 3 else c.view(T, 1))).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=ok, enable_gqa=H != k.shape[1], scale=1.0)


def softmax_step(q: torch.Tensor, e: dict, ok: torch.Tensor, scale, p: float, chunk: int | None) -> torch.Tensor:
    """`softmax_readout`, split over the keys in chunks of `chunk` (`cache.static.split_attention`) for
    one query per head (a step) over a buffer of whole chunks; otherwise `softmax_readout` itself."""
    B, H, T, D = q.shape
    k, v = e["k"], e["v"]
    G, N = k.shape[1], k.shape[2]
    if chunk is None or T != 1 or N % chunk:
        return softmax_readout(q, e, ok, scale, p)
    qf = q.float()
    if isinstance(scale, str) and scale != "sqrt_d":  # a divisor read off the visible keys, folded into q
        c = divisor_naive(expand_heads(k, H).float(), ok, scale, float(p))  # (B, H, 1) or (1,)
        qf = qf / (c[..., None] if c.dim() == 3 else c.view(1, 1))
    else:
        qf = qf * (1 / math.sqrt(D) if scale == "sqrt_d" else float(scale))
    S = N // chunk
    s = torch.einsum("bgrd,bgscd->bgrsc", qf.view(B, G, H // G, D), k.float().view(B, G, S, chunk, D))
    s = s.masked_fill(~ok.view(1, 1, 1, S, chunk), float("-inf"))  # (B, G, r, S, c)
    o = split_attention(s, v.view(B, G, S, chunk, v.shape[-1]))  # (B, G, r, Dv)
    return o.view(B, H, 1, -1).to(q.dtype)


@register
class SoftmaxAttention(Attention):
    mechanism = "softmax"
    uses = ("n_kv_heads", "scale", "p", "rope", "rope_base", "sliding_window")

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

    # ------------------------------------------------------------------ static decoding (keyed_static.py)

    def static_state(self, opts) -> KeyedState:
        return KeyedState(self, opts)

    def static_entries(self, dtype) -> dict:
        return kv_entries(self, dtype)

    def static_values(self, p: Projected, positions) -> dict:
        return {"k": p.k, "v": p.v}

    def static_readout(self, p: Projected, e: dict, kpos, positions, ok, chunk):
        return softmax_step(p.q, e, ok, self.config.scale, self.config.p, chunk)
