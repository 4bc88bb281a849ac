"""Small dataclasses the `Attention` layer hands out: its per-head tensors and its record."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch


@dataclass
class Projected:
    """Per-head tensors of one call of `Attention.project(x, start_pos)`; T is x's length.

    H_d counts the dot-product heads (all heads for hybrid, principled and the linear family), H_s
    the scalar heads (every head for hybrid). A field a mechanism does not use stays None.

    Args:
        start_pos: the absolute position of token 0.
        q: vector queries (B, H_d, T, D), RoPE applied if on.
        k: vector keys (B, G_kv, T, D), RoPE applied if on.
        v: values of the vector heads (B, G_kv, T, D).
        qs: scalar queries (B, H_s, T).
        ks: scalar keys (B, H_s, T).
        vs: values of the scalar heads (B, G, T, D) (mechanism "scalar" only).
        tau: temperature of the scalar heads, (H_s,) or (B, H_s, T).
        qg: principled gate queries (B, H, T, Dg).
        kg: principled gate keys (B, G_kv, T, Dg).
        alpha: principled α: a float, (H,) or (B, H, T).
        beta: principled β, in the same forms.
        gamma: principled γ, in the same forms.
        v0: principled ground value: None, (D,) or (H, D).
        log_decay: gla (B, H, T, D) or ssd (B, H, T), <= 0 (ssd's k already carries its step
            size).
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
    docs: torch.Tensor | None = None  # packed documents: (B, T) document ids (Attention.forward's docs)
    doc_pos: torch.Tensor | None = None  # with docs: each token's position inside its document (B, T)
    key_rule: Any = None  # the keys scalar/hybrid heads read: a `cache.options.KeyRule` (Attention.forward's key_rule)


@dataclass
class AttentionRecord:
    """What one `forward(x, record=True)` leaves in `layer.last`, with the autograd graph.

    qs, ks, tau, q_score, k_score are exactly what the scalar/hybrid op received, the inputs of
    `attnlab.regularizers`: with a sink they carry one extra leading position (the sink key, and an
    extra leading query whose output is dropped), counted by n_prefix.

    Args:
        mechanism: the layer's mechanism name.
        heads: every per-head tensor of the call (`Projected`), without the sink.
        readout: the attention output before the gate, (B, H, T, D).
        gate: the output-gate values (B, H, T, D or 1); None without a gate.
        qs: scalar queries the op received (B, H_s, n_prefix + T).
        ks: scalar keys the op received (B, H_s, n_prefix + T).
        tau: the temperature the op received, (H_s,) or per query (B, H_s, n_prefix + T).
        q_score: the vector queries the op received, for hybrid-score heads only (else None).
        k_score: the vector keys the op received, for hybrid-score heads only (else None).
        n_prefix: the leading positions added for the sink (0 or 1).
        causal: the op's causal flag (always True for a layer).
        impl: the op path in use (config.impl).
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
