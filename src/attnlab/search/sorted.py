"""Scalar selection on a frozen model, read from a sorted array: seed 000's decoding with a learned
one-dimensional search space (`SearchProjections(d_search=1, score="distance")`).

Each candidate set (one per KV head with groups = 'kv') gives every token a scalar search query q_t
and key k_t. At a budget of K keys the query at position t reads

    the first n_sink keys of its block (attention sinks),
    the last `ring` keys up to itself (a ring of recent tokens), and
    the K - n_sink - ring keys nearest to q_t in |q_t - k_j| among the others, the newest first
    among equal distances,

so K keys in all (every key when the block holds at most K). The older keys (neither sink nor in
the ring) stay sorted by their scalar key (`attnlab.cache.SortedKeyIndex`: the sorted scalar cache's
index), so a step binary-searches q_t and reads the 2k entries around it, O(log N + k), instead of
scoring every key. `sorted_select_naive` is the rule written out query by query, `sorted_select` the
same rule on a whole score matrix (for forwards of many queries), and `SortedScalarIndex` the decode
path that keeps the array; they choose the same keys (tested, ties included).
"""

from __future__ import annotations

import torch

from attnlab.cache.sorted_index import SortedKeyIndex, merge_runs
from attnlab.cache.sorted_read import newest_first
from attnlab.checks import check_int


def split_budget(K: int, n_sink: int, ring: int | None) -> tuple[int, int, int]:
    """(sinks, ring, nearest) of a budget of K keys: `ring` None is K // 4; ValueError when the sinks
    and the ring leave no key to choose by distance."""
    check_int("K", K)
    check_int("n_sink", n_sink, 0)
    ring = K // 4 if ring is None else check_int("ring", ring, 0)
    near = K - n_sink - ring
    if near < 1:
        raise ValueError(f"K={K} leaves no key to choose by distance after n_sink={n_sink} sinks and a ring "
                         f"of {ring}; need n_sink + ring < K")
    return n_sink, ring, near


def _pad(idx: list[int], K: int) -> tuple[list[int], list[bool]]:
    return idx + [0] * (K - len(idx)), [True] * len(idx) + [False] * (K - len(idx))


