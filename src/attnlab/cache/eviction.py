"""Eviction and compression for the sorted scalar cache, in scalar-key space.

geometric eviction: a head's keys outside [min recent qs - r, max recent qs + r] (over its
    rolling window of recent queries) are far from every query the head has been asking
    and are dropped; O(n) mask per call, no attention statistics needed.
density compression: in dense regions adjacent keys have nearly identical weights for any
    query, so a run of ``group`` adjacent keys spanning <= max_span becomes one entry with
    key = weighted centroid, value = weighted mean, weight = total count; its logit gets
    + log(count). Exact when the keys are equal; otherwise each member's true logit differs
    from the representative's by at most span * (2 |qs - centroid| + span) / tau. Hybrid
    heads also average the vector keys; members' dot products q . k_i / sqrt(d_k) then
    differ from the representative's by q . (k_i - k_mean) / sqrt(d_k), which the scalar
    span does not control: compress hybrid caches only where vector keys are close too.
budget eviction: a head holding more than ``budget`` entries keeps the ``budget`` nearest to the
    range of its recent queries [min, max] (distance 0 inside it), the newest first among equal
    distances (entry recency = value-slot order), and drops the rest. Called after every decode
    step it caps the cache at a memory budget in tokens; `attnlab.ops.budget_evictions` computes
    the same decisions for a whole sequence at once (the windowed-decode loss under a budget).
sink zone: keys in a reserved range (lo, hi) are never evicted or compressed.
slot reclamation: value slots no head of a group references are freed by compacting
    the value store (O(slots * d_v), so it runs after eviction, not every step).

All functions take the cache (attnlab.cache.sorted.SortedScalarCache) and edit it in place.
"""

from __future__ import annotations

import torch

from ..checks import check_int
from ..ops.scalar import range_distance
from .sorted_index import radius_from_tolerance, run_keys


def live_slots(cache) -> torch.Tensor:
    """(B*G, n_slots) bool: which value slots some head of the group still references."""
    S = cache.n_slots
    ent = cache.index.all_entries()  # (C, R, N)
    slots = torch.where(torch.isfinite(run_keys(ent)), ent[1].long(), S)  # dead refs -> spare column
    live = torch.zeros(cache.batch * cache.n_groups, S + 1, dtype=torch.bool, device=cache.device)
    live[cache.row_group.expand_as(slots), slots] = True
    return live[:, :S]


def reclaim_slots(cache) -> int:
    """Compact the value (and vector-key) store to the slots still referenced; remap the index.
    Returns the number of slots freed (uniform over batch x groups)."""
    S = cache.n_slots
    if S == 0:
        return 0
    B, G, R = cache.batch, cache.n_groups, cache.rows
    cap = cache.values.shape[2]
    live = live_slots(cache)  # (B*G, S)
    new_s = int(live.sum(1).max().item())
    if new_s == S:
        return 0
    newpos = torch.where(live, live.cumsum(1) - 1, 0)  # (B*G, S): old slot -> new slot
    gi, si = live.nonzero(as_tuple=True)
    values = cache.values.view(B * G, cap, cache.d_v)
    fresh = torch.zeros_like(values)
    fresh[gi, newpos[gi, si]] = values[gi, si]
    cache.values = fresh.view_as(cache.values)
    if cache.hybrid:
        vkeys = cache.vkeys.view(R, cap, cache.d_k)
        live_h = live[cache.row_group.view(R)]  # (R, S): slot live in the head's group
        hi, si = live_h.nonzero(as_tuple=True)
        fresh_k = torch.zeros_like(vkeys)
        fresh_k[hi, newpos[cache.row_group.view(R)[hi], si]] = vkeys[hi, si]
        cache.vkeys = fresh_k.view_as(cache.vkeys)
    cache.index.map_slots(lambda s: newpos[cache.row_group, s.long()].to(torch.int32))
    cache.n_slots = new_s
    return S - new_s


