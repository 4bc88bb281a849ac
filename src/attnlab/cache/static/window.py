"""A trained window decoded with static shapes: the sorted cache's choice of keys as fixed-size device work.

A layer trained through a window (`train_window = k`, `local_window = w`) reads, at position t, the
last w keys (its own among them) and the k keys nearest to its scalar query among the older ones,
positions 0 .. t - w, the newest first among equal distances (`ops.scalar.window`); the sorted cache
and its ring compute this token by token (`attnlab.cache.SortedScalarCache`). Here the same choice is
made with shapes that never change, so the step compiles into one graph:

- every key, value and scalar key stays in buffers of `max_len` positions (as for exact decoding);
- the older keys up to a merge point M are held twice, as int64 codes sorted ascending: the key's
  order-preserving integer in the high 32 bits and, in the low 32 bits, its position (the `low`
  array) or max - position (the `high` array). Among the keys below the query, the k nearest are
  the k just before its insertion point in `low` (the newest first within equal keys); among the
  keys at or above it, the k just from its insertion point in `high` (again the newest first). So
  2k candidates hold the k nearest of all keys up to M, ties included, with no fallback;
- the older keys from M to t - w (at most `tail` of them) are scored directly;
- the k nearest of those 2k + tail candidates by (distance bits, newest first) are the window,
  exactly the dense rule's top-k; a step costs O(log max_len + k + tail);
- every `tail` steps, between steps, M moves up: the keys it passes are sorted and merged into both
  arrays (`extend_codes`: O(t) at position t, by searches, a running count and one ordered fill,
  where sorting both arrays again, `merge_codes`, is O(max_len log max_len)), amortised over the
  tail; its temporaries live in one scratch buffer the decoder keeps.

`merge_codes` (after a prompt), `extend_codes` (between steps) and `window_keys` (in a step) are the
pieces; the scalar family's static state calls them. Under a memory budget (`budget=M`: at most M
older keys per head, the cache's `evict_to_budget` after every step) evictions leave holes the codes
cannot skip, so `nearest_alive` scores every live slot (O(max_len), still static) and `budget_keep`
makes the eviction's choice on the device. The naive reference is the sorted cache itself: tests
compare every step's logits with `LM.step` through it.
"""

from __future__ import annotations

import torch

__all__ = ["POS_MAX", "budget_keep", "extend_codes", "extend_scratch_size", "float_order", "merge_codes",
           "nearest_alive", "window_keys"]

POS_MAX = 2**31 - 1  # positions below this (the low 32 bits of a code)
LAST = torch.iinfo(torch.int64).max  # an unused slot's code: after every key