def sorted_select_naive(qs: torch.Tensor, ks: torch.Tensor, allowed: torch.Tensor, K: int, n_sink: int = 4,
                        ring: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The reference, query by query: qs (B, G, Tq), ks (B, G, Tk) scalar search queries and keys,
    allowed (B or 1, 1, Tq, Tk) -> idx, valid (B, G, Tq, K): sinks, then the ring (newest first),
    then the nearest others by |q - k| (newest first among equal distances); filler slots invalid."""
    n_sink, ring, near = split_budget(K, n_sink, ring)
    B, G, Tq = qs.shape
    al = allowed.expand(B, 1, Tq, ks.shape[-1])
    idx = torch.zeros(B, G, Tq, K, dtype=torch.long)
    valid = torch.zeros(B, G, Tq, K, dtype=torch.bool)
    for b in range(B):
        for g in range(G):
            for t in range(Tq):
                seen = al[b, 0, t].nonzero().flatten().tolist()  # admissible positions, oldest first
                if len(seen) <= K:
                    chosen = seen
                else:
                    sinks, recent = seen[:n_sink], seen[len(seen) - ring:][::-1]
                    rest = seen[n_sink:len(seen) - ring]
                    dist = {j: float((qs[b, g, t] - ks[b, g, j]).abs()) for j in rest}
                    chosen = sinks + recent + sorted(rest, key=lambda j: (dist[j], -j))[:near]
                i, v = _pad(chosen, K)
                idx[b, g, t], valid[b, g, t] = torch.tensor(i), torch.tensor(v)
    return idx.to(qs.device), valid.to(qs.device)


def sorted_select(qs: torch.Tensor, ks: torch.Tensor, allowed: torch.Tensor, K: int, n_sink: int = 4,
                  ring: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`sorted_select_naive` on whole matrices (B, G, Tq, Tk): each query's admissible keys ranked by
    (sink or ring first, then distance, the newest first among ties), the best K kept. The chosen
    set equals the reference's; the order of the slots may differ."""
    n_sink, ring, near = split_budget(K, n_sink, ring)
    B, G, Tq = qs.shape
    Tk = ks.shape[-1]
    al = allowed.expand(B, 1, Tq, Tk)
    rank_old = al.long().cumsum(-1) - 1  # (B, 1, Tq, Tk): 0 for the block's first admissible key
    rank_new = al.long().flip(-1).cumsum(-1).flip(-1) - 1  # 0 for the newest admissible key
    kept = al & ((rank_old < n_sink) | (rank_new < ring))
    dist = (qs[..., :, None] - ks[..., None, :]).abs()  # (B, G, Tq, Tk), float32 as the sorted index has it
    dist = torch.where(kept, torch.full_like(dist, -1.0), dist).masked_fill(~al, float("inf"))
    pos = torch.arange(Tk, device=qs.device).expand_as(dist)
    order = newest_first(dist.reshape(-1, Tk), pos.reshape(-1, Tk), min(K, Tk)).view(B, G, Tq, -1)
    valid = al.expand(B, G, Tq, Tk).gather(-1, order)
    if order.shape[-1] < K:
        pad = K - order.shape[-1]
        order = torch.cat([order, order.new_zeros(B, G, Tq, pad)], -1)
        valid = torch.cat([valid, valid.new_zeros(B, G, Tq, pad)], -1)
    return order, valid


class SortedScalarIndex:
    """The decode-time state of the sorted selection for B x G rows: every key by position (the sinks'
    and the ring's are read from there), and the older keys in a `SortedKeyIndex` (key bits and
    position per entry). A key enters the array when it leaves the ring, so a step inserts one entry
    and searches O(log N).

    `add(ks)` appends keys (B, G, Tn) (a prefill: sorted into the array in bulk at the first search);
    `grow_and_search(qs, ks, allowed, K)` adds each new position's key and selects for its query in
    turn, as decoding token by token would (a fresh sequence, a batch of several rows or a mask that
    is not plainly causal goes to `sorted_select` over the stored keys). `reads` counts the entries
    the steps read: the binary searches' probes and the candidates scored."""

    def __init__(self, n_sink: int = 4, ring: int | None = None):
        self.n_sink, self.ring = check_int("n_sink", n_sink, 0), ring
        self.reset()

    @property
    def ntotal(self) -> int:
        return self.count

    @property
    def keys(self) -> torch.Tensor | None:
        """The stored scalar keys (B, G, N) by position (a view)."""
        return None if self._buf is None else self._buf[..., : self.count]

    def reset(self) -> None:
        """Forget every key (a new sequence starts)."""
        self._buf, self.count, self.index, self.sorted_upto, self.reads = None, 0, None, 0, 0

    def add(self, ks: torch.Tensor) -> None:
        """Append scalar keys (B, G, Tn) at positions ntotal.. (amortised O(Tn))."""
        ks = ks.detach().float()
        n = self.count + ks.shape[-1]
        if self._buf is None or n > self._buf.shape[-1]:
            buf = ks.new_empty(*ks.shape[:2], max(n + n // 2, 64))
            if self.count:
                buf[..., : self.count] = self._buf[..., : self.count]
            self._buf = buf
        self._buf[..., self.count:n] = ks
        self.count = n

    def _sort_upto(self, end: int) -> None:
        """Move the keys at positions sorted_upto..end-1 (past the sinks) into the sorted array."""
        start = max(self.sorted_upto, self.n_sink)
        if end <= start:
            return
        B, G, _ = self._buf.shape
        new = self._buf[..., start:end].reshape(B * G, end - start)
        if self.index is None:
            self.index = SortedKeyIndex(B * G, device=new.device)
        if end - start == 1:
            self.index.insert(new[:, 0].contiguous().view(torch.int32), start)
        else:
            order = new.sort(dim=1, stable=True).indices
            run = torch.stack([new.gather(1, order).contiguous().view(torch.int32), (order + start).int()])
            old = self.index.merged()
            self.index.replace(run if old is None else merge_runs(old, run))
        self.sorted_upto = end

    def search(self, qs: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
        """idx, valid (B, G, 1, K) for the query qs (B, G) of the newest stored position."""
        B, G = qs.shape
        n = self.count
        if n <= K:  # every key
            slots = torch.arange(K, device=qs.device)
            return slots.clamp(max=n - 1).expand(B, G, 1, K).contiguous(), (slots < n).expand(B, G, 1, K).contiguous()
        n_sink, ring, near = split_budget(K, self.n_sink, self.ring)
        self._sort_upto(n - ring)
        q = qs.float().reshape(B * G, 1).contiguous()
        cand = self.index.candidates(q, near)  # (C, R, M): each level's 2 * near around q, and the buffer
        self.reads += cand.shape[2] + sum(d.shape[2].bit_length() for d in self.index.runs())
        dist = (cand[0].view(torch.float32) - q).abs()
        pick = newest_first(dist, cand[1], near)
        if _tie_outside(self.index, q, near, dist.gather(1, pick).amax(1, keepdim=True)):
            # a key as near as the farthest chosen lies outside some level's window (equal keys, as a
            # repeated token's are in the first layer): the newest-first rule needs every older key
            self.reads += n
            older = torch.ones(1, 1, 1, n, dtype=torch.bool, device=qs.device)
            return sorted_select(qs[..., None].float(), self.keys, older, K, self.n_sink, self.ring)
        found = cand[1].gather(1, pick).long()  # (R, near) positions
        fixed = torch.cat([torch.arange(n_sink), torch.arange(n - 1, n - 1 - ring, -1)]).to(qs.device)
        idx = torch.cat([fixed.expand(B * G, -1), found], 1).view(B, G, 1, K)
        return idx, torch.ones_like(idx, dtype=torch.bool)

    def grow_and_search(self, qs: torch.Tensor, ks: torch.Tensor, allowed: torch.Tensor, K: int):
        """qs, ks (B, G, Tq) of the Tq newest positions -> idx, valid (B, G, Tq, K)."""
        B, G, Tq = qs.shape
        Tk = self.count + Tq
        causal = torch.arange(Tk, device=qs.device) <= torch.arange(Tk - Tq, Tk, device=qs.device)[:, None]
        if self.count == 0 or B > 1 or allowed.shape[0] > 1 or not torch.equal(allowed[0, 0, :, :Tk], causal):
            self.add(ks)
            return sorted_select(qs, self.keys, allowed[..., :Tk], K, self.n_sink, self.ring)
        out = []
        for t in range(Tq):  # one decode step per new position
            self.add(ks[..., t:t + 1])
            out.append(self.search(qs[..., t], K))
        return torch.cat([o[0] for o in out], 2), torch.cat([o[1] for o in out], 2)


def _tie_outside(index: SortedKeyIndex, q: torch.Tensor, k: int, kth: torch.Tensor) -> bool:
    """Whether an entry just outside some level's candidate window (the 2k entries around q's
    insertion point that `SortedKeyIndex.candidates` reads) is as near to q (R, 1) as the k-th nearest
    candidate kth (R, 1): only then can the window miss a key the rule would choose (no entry outside
    it is nearer)."""
    for data in index.runs():
        keys = data[0].view(torch.float32)  # (R, W)
        W = keys.shape[1]
        if W <= 2 * k:
            continue
        lo = (torch.searchsorted(keys, q) - k).clamp(0, W - 2 * k)  # (R, 1)
        left = (keys.gather(1, (lo - 1).clamp(min=0)) - q).abs() <= kth
        right = (keys.gather(1, (lo + 2 * k).clamp(max=W - 1)) - q).abs() <= kth
        if bool(((left & (lo > 0)) | (right & (lo + 2 * k < W))).any()):
            return True
    return False
