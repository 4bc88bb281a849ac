"""The budget rule of a sorted cache capped at M keys per head, for a whole sequence at once:
`budget_evictions` says after which step each key is evicted (what
`attnlab.cache.eviction.evict_to_budget` does token by token), and `range_distance` is the ranking
both use. `windowed_attention(budget=...)` reads only the keys still held."""

from __future__ import annotations

import torch

from ...checks import check_int

NEVER = torch.iinfo(torch.int64).max

__all__ = ["NEVER", "budget_evictions", "range_distance"]


def range_distance(keys: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor) -> torch.Tensor:
    """Distance of each key to the interval [lo, hi] (0 inside): budget eviction's ranking, shared
    by `budget_evictions` and `attnlab.cache.eviction.evict_to_budget`."""
    return torch.clamp(torch.maximum(lo - keys, keys - hi), min=0.0)


def budget_evictions(qs: torch.Tensor, ks: torch.Tensor, budget: int, *, history: int = 256,
                     n_prefix: int = 0, local: int = 0) -> torch.Tensor:
    """The step after whose query each key is evicted when a sorted cache decoding this sequence
    calls `evict_to_budget(budget)` after every step.

    At step t the cache holds the surviving keys <= t; when that is more than `budget`, the key
    farthest from the range [min, max] of the last `history` queries (distance 0 inside) goes,
    the oldest first among equal distances (`attnlab.cache.eviction.evict_to_budget`'s rule:
    keep the nearest, the newest first). Sequential over t, vectorised over batch x heads. No
    gradient.

    Args:
        qs: scalar queries (B, H, T), one per step.
        ks: scalar keys (B, H, T).
        budget: entries a head keeps, an int >= 1.
        history: how many recent queries span the range, an int >= 1.
        n_prefix: leading positions (a sink) that are never evicted nor counted, an int >= 0.
        local: the last `local` keys sit in the cache's ring, outside the budget: key s enters the
            budgeted cache at step s + local, when it leaves the ring; an int >= 0.

    Returns:
        evicted_at (B, H, T) int64; query t still sees key s when evicted_at[s] >= t. NEVER (the
        largest int64) for keys still held at the end and for the n_prefix positions.

    Raises:
        ValueError: budget or history is not a positive int (for a non-int, a NotAnIntError,
            which is a TypeError too). qs and ks are not checked (`windowed_attention` checks
            them before calling this).
    """
    check_int("budget", budget)
    check_int("history", history)
    B, H, T = ks.shape
    q, k = qs.detach().float(), ks.detach().float()
    evicted = torch.full((B, H, T), NEVER, dtype=torch.long, device=ks.device)
    alive = torch.zeros(B, H, T, dtype=torch.bool, device=ks.device)
    pos = torch.arange(T, device=ks.device)
    check_int("local", local, 0)
    for t in range(n_prefix + local, T):
        s = t - local  # the key entering the budgeted cache at this step
        alive[..., s] = True
        if s - n_prefix + 1 <= budget:
            continue
        window = q[..., max(n_prefix, t - history + 1) : t + 1]
        lo, hi = window.amin(-1, keepdim=True), window.amax(-1, keepdim=True)
        cand = alive[..., : s + 1]
        dist = range_distance(k[..., : s + 1], lo, hi).masked_fill(~cand, float("-inf"))
        worst = cand & (dist == dist.amax(-1, keepdim=True))
        out = torch.where(worst, pos[: s + 1], T).amin(-1, keepdim=True)  # the oldest of the farthest
        alive.scatter_(-1, out, False)
        evicted.scatter_(-1, out, t)
    return evicted
