"""A learned sink weighed in the normaliser (`sink_weight`): the value layout and the combination.

The ops take no per-key weight, so a readout that weighs the sink by w runs on values with two extra
channels (the sink's value zeroed; channel D marks the model's keys, channel D + 1 the sink) and
`mix_sink` combines the three results without cancellation (layers/mechanisms/scalar.py).
"""

from __future__ import annotations

import torch

from ..cache.sink import token_values  # noqa: F401 (the layout is the caches' too: defined there)
from ..ops.common.heads import expand_heads


def sink_weight_value(w: torch.Tensor) -> torch.Tensor:
    """|w|, with gradient +1 at w = 0 (abs's is 0 there), so a sink of weight 0 can grow."""
    return torch.where(w >= 0, w, -w)


def split_sink_values(vals: torch.Tensor) -> torch.Tensor:
    """Values (B, G, n, D) whose entry 0 is the sink -> (B, G, n, D + 2): the sink's value zeroed,
    channel D marking the model's keys and channel D + 1 the sink (module docstring)."""
    B, G, n, _ = vals.shape
    ind = torch.zeros(n, 2, dtype=vals.dtype, device=vals.device)
    ind[1:, 0] = 1
    ind[:1, 1] = 1
    body = torch.cat([torch.zeros_like(vals[:, :, :1]), vals[:, :, 1:]], dim=2)
    return torch.cat([body, ind.expand(B, G, n, 2)], dim=-1)


def mix_sink(o: torch.Tensor, sink_v: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """A readout o (B, H, T, D + 2) of weighted-sink values, the sink's value sink_v (B or 1, G, 1, D)
    and its weight parameter w (H,) -> the readout (B, H, T, D) with the sink weighted by |w|."""
    H, D = o.shape[1], o.shape[-1] - 2
    wp = sink_weight_value(w).to(o.dtype).view(1, H, 1, 1) * o[..., D + 1 :]  # w·p
    num = o[..., :D] + wp * expand_heads(sink_v.to(o.dtype), H)
    return num / (o[..., D : D + 1] + wp).clamp_min(torch.finfo(o.dtype).tiny)
