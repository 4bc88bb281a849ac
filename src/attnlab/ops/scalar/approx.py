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
than the bound (up to float rounding; a fallback has the fused path's precision), at any input;
only the speed depends on the key distribution.

Gradients: the run pass is a custom autograd function that recomputes the weights in backward
(`_RunAttention`); the sorts' permutations, gathers and the exact rows go through autograd.
Per-token tau (B, H, T) is supported (each query's radius uses its own tau). Memory: O(T (W /
block + Dv)) held per call and head, temporaries bounded by CHUNK_ELEMENTS.

Packed documents (``docs`` / ``cu_seqlens``, `attnlab.ops.common.packed`): a key of another document is
masked as a future key is, n_out counts the visible keys of the query's own document, and the exact
rows and fallbacks keep documents apart too, so the bound holds against each document run alone
(the runs themselves are cut from the whole row's sorted keys: the result is within the bound of
each document's exact attention, not the same float as the approximation run per document).
"""

from __future__ import annotations

import math

import torch

from ...checks import check_int
from ..common.packed import packing
from ..common.precision import upcast
from .args import check_approx, check_scalars, check_tol, tau_tensor
from .attention import scalar_attention

__all__ = ["APPROX_TOL", "approx_plan", "scalar_attention_approx"]

APPROX_TOL = 1e-4  # default bound on the dropped softmax mass per query
FALLBACK_FRACTION = 8  # more than T / 8 exact rows in one head: run the exact path instead
CHUNK_ELEMENTS = 1 << 18  # (block x W) weights per chunk of blocks: bounds the temporaries of one step


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
    """What `scalar_attention_approx` would do on these inputs, for benchmarks and diagnostics.

    Args:
        qs: scalar queries (B, H, T).
        ks: scalar keys (B, H, T).
        tau: temperature > 0: a float, (H,) or (B, H, T).
        tol: the bound on each query's dropped softmax mass, a float in (0, 1).
        block: sorted queries per block (each block reads one run of keys), an int >= 1.

    Returns:
        A dict with ``"T"``, the sequence length; ``"window"``, the key-run width W the call
        needs (a multiple of 8, at least 8, capped at T); ``"max_window"``, the width beyond which
        a call with the default max_window runs the exact fused path instead (T // 4, at least 1).

    Raises:
        TypeError: qs, ks or tau is not a tensor (tau: nor a float) or not floating, ks has
            another dtype than qs, tol is not a float, block is not an int.
        ValueError: shapes that do not fit, another device, NaN or inf, tau <= 0, tol outside
            (0, 1), block < 1.
    """
    tol = check_tol(tol)
    check_int("block", block, 1)
    B, H, T = check_scalars(qs, ks, causal=True)
    tau_full = tau_tensor(tau, B, H, T, upcast(qs.dtype), qs.device).detach().expand(B, H, T)
    k_sorted = ks.detach().to(tau_full.dtype).sort(-1).values
    q_sorted, q_perm = qs.detach().to(tau_full.dtype).sort(-1)
    W, _ = _window(k_sorted, q_sorted, tau_full.gather(-1, q_perm), tol, block)
    return {"T": T, "window": W, "max_window": max(1, T // 4)}


def scalar_attention_approx(qs, ks, v, tau, *, tol: float = APPROX_TOL, block: int = 64,
                            max_window: int | None = None, docs: torch.Tensor | None = None,
                            cu_seqlens=None) -> torch.Tensor:
    """Causal scalar attention o_t = sum_{s<=t} softmax_s(-(qs_t - ks_s)^2 / tau_t) v_s, with each
    query's dropped softmax mass at most `tol` (see the module docstring for the bound).

    Gradients reach qs, ks, v and a tensor tau.

    Args:
        qs: scalar queries (B, H, T).
        ks: scalar keys (B, H, T), as many as queries (whole sequences only).
        v: values (B, G, T, Dv), G dividing H (grouped values).
        tau: temperature > 0: a float, (H,) or (B, H, T).
        tol: the bound on each query's dropped softmax mass, a float in (0, 1).
        block: sorted queries per block (each block reads one run of keys), an int >= 1.
        max_window: the widest run of keys to read before running the exact fused path instead;
            None for T // 4.
        docs: packed documents (module docstring), (B, T) integer document ids; None for one
            document per row.
        cu_seqlens: packed documents as N + 1 offsets [0, ..., T] into one row (B = 1), as
            flash-linear-attention's ops take them. Give at most one of docs and cu_seqlens.

    Returns:
        (B, H, T, Dv) in v's dtype.

    Raises:
        TypeError: a tensor argument that is not a tensor, not floating or not of qs's dtype; tau
            neither a float nor a tensor; tol not a float; block or max_window not an int.
        ValueError: shapes that do not fit (batch, heads, groups, ks or v of another length than
            qs), another device, NaN or inf in any input, tau <= 0, tol outside (0, 1), block or
            max_window < 1, docs or cu_seqlens (both, another shape, device or dtype, offsets not
            from 0 to T, cu_seqlens with B != 1).
    """
    B, H, T, tol, tau_b = check_approx(qs, ks, v, tau, tol, block, max_window)
    packed = packing(cu_seqlens, docs, B, T, qs)
    seg = None if packed is None else packed.seg  # (B, T): each position's document
    cap = max(1, T // 4) if max_window is None else max_window
    cdt = upcast(qs.dtype)
    tau_full = tau_b.expand(B, H, T)
    q_sorted, q_perm = qs.detach().to(cdt).sort(-1)
    k_sorted, k_perm = ks.detach().to(cdt).sort(-1)
    W, start = _window(k_sorted, q_sorted, tau_full.detach().gather(-1, q_perm), tol, block)
    if T == 0 or W > cap:
        return scalar_attention(qs, ks, v, tau, causal=True, impl="fast", docs=seg)
    out, fail = _windowed(qs, ks, v, tau_full, q_perm, k_sorted, k_perm, start, W, tol, block, cdt, packed)
    if fail.any():
        if int(fail.sum(-1).max()) > max(block, T // FALLBACK_FRACTION):
            return scalar_attention(qs, ks, v, tau, causal=True, impl="fast", docs=seg)
        out = _exact_rows(out, fail, qs, ks, v, tau_full, cdt, seg)
    return out.to(v.dtype)


def _windowed(qs, ks, v, tau_full, q_perm, k_sorted, k_perm, start, W: int, tol: float, block: int, cdt,
              packed=None):
    """Every query against its block's run of W sorted keys: (B, H, T, Dv) in cdt, and the
    queries whose bound exceeds tol, (B, H, T) bool in time order. packed: the documents' `Packing`
    (keys of other documents hidden), or None."""
    B, H, T = qs.shape
    G, Dv = v.shape[1], v.shape[-1]
    nb = start.shape[-1]
    pad = nb * block - T
    qp = torch.cat([q_perm, q_perm[..., -1:].expand(B, H, pad)], dim=-1) if pad else q_perm  # (B, H, nb*block)
    kidx = start.unsqueeze(-1) + torch.arange(W, device=qs.device)  # (B, H, nb, W) sorted-key slots
    pos_k = k_perm.gather(-1, kidx.view(B, H, nb * W)).view(B, H, nb, W)  # time positions of the run's keys
    pos_q = qp.view(B, H, nb, block)
    q_b = qs.to(cdt).gather(-1, qp).view(B, H, nb, block)
    t_b = tau_full.to(cdt).gather(-1, qp).view(B, H, nb, block)
    k_b = ks.to(cdt).gather(-1, pos_k.view(B, H, nb * W)).view(B, H, nb, W)
    head_group = torch.arange(H, device=qs.device) // (H // G)  # (H,)
    rows = (torch.arange(B, device=qs.device)[:, None] * G + head_group) * T  # (B, H)
    v_idx = rows[..., None, None] + pos_k  # (B, H, nb, W): rows of the values flattened to (B G T, Dv)
    v_flat = v.to(cdt).reshape(B * G * T, Dv)
    seg_q = seg_k = None
    seen = pos_q + 1  # visible keys of each query
    if packed is not None:  # each run key's and block query's document; a query sees its document's start on
        segs = packed.seg[:, None].expand(B, H, T)
        seg_q = segs.gather(-1, qp).view(B, H, nb, block)
        seg_k = segs.gather(-1, pos_k.view(B, H, nb * W)).view(B, H, nb, W)
        seen = packed.pos[:, None].expand(B, H, T).gather(-1, qp).view(B, H, nb, block) + 1
    # o_b (B, H, nb, block, Dv); lse, n_in (B, H, nb, block)
    o_b, lse, n_in = _RunAttention.apply(q_b, t_b, k_b, v_flat, v_idx, pos_q, pos_k, seg_q, seg_k)
    o_sorted = o_b.view(B, H, nb * block, Dv)[:, :, :T]  # (B, H, T, Dv) in sorted-query order
    inv = torch.empty_like(q_perm).scatter_(-1, q_perm, torch.arange(T, device=qs.device).expand(B, H, T))
    out = o_sorted.gather(2, inv.unsqueeze(-1).expand(B, H, T, Dv))  # (B, H, T, Dv) in time order
    with torch.no_grad():
        n_out = seen - n_in  # visible keys outside the run
        before = torch.cat([k_sorted.new_full((B, H, 1), float("-inf")), k_sorted], dim=-1)
        after = torch.cat([k_sorted, k_sorted.new_full((B, H, 1), float("inf"))], dim=-1)
        left = before.gather(-1, start).unsqueeze(-1)  # (B, H, nb, 1): the nearest excluded key below
        right = after.gather(-1, start + W).unsqueeze(-1)
        qd = q_b.detach()
        d = torch.minimum(qd - left, right - qd).clamp(min=0)  # (B, H, nb, block)
        log_bound = torch.log(n_out.to(cdt)) - d.pow(2) / t_b.detach() - lse
        fail = (n_out > 0) & ~(log_bound <= math.log(tol))  # NaN (no visible key in the run) fails
        fail = fail.reshape(B, H, nb * block)[..., :T].gather(-1, inv)
    return out, fail


def _run_logits(q, t, k, pos_q, pos_k, seg_q=None, seg_k=None):
    """Masked logits (B, H, nb, block, W) of each block's queries against its run, and the number of
    keys each query sees there; rows that see none are left unmasked (finite; their output is
    replaced by an exact row). seg_q, seg_k: the queries' and keys' documents, or None."""
    logits = -(q.unsqueeze(-1) - k.unsqueeze(-2)).pow(2) / t.unsqueeze(-1)
    hidden = pos_k.unsqueeze(-2) > pos_q.unsqueeze(-1)
    if seg_q is not None:
        hidden = hidden | (seg_k.unsqueeze(-2) != seg_q.unsqueeze(-1))
    n_in = hidden.shape[-1] - hidden.sum(-1, keepdim=True)  # visible keys in the run
    return logits.masked_fill(hidden & (n_in > 0), float("-inf")), n_in


def _chunks(q, k):
    """Slices of the block axis (dim 2) holding about CHUNK_ELEMENTS weights each."""
    B, H, nb, block = q.shape
    step = max(1, CHUNK_ELEMENTS // max(1, B * H * block * k.shape[-1]))
    return [slice(i, min(nb, i + step)) for i in range(0, nb, step)]


def _gather(v_flat, idx):
    """Rows idx (B, H, n, W) of v_flat (rows, Dv) as (B, H, n, W, Dv)."""
    return v_flat.index_select(0, idx.reshape(-1)).view(*idx.shape, v_flat.shape[-1])


class _RunAttention(torch.autograd.Function):
    """softmax(masked -(q - k)^2 / t) v per block and run, a chunk of blocks at a time, saving
    only the inputs and each row's max and sum: the (block x W) weights are recomputed in backward
    rather than kept, and each chunk gathers its runs' values itself (v_flat rows v_idx), so a call
    holds O(T (W / block + Dv)) between forward and backward and its temporaries are bounded by
    CHUNK_ELEMENTS (times Dv for the gathered values)."""

    @staticmethod
    def forward(ctx, q, t, k, v_flat, v_idx, pos_q, pos_k, seg_q=None, seg_k=None):
        # q, t, pos_q, seg_q (B, H, nb, block); k, v_idx, pos_k, seg_k (B, H, nb, W); v_flat (B G T, Dv);
        # seg_q, seg_k: documents, or None
        B, H, nb, block = q.shape
        # results are written into tensors allocated once: small per-chunk results kept alive between
        # the chunks' large temporaries would fragment the CPU heap
        o = q.new_empty(B, H, nb, block, v_flat.shape[-1])
        m, z, lse = (q.new_empty(B, H, nb, block, 1) for _ in range(3))
        n_in = torch.empty(B, H, nb, block, 1, dtype=torch.long, device=q.device)
        for c in _chunks(q, k):
            logits, n_in[:, :, c] = _run_logits(q[:, :, c], t[:, :, c], k[:, :, c], pos_q[:, :, c], pos_k[:, :, c],
                                                *_docs_of(seg_q, seg_k, c))
            # the row max and sum kept apart: logits reach -1e4 and more, where a float32 log-sum-exp
            # would carry an absolute rounding error of ~1e-3 into every recomputed weight
            torch.amax(logits, -1, keepdim=True, out=m[:, :, c])
            p = torch.exp(logits - m[:, :, c])
            torch.sum(p, -1, keepdim=True, out=z[:, :, c])
            torch.div(p @ _gather(v_flat, v_idx[:, :, c]), z[:, :, c], out=o[:, :, c])  # (B, H, n, block, Dv)
        torch.add(m, z.log(), out=lse)
        lse.masked_fill_(n_in == 0, float("-inf"))  # -inf: no visible key in the run
        ctx.save_for_backward(q, t, k, v_flat, v_idx, pos_q, pos_k, m, z, seg_q, seg_k)
        lse, n_in = lse.squeeze(-1), n_in.squeeze(-1)
        ctx.mark_non_differentiable(lse, n_in)
        return o, lse, n_in

    @staticmethod
    def backward(ctx, d_o, *_):
        q, t, k, v_flat, v_idx, pos_q, pos_k, m, z, seg_q, seg_k = ctx.saved_tensors
        dq, dt, dk = torch.empty_like(q), torch.empty_like(t), torch.empty_like(k)
        dv = torch.zeros_like(v_flat)
        for c in _chunks(q, k):
            qc, tc, kc, doc = q[:, :, c], t[:, :, c], k[:, :, c], d_o[:, :, c]
            logits, _ = _run_logits(qc, tc, kc, pos_q[:, :, c], pos_k[:, :, c], *_docs_of(seg_q, seg_k, c))
            p = torch.exp(logits - m[:, :, c]) / z[:, :, c]
            dp = doc @ _gather(v_flat, v_idx[:, :, c]).transpose(-1, -2)
            # sum_w p dp rather than d_o . o: the same rounding as dp, so a row whose weight sits on one
            # key gets ds = 0 exactly (else ds ~ 1e-7 times diff^2 / t^2 reaches the tau gradient)
            ds = p * (dp - (p * dp).sum(-1, keepdim=True))  # d loss / d logits
            diff = qc.unsqueeze(-1) - kc.unsqueeze(-2)  # (B, H, n, block, W)
            ds_t = ds * diff / tc.unsqueeze(-1)  # d logits / d q = -2 diff / t, / d k = +2 diff / t
            torch.mul(ds_t.sum(-1), -2.0, out=dq[:, :, c])
            torch.div((ds_t * diff).sum(-1), tc, out=dt[:, :, c])  # d logits / d t = diff^2 / t^2
            torch.mul(ds_t.sum(-2), 2.0, out=dk[:, :, c])
            dv.index_add_(0, v_idx[:, :, c].reshape(-1), (p.transpose(-1, -2) @ doc).reshape(-1, dv.shape[-1]))
        return dq, dt, dk, dv, None, None, None, None, None


def _docs_of(seg_q, seg_k, c: slice) -> tuple:
    """The documents of a chunk of blocks: (seg_q, seg_k) sliced, or (None, None)."""
    return (None, None) if seg_q is None else (seg_q[:, :, c], seg_k[:, :, c])


def _exact_rows(out, fail, qs, ks, v, tau_full, cdt, seg=None):
    """`out` with the rows where `fail` (B, H, T) replaced by the naive formula's (seg (B, T): the
    documents, keys of another one hidden; or None)."""
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
    if seg is not None:  # (B, H, F, L): and the keys of other documents
        hidden = hidden | (seg[:, None, None, :L] != seg[:, None].expand(B, H, T).gather(-1, pos).unsqueeze(-1))
    w = torch.softmax(logits.masked_fill(hidden, float("-inf")), dim=-1)
    o_f = w.view(B, G, (H // G) * F, L) @ v.to(cdt)[:, :, :L]  # grouped values read in place
    o_f = o_f.view(B, H, F, Dv)
    idx = ((torch.arange(B * H, device=qs.device).view(B, H, 1) * T) + pos)[valid]
    return out.reshape(B * H * T, Dv).index_put((idx,), o_f[valid]).view(B, H, T, Dv)