def _count(cache) -> int:
    return int(cache.index.n_entries().sum().item())


def evict_geometric(cache, radius=None, *, tau=None, eps=None, reclaim: bool = True) -> int:
    """Drop each head's keys outside [min recent qs - r, max recent qs + r], keeping the sink zone.

    r is ``radius`` (float, (H,) or (B, H)), or sqrt(-tau log eps) from ``tau`` and ``eps``.
    The recent queries are the last ``query_history`` ones recorded by ``attend``.
    Returns the number of entries evicted (summed over batch x heads)."""
    hist = cache.recent_queries()  # (R, m)
    if hist.shape[1] == 0:
        raise ValueError("geometric eviction needs recent queries: call attend() before evict_geometric()")
    if radius is None:
        if tau is None or eps is None:
            raise ValueError("give radius, or both tau and eps (r = sqrt(-tau log eps))")
        if not 0 < eps < 1:
            raise ValueError(f"eps must be in (0, 1), got {eps!r}")
        r = radius_from_tolerance(cache.per_row("tau", tau), float(eps), cache.kernel)
    else:
        r = cache.per_row("radius", radius)
    lo = hist.amin(1, keepdim=True) - r  # (R, 1)
    hi = hist.amax(1, keepdim=True) + r
    zone = cache.sink_zone

    def keep(keys: torch.Tensor) -> torch.Tensor:
        mask = (keys >= lo) & (keys <= hi)
        if zone is not None:
            mask = mask | ((keys >= zone[0]) & (keys <= zone[1]))
        return mask

    before = _count(cache)
    cache.index.filter(keep)
    removed = before - _count(cache)
    cache.recount_entries()
    if reclaim and removed:
        reclaim_slots(cache)
    return removed


def evict_to_budget(cache, budget: int) -> int:
    """Keep at most ``budget`` entries per head (see the module docstring; the sink entry is not an
    entry, keys in the sink zone are kept on top of the budget). Returns the entries evicted.
    The value store is compacted (slot order, hence recency, kept) once it holds twice the budget,
    so memory stays O(budget) at O(1) amortised cost per step."""
    check_int("budget", budget)
    if int(cache.index.n_entries().max().item()) <= budget:
        return 0
    hist = cache.recent_queries()  # (R, m)
    if hist.shape[1] == 0:
        raise ValueError("budget eviction needs recent queries: call attend() before evict_to_budget()")
    run = cache.index.merged(weighted=cache.index.weighted)
    keys, slots = run_keys(run), run[1].long()  # (R, W); pads: +inf keys
    lo, hi = hist.amin(1, keepdim=True), hist.amax(1, keepdim=True)
    dist = range_distance(keys, lo, hi)
    live = torch.isfinite(keys)
    protected = torch.zeros_like(live)
    if cache.sink_zone is not None:
        protected = live & (keys >= cache.sink_zone[0]) & (keys <= cache.sink_zone[1])
    dist = torch.where(live & ~protected, dist, float("inf"))
    # rank by (distance, newest first): sort by slot descending, then stably by distance
    by_slot = slots.masked_fill(~live, -1).argsort(dim=1, descending=True, stable=True)
    order = by_slot.gather(1, dist.gather(1, by_slot).argsort(dim=1, stable=True))
    rank = torch.empty_like(order)
    rank.scatter_(1, order, torch.arange(order.shape[1], device=order.device).expand_as(order))
    keep = protected | (live & ~protected & (rank < budget))
    before = _count(cache)
    cache.index.replace(cache.index.compact(run, keep))
    cache.recount_entries()
    removed = before - _count(cache)
    if cache.n_slots >= 2 * budget + 64:
        reclaim_slots(cache)
    return removed


