"""Small dataclasses the `Attention` layer hands out: its per-head tensors and its record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Projected:
    """Per-head tensors of one call of `Attention.project(x, start_pos)`; T is x's length.

    q, k, v       vector heads: q (B, H_d, T, D), k and v (B, G_kv, T, D), RoPE applied if on.
                  H_d counts the dot-product heads (all heads for hybrid/principled/linear family).
    qs, ks        scalar queries/keys (B, H_s, T): the scalar heads, or every hybrid head.
    vs            values of the scalar heads, (B, G, T, D) (mechanism "scalar" only).
    tau           temperature of the scalar heads: (H_s,) or (B, H_s, T).
    qg, kg        principled gate vectors (B, H, T, Dg) and (B, G_kv, T, Dg).
    alpha, beta, gamma   principled parameters: a float, (H,) or (B, H, T).
    v0            principled ground value: None, (D,) or (H, D).
    log_decay     gla (B, H, T, D) or ssd (B, H, T), <= 0 (ssd's k already carries its step size).
    """

    start_pos: int
    q: torch.Tensor | None = None
    k: torch.Tensor | None = None
    v: torch.Tensor | None = None
    qs: torch.Tensor | None = None
    ks: torch.Tensor | None = None
    vs: torch.Tensor | None = None
    tau: torch.Tensor | None = None
    qg: torch.Tensor | None = None
    kg: torch.Tensor | None = None
    alpha: Any = None
    beta: Any = None
    gamma: Any = None
    v0: torch.Tensor | None = None
    log_decay: torch.Tensor | None = None


@dataclass
class AttentionRecord:
    """What one `forward(x, record=True)` leaves in `layer.last`, with the autograd graph.

    qs, ks, tau, q_score, k_score are exactly what the scalar/hybrid op received: with a sink they
    carry one extra leading position (the sink key, and an extra leading query whose output is
    dropped), counted by n_prefix. q_score/k_score are set for hybrid-score heads only. These are
    the inputs of `attnlab.regularizers`. `heads` holds every per-head tensor without the sink,
    `gate` the output-gate values (B, H, T, D or 1), `readout` the attention output before the gate.
    """

    mechanism: str
    heads: Projected
    readout: torch.Tensor
    gate: torch.Tensor | None = None
    qs: torch.Tensor | None = None
    ks: torch.Tensor | None = None
    tau: torch.Tensor | None = None
    q_score: torch.Tensor | None = None
    k_score: torch.Tensor | None = None
    n_prefix: int = 0
    causal: bool = True
    impl: str = "auto"
