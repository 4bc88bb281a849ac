"""GOAT's log-prior over positions, log pi_ij = sum_r [a_r cos(w_r (i - j)) + b_r sin(w_r (i - j))] + u_j:
materialised (`goat_prior`, its spectral part `spectral_prior`), or as the phases cos w t, sin w t the
fused paths append to queries and keys (`phases`). Phases are built in float64 and cast, so long
positions keep their accuracy."""

from __future__ import annotations

import torch

from ...masks import visible_keys
from ..common.precision import upcast


def phases(freqs: torch.Tensor, start: int, n: int, dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of w_r t for t = start .. start + n - 1: (n, R) each, computed in float64."""
    t = torch.arange(start, start + n, device=freqs.device, dtype=torch.float64)
    ph = t[:, None] * freqs.to(torch.float64)[None, :]  # (n, R)
    return ph.cos().to(dtype), ph.sin().to(dtype)


def goat_prior(freqs, lam_sym, lam_asym, u, Tq: int, causal: bool = True, window: int | None = None) -> torch.Tensor:
    """The log-prior log pi as a (B|1, G, Tq, Tk) tensor, -inf where key j is hidden from query i.

    Materialises Tq x Tk: the naive path and analysis. It does not check its arguments;
    `goat_attention` checks the same ones before calling it.

    Args:
        freqs: the prior's frequencies w_r (R,).
        lam_sym: the symmetric (cosine) spectral weights a (G, R), one row per key group.
        lam_asym: the antisymmetric (sine) spectral weights b (G, R).
        u: the key-only term (B or 1, G, Tk); its last dimension sets Tk.
        Tq: the number of queries, the last Tq of the Tk positions.
        causal: -inf where key j comes after query i.
        window: with causal, -inf too where key j is not among query i's last `window` keys.

    Returns:
        (B or 1, G, Tq, Tk), in u's dtype (float32 for 16-bit u).
    """
    Tk = u.shape[-1]
    dt = upcast(u.dtype)
    kpos = torch.arange(Tk, device=u.device)
    prior = spectral_prior(freqs, lam_sym, lam_asym, kpos[Tk - Tq :], kpos, dt)[None] + u.to(dt)[:, :, None, :]
    if causal:
        prior = prior.masked_fill(~visible_keys(Tq, Tk, True, u.device, window), float("-inf"))
    return prior


def spectral_prior(freqs, lam_sym, lam_asym, qpos: torch.Tensor, kpos: torch.Tensor, dtype) -> torch.Tensor:
    """The prior's spectral part sum_r [a_r cos w_r (i - j) + b_r sin w_r (i - j)] for queries at
    positions qpos (Tq,) and keys at kpos (Tk,) (integer tensors): (G, Tq, Tk) in dtype, the phases
    in float64. `goat_prior` calls it; a static decoder passes the positions its buffers hold."""
    rel = (qpos[:, None] - kpos[None, :]).to(torch.float64)
    ph = rel[..., None] * freqs.to(torch.float64)  # (Tq, Tk, R)
    return (torch.einsum("ijr,gr->gij", ph.cos().to(dtype), lam_sym.to(dtype))
            + torch.einsum("ijr,gr->gij", ph.sin().to(dtype), lam_asym.to(dtype)))