def compress_density(cache, max_span: float, group: int = 4, reclaim: bool = True) -> int:
    """Merge every aligned run of ``group`` adjacent keys (in a head's sorted order) whose
    key span is <= max_span into one weighted entry (see the module docstring).

    Works on a merged copy of the index and changes the cache only once nothing can fail: when
    it merges something, the index becomes one weighted sorted run. A fixed capacity without room
    for the merged entries raises RuntimeError, the cache unchanged. Returns the entries removed."""
    if isinstance(max_span, bool) or not isinstance(max_span, (int, float)) or not max_span >= 0:
        raise ValueError(f"max_span must be a float >= 0, got {max_span!r}")
    check_int("group", group, 2)
    index, m = cache.index, group
    run = index.merged(weighted=True)
    if run is None or run.shape[2] < m:
        return 0
    R, W = run.shape[1], run.shape[2]
    nch = W // m
    chunks = run_keys(run)[:, : nch * m].reshape(R, nch, m)  # sorted within each row
    ok = (chunks[..., -1] - chunks[..., 0]) <= max_span  # pads: inf or nan -> False
    if cache.sink_zone is not None:
        lo, hi = cache.sink_zone
        ok = ok & ~((chunks >= lo) & (chunks <= hi)).any(-1)
    rr, cc = ok.nonzero(as_tuple=True)  # row-major: rows ascending
    if rr.numel() == 0:
        return 0
    grow = cache.row_group.view(R)[rr]  # (Q,) value row b*G+g; nondecreasing in rr
    counts = torch.bincount(grow, minlength=cache.batch * cache.n_groups)
    rank = torch.arange(rr.numel(), device=rr.device) - (counts.cumsum(0) - counts)[grow]
    n_new = int(counts.max().item())
    if cache.capacity is not None and cache.n_slots + n_new > cache.values.shape[2]:
        in_use = int(live_slots(cache).sum(1).max().item()) if cache.n_slots else 0  # after a reclaim
        if in_use + n_new > cache.capacity:
            raise RuntimeError(f"the cache is full: compressing needs {n_new} new value slots, capacity="
                               f"{cache.capacity} has {cache.capacity - in_use} free after reclaiming; "
                               f"the cache is unchanged (evict first, or use a larger capacity)")
    index.ensure_weighted()
    index.replace(run)
    cache.reserve_slots(n_new)  # may reclaim slots, which remaps the run in place
    run = index.runs()[0]
    cap = cache.values.shape[2]

    pos = cc[:, None] * m + torch.arange(m, device=rr.device)  # (Q, m) positions in the row
    mk = run_keys(run)[rr[:, None], pos]  # (Q, m)
    ms = run[1][rr[:, None], pos].long()
    mw = run[2].view(torch.float32)[rr[:, None], pos]
    p = torch.softmax(mw, -1)  # member weights count_i / sum(count)
    logw = torch.logsumexp(mw, -1)
    key = (p * mk).sum(-1).clamp(mk[:, 0], mk[:, -1])  # centroid stays inside the run: order kept
    vals = cache.values.view(-1, cap, cache.d_v)[grow[:, None], ms].float()  # (Q, m, Dv)
    new_slot = cache.n_slots + rank  # (Q,)
    cache.values.view(-1, cap, cache.d_v)[grow, new_slot] = (p[..., None] * vals).sum(1).to(cache.dtype)
    if cache.hybrid:
        vk = cache.vkeys.view(-1, cap, cache.d_k)[rr[:, None], ms].float()  # (Q, m, Dk)
        cache.vkeys.view(-1, cap, cache.d_k)[rr, new_slot] = (p[..., None] * vk).sum(1).to(cache.dtype)
    cache.n_slots += n_new

    first = pos[:, 0]
    run[0][rr, first] = key.contiguous().view(torch.int32)
    run[1][rr, first] = new_slot.to(torch.int32)
    run[2][rr, first] = logw.contiguous().view(torch.int32)
    keep = torch.isfinite(run_keys(run))
    keep[rr[:, None], pos[:, 1:]] = False
    index.replace(index.compact(run, keep))
    cache.recount_entries()
    if reclaim:
        reclaim_slots(cache)
    return int(rr.numel()) * (m - 1)
