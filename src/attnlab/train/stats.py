"""Per-layer statistics read from the attention layers' records (`layer.last`): τ and gate values.

τ is the temperature of the scalar / hybrid heads (the scalar-attention proposal reports it
drifting upward during training unless regularized, which widens the decode window); the gate is
the post-readout sigmoid output gate (its sparsity, the share of values below 0.1, is one of the
gate proposal's metrics). See docs/mechanisms.md.
"""

from __future__ import annotations

import torch

GATE_LOW = 0.1


def _per_head(t: torch.Tensor) -> torch.Tensor:
    """τ of shape (H,), (B, H, T) or a scalar, as (H,) means (a scalar gives one entry)."""
    t = t.detach().float()
    if t.dim() == 3:
        return t.mean(dim=(0, 2))
    return t.reshape(-1)


def layer_stats(layer) -> dict:
    """{"mechanism", "tau_mean", "tau_heads", "gate_mean", "gate_low_frac"} for one layer's last
    record; keys are left out when the layer has no τ or no gate, or recorded nothing."""
    rec = getattr(layer, "last", None)
    out = {"mechanism": layer.config.mechanism}
    if rec is None:
        return out
    heads = getattr(rec, "heads", None)
    tau = getattr(heads, "tau", None) if heads is not None else None
    if tau is None:
        tau = getattr(rec, "tau", None)
    if isinstance(tau, torch.Tensor):
        per_head = _per_head(tau)
        out["tau_mean"] = float(per_head.mean())
        out["tau_heads"] = [float(v) for v in per_head]
    gate = getattr(rec, "gate", None)
    if isinstance(gate, torch.Tensor):
        g = gate.detach().float()
        out["gate_mean"] = float(g.mean())
        out["gate_low_frac"] = float((g < GATE_LOW).float().mean())
    return out


def attention_stats(layers) -> list[dict]:
    """`layer_stats` for every attention layer, in depth order."""
    return [layer_stats(layer) for layer in layers]
