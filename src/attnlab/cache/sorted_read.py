"""The read path of `SortedScalarCache`: a decode query checked and laid out per row, the
candidate window from the sorted index, the op's scores of those entries and the readout.
Functions of the cache, like `eviction.py`'s; the cache's `query`, `select`, `scores` and
`attend` call them (module docstring of cache/sorted.py for the layout)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import checks
from ..checks import check_int
from ..ops.scalar import hybrid_scores, scalar_scores
from .sorted_index import radius_from_tolerance, run_keys

F32_MAX = float(torch.finfo(torch.float32).max)


def check_finite_cache(name: str, x: torch.Tensor) -> None:
    """`attnlab.checks.check_finite`, its error saying that the cache was left as it was."""
    try:
        checks.check_finite(name, x)
    except ValueError as e:
        raise ValueError(f"{e}; the cache is unchanged") from None


def check_float32_range(name: str, x: torch.Tensor) -> None:
    """Finite float64 scalar keys/queries beyond float32's range would become inf in the float32
    key index: reject them by name rather than store or compare an inf."""
    if x.dtype == torch.float64 and x.numel():
        big = float(x.detach().abs().max())
        if big > F32_MAX:
            raise ValueError(f"{name} must lie within the float32 range (|{name}| <= {F32_MAX:.4g}: the sorted "
                             f"index holds float32 keys), got |{name}| up to {big:.4g}; the cache is unchanged")


@dataclass(frozen=True)
class DecodeQuery:
    """One checked decode query in the cache's row layout (R = B * H rows, one per head):
    qs (R, 1) float32; q (R, Dk) float32 for hybrid heads, else None; tau a float or (R, 1);
    radius None, a float or (R, 1); window the k nearest entries to keep, None for all; lam the
    hybrid's scale of its scalar term (any sign; the entries are still chosen by distance)."""

    qs: torch.Tensor
    q: torch.Tensor | None
    tau: float | torch.Tensor
    radius: float | torch.Tensor | None
    window: int | None
    lam: torch.Tensor | None = None  # (H,) the hybrid's gain on the scalar term, None for 1



def make_query(cache, qs: torch.Tensor, tau, q: torch.Tensor | None = None, window: int | None = 64,
               radius=None, eps: float | None = None, *, check_values: bool = True,
               scalar_scale=None) -> DecodeQuery:
    """Check the arguments of `attend` (same meaning; check_values=False: shapes and options only)
    and lay them out per row; records nothing."""
    B, H = cache.batch, cache.n_heads
    cache._check_shape("qs", qs, (B, H))
    cache._check_dtype("qs", qs, qs.dtype)
    if cache.hybrid:
        if q is None:
            raise ValueError(f"q (B, H, Dk) = ({B}, {H}, {cache.d_k}) is required: this cache has hybrid heads")
        cache._check_shape("q", q, (B, H, cache.d_k))
        cache._check_dtype("q", q, qs.dtype)
    elif q is not None:
        raise ValueError("q must be None: this cache has pure scalar heads")
    if check_values:
        check_finite_cache("qs", qs)
        check_float32_range("qs", qs)
        if cache.hybrid:
            check_finite_cache("q", q)
            check_float32_range("q", q)
    if window is not None:
        check_int("window", window)
    if radius is not None and eps is not None:
        raise ValueError("give radius or eps, not both")
    tau_r = cache.per_row("tau", tau)
    r = None
    if radius is not None:
        r = cache.per_row("radius", radius)
    elif eps is not None:
        if isinstance(eps, bool) or not isinstance(eps, (int, float)) or not 0 < eps < 1:
            raise ValueError(f"eps must be a float in (0, 1), got {eps!r}")
        r = radius_from_tolerance(tau_r, float(eps), cache.kernel)
    qr = qs.reshape(cache.rows, 1)
    if qr.dtype != torch.float32 or qr.device != cache.device:
        qr = qr.to(cache.device, torch.float32)
    q_rows = q.to(cache.device, torch.float32).reshape(cache.rows, cache.d_k) if cache.hybrid else None
    lam = None
    if scalar_scale is not None:
        if not cache.hybrid:
            raise ValueError("scalar_scale scales the hybrid's scalar term: this cache has pure scalar heads")
        from ..ops.scalar.args import scalar_scale_tensor

        lam = scalar_scale_tensor(scalar_scale, H, torch.float32, cache.device).view(H)
    return DecodeQuery(qr, q_rows, tau_r, r, window, lam)

