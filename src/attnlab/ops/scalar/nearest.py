"""The window's nearest-n rule over dense distances (`window.window_mask`): the n smallest entries of each
row, the newest (rightmost) first among equal values; `nearest_newest` by one top-k, with its reference
`nearest_newest_naive`, a stable sort. (Selecting without a dense row: `tree` and the compiled CPU
kernel, `window_cpu`.)"""

from __future__ import annotations

import torch

__all__ = ["nearest_newest", "nearest_newest_naive"]


def nearest_newest_naive(dist: torch.Tensor, n: int) -> torch.Tensor:
    """The reference of `nearest_newest`: a stable sort of each row, newest first."""
    Tk = dist.shape[-1]
    keep = torch.zeros(dist.shape, dtype=torch.bool, device=dist.device)
    keep.scatter_(-1, Tk - 1 - dist.flip(-1).sort(dim=-1, stable=True).indices[..., :n], True)
    return keep


def nearest_newest(dist: torch.Tensor, n: int) -> torch.Tensor:
    """Bool mask of the n smallest entries of each row of dist (..., Tk), the newest (rightmost)
    first among equal values. A topk of n + 1 finds them; only the rows where the n-th and the
    (n+1)-th smallest are equal (a tie at the boundary, e.g. rows with fewer than n finite entries)
    are redone: every entry below the n-th value, and of the entries equal to it the rightmost ones
    still needed. Equal to the stable sort of `nearest_newest_naive` (tested with ties and
    infinities; a tensor holding NaN takes the sort throughout)."""
    Tk = dist.shape[-1]
    if n >= Tk or bool(torch.isnan(dist).any()):
        return nearest_newest_naive(dist, n)
    vals, idx = dist.topk(n + 1, dim=-1, largest=False, sorted=True)
    keep = torch.zeros(dist.shape, dtype=torch.bool, device=dist.device)
    keep.scatter_(-1, idx[..., :n], True)
    tied = (vals[..., n - 1] == vals[..., n]).reshape(-1)
    if bool(tied.any()):  # those rows: everything below the n-th value, then the newest of its ties
        rows = tied.nonzero().squeeze(1)
        d = dist.reshape(-1, Tk)[rows]
        thr = vals.reshape(-1, n + 1)[rows, n - 1 : n]
        below, tie = d < thr, d == thr
        need = n - below.sum(-1, keepdim=True, dtype=torch.int32)
        from_right = tie.flip(-1).cumsum(-1, dtype=torch.int32).flip(-1)  # ties at or right of each slot
        keep.view(-1, Tk)[rows] = below | (tie & (from_right <= need))
    return keep
