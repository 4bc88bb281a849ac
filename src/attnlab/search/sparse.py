"""Exact attention over a retrieved candidate set: the model's own q, k, v, softmax over S_t only.

    o_t = sum_{j in S_t} exp(q_t.k_j * s) / sum_{l in S_t} exp(q_t.k_l * s) * v_j

The candidate set is given as indices (B, G, Tq, K) with a validity mask; invalid (filler) slots
are left out of the softmax. G candidate groups are shared by H / G query heads each (G = 1: one
set per token for all heads, as the search projections produce).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from attnlab.checks import check_groups, check_impl, check_same, check_tensor
from attnlab.ops.common.heads import expand_heads


def _check(q, k, v, idx, valid):
    check_tensor("q", q, 4)
    check_tensor("k", k, 4)
    check_tensor("v", v, 4)
    check_tensor("idx", idx, 4)
    check_tensor("valid", valid, 4)
    if idx.dtype not in (torch.int64, torch.int32):
        raise TypeError(f"idx must be an integer tensor, got {idx.dtype}")
    if valid.dtype != torch.bool:
        raise TypeError(f"valid must be a bool tensor, got {valid.dtype}")
    if tuple(valid.shape) != tuple(idx.shape):
        raise ValueError(f"valid must have the shape of idx {tuple(idx.shape)}, got {tuple(valid.shape)}")
    check_same("k", k.shape[2], "v", v.shape[2], "length")
    check_same("k", k.shape[1], "v", v.shape[1], "heads")
    check_same("q", q.shape[-1], "k", k.shape[-1], "head dim")
    check_same("q", q.shape[2], "idx", idx.shape[2], "query length")
    check_groups(q.shape[1], k.shape[1], "k")
    check_groups(q.shape[1], idx.shape[1], "idx")
    if idx.numel() and bool(((idx < 0) | (idx >= k.shape[2]))[valid].any()):
        raise ValueError(f"idx: a valid slot points outside the {k.shape[2]} keys (valid indices are 0..{k.shape[2] - 1})")


def _head_maps(H: int, Hkv: int, G: int, device):
    """(KV head, candidate set) of each query head: head h reads KV head h // (H / Hkv) and set h // (H / G)."""
    h = torch.arange(H, device=device)
    return h // (H // Hkv), h // (H // G)


def sparse_attention_naive(q, k, v, idx, valid, scaling: float) -> torch.Tensor:
    """Gather the K candidate keys/values of every query and softmax over the valid ones.

    The gather indexes the KV heads in place (no copy of k or v per query head), so a decode step
    costs O(H * K * D) whatever the context length."""
    B, H, Tq, D = q.shape
    kv_of, set_of = _head_maps(H, k.shape[1], idx.shape[1], q.device)
    ih = idx[:, set_of].clamp(0, max(k.shape[2] - 1, 0)).long()  # (B, H, Tq, K); filler slots may hold anything
    b = torch.arange(B, device=q.device)[:, None, None, None]
    kvh = kv_of[None, :, None, None]
    ks = k[b, kvh, ih]  # (B, H, Tq, K, D)
    vs = v[b, kvh, ih]
    ok = valid[:, set_of]  # (B, H, Tq, K)
    s = torch.einsum("bhtd,bhtkd->bhtk", q, ks) * scaling
    s = s.masked_fill(~ok, float("-inf"))
    wide = s if s.dtype == torch.float64 else s.float()
    p = torch.softmax(wide, dim=-1).nan_to_num(0.0).to(q.dtype)  # rows with no valid slot -> 0
    return torch.einsum("bhtk,bhtkd->bhtd", p, vs)  # (B, H, Tq, D)


