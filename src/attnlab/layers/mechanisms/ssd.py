"""mechanism = "ssd": the Mamba-2 SSD readout, one decay per head and step
(docs/mechanisms.md#ssd): Δ = softplus(W_dt x + b), log_decay = −exp(A_log)·Δ, and the keys carry Δ
(the discretised input B·Δ)."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ...ops import ssd_attention, ssd_step
from ..record import Projected
from ..registry import register
from ._recurrent import RecurrentAttention, RecurrentStore


@register
class SSDAttention(RecurrentAttention):
    mechanism = "ssd"
    uses = ("n_kv_heads", "rope", "rope_base")

    def build(self, c) -> None:
        super().build(c)
        H = c.n_heads
        # Mamba-2 init: step sizes log-uniform in [1e-3, 1e-1], A = -exp(A_log) with A_log = log U[1, 16].
        self.dt_proj = nn.Linear(c.d_model, H, bias=True)
        dt = torch.exp(torch.rand(H) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
        with torch.no_grad():
            self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
        self.A_log = nn.Parameter(torch.log(torch.empty(H).uniform_(1.0, 16.0)))

    def project(self, x, start_pos: int = 0, qkv=None) -> Projected:
        p = super().project(x, start_pos, qkv)
        # softplus of a contiguous (B, H, T): on the transposed view, torch.compile's backward (AOTAutograd,
        # torch 2.13) gets the strides of softplus_backward wrong and fails on a view
        # in q's dtype: CUDA autocast computes softplus in float32 (the CPU's keeps bf16), and the op needs one dtype
        dt = F.softplus(self.dt_proj(x).transpose(1, 2).contiguous()).to(p.q.dtype)  # (B, H, T)
        p.log_decay = -torch.exp(self.A_log).to(dt.dtype)[None, :, None] * dt  # (B, H, T)
        p.k = p.k * dt.unsqueeze(-1)  # discretised input B·Δ
        return p

    def attend(self, p: Projected, values=None, impl: str | None = None):
        v = p.v if values is None else values
        o, _ = ssd_attention(p.q, p.k, v, p.log_decay, causal=True, impl=impl or self.config.impl, docs=p.docs)
        return o, None

    def chunk_op(self, p: Projected, state, cache, impl: str | None = None):
        return ssd_attention(p.q, p.k, p.v, p.log_decay, initial_state=state, causal=True, impl=impl or self.config.impl)

    def step_op(self, q, k, v, p: Projected, state, cache):
        return ssd_step(q, k, v, p.log_decay[:, :, 0], state)

    def static_state(self, opts) -> RecurrentStore:
        return RecurrentStore(self, opts)
