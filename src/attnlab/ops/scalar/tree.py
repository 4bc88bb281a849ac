"""The window's selection at O(T x (k log T + c)) per head on any device, exact and with no host sync:
query t's k nearest keys in scalar space among positions n_prefix .. t - local, the newest first on
equal distances (the rule of `window.window_mask`).

Structure: a merge-sort tree over key positions. The keys from n_prefix on are cut into blocks of c;
level l holds every aligned run of 2^l blocks sorted by value, twice (equal values in ascending
position in order L, descending in order R; two stable sorts). Query t's old keys are whole blocks
0 .. J_t - 1 (J_t = (t - local + 1 - n_prefix) // c) and a fringe of fewer than c keys after them.
The whole blocks split into at most one node per level (the set bits of J_t, as a Fenwick prefix).

Search: in each of its nodes a query finds its place by one `searchsorted` over the level's keys
(node id above the value's order-preserving bits, so every node of a level is searched in one call)
and takes the k keys just below it in order L and the k from it up in order R. Walking down order L
the distances grow and equal values come newest first; walking up order R likewise, so a node's own
k nearest (distance, newest) are among those 2k. Every key lies in one node or the fringe, so the k
smallest (distance bits, newest) among the candidates are exactly the dense rule's. One top-k over
L x 2k + c candidates per query replaces the dense top-k over every visible key; query rows run in
chunks (on CUDA as many as keep B x H x rows x candidates within CUDA_CANDIDATES), so the candidates
take O(chunk x (2kL + c)) memory.

The arguments are float32 (distances compared as the dense rule's float32 values); the callers check.
"""

from __future__ import annotations

import torch

__all__ = ["CUDA_CANDIDATES", "TREE_BLOCK", "tree_select"]

TREE_BLOCK = 64  # keys per leaf block (c): the fringe each query scores directly
CUDA_CANDIDATES = 1 << 26  # on CUDA: query rows per chunk such that B x H x rows x candidates stay below this


def _ordered(x: torch.Tensor) -> torch.Tensor:
    """float32 -> int64 in [0, 2^32) with the order of the values (-0.0 counted as +0.0)."""
    b = (x + 0.0).view(torch.int32).to(torch.int64)  # + 0.0 turns -0.0 into +0.0
    return torch.where(b < 0, b ^ 0x7FFFFFFF, b) + (1 << 31)


def _levels(ks: torch.Tensor, n_prefix: int, c: int):
    """Per level l (nodes of c * 2^l keys from n_prefix on): the search keys (node << 32 | value order) in
    order L, and the key positions in orders L and R, each (B, H, P), P the padded key count."""
    B, H, T = ks.shape
    n = max(T - n_prefix, 0)
    blocks = -(-n // c)  # every query's whole blocks J <= blocks < 2^L
    L = max(1, blocks.bit_length())
    P = c << L
    vals = torch.full((B, H, P), float("inf"), dtype=ks.dtype, device=ks.device)
    vals[..., :n] = ks[..., n_prefix:]
    pos = torch.arange(P, device=ks.device) + n_prefix
    out = []
    for lv in range(L):
        S = c << lv
        v = vals.view(B, H, P // S, S)
        sv, iL = v.sort(dim=-1, stable=True)  # ascending, equal values by position
        iR = S - 1 - v.flip(-1).sort(dim=-1, stable=True).indices  # equal values newest first
        node = torch.arange(P // S, device=ks.device).view(1, 1, -1, 1)
        base = node * S
        keys = ((node << 32) | _ordered(sv)).view(B, H, P)
        out.append((keys, pos[(base + iL).view(B, H, P)], pos[(base + iR).view(B, H, P)]))
    return out, P


def tree_select(q32: torch.Tensor, k32: torch.Tensor, k: int, n_prefix: int, local: int,
                chunk: int = 1024, c: int = TREE_BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """Query t's k nearest keys among positions n_prefix .. t - local of k32 (B, H, T), for the float32
    scalar queries q32 (B, H, T) -> idx (B, H, T, k) int64 in the dense rule's order (distance, then
    newest) and ok (B, H, T, k) bool (False past the keys a query has, where idx is 0: the same on every
    device). No value is read back."""
    B, H, T = k32.shape
    dev = k32.device
    idx = torch.zeros(B, H, T, k, dtype=torch.long, device=dev)
    ok = torch.zeros(B, H, T, k, dtype=torch.bool, device=dev)
    if T == 0 or k == 0:
        return idx, ok
    levels, P = _levels(k32, n_prefix, c)
    if dev.type == "cuda":  # fewer, larger chunks: each costs a few dozen launches whatever its size
        chunk = max(chunk, CUDA_CANDIDATES // max(1, B * H * (2 * k * len(levels) + c)))
    kk = torch.arange(k, device=dev)
    fr = torch.arange(c, device=dev)
    big = torch.iinfo(torch.int64).max
    for a in range(0, T, chunk):
        b = min(T, a + chunk)
        t = torch.arange(a, b, device=dev)
        q = q32[..., a:b]  # (B, H, n)
        J = torch.div(t - local + 1 - n_prefix, c, rounding_mode="floor").clamp_min(0)  # whole blocks seen
        cands, valid = [], []
        for lv, (keys, posL, posR) in enumerate(levels):
            S = c << lv
            used = ((J >> lv) & 1).bool()  # (n,)
            node = ((J >> lv) - 1).clamp_min(0)
            qkey = (node << 32).expand_as(q) | _ordered(q)
            p = torch.searchsorted(keys, qkey.contiguous())  # (B, H, n): the first key of the node >= q
            lo, hi = (node * S)[:, None], ((node + 1) * S)[:, None]
            down = p[..., None] - 1 - kk  # order L, below q
            up = p[..., None] + kk  # order R, at or above q
            cands += [posL.gather(-1, down.clamp(0, P - 1).flatten(2)).view(down.shape),
                      posR.gather(-1, up.clamp(0, P - 1).flatten(2)).view(up.shape)]
            valid += [used[:, None] & (down >= lo), used[:, None] & (up < hi)]
        f = (t - local)[:, None] - fr  # (n, c): the fringe, the newest first
        cands.append(f.clamp_min(0).expand(B, H, -1, -1))
        valid.append((f >= n_prefix + J[:, None] * c).expand(B, H, -1, -1))
        cand, ok_c = torch.cat(cands, -1), torch.cat(valid, -1)  # (B, H, n, 2kL + c)
        ok_c &= cand < T  # the padding's positions (+inf values) are no keys
        cand = cand.clamp(max=T - 1)
        dist = (q[..., None] - k32.gather(-1, cand.flatten(2)).view(cand.shape)).abs()
        order = (dist.view(torch.int32).to(torch.int64) << 32) | (T - 1 - cand)
        order = order.masked_fill(~ok_c, big)
        m = min(k, order.shape[-1])
        top = order.topk(m, dim=-1, largest=False).indices
        got = order.gather(-1, top) < big
        idx[:, :, a:b, :m] = cand.gather(-1, top).masked_fill(~got, 0)  # a tie of `big`s orders by device
        ok[:, :, a:b, :m] = got
    return idx, ok
