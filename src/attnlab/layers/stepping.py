"""Token-by-token decode for `Attention`: `make_cache` and `step`.

`step` projects one token at its absolute position, appends what later tokens need to the
cache, reads out the new query against everything cached, and finishes (gate, W_O) exactly as
`forward` does, so T steps reproduce `forward` on the whole sequence.

- softmax / principled / dot-product heads: a growing `KVCache` of k, v (and kg); principled
  reads out with its op, which takes fewer queries than keys;
- scalar / hybrid heads: the same plain cache of ks (and k), values per group, or with
  `window=k` the sorted scalar cache of `attnlab.cache.sorted`, which attends the k nearest keys;
  the sink, when on, is the plain cache's first entry, or the sorted cache's built-in sink entry,
  a candidate at every step in addition to the window;
- cosformer / gla / ssd: the op's recurrent state, advanced by its `*_step` function.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ..cache.kv import KVCache, RecurrentState
from ..ops.cosformer import cosformer_step
from ..ops.gla import gla_step, ssd_step
from .config import LINEAR_FAMILY
from ..ops import hybrid_attention, principled_attention, scalar_attention, softmax_attention


@dataclass
class LayerCache:
    """Decode state of one `Attention` layer. pos: tokens seen (the next token's position).

    kv: plain cache of the vector heads (k, v, and kg / ks where used); scalar: the scalar heads'
    cache (a KVCache of ks, vs or a SortedScalarCache); state: the linear family's RecurrentState.
    """

    batch_size: int
    pos: int = 0
    kv: KVCache | None = None
    scalar: Any = None
    state: RecurrentState | None = None
    window: int | None = None
    max_len: int | None = None


def make_cache(layer, batch_size: int, *, window: int | None = None, max_len: int | None = None) -> LayerCache:
    c, m = layer.config, layer.config.mechanism
    if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
    if window is not None:
        if not layer.n_scalar:
            raise ValueError(f"window is for scalar and hybrid heads; mechanism {m!r} has none (got window={window!r})")
        if isinstance(window, bool) or not isinstance(window, int) or window < 1:
            raise ValueError(f"window must be an int >= 1 or None, got {window!r}")
    if max_len is not None and m != "cosformer":
        raise ValueError(f"max_len is the cosformer horizon; mechanism {m!r} takes none (got {max_len!r})")
    cache = LayerCache(batch_size, window=window)
    if m in LINEAR_FAMILY:
        cache.state = RecurrentState(batch_size)
        if m == "cosformer":
            cache.max_len = max_len or c.cosformer_max_len
            if cache.max_len is None:
                raise ValueError(
                    "max_len is needed to decode cosformer (the horizon M of its cos reweighting): "
                    "pass make_cache(..., max_len=M) or set AttentionConfig.cosformer_max_len"
                )
        return cache
    if m == "scalar" and layer.n_dot:
        cache.kv = KVCache(batch_size)
    if m in ("softmax", "principled"):
        cache.kv = KVCache(batch_size)
    if layer.n_scalar:
        cache.scalar = _scalar_cache(layer, batch_size, window)
    return cache


def _sink_entry(layer, batch_size: int) -> dict[str, torch.Tensor]:
    """The sink as one cache entry: ks (B, H_s, 1), values (B, G, 1, D) (hybrid: a zero k too)."""
    c = layer.config
    w = layer.sink_value.detach()  # (G, D)
    entry = {"ks": w.new_full((batch_size, layer.n_scalar, 1), c.sink_key)}
    entry["v" if c.mechanism == "hybrid" else "vs"] = w[None, :, None, :].expand(batch_size, -1, 1, -1)
    if c.mechanism == "hybrid":
        entry["k"] = w.new_zeros(batch_size, layer.n_kv, 1, c.head_dim)
    return entry


def _scalar_cache(layer, batch_size: int, window: int | None):
    c = layer.config
    hybrid = c.mechanism == "hybrid"
    if window is None:
        cache = KVCache(batch_size)
        if c.sink:
            cache.append(**_sink_entry(layer, batch_size))
        return cache
    from ..cache.sorted import SortedScalarCache  # lazy: the sorted cache sits beside this module

    groups = layer.n_kv if hybrid else c.n_value_groups
    w = layer.sink_value.detach() if c.sink else None  # (G, D): the sorted cache's own sink entry
    return SortedScalarCache(
        batch_size, layer.n_scalar, groups, c.head_dim, d_k=c.head_dim if hybrid else None,
        dtype=layer.wo.weight.dtype, device=layer.wo.weight.device,
        sink_key=c.sink_key if c.sink else None, sink_value=w,
    )


def _expand(x: torch.Tensor, H: int) -> torch.Tensor:
    G = x.shape[1]
    return x if G == H else x.repeat_interleave(H // G, dim=1)


def _scalar_step(layer, cache: LayerCache, p) -> torch.Tensor:
    """Readout (B, H_s, 1, D) of the scalar or hybrid heads for one token."""
    c = layer.config
    hybrid = c.mechanism == "hybrid"
    vals = p.v if hybrid else p.vs  # (B, G, 1, D)
    if cache.window is None:
        new = {"ks": p.ks, ("v" if hybrid else "vs"): vals}
        if hybrid:
            new["k"] = p.k
        full = cache.scalar.append(**new)
        if hybrid:  # one query against every cached key: the op's causal offset form
            return hybrid_attention(p.q, full["k"], full["v"], p.qs, full["ks"], p.tau, impl=c.impl)
        return scalar_attention(p.qs, full["ks"], full["vs"], p.tau, impl=c.impl)
    k = _expand(p.k, layer.n_scalar)[:, :, 0] if hybrid else None  # (B, H, D)
    cache.scalar.append(p.ks[..., 0], vals[:, :, 0], k=k)
    tau = p.tau if p.tau.dim() == 1 else p.tau[..., 0]  # (H,) or (B, H)
    q = p.q[:, :, 0] if hybrid else None
    o = cache.scalar.attend(p.qs[..., 0], tau, q=q, window=cache.window)  # (B, H, D)
    return o.unsqueeze(2)


def step(layer, x_t: torch.Tensor, cache: LayerCache) -> torch.Tensor:
    c, m = layer.config, layer.config.mechanism
    if not isinstance(cache, LayerCache):
        raise TypeError(f"cache must come from make_cache, got {type(cache).__name__}")
    layer._check_input(x_t, "x_t")
    if x_t.shape[1] != 1:
        raise ValueError(f"x_t must be one token (B, 1, d_model), got {tuple(x_t.shape)}")
    if x_t.shape[0] != cache.batch_size:
        raise ValueError(f"x_t has batch {x_t.shape[0]}, the cache was made for batch_size={cache.batch_size}")
    p = layer.project(x_t, cache.pos)
    if m in LINEAR_FAMILY:
        o = _linear_step(layer, cache, p)
    elif m == "scalar":
        o = _scalar_step(layer, cache, p)
        if layer.n_dot:
            full = cache.kv.append(k=p.k, v=p.v)
            od = softmax_attention(p.q, full["k"], full["v"], scale=c.scale, p=c.p, impl=c.impl)
            o = torch.cat([o, od.to(o.dtype)], dim=1)  # scalar heads first
    elif m == "hybrid":
        o = _scalar_step(layer, cache, p)
    elif m == "softmax":
        full = cache.kv.append(k=p.k, v=p.v)
        o = softmax_attention(p.q, full["k"], full["v"], scale=c.scale, p=c.p, impl=c.impl)
    else:  # principled
        full = cache.kv.append(k=p.k, kg=p.kg, v=p.v)
        o = principled_attention(  # one query, all n keys: the op's causal offset form
            p.q, full["k"], p.qg, full["kg"], full["v"], alpha=p.alpha, beta=p.beta, gamma=p.gamma, v0=p.v0,
            causal=True, impl=c.impl,
        )
    cache.pos += 1
    return layer.finish(o, x_t)  # (B, 1, C)


def _linear_step(layer, cache: LayerCache, p) -> torch.Tensor:
    c, m = layer.config, layer.config.mechanism
    q, k, v = p.q[:, :, 0], p.k[:, :, 0], p.v[:, :, 0]  # (B, H, D)
    st = cache.state
    if m == "cosformer":
        o, new = cosformer_step(q, k, v, st.state, max_len=cache.max_len, normalize=c.cosformer_normalize)
    elif m == "gla":
        o, new = gla_step(q, k, v, p.log_decay[:, :, 0], st.state)
    else:
        o, new = ssd_step(q, k, v, p.log_decay[:, :, 0], st.state)
    st.update(new)
    return o.unsqueeze(2)  # (B, H, 1, D)
