"""Approximate causal scalar attention in O(T W) per head (docs/mechanisms.md#approximate-scalar-attention).

The Gaussian weight exp(-(qs_t - ks_s)^2 / tau_t) falls off so fast that a query only needs the
keys near it on the scalar axis. Per (B, H) the keys and the queries are sorted by value; the
sorted queries are cut into blocks of `block`, and every block reads one contiguous run of W
sorted keys, wide enough that each of its queries has every key within the radius
r_t = sqrt(tau_t ln(T / tol)) of it (W is the widest run any block needs, so it adapts to how
spread the keys are). Inside the run the weights are exact, causally masked by position.

Bound. For query t, let Z_in be the kernel mass of the visible keys in its run, n_out the number
of visible keys outside it and d the distance from qs_t to the nearest key outside the run (every
excluded key is at least that far, because the run is contiguous in sorted order). The excluded
mass is at most n_out exp(-d^2 / tau_t), so delta_t = n_out exp(-d^2 / tau_t) / Z_in bounds the
fraction of the softmax mass dropped, and |o_t - o~_t| <= 2 delta_t max_s |v_s| elementwise.
Every query's delta_t is computed after the fact; queries with delta_t > tol (a cluster wider
than the run, a query that sees no key of its run) get their exact row from the naive formula.
When the run would be wider than `max_window` (default T / 4: the keys are too dense for the
radius, as for clustered keys or a large tau), or more than T / 8 queries of one head would need
their exact row, the whole call runs the exact fused path. The result is therefore never worse
than the bound, at any input; only the speed depends on the key distribution.

Gradients flow through gathers and a plain softmax (PyTorch autograd); per-token tau (B, H, T)
is supported (each query's radius uses its own tau). Memory is O(T W) per head.
"""

from __future__ import annotations

import math

import torch

from ..checks import check_int, check_same
from ._sdpa import upcast
from .scalar import _check_scalars, _check_values, _tau, scalar_attention

__all__ = ["APPROX_TOL", "approx_plan", "scalar_attention_approx"]

APPROX_TOL = 1e-4  # default bound on the dropped softmax mass per query
FALLBACK_FRACTION = 8  # more than T / 8 exact rows in one head: run the exact path instead


def _check_tol(tol) -> float:
    if isinstance(tol, bool) or not isinstance(tol, (int, float)):
        raise TypeError(f"tol must be a float in (0, 1), got {type(tol).__name__}")
    if not (math.isfinite(tol) and 0.0 < tol < 1.0):
        raise ValueError(f"tol must be a finite float in (0, 1), got {tol}")
    return float(tol)


def _check(qs, ks, v, tau, tol, block, max_window):
    """All argument checks, before any work. Returns (B, H, T, tol, tau broadcastable to (B, H, T))."""
    tol = _check_tol(tol)
    check_int("block", block, 1)
    if max_window is not None:
        check_int("max_window", max_window, 1)
    B, H, T = _check_scalars(qs, ks, causal=True)
    check_same("qs", T, "ks", ks.shape[2], "sequence length (the approximate path runs on whole sequences)")
    _check_values(v, qs, B, H, T)
    tau_b = _tau(tau, B, H, T, upcast(qs.dtype), qs.device)  # (1|B, 1|H, 1|T)
    return B, H, T, tol, tau_b