def float_order(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 with the same order (x < y iff order(x) < order(y)) for finite x, +0.0 and
    -0.0 alike (keys are stored as x + 0.0, which makes every zero +0.0)."""
    bits = x.contiguous().view(torch.int32)
    return torch.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(torch.int64)


def merge_codes(ks: torch.Tensor, merged: int) -> torch.Tensor:
    """The sorted codes of the scalar keys ks (B, H, N) float32 at positions < merged, (B, H, 2, N):
    `low` [..., 0, :] (order << 32 | position) and `high` [..., 1, :] (order << 32 | POS_MAX -
    position), unused slots last. One tensor, so that a decode step searches both in one call."""
    N = ks.shape[-1]
    pos = torch.arange(N, device=ks.device)
    order = (float_order(ks) << 32)[..., None, :]
    both = torch.stack([pos, POS_MAX - pos])  # (2, N)
    return torch.where(pos < merged, order | both, LAST).sort(dim=-1).values


def extend_codes(codes: torch.Tensor, ks: torch.Tensor, old: int, upto: int,
                 scratch: torch.Tensor | None = None) -> torch.Tensor:
    """`codes` (B, H, 2, N), which hold `merge_codes(ks, old)`, made `merge_codes(ks, upto)` in place
    (old <= upto) and returned. Only the new keys, positions old .. upto - 1, are sorted; each finds
    its place among the old codes by binary search (every code is distinct: its low 32 bits hold its
    position), and each old code moves up by the number of new codes below it: a count of the new
    codes per place, summed cumulatively (a linear pass, no search per old code). O(upto + n log upto)
    for n new keys, where sorting again is O(upto log upto); no host sync and no shape from data.
    The merge a decode step makes every `tail` steps.
    scratch: an int64 buffer of at least `extend_scratch_size(codes)` elements on codes' device that
    holds the temporaries (a copy of the old codes, their destinations), so that a merge allocates
    nothing of size upto; None allocates them."""
    if not 0 <= old <= upto <= ks.shape[-1]:
        raise ValueError(f"need 0 <= old <= upto <= {ks.shape[-1]}, got old={old}, upto={upto}")
    need = extend_scratch_size(codes)
    if scratch is not None and (scratch.dtype != torch.int64 or scratch.device != codes.device
                                or scratch.numel() < need):
        raise ValueError(f"scratch must be int64 on {codes.device} with at least {need} elements, "
                         f"got {scratch.dtype} on {scratch.device} with {scratch.numel()}")
    if upto == old:
        return codes
    dev = ks.device
    pos = torch.arange(old, upto, device=dev)
    fresh = ((float_order(ks[..., old:upto]) << 32)[..., None, :]
             | torch.stack([pos, POS_MAX - pos])).sort(dim=-1).values  # (B, H, 2, n)
    lead, rows = codes.shape[:-1], codes[..., 0].numel()
    if scratch is None:
        scratch = torch.empty(rows * (2 * old + 1), dtype=torch.int64, device=dev)
    flat = scratch.view(-1)
    before = flat[:rows * old].view(*lead, old)
    before.copy_(codes[..., :old])  # the old codes (a copy: their places move)
    below = torch.searchsorted(before, fresh)  # (B, H, 2, n): old codes below each new one
    # new codes below old code j: those with below <= j, the running sum of how many sit at each place
    dest = flat[rows * old:rows * (2 * old + 1)].view(*lead, old + 1).zero_()
    dest.scatter_add_(-1, below, torch.ones_like(below))
    dest.cumsum_(-1)
    dest = dest[..., :old].add_(torch.arange(old, device=dev))
    head = codes[..., :upto]
    head.scatter_(-1, dest, before)
    head.scatter_(-1, torch.arange(upto - old, device=dev) + below, fresh)
    return codes


def extend_scratch_size(codes: torch.Tensor) -> int:
    """How many int64 elements `extend_codes` needs as scratch for `codes` (B, H, 2, N), at any merge
    point: a copy of the old codes and their N + 1 destination counts per row."""
    return codes[..., 0].numel() * (2 * codes.shape[-1] + 1)


def window_keys(qs: torch.Tensor, ks: torch.Tensor, codes: torch.Tensor, merged: torch.Tensor,
                last_old: torch.Tensor, k: int, tail: int, impl: str = "auto") -> tuple[torch.Tensor, torch.Tensor]:
    """The k keys nearest to each scalar query qs (B, H) float32 among positions 0 .. last_old (a
    0-dim tensor; none when negative): those below `merged` (a 0-dim tensor) through the sorted codes
    (B, H, 2, N) of `merge_codes`, those from merged to last_old (at most `tail`) scored directly.
    ks (B, H, N) the stored scalar keys. Returns positions (B, H, k) and validity (False where fewer
    keys exist), in the dense rule's order (nearest first, the newest first among equal distances).
    impl: "auto" runs one Triton kernel on CUDA (`window_kernel`, the same keys) and the PyTorch
    ops below elsewhere; "triton" the kernel (the CPU under TRITON_INTERPRET=1); "torch" the ops."""
    from ...ops.common.triton_route import triton_missing, triton_route

    if impl not in ("auto", "triton", "torch"):
        raise ValueError(f"impl must be 'auto', 'triton' or 'torch', got {impl!r}")
    if impl == "triton" and triton_missing(qs.device):
        raise ValueError(f"impl='triton': {triton_missing(qs.device)}")
    if triton_route(impl, qs.device):
        from .window_kernel import triton_window_keys

        return triton_window_keys(qs, ks, codes, merged, last_old, k, tail)
    B, H, N = ks.shape
    dev = ks.device
    code = (float_order(qs) << 32)[..., None, None].expand(B, H, 2, 1)  # every key below the query sorts first
    spread = torch.arange(k, device=dev)
    at = torch.searchsorted(codes, code.contiguous())  # (B, H, 2, 1): the insertion points in low and high
    shift = ((torch.arange(2, device=dev) - 1) * k)[:, None]  # -k, 0: the k slots before it in low, k from it in high
    i = at + shift + spread  # (B, H, 2, k)
    i_lo, i_hi = i[:, :, 0], i[:, :, 1]
    n_sorted = torch.minimum(merged, last_old + 1)
    ok_lo = i_lo >= 0
    ok_hi = i_hi < n_sorted
    got = codes.gather(-1, i.clamp(0, N - 1)) & 0xFFFFFFFF
    p_lo, p_hi = got[:, :, 0], POS_MAX - got[:, :, 1]
    p_tail = merged + torch.arange(tail, device=dev)  # (tail,)
    ok_tail = p_tail <= last_old
    cand = torch.cat([p_lo, p_hi, p_tail.clamp(max=N - 1).expand(B, H, tail)], -1)  # (B, H, 2k + tail)
    ok = torch.cat([ok_lo, ok_hi & (p_hi <= last_old), ok_tail.expand(B, H, tail)], -1)
    cand = cand.clamp(0, N - 1)  # an unused slot's code decodes to no position
    dist = (qs[..., None] - ks.gather(-1, cand)).abs().masked_fill(~ok, float("inf"))
    rank = ((float_order(dist) << 32) | (POS_MAX - cand)).masked_fill(~ok, LAST)  # nearest first, then the newest
    best = rank.topk(k, dim=-1, largest=False).indices
    return cand.gather(-1, best), dist.gather(-1, best) < float("inf")


def nearest_alive(qs: torch.Tensor, ks: torch.Tensor, older: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The k keys nearest to qs (B, H) among the slots `older` marks (B, H, N) of ks (B, H, N), by the
    dense rule (distance, then the newest first), every slot scored: O(N) per step with static
    shapes, the route of a budgeted window, whose evictions leave holes the sorted codes cannot
    skip. Returns positions (B, H, k) and validity."""
    N = ks.shape[-1]
    pos = torch.arange(N, device=ks.device)
    dist = (qs[..., None] - ks).abs()
    rank = ((float_order(dist) << 32) | (POS_MAX - pos)).masked_fill(~older, LAST)
    best = rank.topk(min(k, N), dim=-1, largest=False)
    return best.indices, best.values != LAST


def budget_keep(ks: torch.Tensor, older: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, budget: int) -> torch.Tensor:
    """Which of the slots `older` marks (B, H, N) stay under a budget of `budget` entries per head:
    the budget nearest to the recent queries' range [lo, hi] (B, H) (distance 0 inside it), the
    newest first among equal distances, as `cache.eviction.evict_to_budget` keeps them. (B, H, N) bool."""
    from ...ops.scalar.budget import range_distance

    N = ks.shape[-1]
    pos = torch.arange(N, device=ks.device)
    dist = range_distance(ks, lo[..., None], hi[..., None]) + 0.0  # + 0.0: one zero, as the cache compares
    rank = ((float_order(dist) << 32) | (POS_MAX - pos)).masked_fill(~older, LAST)
    best = rank.topk(min(budget, N), dim=-1, largest=False)
    keep = torch.zeros_like(older)
    keep.scatter_(-1, best.indices, best.values != LAST)
    return keep