def check_step_values(*tensors: torch.Tensor | None) -> None:
    """One decode step's projections (scalar queries and keys, values, vector queries and keys;
    None skipped) checked at once: finite, and float64 ones within float32's range (the sorted
    index holds float32 keys). One check in place of one per tensor per cache call."""
    xs = [x for x in tensors if x is not None]
    dtype = torch.float64 if any(x.dtype == torch.float64 for x in xs) else xs[0].dtype
    flat = torch.cat([x.detach().reshape(-1).to(dtype) for x in xs])
    check_finite_cache("the step's queries, keys and values", flat)
    check_float32_range("the step's queries, keys and values", flat)


def check_extra(cache, extra, check_values: bool = True):
    """`attend`'s extra columns (logits (B, H, m), values (B, H, m, Dv)) checked (values finite,
    logits finite or -inf, unless check_values is False) -> per row (R, m) float32, (R, m, Dv)."""
    B, H, Dv = cache.batch, cache.n_heads, cache.d_v
    if not isinstance(extra, (tuple, list)) or len(extra) != 2 or not all(isinstance(x, torch.Tensor) for x in extra):
        raise TypeError("extra must be a pair of tensors (logits (B, H, m), values (B, H, m, Dv))")
    lg, v = extra
    if lg.dim() != 3 or tuple(lg.shape[:2]) != (B, H) or tuple(v.shape) != (B, H, lg.shape[2], Dv):
        raise ValueError(f"extra must be logits (B, H, m) = ({B}, {H}, m) and values (B, H, m, Dv) = "
                         f"({B}, {H}, m, {Dv}), got {tuple(lg.shape)} and {tuple(v.shape)}")
    if check_values:
        if bool(torch.isnan(lg).any()) or bool((lg == float("inf")).any()):
            raise ValueError("extra logits must be finite or -inf")
        check_finite_cache("extra values", v)
    m = lg.shape[2]
    lg = lg.reshape(cache.rows, m)
    return lg if lg.dtype == torch.float32 else lg.float(), v.reshape(cache.rows, m, Dv)


