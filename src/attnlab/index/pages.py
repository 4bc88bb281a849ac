"""Quest's page bounds on an attnlab layer's logits (the "quest" method of `attnlab.eval.selectors`
and the Quest decoder of `attnlab.cache.selected`): per page of consecutive keys the running
range of its scalar keys and, for hybrid heads, of its vector keys per channel; an upper bound on
every logit of the page from those ranges; and the keys of the best pages per query."""

from __future__ import annotations

import math

import torch

from ..checks import check_int, check_tensor
from ..ops import range_distance
from ..ops.common.heads import expand_heads
from ..ops.common.precision import upcast
from ..ops.scalar import check_kernel, kernel_term

__all__ = ["quest_page_bounds", "scalar_range_bound", "scalar_term"]

def _tau_rows(tau, a: int, b: int, like: torch.Tensor) -> torch.Tensor:
    """tau as a float, (H,) or (B, H, T) -> a tensor broadcastable to (B, H, b - a)."""
    t = torch.as_tensor(tau, dtype=like.dtype, device=like.device)
    if t.dim() == 0:
        return t.view(1, 1, 1)
    if t.dim() == 1:
        return t.view(1, -1, 1)
    return t[..., a:b]


def _running_page_stats(x: torch.Tensor, page: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Running max and min of keys x (B, H, N[, D]) from the start of each key's page to the key:
    entry j holds the range of keys page_start(j)..j. Same shape as x."""
    N = x.shape[2]
    P = math.ceil(N / page)
    pad = P * page - N
    tail = x.shape[3:]
    shape = (*x.shape[:2], P, page, *tail)
    fill = (0, 0) * len(tail) + (0, pad)
    hi = torch.nn.functional.pad(x, fill, value=float("-inf")).view(shape).cummax(3).values
    lo = torch.nn.functional.pad(x, fill, value=float("inf")).view(shape).cummin(3).values
    back = (*x.shape[:2], P * page, *tail)
    return hi.reshape(back)[:, :, :N], lo.reshape(back)[:, :, :N]


class _PageRanges:
    """Per-page key ranges of one layer call, for Quest bounds: ks (B, H, N) and k (B, H, N, D) of
    the N keys past the prefix, as running ranges inside each page (see `_running_page_stats`)."""

    def __init__(self, ks: torch.Tensor, k: torch.Tensor | None, page: int):
        self.page = page
        self.N = ks.shape[-1]
        self.ks_hi, self.ks_lo = _running_page_stats(ks, page)  # (B, H, N)
        self.k_hi = self.k_lo = None
        if k is not None:
            self.k_hi, self.k_lo = _running_page_stats(k, page)  # (B, H, N, D)
        last = torch.arange(page - 1, self.N + page - 1, page, device=ks.device).clamp(max=max(self.N - 1, 0))  # each page's last key
        self.last = last[: math.ceil(self.N / page)]


def _dot_bound(q: torch.Tensor, hi: torch.Tensor, lo: torch.Tensor) -> torch.Tensor:
    """The terms max(q_c lo_c, q_c hi_c) = q+_c hi_c + q-_c lo_c of Quest's bound, for q (..., D)
    against key ranges (..., D); their sum over c bounds q . k for every k in the range."""
    return q.clamp(min=0) * hi + q.clamp(max=0) * lo


def scalar_range_bound(qs: torch.Tensor, lo: torch.Tensor, hi: torch.Tensor, tau, kernel: str = "gaussian",
                       lam=None) -> torch.Tensor:
    """The largest scalar term lam * kernel((qs - ks)^2 / tau) over keys ks in [lo, hi] (all
    broadcast together): at the nearest point of the range when lam >= 0 (or None, i.e. 1), at its
    farthest end when lam < 0 (a hybrid's learned gain may have either sign)."""
    near = kernel_term(range_distance(qs, lo, hi).square() / tau, kernel)
    if lam is None:
        return near
    far = kernel_term(torch.maximum((qs - lo).abs(), (qs - hi).abs()).square() / tau, kernel)
    return torch.where(lam >= 0, lam * near, lam * far)


def scalar_term(layer) -> tuple[str, torch.Tensor | None]:
    """(kernel, per-head gain on the scalar term or None) of a scalar/hybrid layer, detached."""
    lam = layer.scalar_scale  # None for scalar heads and an unset gain
    return layer.config.options.kernel, None if lam is None else lam.detach()


def _lam_rows(lam, like: torch.Tensor):
    """A per-head gain (H,) shaped to broadcast against (B, H, Tq[, P]) (None stays None)."""
    if lam is None:
        return None
    lam = torch.as_tensor(lam, dtype=like.dtype, device=like.device)
    return lam.reshape(1, -1, 1) if lam.dim() == 1 else lam


def quest_page_bounds(qs: torch.Tensor, ks: torch.Tensor, tau, q: torch.Tensor | None = None,
                      k: torch.Tensor | None = None, *, page: int = 16, n_prefix: int = 0,
                      rows: tuple[int, int] | None = None, _ranges: _PageRanges | None = None,
                      kernel: str = "gaussian", lam=None) -> torch.Tensor:
    """Upper bounds on the logits of each page of keys, for the queries in `rows` = (a, b) (op
    positions; default all): (B, H, b - a, P), P = ceil((Tk - n_prefix) / page), -inf for pages
    the query cannot see. qs (B, H, Tq), ks (B, H, Tk), tau a float, (H,) or (B, H, Tq);
    q (B, H, Tq, D), k (B, G, Tk, D) for the hybrid score (scale 1/sqrt(D)); the queries are the
    op's positions 0..Tq-1 with Tq = Tk (a whole sequence), key positions past the prefix in pages.

    Page j of a query at op position t covers keys n_prefix + j*page .. and is bounded over the
    keys of it that t sees: for the page holding t itself, those up to t. kernel ("gaussian" or
    "cauchy") and lam (the hybrid's per-head gain on the scalar term, (H,), any sign) are the
    layer's: the bound is over its actual logits."""
    check_kernel(kernel)
    check_int("page", page)
    check_int("n_prefix", n_prefix, 0)
    check_tensor("qs", qs, 3)
    if not isinstance(ks, torch.Tensor) or ks.shape != qs.shape:
        raise ValueError(f"ks must have the shape of qs {tuple(qs.shape)} (a whole sequence), "
                         f"got {tuple(ks.shape) if isinstance(ks, torch.Tensor) else type(ks).__name__}")
    if (q is None) != (k is None):
        raise ValueError("q and k must be given together (hybrid score) or both be None (scalar)")
    T = qs.shape[-1]
    a, b = (0, T) if rows is None else rows
    if not 0 <= a <= b <= T:
        raise ValueError(f"rows must be (a, b) with 0 <= a <= b <= {T}, got {rows!r}")
    cdt = upcast(qs.dtype)
    if _ranges is None:
        kk = None if k is None else expand_heads(k, qs.shape[1])[:, :, n_prefix:].to(cdt)
        _ranges = _PageRanges(ks[..., n_prefix:].to(cdt), kk, page)
    R = _ranges
    P = math.ceil(R.N / page)
    if P == 0:  # no keys past the prefix
        return qs.new_full((*qs.shape[:2], b - a, 0), float("-inf"), dtype=cdt)
    r = torch.arange(a, b, device=qs.device) - n_prefix  # each query's index among the N keys
    own = r.clamp(min=0) // page  # the page each query sits in
    tq = _tau_rows(tau, a, b, qs.to(cdt))  # (1|B, 1|H, Tq)
    qsr = qs[..., a:b].to(cdt)
    # full pages: the range of the whole page (the running range at its last key)
    lam = _lam_rows(lam, qsr)
    bound = scalar_range_bound(qsr[..., None], R.ks_lo[..., R.last][..., None, :], R.ks_hi[..., R.last][..., None, :],
                               tq[..., None], kernel, None if lam is None else lam[..., None])  # (B, H, Tq, P)
    # the page a query sits in: the range of its keys up to the query
    rc = r.clamp(min=0, max=max(R.N - 1, 0))
    part = scalar_range_bound(qsr, R.ks_lo[..., rc], R.ks_hi[..., rc], tq, kernel, lam)  # (B, H, Tq)
    if q is not None:
        D = q.shape[-1]
        qr = q[:, :, a:b].to(cdt)
        hi, lo = R.k_hi[:, :, R.last], R.k_lo[:, :, R.last]  # (B, H, P, D)
        bound = bound + (qr.clamp(min=0) @ hi.transpose(-1, -2) + qr.clamp(max=0) @ lo.transpose(-1, -2)) / math.sqrt(D)
        part = part + _dot_bound(qr, R.k_hi[:, :, rc], R.k_lo[:, :, rc]).sum(-1) / math.sqrt(D)
    bound = bound.scatter(-1, own.view(1, 1, -1, 1).expand(*bound.shape[:3], 1), part[..., None])
    seen = (torch.arange(P, device=qs.device)[None, :] <= own[:, None]) & (r[:, None] >= 0)  # (Tq, P)
    return bound.masked_fill(~seen, float("-inf"))


def _quest_keep(bounds: torch.Tensor, a: int, b: int, K: int, page: int, n_prefix: int) -> torch.Tensor:
    """The keys of the best ceil(K / page) pages by bound (the newest first among equal bounds), at
    most K (best page first, then by position), for query rows a..b-1: (B, H, b - a, b) bool,
    prefix excluded."""
    B, H, Tq, P = bounds.shape
    keep = torch.zeros(B, H, Tq, b + 1, dtype=torch.bool, device=bounds.device)  # last column: a drain
    n_sel = min(math.ceil(K / page), P)
    if n_sel:
        # best first; at equal bounds (a query inside several pages' scalar ranges) the newest page first
        order = bounds.flip(-1).sort(dim=-1, descending=True, stable=True)
        val, top = order.values[..., :n_sel], P - 1 - order.indices[..., :n_sel]
        tok = n_prefix + top[..., None] * page + torch.arange(page, device=bounds.device)  # (B, H, Tq, n_sel, page)
        pos_q = torch.arange(a, b, device=bounds.device).view(1, 1, -1, 1, 1)
        ok = (val > float("-inf"))[..., None] & (tok <= pos_q)
        ok, tok = ok.flatten(-2), tok.flatten(-2)
        ok &= ok.cumsum(-1) <= K
        keep.scatter_(-1, torch.where(ok, tok, b), True)
    return keep[..., :b]
