"""The sorted cache's sink entry and sink zone, parsed from constructor arguments.

The sink is a persistent entry with a fixed scalar key and a learned value that every
query sees in addition to its window (the seed's scalar sink token): it absorbs attention
mass when no cached key is near the query. The sink zone is a reserved scalar range whose
keys eviction and compression leave alone.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..checks import check_finite
from ..ops.common.heads import expand_heads


@dataclass(frozen=True)
class SinkRows:
    """The sink entry per index row (R = B * H): key (R, 1) float32, value (R, Dv) in the cache's
    dtype, vkey (R, Dk) float32 for hybrid heads, else None; logw (R, 1) float32, the log of the
    sink's weight in the normaliser (0: weight 1, like any key; -inf: no mass)."""

    key: torch.Tensor
    value: torch.Tensor
    vkey: torch.Tensor | None
    logw: torch.Tensor


def _finite(name: str, x: torch.Tensor, cast: torch.Tensor | None = None) -> None:
    """NaN/inf in a sink argument (or in ``cast``, its copy in the dtype stored) raises ValueError naming it."""
    check_finite(name, x)
    if cast is not None and not bool(torch.isfinite(cast).all()):
        raise ValueError(f"{name} must fit in {cast.dtype}, the dtype the cache stores it in, got |{name}| up to "
                         f"{float(x.abs().max()):.4g}, which is inf there")


def _per_head(cache, name: str, x, d: int, allow_groups: bool = False) -> torch.Tensor:
    """(d,), (H, d) or, for values, (G, d) (one per value group) -> (H, d). Finite floating tensors only."""
    H, G = cache.n_heads, cache.n_groups
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(x).__name__}")
    if not x.is_floating_point():
        raise TypeError(f"{name} must be a floating-point tensor, got {x.dtype}")
    x = x.detach().to(cache.device)
    if x.dim() == 1 and x.shape[0] == d:
        return x.expand(H, d)
    if x.dim() == 2 and tuple(x.shape) == (H, d):
        return x
    if allow_groups and x.dim() == 2 and tuple(x.shape) == (G, d):
        return expand_heads(x[None], H)[0]
    shapes = f"({d},), ({G}, {d}) or ({H}, {d})" if allow_groups else f"({d},) or ({H}, {d})"
    raise ValueError(f"{name} must have shape {shapes}, got {tuple(x.shape)}")


def _sink_key(cache, sink_key) -> torch.Tensor:
    """A finite float, 0-d or (H,) floating tensor -> (H,) float32."""
    H = cache.n_heads
    if isinstance(sink_key, bool) or not isinstance(sink_key, (int, float, torch.Tensor)):
        raise TypeError(f"sink_key must be a float or a tensor, got {type(sink_key).__name__}")
    if isinstance(sink_key, torch.Tensor) and not sink_key.is_floating_point():
        raise TypeError(f"sink_key must be a float or a floating-point tensor, got {sink_key.dtype}")
    if isinstance(sink_key, torch.Tensor):
        given = sink_key.detach()
    else:
        given = torch.tensor(float(sink_key), dtype=torch.float64)
    key = given.to(cache.device, torch.float32)
    if key.dim() == 0:
        key = key.expand(H)
    if tuple(key.shape) != (H,):
        raise ValueError(f"sink_key must be a float, 0-d or ({H},) tensor, got shape {tuple(given.shape)}")
    _finite("sink_key", given, key)
    return key


def _sink_logw(cache, sink_logw) -> torch.Tensor:
    """None, a float, 0-d or (H,) tensor -> (H,) float32; finite or -inf (a sink with no mass)."""
    H = cache.n_heads
    if sink_logw is None:
        return torch.zeros(H, device=cache.device)
    if isinstance(sink_logw, bool) or not isinstance(sink_logw, (int, float, torch.Tensor)):
        raise TypeError(f"sink_logw must be a float or a tensor, got {type(sink_logw).__name__}")
    x = torch.as_tensor(sink_logw).detach().to(cache.device, torch.float32)
    if not x.is_floating_point() or x.dim() > 1 or (x.dim() == 1 and x.shape[0] != H):
        raise ValueError(f"sink_logw must be a float, 0-d or ({H},) floating tensor, got {tuple(x.shape)}")
    if bool(torch.isnan(x).any()) or bool((x == float("inf")).any()):
        raise ValueError(f"sink_logw must be finite or -inf (log of a weight >= 0), got {x.tolist()}")
    return x.expand(H).contiguous()


def sink_rows(cache, sink_key, sink_value, sink_vkey, sink_logw=None) -> SinkRows | None:
    """The sink per row (key (R, 1) float32, value (R, Dv), hybrid vector key (R, Dk), log-weight
    (R, 1)), or None.

    sink_key: float, 0-d or (H,); sink_value: (Dv,), (G, Dv) or (H, Dv); sink_vkey: (Dk,) or
    (H, Dk), hybrid only, default zeros (the sink then scores by scalar distance alone);
    sink_logw: float, 0-d or (H,), the log of the sink's weight in the normaliser (default 0).
    Every one must be finite (floating tensors of any dtype; the value is stored in the cache's),
    except sink_logw, which may be -inf."""
    B = cache.batch
    if (sink_key is None) != (sink_value is None):
        raise ValueError("sink_key and sink_value must be given together (or neither), "
                         f"got sink_key={'set' if sink_key is not None else None}, "
                         f"sink_value={'set' if sink_value is not None else None}")
    if sink_vkey is not None and (sink_key is None or cache.d_k is None):
        raise ValueError("sink_vkey needs sink_key and sink_value, and a hybrid cache (d_k given)")
    if sink_key is None:
        if sink_logw is not None:
            raise ValueError("sink_logw weighs the sink: give sink_key and sink_value as well")
        return None
    key = _sink_key(cache, sink_key)
    logw = _sink_logw(cache, sink_logw)
    val = _per_head(cache, "sink_value", sink_value, cache.d_v, allow_groups=True)
    val_c = val.to(cache.dtype)
    _finite("sink_value", val, val_c)
    vk = None
    if cache.d_k is not None:
        vk = torch.zeros(cache.d_k) if sink_vkey is None else sink_vkey
        vk = _per_head(cache, "sink_vkey", vk, cache.d_k)
        vk32 = vk.float()
        _finite("sink_vkey", vk, vk32)
        vk = vk32.repeat(B, 1)  # (R, Dk)
    return SinkRows(key.repeat(B).view(-1, 1), val_c.repeat(B, 1), vk, logw.repeat(B).view(-1, 1))


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


def token_values(vals: torch.Tensor) -> torch.Tensor:
    """Values (B, G, T, D) of model tokens in the weighted-sink layout (B, G, T, D + 2)."""
    ones = torch.ones_like(vals[..., :1])
    return torch.cat([vals, ones, torch.zeros_like(ones)], dim=-1)
