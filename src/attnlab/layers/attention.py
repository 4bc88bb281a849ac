"""`Attention`: one causal self-attention layer for every mechanism of attnlab, `(B, T, C) -> (B, T, C)`.

The layer owns the projections and calls one op (two for a mixed scalar + dot-product layer):

    x ──project──> per-head tensors ──op──> readout o (B, H, T, D) ──finish──> gate, W_O ──> y

Head layout: for a mixed layer the n_scalar_heads scalar heads come first, then the dot-product
heads; their readouts are concatenated along heads before the output projection.

Position. Vector queries/keys may carry RoPE. Scalar heads get no position signal of their own:
a scalar has no rotation, and adding a position term would break the kernel's dependence on
qs − ks alone (and with it the sorted cache). Scalar heads see position only through the causal
mask and whatever position information the residual stream carries.

Sink. With `sink=True`, scalar/hybrid heads see one extra key at position "−1": scalar key
`sink_key` (zero vector key for hybrid scores) and a learned value per value group, initialised
to zero (a neutral destination). It is prepended to the sequence, with an extra leading query whose
output is dropped, so the fused op runs unchanged on T + 1 positions.

Decode: `make_cache(batch_size, ...)` then `step(x_t, cache)` per token; T steps equal `forward`
on the whole sequence (see `stepping.py`).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

from ..ops._checks import check_finite
from ..ops import (
    cosformer_attention, gla_attention, hybrid_attention, principled_attention,
    scalar_attention, softmax_attention, ssd_attention,
)
from . import stepping
from .config import AttentionConfig
from .gate import OutputGate
from .params import GroundValue, HeadParam, Temperature
from .record import AttentionRecord, Projected
from .rope import RotaryEmbedding


def _heads(x: torch.Tensor, n: int, d: int) -> torch.Tensor:
    """(B, T, n*d) -> (B, n, T, d)."""
    B, T, _ = x.shape
    return x.view(B, T, n, d).transpose(1, 2)


class Attention(nn.Module):
    """Causal self-attention configured by an `AttentionConfig`; see the module docstring."""

    def __init__(self, config: AttentionConfig):
        super().__init__()
        if not isinstance(config, AttentionConfig):
            raise TypeError(f"config must be an AttentionConfig, got {type(config).__name__}")
        self.config = c = config
        C, H, D, m = c.d_model, c.n_heads, c.head_dim, c.mechanism
        self.n_dot, self.n_kv = c.n_dot_heads, c.n_kv_heads
        self.n_scalar = H if m == "hybrid" else c.n_scalar_heads  # heads with qs/ks
        if self.n_dot:
            self.wq = nn.Linear(C, self.n_dot * D, bias=c.bias)
            self.wk = nn.Linear(C, self.n_kv * D, bias=c.bias)
            self.wv = nn.Linear(C, self.n_kv * D, bias=c.bias)
            self.rope = RotaryEmbedding(D, c.rope_base) if c.rope else None
        if self.n_scalar:
            self.wqs = nn.Linear(C, self.n_scalar, bias=c.bias)
            self.wks = nn.Linear(C, self.n_scalar, bias=c.bias)
            self.temperature = Temperature(c.tau, self.n_scalar, C, c.tau_init, c.tau_max)
        if m == "scalar":
            self.wvs = nn.Linear(C, c.n_value_groups * D, bias=c.bias)
        if c.sink:
            groups = c.n_value_groups if m == "scalar" else self.n_kv
            self.sink_value = nn.Parameter(torch.zeros(groups, D))  # (G, D)
        if m == "principled":
            self.wqg = nn.Linear(C, H * c.gate_dim, bias=c.bias)
            self.wkg = nn.Linear(C, self.n_kv * c.gate_dim, bias=c.bias)
            self.alpha = HeadParam(c.alpha, H, D, c.alpha_init)
            self.beta = HeadParam(c.beta, H, D, c.beta_init)
            self.gamma = HeadParam(c.gamma, H, D, c.gamma_init)
            self.ground = GroundValue(c.v0, H, D)
        if m == "gla":
            self.decay_down = nn.Linear(C, c.gla_rank, bias=False)
            self.decay_up = nn.Linear(c.gla_rank, H * D, bias=True)
        if m == "ssd":
            # Mamba-2 init: step sizes log-uniform in [1e-3, 1e-1], A = -exp(A_log) with A_log = log U[1, 16].
            self.dt_proj = nn.Linear(C, H, bias=True)
            dt = torch.exp(torch.rand(H) * (math.log(0.1) - math.log(1e-3)) + math.log(1e-3))
            with torch.no_grad():
                self.dt_proj.bias.copy_(dt + torch.log(-torch.expm1(-dt)))
            self.A_log = nn.Parameter(torch.log(torch.empty(H).uniform_(1.0, 16.0)))
        self.gate = OutputGate(c.output_gate, C, H, D) if c.output_gate else None
        self.wo = nn.Linear(H * D, C, bias=c.bias)
        self.last: AttentionRecord | None = None

    # ------------------------------------------------------------------ projections

    def _check_input(self, x, name: str = "x") -> None:
        """x: a finite floating (B, T, d_model) tensor in the parameters' dtype (any float dtype
        under torch.autocast, which casts at each projection)."""
        if not isinstance(x, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor (B, T, d_model={self.config.d_model}), got {type(x).__name__}")
        if x.dim() != 3 or x.shape[-1] != self.config.d_model:
            raise ValueError(f"{name} must be (B, T, d_model={self.config.d_model}), got {tuple(x.shape)}")
        dtype = self.wo.weight.dtype
        if not x.is_floating_point():
            raise TypeError(f"{name} must be a floating-point tensor ({dtype}, the layer's dtype), got {x.dtype}")
        if x.dtype != dtype and not torch.is_autocast_enabled(x.device.type):
            raise TypeError(
                f"{name} must have the layer's dtype {dtype} (cast it or the layer, or run under torch.autocast), "
                f"got {x.dtype}"
            )
        check_finite(name, x)

    def project(self, x: torch.Tensor, start_pos: int = 0) -> Projected:
        """x (B, T, C) at absolute positions start_pos.. -> the per-head tensors (see `Projected`)."""
        self._check_input(x)
        if isinstance(start_pos, bool) or not isinstance(start_pos, int) or start_pos < 0:
            raise ValueError(f"start_pos must be an int >= 0, got {start_pos!r}")
        c, m = self.config, self.config.mechanism
        H, D = c.n_heads, c.head_dim
        p = Projected(start_pos=start_pos)
        if self.n_dot:
            q = _heads(self.wq(x), self.n_dot, D)  # (B, H_d, T, D)
            k = _heads(self.wk(x), self.n_kv, D)  # (B, G_kv, T, D)
            p.v = _heads(self.wv(x), self.n_kv, D)
            if m == "principled":
                p.alpha, p.beta, p.gamma = self.alpha(q), self.beta(q), self.gamma(q)  # from un-rotated q
                p.qg = _heads(self.wqg(x), H, c.gate_dim)  # (B, H, T, Dg)
                p.kg = _heads(self.wkg(x), self.n_kv, c.gate_dim)
                v0 = self.ground()
                p.v0 = None if v0 is None else v0.to(p.v.dtype)
            if self.rope is not None:
                q, k = self.rope(q, start_pos), self.rope(k, start_pos)
            p.q, p.k = q, k
        if self.n_scalar:
            p.qs = self.wqs(x).transpose(1, 2)  # (B, H_s, T)
            p.ks = self.wks(x).transpose(1, 2)
            p.tau = self.temperature(x)  # (H_s,) or (B, H_s, T)
        if m == "scalar":
            p.vs = _heads(self.wvs(x), c.n_value_groups, D)  # (B, G, T, D)
        if m == "gla":
            raw = self.decay_up(self.decay_down(x))  # (B, T, H*D), low rank
            p.log_decay = _heads(F.logsigmoid(raw) / c.gla_normalizer, H, D)  # (B, H, T, D)
        if m == "ssd":
            dt = F.softplus(self.dt_proj(x)).transpose(1, 2)  # (B, H, T)
            p.log_decay = -torch.exp(self.A_log).to(dt.dtype)[None, :, None] * dt  # (B, H, T), in q's dtype
            p.k = p.k * dt.unsqueeze(-1)  # discretised input B·Δ
        return p

    def _with_sink(self, p: Projected):
        """Scalar-op inputs, with the sink prepended when on: (qs, ks, values, tau, q, k, n_prefix)."""
        c = self.config
        vals = p.vs if c.mechanism == "scalar" else p.v
        q, k = (p.q, p.k) if c.mechanism == "hybrid" else (None, None)
        if not c.sink:
            return p.qs, p.ks, vals, p.tau, q, k, 0
        B = p.qs.shape[0]
        key = p.ks.new_full((B, self.n_scalar, 1), c.sink_key)  # (B, H_s, 1)
        qs = torch.cat([key, p.qs], dim=-1)  # extra leading query: its output is dropped
        ks = torch.cat([key, p.ks], dim=-1)  # (B, H_s, T+1)
        sink_v = self.sink_value.to(vals.dtype)[None, :, None, :].expand(B, -1, 1, -1)  # (B, G, 1, D)
        vals = torch.cat([sink_v, vals], dim=2)  # (B, G, T+1, D)
        if p.tau.dim() == 1:
            tau = p.tau
        else:  # the sink query's output is dropped; it borrows the first query's tau (any > 0 would do at T = 0)
            first = p.tau[..., :1] if p.tau.shape[-1] else p.tau.new_ones(B, self.n_scalar, 1)
            tau = torch.cat([first, p.tau], dim=-1)
        if q is not None:
            q = torch.cat([q.new_zeros(B, q.shape[1], 1, q.shape[3]), q], dim=2)  # (B, H, T+1, D)
            k = torch.cat([k.new_zeros(B, k.shape[1], 1, k.shape[3]), k], dim=2)  # zero sink key vector
        return qs, ks, vals, tau, q, k, 1

    # ------------------------------------------------------------------ attention

    def _attend(self, p: Projected, values=None, impl: str | None = None):
        """Readout (B, H, T, Dv) of the whole sequence, and the scalar-op inputs for the record.

        values: replaces every head's values (for `attention_weights`), shape (B, G, T[+1], Dv).
        """
        c, m = self.config, self.config.mechanism
        impl = impl or c.impl
        scal = None
        if m in ("scalar", "hybrid"):
            scal = qs, ks, vals, tau, q, k, n_pre = self._with_sink(p)
            vals = vals if values is None else values
            if m == "scalar":
                o = scalar_attention(qs, ks, vals, tau, causal=True, impl=impl)[:, :, n_pre:]
                if self.n_dot:
                    vd = p.v if values is None else values[:, :1, n_pre:, n_pre:].expand(-1, self.n_kv, -1, -1)
                    od = softmax_attention(p.q, p.k, vd, causal=True, scale=c.scale, p=c.p, impl=impl)
                    if n_pre and values is not None:  # the sink column, never seen by dot heads
                        od = torch.cat([od.new_zeros(od[..., :n_pre].shape), od], dim=-1)
                    o = torch.cat([o, od], dim=1)  # (B, H, T, Dv): scalar heads first
            else:
                o = hybrid_attention(q, k, vals, qs, ks, tau, causal=True, impl=impl)[:, :, n_pre:]
            return o, scal
        v = p.v if values is None else values
        if m == "softmax":
            return softmax_attention(p.q, p.k, v, causal=True, scale=c.scale, p=c.p, impl=impl), None
        if m == "principled":
            v0 = p.v0 if values is None else None
            o = principled_attention(
                p.q, p.k, p.qg, p.kg, v, alpha=p.alpha, beta=p.beta, gamma=p.gamma, v0=v0, causal=True, impl=impl
            )
            return o, None
        if m == "cosformer":
            max_len = c.cosformer_max_len or max(p.q.shape[2], 1)
            o, _ = cosformer_attention(p.q, p.k, v, causal=True, max_len=max_len, normalize=c.cosformer_normalize, impl=impl)
            return o, None
        op = gla_attention if m == "gla" else ssd_attention
        o, _ = op(p.q, p.k, v, p.log_decay, causal=True, impl=impl)
        return o, None

    def _finish(self, o: torch.Tensor, x: torch.Tensor):
        g = self.gate(x) if self.gate is not None else None  # (B, H, T, D or 1)
        if g is not None:
            o = o * g.to(o.dtype)
        B, H, T, D = o.shape
        return self.wo(o.transpose(1, 2).reshape(B, T, H * D)), g  # (B, T, C)

    def finish(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Readout o (B, H, T, D) and the layer input x (B, T, C) -> output (B, T, C): gate, then W_O."""
        return self._finish(o, x)[0]

    def forward(self, x: torch.Tensor, record: bool = False) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C). record=True keeps an `AttentionRecord` in `self.last`."""
        p = self.project(x, 0)
        o, scal = self._attend(p)
        y, g = self._finish(o, x)
        if record:
            rec = AttentionRecord(self.config.mechanism, p, o, g, causal=True, impl=self.config.impl)
            if scal is not None:
                rec.qs, rec.ks, _, rec.tau, rec.q_score, rec.k_score, rec.n_prefix = scal
            self.last = rec
        return y

    def attention_weights(self, x: torch.Tensor) -> torch.Tensor:
        """The mixing weights of every head, from the naive ops: (B, H, T, T), or (B, H, T, T+1)
        with a sink (column 0 is the sink; dot-product heads of a mixed layer put 0 there).

        Every mechanism's readout is linear in v, so the weights are its output with v = I.
        Principled rows sum to 1 − w0 (the ground weight is left out). For the linear family this
        is the effective causal matrix A with o = A v: cosformer's normalised scores, GLA/SSD's
        decayed scale·q·k (not normalised). Materialises T×T (and T×T values): for small T.
        """
        p = self.project(x, 0)
        B, T = x.shape[:2]
        n_keys = T + (1 if self.config.sink else 0)
        if self.config.mechanism == "scalar":
            groups = self.config.n_value_groups
        else:
            groups = self.n_kv
        eye = torch.eye(n_keys, dtype=x.dtype, device=x.device).expand(B, groups, n_keys, n_keys)
        return self._attend(p, values=eye, impl="naive")[0]

    # ------------------------------------------------------------------ decode

    def make_cache(self, batch_size: int, *, window: int | None = None, max_len: int | None = None):
        """A decode cache for `step`. window (scalar/hybrid heads only): use the sorted scalar cache
        attending the `window` nearest keys instead of the plain KV cache (None: every key, exact).
        max_len (cosformer): the position horizon M; default config.cosformer_max_len."""
        return stepping.make_cache(self, batch_size, window=window, max_len=max_len)

    def step(self, x_t: torch.Tensor, cache) -> torch.Tensor:
        """One decode token: x_t (B, 1, C) -> y_t (B, 1, C); appends to `cache`."""
        return stepping.step(self, x_t, cache)

    def extra_repr(self) -> str:
        c = self.config
        return f"mechanism={c.mechanism}, heads={c.n_heads}, head_dim={c.head_dim}, kv_heads={self.n_kv}, scalar_heads={self.n_scalar}"
