"""The sorted cache's sink entry and sink zone, parsed from constructor arguments.

The sink is a persistent entry with a fixed scalar key and a learned value that every
query sees in addition to its window (the seed's scalar sink token): it absorbs attention
mass when no cached key is near the query. The sink zone is a reserved scalar range whose
keys eviction and compression leave alone.
"""

from __future__ import annotations

import torch


def _per_head(cache, name: str, x, d: int, allow_groups: bool = False) -> torch.Tensor:
    """(d,), (H, d) or, for values, (G, d) (one per value group) -> (H, d)."""
    H, G = cache.n_heads, cache.n_groups
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    x = x.detach().to(cache.device)
    if x.dim() == 1 and x.shape[0] == d:
        return x.expand(H, d)
    if x.dim() == 2 and tuple(x.shape) == (H, d):
        return x
    if allow_groups and x.dim() == 2 and tuple(x.shape) == (G, d):
        return x.repeat_interleave(H // G, 0)
    shapes = f"({d},), ({G}, {d}) or ({H}, {d})" if allow_groups else f"({d},) or ({H}, {d})"
    raise ValueError(f"{name} must have shape {shapes}, got {tuple(x.shape)}")


def sink_rows(cache, sink_key, sink_value, sink_vkey):
    """Per-row sink key (R, 1) float32, value (R, Dv) and hybrid vector key (R, Dk), or Nones.

    sink_key: float, 0-d or (H,); sink_value: (Dv,), (G, Dv) or (H, Dv); sink_vkey: (Dk,) or
    (H, Dk), hybrid only, default zeros (the sink then scores by scalar distance alone)."""
    B, H = cache.batch, cache.n_heads
    if (sink_key is None) != (sink_value is None):
        raise ValueError("sink_key and sink_value must be given together (or neither), "
                         f"got sink_key={'set' if sink_key is not None else None}, "
                         f"sink_value={'set' if sink_value is not None else None}")
    if sink_vkey is not None and (sink_key is None or cache.d_k is None):
        raise ValueError("sink_vkey needs sink_key and sink_value, and a hybrid cache (d_k given)")
    if sink_key is None:
        return None, None, None
    key = torch.as_tensor(sink_key, dtype=torch.float32, device=cache.device).detach()
    if key.dim() == 0:
        key = key.expand(H)
    if tuple(key.shape) != (H,) or not bool(torch.isfinite(key).all()):
        raise ValueError(f"sink_key must be a finite float or ({H},) tensor, got {tuple(key.shape)}")
    val = _per_head(cache, "sink_value", sink_value, cache.d_v, allow_groups=True)
    vk = None
    if cache.d_k is not None:
        vk = torch.zeros(cache.d_k) if sink_vkey is None else sink_vkey
        vk = _per_head(cache, "sink_vkey", vk, cache.d_k).float().repeat(B, 1)  # (R, Dk)
    return key.repeat(B).view(-1, 1), val.to(cache.dtype).repeat(B, 1), vk


def parse_zone(zone):
    """None or a pair (lo, hi) with lo <= hi."""
    if zone is None:
        return None
    try:
        lo, hi = (float(z) for z in zone)
    except (TypeError, ValueError):
        raise ValueError(f"sink_zone must be a pair (lo, hi) of floats, got {zone!r}") from None
    if not lo <= hi:
        raise ValueError(f"sink_zone must have lo <= hi, got {zone!r}")
    return lo, hi