@torch.no_grad()
def _window(k_sorted, q_sorted, tau_sorted, tol: float, block: int):
    """The run of sorted keys each block of sorted queries reads: (W, start (B, H, nb))."""
    B, H, T = k_sorted.shape
    r = (tau_sorted * math.log(max(T, 2) / tol)).sqrt()  # (B, H, T)
    k_sorted = k_sorted.contiguous()
    lo = torch.searchsorted(k_sorted, (q_sorted - r).contiguous())
    hi = torch.searchsorted(k_sorted, (q_sorted + r).contiguous(), right=True)
    nb = -(-T // block)
    pad = nb * block - T
    if pad:  # the last block repeats its last query
        lo = torch.cat([lo, lo[..., -1:].expand(B, H, pad)], dim=-1)
        hi = torch.cat([hi, hi[..., -1:].expand(B, H, pad)], dim=-1)
    blo = lo.view(B, H, nb, block).amin(-1)
    bhi = hi.view(B, H, nb, block).amax(-1)
    W = int((bhi - blo).max()) if T else 0
    W = min(T, max(8, -(-W // 8) * 8))
    start = (blo - (W - (bhi - blo)) // 2).clamp(min=0, max=T - W)  # (B, H, nb)
    return W, start


def approx_plan(qs, ks, tau, *, tol: float = APPROX_TOL, block: int = 64) -> dict:
    """What `scalar_attention_approx` would do on these inputs: the key-run width W it needs and
    the width at which it would give up (T / 4), for benchmarks and diagnostics."""
    tol = _check_tol(tol)
    check_int("block", block, 1)
    B, H, T = _check_scalars(qs, ks, causal=True)
    tau_full = _tau(tau, B, H, T, upcast(qs.dtype), qs.device).detach().expand(B, H, T)
    k_sorted = ks.detach().to(tau_full.dtype).sort(-1).values
    q_sorted, q_perm = qs.detach().to(tau_full.dtype).sort(-1)
    W, _ = _window(k_sorted, q_sorted, tau_full.gather(-1, q_perm), tol, block)
    return {"T": T, "window": W, "max_window": max(1, T // 4)}


def scalar_attention_approx(qs, ks, v, tau, *, tol: float = APPROX_TOL, block: int = 64,
                            max_window: int | None = None) -> torch.Tensor:
    """Causal scalar attention o_t = sum_{s<=t} softmax_s(-(qs_t - ks_s)^2 / tau_t) v_s, with each
    query's dropped softmax mass at most `tol` (see the module docstring for the bound).

    qs, ks (B, H, T); v (B, G, T, Dv) with G dividing H (grouped values); tau > 0: a float, (H,)
    or (B, H, T). tol in (0, 1); block: sorted queries per block; max_window: the widest run of
    keys to read before running the exact fused path instead (default T // 4). Returns
    (B, H, T, Dv) in v's dtype; gradients reach qs, ks, v and a tensor tau.
    """
    B, H, T, tol, tau_b = _check(qs, ks, v, tau, tol, block, max_window)
    cap = max(1, T // 4) if max_window is None else max_window
    cdt = upcast(qs.dtype)
    tau_full = tau_b.expand(B, H, T)
    q_sorted, q_perm = qs.detach().to(cdt).sort(-1)
    k_sorted, k_perm = ks.detach().to(cdt).sort(-1)
    W, start = _window(k_sorted, q_sorted, tau_full.detach().gather(-1, q_perm), tol, block)
    if T == 0 or W > cap:
        return scalar_attention(qs, ks, v, tau, causal=True, impl="fast")
    out, fail = _windowed(qs, ks, v, tau_full, q_perm, k_sorted, k_perm, start, W, tol, block, cdt)
    if fail.any():
        if int(fail.sum(-1).max()) > max(block, T // FALLBACK_FRACTION):
            return scalar_attention(qs, ks, v, tau, causal=True, impl="fast")
        out = _exact_rows(out, fail, qs, ks, v, tau_full, cdt)
    return out.to(v.dtype)


def _windowed(qs, ks, v, tau_full, q_perm, k_sorted, k_perm, start, W: int, tol: float, block: int, cdt):
    """Every query against its block's run of W sorted keys: (B, H, T, Dv) in cdt, and the
    queries whose bound exceeds tol, (B, H, T) bool in time order."""
    B, H, T = qs.shape
    G, Dv = v.shape[1], v.shape[-1]
    nb = start.shape[-1]
    pad = nb * block - T
    qp = torch.cat([q_perm, q_perm[..., -1:].expand(B, H, pad)], dim=-1) if pad else q_perm  # (B, H, nb*block)
    kidx = start.unsqueeze(-1) + torch.arange(W, device=qs.device)  # (B, H, nb, W) sorted-key slots
    pos_k = k_perm.gather(-1, kidx.view(B, H, nb * W)).view(B, H, nb, 1, W)
    pos_q = qp.view(B, H, nb, block, 1)
    q_b = qs.to(cdt).gather(-1, qp).view(B, H, nb, block, 1)
    t_b = tau_full.to(cdt).gather(-1, qp).view(B, H, nb, block, 1)
    k_b = ks.to(cdt).gather(-1, pos_k.view(B, H, nb * W)).view(B, H, nb, 1, W)
    vis = pos_k <= pos_q  # (B, H, nb, block, W)
    logits = -(q_b - k_b).pow(2) / t_b  # (B, H, nb, block, W)
    empty = ~vis.any(-1, keepdim=True)  # rows with no visible key: computed unmasked, replaced below
    w = torch.softmax(logits.masked_fill(~vis & ~empty, float("-inf")), dim=-1)
    head_group = torch.arange(H, device=qs.device) // (H // G)  # (H,)
    rows = (torch.arange(B, device=qs.device)[:, None] * G + head_group) * T  # (B, H)
    flat = (rows[..., None] + pos_k.view(B, H, nb * W)).reshape(-1)
    v_b = v.to(cdt).reshape(B * G * T, Dv).index_select(0, flat).view(B, H, nb, W, Dv)
    o_sorted = (w @ v_b).view(B, H, nb * block, Dv)[:, :, :T]  # (B, H, T, Dv) in sorted-query order
    inv = torch.empty_like(q_perm).scatter_(-1, q_perm, torch.arange(T, device=qs.device).expand(B, H, T))
    out = o_sorted.gather(2, inv.unsqueeze(-1).expand(B, H, T, Dv))  # (B, H, T, Dv) in time order
    with torch.no_grad():
        lse = logits.detach().masked_fill(~vis, float("-inf")).logsumexp(-1)  # (B, H, nb, block)
        n_out = (pos_q[..., 0] + 1) - vis.sum(-1)  # visible keys outside the run
        before = torch.cat([k_sorted.new_full((B, H, 1), float("-inf")), k_sorted], dim=-1)
        after = torch.cat([k_sorted, k_sorted.new_full((B, H, 1), float("inf"))], dim=-1)
        left = before.gather(-1, start).unsqueeze(-1)  # (B, H, nb, 1): the nearest excluded key below
        right = after.gather(-1, start + W).unsqueeze(-1)
        qd = q_b.detach()[..., 0]
        d = torch.minimum(qd - left, right - qd).clamp(min=0)  # (B, H, nb, block)
        log_bound = torch.log(n_out.to(cdt)) - d.pow(2) / t_b.detach()[..., 0] - lse
        fail = (n_out > 0) & ~(log_bound <= math.log(tol))  # NaN (no visible key in the run) fails
        fail = fail.reshape(B, H, nb * block)[..., :T].gather(-1, inv)
    return out, fail


def _exact_rows(out, fail, qs, ks, v, tau_full, cdt):
    """`out` with the rows where `fail` (B, H, T) replaced by the naive formula's."""
    B, H, T = qs.shape
    G, Dv = v.shape[1], v.shape[-1]
    counts = fail.sum(-1)  # (B, H)
    F = int(counts.max())
    pos = torch.sort((~fail).to(torch.int8), dim=-1, stable=True).indices[..., :F]  # (B, H, F) failing first
    valid = torch.arange(F, device=qs.device) < counts.unsqueeze(-1)  # (B, H, F)
    L = int(pos[valid].max()) + 1  # no failing query sees past L
    q_f = qs.to(cdt).gather(-1, pos).unsqueeze(-1)  # (B, H, F, 1)
    t_f = tau_full.to(cdt).gather(-1, pos).unsqueeze(-1)
    logits = -(q_f - ks.to(cdt)[..., None, :L]).pow(2) / t_f  # (B, H, F, L)
    hidden = torch.arange(L, device=qs.device) > pos.unsqueeze(-1)
    w = torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1)
    o_f = w.view(B, G, (H // G) * F, L) @ v.to(cdt)[:, :, :L]  # grouped values read in place
    o_f = o_f.view(B, H, F, Dv)
    idx = ((torch.arange(B * H, device=qs.device).view(B, H, 1) * T) + pos)[valid]
    return out.reshape(B * H * T, Dv).index_put((idx,), o_f[valid]).view(B, H, T, Dv)