def select(cache, query: DecodeQuery) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed candidates (C, R, k), each head's k nearest entries (within the radius, if
    any), and their distances |qs - ks| (R, k); pads (rows with fewer entries) at inf."""
    qr, window, r = query.qs, query.window, query.radius
    k = cache._n_max if window is None else min(window, cache._n_max)
    if r is not None and k > 0:
        k = min(k, int(cache.index.count_within(qr, r).max().item()))
    if k == 0:
        cand = cache.index.empty(0)
        return cand, run_keys(cand) - qr
    cand = cache.index.candidates(qr, k)
    dist = (run_keys(cand) - qr).abs()  # (R, M)
    if cand.shape[2] > k:
        full = dist
        dist, sel = full.topk(k, dim=1, largest=False, sorted=False)  # (R, k)
        kth = dist.amax(1, keepdim=True)
        if bool(((full == kth).sum(1) > (dist == kth).sum(1)).any()):  # a tie at the window's edge
            sel = newest_first(full, cand[1], k)
            dist = full.gather(1, sel)
        cand = cand.gather(2, sel.unsqueeze(0).expand(cand.shape[0], -1, -1))
    return cand, dist


def newest_first(dist: torch.Tensor, slots: torch.Tensor, k: int | None = None) -> torch.Tensor:
    """Column order (R, k) of the k smallest distances (R, M), the newest entry (the highest value
    slot) first among equal distances: the window rule of `attnlab.ops.window_mask`."""
    perm = slots.argsort(dim=1, descending=True, stable=True)
    order = perm.gather(1, dist.gather(1, perm).argsort(dim=1, stable=True))
    return order if k is None else order[:, :k]

def scores(cache, entries: torch.Tensor, query: DecodeQuery, *, radius: bool = True,
           sink: bool = False) -> torch.Tensor:
    """Logits (R, n) of packed entries (C, R, n): the op's score (`ops.scalar_logits`, or
    `ops.hybrid_logits` with the entries' vector keys) + the log-weight of merged entries;
    -inf for pads and, with `radius`, beyond query.radius. With `sink`, the sink's logit is
    appended as column n (its log-weight `sink.logw` added, no radius)."""
    B, H, R, n = cache.batch, cache.n_heads, cache.rows, entries.shape[2]
    keys = run_keys(entries)  # (R, n) float32, pads +inf
    hidden = ~torch.isfinite(keys)
    if radius and query.radius is not None:
        hidden = hidden | ((keys - query.qs).abs() > query.radius)
    ks = torch.where(hidden, query.qs.detach(), keys)  # hidden entries: any finite key, masked below
    kv = None
    if cache.hybrid:
        idx = (entries[1] + cache._key_off).reshape(-1)
        kv = cache.vkeys.view(-1, cache.d_k).index_select(0, idx).view(R, n, cache.d_k).float()  # (R, n, Dk)
    if sink:
        ks = torch.cat([ks, cache._sink.key], 1)  # (R, n + 1)
        kv = None if kv is None else torch.cat([kv, cache._sink.vkey[:, None]], 1)
        hidden = torch.cat([hidden, hidden.new_zeros(R, 1)], 1)
    # the ops' score formula, unchecked: the keys were checked when appended, the query by make_query
    tau = torch.as_tensor(query.tau, dtype=torch.float32) if isinstance(query.tau, float) else query.tau.view(B, H, 1)
    lam = None if query.lam is None else query.lam.view(1, H, 1)  # the hybrid's gain on the scalar term, any sign
    qs, ks = query.qs.view(B, H, 1), ks.view(B, H, -1)
    if kv is None:
        logits = scalar_scores(qs, ks, tau, cache.kernel, lam)  # (B, H, 1, n [+ 1])
    else:
        q = query.q.view(B, H, 1, cache.d_k)
        logits = hybrid_scores(q, kv.view(B, H, -1, cache.d_k), qs, ks, tau, cache.kernel, lam)
    logits = logits.view(R, -1)
    if cache.index.weighted:
        logw = entries[2].view(torch.float32)  # log(count)
        logits = logits + (torch.cat([logw, logw.new_zeros(R, 1)], 1) if sink else logw)
    if sink:
        logits = torch.cat([logits[:, :-1], logits[:, -1:] + cache._sink.logw], 1)  # the sink's weight
    return logits.masked_fill(hidden, float("-inf"))

def output(cache, cand: torch.Tensor, query: DecodeQuery, extra=None) -> torch.Tensor:
    """The readout (B, H, Dv) over candidates cand (C, R, k), the sink, and `extra` columns
    (logits (R, m), values (R, m, Dv)) from outside the cache, one softmax over all of them."""
    R, k, Dv = cache.rows, cand.shape[2], cache.d_v
    logits = scores(cache, cand, query, sink=cache.has_sink)  # (R, k [+ 1])
    n = logits.shape[1]
    if extra is not None:
        logits = torch.cat([logits, extra[0].to(logits.dtype)], 1)  # (R, n + m)
    w = torch.softmax(logits, 1).nan_to_num(0.0)  # a head with no candidate (empty, or none within r,
    # and no sink or a sink of weight 0) outputs 0
    idx = (cand[1] + cache._val_off).reshape(-1)
    vals = cache.values.view(-1, Dv).index_select(0, idx).view(R, k, Dv)  # (R, k, Dv)
    w = w.to(vals.dtype)
    out = torch.bmm(w[:, None, :k], vals).squeeze(1)  # (R, Dv)
    if cache.has_sink:
        out = out + w[:, k:n] * cache._sink.value
    if extra is not None:
        out = out + torch.bmm(w[:, None, n:], extra[1].to(vals.dtype)).squeeze(1)
    return out.view(cache.batch, cache.n_heads, Dv)
