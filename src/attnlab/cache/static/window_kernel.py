"""A trained window's choice of keys for one decode step as one Triton kernel (`window_keys` on a GPU).

`window.window_keys` in PyTorch is a chain of device ops per layer and step: the query's code,
a searchsorted in the sorted codes, gathers of the 2k candidates and of their scalar keys, the
distances and ranks, a top-k, and the gathers of its result. In a compiled decode step on a GPU each is
a launch of its own, and a step of a small model is bound by launches, not by bytes (the shipped
windowed model's compiled window step measured slower than its exact step on an H200 at 4K and 32K,
0.462 against 0.339 ms). Here one program per (batch row, head) does all of it:

- the insertion point of the query's code in the low and the high codes by a 128-way search: each round
  reads 128 evenly spaced codes of the range left and keeps the one gap the query falls in, so
  ceil(log_128 N) + 1 rounds of one vector load each (a binary search would make log2 N dependent loads);
- the k slots before the point in `low`, the k from it in `high` and the `tail` positions after the
  merge point, their scalar keys, distances and ranks (the distance's bits, then the newest first), as
  `window_keys` forms them;
- the k smallest ranks in order, by k rounds of one minimum over all 2k + tail candidates (held in one
  vector; ranks of valid candidates are unique, each holding its position), each round's winner
  written and removed.

The result equals `window_keys` exactly (positions where valid, and validity); a slot with fewer keys
than k holds position 0, invalid. It runs inside the custom op `attnlab::window_keys`, so a compiled step
sees one opaque call, and reads the merge point and the last old position from device tensors: no host
sync, nothing allocated but its outputs, capturable in a CUDA graph.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["search_rounds", "triton_window_keys"]

PROBES = 128  # codes read per round of the search
# window.py's POS_MAX (2**31 - 1) and LAST (2**63 - 1) appear as literals in the kernel (tested equal)


def search_rounds(n: int, probes: int = PROBES) -> int:
    """Rounds of the `probes`-way search that leave a range of n codes empty (the insertion point found)."""
    rounds = 0
    while n > 0:
        n = -(-n // probes) - 1
        rounds += 1
    return max(rounds, 1)


@triton.jit
def _order(x):
    """float32 -> int64 of the same order (`window.float_order`)."""
    bits = x.to(tl.int32, bitcast=True)
    return tl.where(bits < 0, bits ^ 0x7FFFFFFF, bits).to(tl.int64)


@triton.jit
def _insertion(codes, n, code, ROUNDS: tl.constexpr, PROBES: tl.constexpr):
    """The first index of codes[0:n] (sorted ascending) holding a value >= code (n when none)."""
    j = tl.arange(0, PROBES).to(tl.int64)
    lo = tl.zeros((), tl.int64)
    hi = lo + n
    for _ in tl.static_range(ROUNDS):
        step = (hi - lo + PROBES - 1) // PROBES
        p = lo + j * step
        inside = p < hi
        below = inside & (tl.load(codes + p, mask=inside, other=0) < code)
        cnt = tl.sum(below.to(tl.int64), 0)  # probes 0 .. cnt - 1 lie below the code, the answer after them
        new_lo = tl.where(cnt > 0, lo + (cnt - 1) * step + 1, lo)
        hi = tl.minimum(lo + cnt * step, hi)
        lo = new_lo
    return lo


@triton.jit
def _window_keys(QS, KS, CODES, MERGED, LAST_OLD, IDX, OK, N, K: tl.constexpr, TAIL: tl.constexpr,
                 KP: tl.constexpr, CP: tl.constexpr, ROUNDS: tl.constexpr, PROBES: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # b * H + h
    KS += row * N
    low = CODES + row * 2 * N
    high = low + N
    qs = tl.load(QS + row)
    merged = tl.load(MERGED).to(tl.int64)
    last_old = tl.load(LAST_OLD).to(tl.int64)
    code = _order(qs) << 32  # every key below the query sorts before it
    n_sorted = tl.minimum(merged, last_old + 1)
    at_lo = _insertion(low, N, code, ROUNDS, PROBES)
    at_hi = _insertion(high, N, code, ROUNDS, PROBES)
    # the candidates in one vector of CP lanes: [0, KP) the k slots before the point in low, [KP, 2 KP)
    # the k from it in high, [2 KP, 2 KP + TAIL) the older keys after the merge point, scored directly
    j = tl.arange(0, CP).to(tl.int64)
    seg_lo, seg_hi = j < KP, (j >= KP) & (j < 2 * KP)
    i = tl.where(seg_lo, at_lo - K + j, at_hi + j - KP)
    i_ok = tl.where(seg_lo, (i >= 0) & (j < K), (i < n_sorted) & (j - KP < K))
    from_low = tl.load(low + tl.minimum(tl.maximum(i, 0), N - 1), mask=seg_lo, other=0) & 0xFFFFFFFF
    from_high = 2147483647 - (tl.load(high + tl.minimum(tl.maximum(i, 0), N - 1), mask=seg_hi, other=0) & 0xFFFFFFFF)
    pos = tl.where(seg_lo, from_low, tl.where(seg_hi, from_high, merged + j - 2 * KP))
    ok = tl.where(seg_lo, i_ok, tl.where(seg_hi, i_ok & (pos <= last_old), (pos <= last_old) & (j - 2 * KP < TAIL)))
    cand = tl.minimum(tl.maximum(pos, 0), N - 1)
    dist = tl.abs(qs - tl.load(KS + cand))
    rank = tl.where(ok, (_order(dist) << 32) | (2147483647 - cand), 9223372036854775807)  # LAST where not ok
    jk = tl.arange(0, KP)
    out = tl.zeros((KP,), tl.int64)
    good = tl.zeros((KP,), tl.int1)
    for s in tl.static_range(K):  # the k smallest ranks, nearest first: one minimum per round
        m = tl.min(rank, 0)
        valid = (m >> 32) < 0x7F800000  # a finite distance: not LAST
        out = tl.where(jk == s, tl.where(valid, 2147483647 - (m & 0xFFFFFFFF), 0), out)
        good = tl.where(jk == s, valid, good)
        rank = tl.where(rank == m, 9223372036854775807, rank)
    tl.store(IDX + row * K + jk, out, mask=jk < K)
    tl.store(OK + row * K + jk, good, mask=jk < K)


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


@torch.library.custom_op("attnlab::window_keys", mutates_args=())
def _window_keys_op(qs: torch.Tensor, ks: torch.Tensor, codes: torch.Tensor, merged: torch.Tensor,
                    last_old: torch.Tensor, k: int, tail: int) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, N = ks.shape
    idx = torch.empty(B, H, k, dtype=torch.int64, device=ks.device)
    ok = torch.empty(B, H, k, dtype=torch.bool, device=ks.device)
    _window_keys[(B * H,)](qs.contiguous(), ks.contiguous(), codes.contiguous(), merged.reshape(1),
                           last_old.reshape(1).to(torch.int64), idx, ok, N, K=k, TAIL=tail, KP=_pow2(k),
                           CP=_pow2(2 * _pow2(k) + tail), ROUNDS=search_rounds(N), PROBES=PROBES, num_warps=4)
    return idx, ok


@_window_keys_op.register_fake
def _(qs, ks, codes, merged, last_old, k, tail):
    B, H, _ = ks.shape
    return ks.new_empty(B, H, k, dtype=torch.int64), ks.new_empty(B, H, k, dtype=torch.bool)


def triton_window_keys(qs: torch.Tensor, ks: torch.Tensor, codes: torch.Tensor, merged: torch.Tensor,
                       last_old: torch.Tensor, k: int, tail: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`window.window_keys` in one kernel launch (module docstring): positions (B, H, k) int64
    and validity (B, H, k) bool, equal to it where valid."""
    return torch.ops.attnlab.window_keys(qs.float(), ks, codes, merged, last_old, k, tail)
