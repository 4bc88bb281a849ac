"""Learned per-layer / per-head / per-token quantities fed to the ops: τ, principled α/β/γ, v0.

Each module returns its value in a form the ops broadcast: a float, a per-head tensor `(H,)`
or a per-token tensor `(B, H, T)`.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

TAU_FLOOR = 1e-6  # added to softplus so τ stays > 0 even where softplus underflows to 0


def _inv_softplus(y: float) -> float:
    return y + math.log(-math.expm1(-y))


TAU_PARAMS = ("softplus", "log")


class Temperature(nn.Module):
    """Scalar-attention temperature τ > 0: global, per head, or per token from the input.

    τ = floor + softplus(raw) (param="softplus") or τ = floor + exp(raw) (param="log"), or with a
    cap τ = floor + (tau_max − floor)·sigmoid(raw), which stays strictly inside (0, tau_max] and
    keeps a gradient everywhere (a hard clamp would freeze τ at the cap); floor = 1e-6 keeps τ > 0
    where softplus, exp or sigmoid underflow to 0. In log space an optimizer step of size lr moves
    log τ by lr, a relative change whatever τ is. Softplus does the same while τ is small (its
    slope 1 − e^(−τ) ≈ τ: within 5% of the log form's slope τ up to τ = 0.1) and becomes linear
    above τ ≈ 1, where a step moves τ by lr, not by lr·τ; the capped sigmoid form behaves like the
    log form well below the cap. The per-token form is raw = x·W + b per head with W zero-initialised, so
    every token starts at tau_init and learns its own bandwidth from there.

    Args:
        mode: "global" (one τ), "head" (one per head) or "token" (per head and token, from x).
        n_heads: H.
        d_model: C, the width of the input x (read by the token form).
        init: τ at initialisation, in (1e-6, tau_max).
        tau_max: an optional cap on τ; None for none.
        param: "softplus" or "log", the parametrisation of raw (without a cap).

    Raises:
        ValueError: an unknown mode or param, or init outside (1e-6, tau_max).
    """

    def __init__(self, mode: str, n_heads: int, d_model: int, init: float, tau_max: float | None = None,
                 param: str = "softplus"):
        super().__init__()
        if mode not in ("global", "head", "token"):
            raise ValueError(f"mode must be 'global', 'head' or 'token', got {mode!r}")
        if param not in TAU_PARAMS:
            raise ValueError(f"param must be one of {TAU_PARAMS}, got {param!r}")
        if not init > TAU_FLOOR or (tau_max is not None and not init < tau_max):
            raise ValueError(f"init must be in ({TAU_FLOOR}, tau_max), got init={init}, tau_max={tau_max}")
        self.mode, self.n_heads, self.tau_max, self.param = mode, n_heads, tau_max, param
        if tau_max is None:
            raw0 = math.log(init - TAU_FLOOR) if param == "log" else _inv_softplus(init - TAU_FLOOR)
        else:
            frac = (init - TAU_FLOOR) / (tau_max - TAU_FLOOR)
            raw0 = math.log(frac / (1 - frac))
        if mode == "token":
            self.proj = nn.Linear(d_model, n_heads)
            nn.init.zeros_(self.proj.weight)
            nn.init.constant_(self.proj.bias, raw0)
        else:
            self.raw = nn.Parameter(torch.full((1 if mode == "global" else n_heads,), raw0))

    def squash(self, raw: torch.Tensor) -> torch.Tensor:
        """τ from the raw parameter (any shape, the same out): floor + softplus(raw) or floor +
        exp(raw) (raw clamped at 80), or with a cap floor + (tau_max − floor)·sigmoid(raw)."""
        if self.tau_max is None:
            # exp saturates at raw = 80 (τ ≈ 5.5e34, finite in float32) rather than overflowing to inf
            return (raw.clamp(max=80.0).exp() if self.param == "log" else F.softplus(raw)) + TAU_FLOOR
        return TAU_FLOOR + (self.tau_max - TAU_FLOOR) * torch.sigmoid(raw)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """x (B, T, C) -> τ as (H,) for global/head forms or (B, H, T) for the token form."""
        if self.mode == "token":
            return self.squash(self.proj(x)).transpose(1, 2)  # (B, T, H) -> (B, H, T)
        return self.squash(self.raw).expand(self.n_heads)  # (H,)


class HeadParam(nn.Module):
    """One of principled attention's α, β, γ in the form its proposal's ablation grid names.

    constant: the fixed float `init`; layer: one learned scalar; head: one learned scalar per head;
    query: learned from the (un-rotated) query, value_h(t) = q_{h,t}·w_h + b_h with w zero-initialised
    and b = init, so every form starts at `init`.

    Args:
        form: "constant", "layer", "head" or "query".
        n_heads: H.
        head_dim: D, the width of the queries the "query" form reads.
        init: the initial (for "constant", the fixed) value.

    Raises:
        ValueError: an unknown form.
    """

    def __init__(self, form: str, n_heads: int, head_dim: int, init: float):
        super().__init__()
        if form not in ("constant", "layer", "head", "query"):
            raise ValueError(f"form must be 'constant', 'layer', 'head' or 'query', got {form!r}")
        self.form, self.n_heads, self.init = form, n_heads, float(init)
        if form == "layer":
            self.value = nn.Parameter(torch.tensor(self.init))
        elif form == "head":
            self.value = nn.Parameter(torch.full((n_heads,), self.init))
        elif form == "query":
            self.weight = nn.Parameter(torch.zeros(n_heads, head_dim))
            self.bias = nn.Parameter(torch.full((n_heads,), self.init))

    def forward(self, q: torch.Tensor) -> float | torch.Tensor:
        """q (B, H, T, D) -> a float, (H,) or (B, H, T)."""
        if self.form == "constant":
            return self.init
        if self.form == "layer":
            return self.value.expand(self.n_heads)  # (H,)
        if self.form == "head":
            return self.value
        return torch.einsum("bhtd,hd->bht", q, self.weight) + self.bias[None, :, None]  # (B, H, T)


class GroundValue(nn.Module):
    """Principled attention's ground value v0: zero (None), one learned vector per layer, or per head.

    Learned forms start at zero, i.e. exactly the "zero" form.

    Args:
        form: "zero", "layer" or "head".
        n_heads: H (read by the "head" form).
        d_v: Dv, the width of the values.

    Raises:
        ValueError: an unknown form.
    """

    def __init__(self, form: str, n_heads: int, d_v: int):
        super().__init__()
        if form not in ("zero", "layer", "head"):
            raise ValueError(f"form must be 'zero', 'layer' or 'head', got {form!r}")
        self.form = form
        if form == "layer":
            self.value = nn.Parameter(torch.zeros(d_v))  # (Dv,)
        elif form == "head":
            self.value = nn.Parameter(torch.zeros(n_heads, d_v))  # (H, Dv)

    def forward(self) -> torch.Tensor | None:
        """v0: None for the "zero" form, else the parameter, (Dv,) per layer or (H, Dv) per head."""
        return None if self.form == "zero" else self.value
