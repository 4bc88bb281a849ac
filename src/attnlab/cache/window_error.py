"""Error control for windowed decode: how much attention mass the window leaves out.

The measured quantity is exact: mass_out = 1 - Z_window / Z_full, where Z sums
exp(score) over the window's candidates (sink included) or over every cached entry.

The seed's bound: for a pure scalar head, the Gaussian weight exp(-d^2 / tau) outside a
radius r holds a fraction erfc(r / sqrt(tau)) of the total,

    int_{|x| > r} exp(-x^2/tau) dx / int exp(-x^2/tau) dx = erfc(r / sqrt(tau)).

That is a statement about a continuum of keys of constant density around the query. It
carries over to a cache when (a) the key density outside the window is no higher than
inside it (a sparse region just outside the window, or keys ending, only lowers the
leftover mass), and (b) keys are spaced finely compared with sqrt(tau) so the sum over
keys is close to the integral. A query in a sparse region with a dense cluster just past
the radius breaks (a), and the measured mass can then exceed the bound by any factor; the
tests show both cases. It does not apply to hybrid heads (the dot product reweights
keys), whose leftover mass is measured but not bounded. It is independent of n only at
fixed key density: at fixed key range, density grows with n and a k-window's radius shrinks.

Under the Cauchy kernel (kernel="cauchy", weight 1 / (1 + d^2 / tau)) the same continuum gives
1 - (2 / pi) atan(r / sqrt(tau)): a polynomial tail, far above erfc at the same radius (at
r = 3 sqrt(tau): 0.20 against 2e-5), so a window leaves out more of such a kernel's mass.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .sorted_index import run_keys

__all__ = ["WindowError", "window_error", "erfc_bound", "cauchy_bound"]


def erfc_bound(radius, tau):
    """erfc(radius / sqrt(tau)): the seed's bound on the mass outside radius (module docstring).

    Args:
        radius: the window's radius r >= 0, a float or a tensor.
        tau: the temperature > 0, a float or a tensor broadcastable with radius.

    Returns:
        A float for floats, else a float64 tensor of the broadcast shape. Nothing is checked; a
        negative tensor tau gives NaN, a negative float tau a ValueError from math.sqrt.
    """
    if isinstance(radius, torch.Tensor) or isinstance(tau, torch.Tensor):
        r = torch.as_tensor(radius, dtype=torch.float64)
        return torch.special.erfc(r / torch.as_tensor(tau, dtype=torch.float64).sqrt())
    return math.erfc(radius / math.sqrt(tau))


def cauchy_bound(radius, tau):
    """1 - (2 / pi) atan(radius / sqrt(tau)): the Cauchy kernel's mass beyond radius over a continuum
    of keys (module docstring); arguments as `erfc_bound`'s."""
    if isinstance(radius, torch.Tensor) or isinstance(tau, torch.Tensor):
        r = torch.as_tensor(radius, dtype=torch.float64)
        return 1.0 - (2.0 / math.pi) * torch.atan(r / torch.as_tensor(tau, dtype=torch.float64).sqrt())
    return 1.0 - (2.0 / math.pi) * math.atan(radius / math.sqrt(tau))


@dataclass
class WindowError:
    """What `window_error` measures, per head.

    Attributes:
        mass_out: (B, H), the fraction of the full softmax mass outside the window.
        radius: (B, H), the distance from the query to the nearest cached key left out (inf if
            none).
        bound: (B, H), erfc(radius / sqrt(tau)), or `cauchy_bound` for a Cauchy cache (meaningful
            for pure scalar heads, see the module docstring).
    """

    mass_out: torch.Tensor
    radius: torch.Tensor
    bound: torch.Tensor


@torch.no_grad()
def window_error(cache, qs: torch.Tensor, tau, q: torch.Tensor | None = None, window: int | None = 64,
                 radius=None, eps: float | None = None) -> WindowError:
    """Measure the attention mass that ``cache.attend`` with these arguments leaves out.

    Does not record the queries for eviction. O(n) per head: a diagnostic, not a decode path.

    Args:
        cache: the `attnlab.cache.SortedScalarCache` to measure.
        qs: scalar queries (B, H).
        tau: temperature: a float, 0-d, (H,) or (B, H).
        q: vector queries (B, H, Dk) for hybrid heads; None for scalar heads.
        window: the k nearest entries, as ``attend`` takes it; None for all.
        radius: keep only entries within this radius (float, (H,) or (B, H)), as ``attend``.
        eps: or the radius sqrt(-tau log eps), eps in (0, 1).

    Returns:
        A `WindowError` of (B, H) float64 tensors.

    Raises:
        TypeError: as ``cache.attend`` (its argument checks, through ``cache.query``).
        ValueError: as ``cache.attend``.
    """
    query = cache.query(qs, tau, q, window, radius, eps)
    cand, dist_w = cache.select(query)
    full = cache.index.all_entries()
    dist = (run_keys(full) - query.qs).abs()  # (R, N), pads inf
    lw = cache.scores(cand, query).double()  # (R, k)
    lf_sink = cache.scores(full, query, radius=False, sink=cache.has_sink).double()  # (R, N [+ 1])
    lf = lf_sink[:, : dist.shape[1]]  # (R, N)
    kept = torch.isfinite(lw)  # (R, k) candidates that count (radius mode masks some)
    lse_full = lf_sink.logsumexp(1)  # the sink is always in the window
    # realized radius: distance to the nearest entry left out (the window is a set of nearest keys)
    none = torch.full_like(dist[:, :1], float("-inf"))
    far = torch.cat([torch.where(kept, dist_w, float("-inf")), none], 1).amax(1, keepdim=True)  # (R, 1)
    ties_left_out = (dist <= far).sum(1) > kept.sum(1)  # some entries at the edge distance left out
    beyond = torch.where(dist > far, dist, float("inf")).amin(1)
    rad = torch.where(ties_left_out, far.squeeze(1), beyond).double()
    # mass out, summed over the entries beyond the window's edge distance, plus the share of
    # entries at exactly that distance that the window left out (ties): sums of small terms,
    # so tiny masses keep their precision instead of vanishing in 1 - Z_window / Z_full
    p_full = (lf - lse_full[:, None]).exp()  # (R, N)
    p_win = (lw - lse_full[:, None]).exp()  # (R, k)
    beyond_mass = p_full.masked_fill(dist <= far, 0.0).sum(1)
    tied_full = p_full.masked_fill(dist != far, 0.0).sum(1)
    tied_kept = p_win.masked_fill(~(kept & (dist_w == far)), 0.0).sum(1)
    mass_out = (beyond_mass + (tied_full - tied_kept).clamp_min(0.0)).nan_to_num(0.0).clamp(0.0, 1.0)
    tau64 = query.tau.double().view(-1) if isinstance(query.tau, torch.Tensor) else query.tau
    bound = (erfc_bound if cache.kernel == "gaussian" else cauchy_bound)(rad, tau64)
    shape = (cache.batch, cache.n_heads)
    return WindowError(mass_out.view(shape), rad.view(shape), bound.view(shape))