def sparse_attention_grouped(q, k, v, idx, valid, scaling: float) -> torch.Tensor:
    """The gather path when candidate set g is read by exactly the query heads of KV head g (G = Hkv,
    as `groups="kv"` gives): each set's K keys and values are gathered once from their KV head and
    shared by its H / G query heads, instead of once per query head. Equal to the naive path."""
    B, H, Tq, D = q.shape
    G, K = idx.shape[1], idx.shape[-1]
    n = H // G
    ih = idx.clamp(0, max(k.shape[2] - 1, 0)).long().reshape(B, G, Tq * K, 1)
    ks = k.gather(2, ih.expand(-1, -1, -1, D)).view(B, G, Tq, K, D)
    vs = v.gather(2, ih.expand(-1, -1, -1, v.shape[-1])).view(B, G, Tq, K, v.shape[-1])
    qg = q.reshape(B, G, n, Tq, D).transpose(2, 3)  # (B, G, Tq, n, D): the set's heads share its keys
    s = (qg @ ks.transpose(-1, -2)) * scaling  # (B, G, Tq, n, K)
    s = s.masked_fill(~valid[:, :, :, None], float("-inf"))
    wide = s if s.dtype == torch.float64 else s.float()
    p = torch.softmax(wide, dim=-1).nan_to_num(0.0).to(q.dtype)
    return (p @ vs).transpose(2, 3).reshape(B, H, Tq, v.shape[-1])


def candidate_mask(idx: torch.Tensor, valid: torch.Tensor, n_keys: int) -> torch.Tensor:
    """The dense (B, G, Tq, Tk) boolean mask of the valid candidate slots."""
    m = torch.zeros(*idx.shape[:-1], n_keys + 1, dtype=torch.bool, device=idx.device)
    slot = torch.where(valid, idx.long(), torch.full_like(idx.long(), n_keys))  # fillers -> spare column
    m.scatter_(-1, slot, True)
    return m[..., :n_keys]


def sparse_attention_fast(q, k, v, idx, valid, scaling: float) -> torch.Tensor:
    """Scatter the candidates into a boolean mask and run the fused SDPA kernel with it.

    The (B, G, Tq, Tk) mask is never copied out to the H heads: the heads are taken in H / G
    passes, pass j holding the j-th head of every candidate set (G heads, one mask each), and each
    pass reads its heads' KV heads (in place when they are the KV heads in order)."""
    B, H, Tq, D = q.shape
    G, Hkv = idx.shape[1], k.shape[1]
    mask = candidate_mask(idx, valid, k.shape[2])  # (B, G, Tq, Tk)
    empty = ~mask.any(-1, keepdim=True)  # (B, G, Tq, 1)
    mask = mask | (empty & (torch.arange(k.shape[2], device=q.device) == 0))
    kv_of, _ = _head_maps(H, Hkv, G, q.device)
    n = H // G
    out = q.new_empty(B, H, Tq, v.shape[-1])
    for j in range(n):
        heads = torch.arange(j, H, n, device=q.device)  # the j-th head of each set, (G,)
        kv = kv_of[heads]
        same = G == Hkv and bool((kv == torch.arange(Hkv, device=q.device)).all())
        kj, vj = (k, v) if same else (k[:, kv], v[:, kv])
        out[:, heads] = F.scaled_dot_product_attention(q[:, heads], kj, vj, attn_mask=mask, scale=scaling)
    return out.masked_fill(expand_heads(empty, H), 0.0)


def sparse_attention(q, k, v, idx, valid, scaling: float, impl: str = "auto") -> torch.Tensor:
    """q (B, H, Tq, D), k/v (B, Hkv, Tk, D), idx/valid (B, G, Tq, K) -> (B, H, Tq, D).

    auto: gather for a few queries (decode, cost O(K); once per set when the sets are the KV heads'),
    fused masked SDPA otherwise.
    """
    check_impl(impl)
    _check(q, k, v, idx, valid)
    if impl == "naive":
        return sparse_attention_naive(q, k, v, idx, valid, scaling)
    if impl == "auto" and q.shape[2] * idx.shape[-1] <= 4096:
        if idx.shape[1] == k.shape[1]:  # set g is KV head g's: gather once per set
            return sparse_attention_grouped(q, k, v, idx, valid, scaling)
        return sparse_attention_naive(q, k, v, idx, valid, scaling)
    return sparse_attention_fast(q, k, v, idx, valid, scaling)
