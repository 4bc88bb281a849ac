"""Quest (Tang et al. 2024): rank a query's pages of keys by an upper bound on q.k from each page's
per-channel key min and max, and attend over the keys of the best pages.

`quest_select` computes the bounds from the keys; `QuestIndex` keeps them as keys arrive, so a
decode step reads N / page page bounds, not N keys. Both select the same keys.
"""

from __future__ import annotations

import math

import torch

from attnlab.checks import check_groups, check_int


def page_minmax(k: torch.Tensor, page: int = 16, start: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-page, per-channel key min and max of keys k (B, Hkv, Tk, D) that sit at positions
    start.. (pages are aligned to position 0): each (B, Hkv, n, D) float32 for the n pages the keys
    touch; channels of a page's absent positions count as neither."""
    B, Hkv, Tk, D = k.shape
    front = start % page
    n = math.ceil((front + Tk) / page)
    pad = (0, 0, front, n * page - front - Tk)
    kf = k.float()
    kmax = torch.nn.functional.pad(kf, pad, value=float("-inf")).view(B, Hkv, n, page, D).amax(3)
    kmin = torch.nn.functional.pad(kf, pad, value=float("inf")).view(B, Hkv, n, page, D).amin(3)
    return kmin, kmax


def bounds_from_pages(q: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor) -> torch.Tensor:
    """Quest's per-page upper bound on q.k, sum_c max(q_c * min_c, q_c * max_c): q (B, H, Tq, D),
    page bounds (B, Hkv, P, D) -> (B, H, Tq, P). Each KV head's bounds serve its H / Hkv query
    heads in one grouped matmul (nothing expanded)."""
    B, H, Tq, D = q.shape
    Hkv, P = kmin.shape[1], kmin.shape[2]
    qf = q.float().reshape(B, Hkv, (H // Hkv) * Tq, D)
    out = qf.clamp(min=0) @ kmax.transpose(-1, -2) + qf.clamp(max=0) @ kmin.transpose(-1, -2)
    return out.view(B, H, Tq, P)


def quest_bounds(q: torch.Tensor, k: torch.Tensor, page: int = 16) -> torch.Tensor:
    """Quest's per-page upper bound on q.k: sum_c max(q_c * min_c, q_c * max_c) over each page's
    per-channel key min/max. q (B, H, Tq, D), k (B, Hkv, Tk, D) -> (B, H, Tq, n_pages)."""
    return bounds_from_pages(q, *page_minmax(k, page))


def quest_select(q, k, allowed, scaling: float, K: int, page: int = 16, groups: int = 1):
    """Quest-style page selection at budget K: rank pages by the softmax of their bounds (averaged
    over the heads of each candidate group, so one set serves those heads), take the best
    ceil(K / page) pages, keep their admissible keys in page-rank order, truncated to K."""
    return select_pages(quest_bounds(q, k, page), allowed, scaling, K, page, groups, k.shape[2])


def select_pages(bound: torch.Tensor, allowed, scaling: float, K: int, page: int, groups: int, Tk: int):
    """`quest_select` from the page bounds (B, H, Tq, P) of Tk keys."""
    B, H, Tq, n_pages = bound.shape
    G = check_groups(H, groups, "groups")
    al = allowed.expand(B, 1, Tq, Tk)
    al_p = torch.nn.functional.pad(al, (0, n_pages * page - Tk)).view(B, 1, Tq, n_pages, page)
    page_ok = al_p.any(-1)  # (B, 1, Tq, P)
    bound = (bound * scaling).masked_fill(~page_ok, float("-inf"))
    score = torch.softmax(bound, dim=-1).nan_to_num(0.0)  # (B, H, Tq, P)
    score = score.view(B, G, H // G, Tq, n_pages).mean(2)  # (B, G, Tq, P)
    score = score.masked_fill(~page_ok, -1.0)
    n_sel = min(math.ceil(K / page), n_pages)
    top = score.topk(n_sel, dim=-1).indices  # (B, G, Tq, n_sel)
    tok = (top[..., None] * page + torch.arange(page, device=bound.device)).flatten(-2)  # (B, G, Tq, n_sel*page)
    ok = al_p.expand(B, G, Tq, n_pages, page).gather(3, top[..., None].expand(-1, -1, -1, -1, page)).flatten(-2)
    ok = ok & (tok < Tk)
    tok = tok.clamp(max=Tk - 1)
    # admissible keys first (stable: keeps page rank order), then truncate / pad to K
    order = torch.sort((~ok).to(torch.int8), dim=-1, stable=True).indices
    tok, ok = tok.gather(-1, order), ok.gather(-1, order)
    if tok.shape[-1] >= K:
        return tok[..., :K], ok[..., :K]
    pad = K - tok.shape[-1]
    return (torch.cat([tok, tok.new_zeros(*tok.shape[:-1], pad)], -1),
            torch.cat([ok, ok.new_zeros(*ok.shape[:-1], pad)], -1))


class QuestIndex:
    """Quest's page bounds kept as keys arrive, as a decoder keeps them beside its KV cache: adding
    keys updates only the pages they touch (storage grows by doubling), so a step scores P = N / page
    pages from the stored bounds instead of re-reading all N keys. `select` equals `quest_select`
    over the same keys (tested)."""

    def __init__(self, page: int = 16):
        self.page = check_int("page", page)
        self.page, self.count = page, 0
        self._min = self._max = None  # (B, Hkv, capacity, D)

    @property
    def ntotal(self) -> int:
        return self.count

    @property
    def pages(self) -> int:
        return math.ceil(self.count / self.page)

    def reset(self) -> None:
        """Forget every key (a new sequence starts)."""
        self.count, self._min, self._max = 0, None, None

    def add(self, k: torch.Tensor) -> None:
        """Append keys k (B, Hkv, Tnew, D) at positions ntotal.."""
        if k.shape[2] == 0:
            return
        kmin, kmax = page_minmax(k.detach(), self.page, self.count)
        first, n = self.count // self.page, kmin.shape[2]
        if self._min is None:
            self._min, self._max = kmin.new_empty(*kmin.shape[:2], max(n, 64), kmin.shape[3]), kmax.new_empty(
                *kmax.shape[:2], max(n, 64), kmax.shape[3])
        elif first + n > self._min.shape[2]:
            cap = max(first + n, 2 * self._min.shape[2])
            grow = lambda t: torch.cat([t, t.new_empty(*t.shape[:2], cap - t.shape[2], t.shape[3])], 2)  # noqa: E731
            self._min, self._max = grow(self._min), grow(self._max)
        if self.count % self.page:  # the first page was partly filled: combine
            kmin[:, :, 0] = torch.minimum(kmin[:, :, 0], self._min[:, :, first])
            kmax[:, :, 0] = torch.maximum(kmax[:, :, 0], self._max[:, :, first])
        self._min[:, :, first:first + n] = kmin
        self._max[:, :, first:first + n] = kmax
        self.count += k.shape[2]

    def select(self, q: torch.Tensor, allowed: torch.Tensor, scaling: float, K: int, groups: int = 1):
        """idx, valid (B, G, Tq, K) of queries q (B, H, Tq, D) over the stored keys (`quest_select`)."""
        P = self.pages
        bound = bounds_from_pages(q, self._min[:, :, :P], self._max[:, :, :P])
        return select_pages(bound, allowed[..., : self.count], scaling, K, self.page, groups, self.count)
