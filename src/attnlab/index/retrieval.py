"""Maximum-inner-product search over a growing set of search keys: exact (`ExactIndex`) and FAISS HNSW
(`HNSWIndex`), with the top-K rule they share (`topk_candidates`). Used by learned search
(`attnlab.search`), the learned key selectors (`attnlab.eval.selectors`) and the decode cache that
selects through them (`attnlab.cache.selected`); `attnlab.index.ivf` adds FAISS IVF."""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["ExactIndex", "HNSWIndex", "block_starts", "topk_candidates"]


def topk_candidates(scores: torch.Tensor, allowed: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K best admissible keys by score; scores (B, G, Tq, Tk) -> idx, valid (B, G, Tq, K)."""
    kk = min(K, scores.shape[-1])
    if allowed.shape[-2] == 1 and bool(allowed.all()):  # a decode step admitting every key: no mask to apply
        idx = scores.float().topk(kk, dim=-1).indices
        valid = torch.ones_like(idx, dtype=torch.bool)
    else:
        allowed = allowed.expand_as(scores)
        idx = scores.float().masked_fill(~allowed, float("-inf")).topk(kk, dim=-1).indices
        valid = allowed.gather(-1, idx)
    if kk < K:  # fewer keys than K: filler slots
        pad = K - kk
        idx = torch.cat([idx, idx.new_zeros(*idx.shape[:-1], pad)], dim=-1)
        valid = torch.cat([valid, valid.new_zeros(*valid.shape[:-1], pad)], dim=-1)
    return idx, valid

def block_starts(allowed: torch.Tensor, batch: int) -> torch.Tensor:
    """(B or 1, 1, Tq, Tk) mask -> (B, Tq): the first admissible key of each query (its block's start)."""
    al = allowed.expand(batch, 1, *allowed.shape[2:])[:, 0]
    return al.float().argmax(-1)

class ExactIndex:
    """Exact maximum-inner-product search over a growing set of search keys (B, G, N, d).

    A step reads every stored key, so its cost is memory traffic: `dtype=torch.float16` stores the
    keys (and scores the queries) in half precision, half the bytes per step; the ranking then
    holds up to fp16 rounding of the scores (near-ties may swap)."""

    def __init__(self, dtype: torch.dtype = torch.float32):
        if dtype not in (torch.float32, torch.float16, torch.bfloat16):
            raise ValueError(f"dtype must be torch.float32, float16 or bfloat16, got {dtype}")
        self.dtype = dtype
        self._buf: torch.Tensor | None = None  # (B, G, capacity, d): one key per step appends in place
        self.count = 0

    @property
    def keys(self) -> torch.Tensor | None:
        """The stored keys (B, G, N, d), a view of the buffer."""
        return None if self._buf is None else self._buf[:, :, : self.count]

    @property
    def ntotal(self) -> int:
        return self.count

    def reset(self) -> None:
        """Forget every key (a new sequence starts)."""
        self._buf, self.count = None, 0

    def add(self, ks: torch.Tensor) -> None:
        """Append search keys (B, G, Tnew, d) as the next positions (amortised O(Tnew): a full buffer
        grows to 1.5x what it must hold instead of being copied at every step)."""
        ks = ks.detach().to(self.dtype)
        n = self.count + ks.shape[2]
        if self._buf is None or n > self._buf.shape[2]:
            cap = max(n + n // 2, 64)  # 1.5x headroom: a copy every few doublings' worth of steps
            buf = ks.new_empty(*ks.shape[:2], cap, ks.shape[3])
            if self.count:
                buf[:, :, : self.count] = self._buf[:, :, : self.count]
            self._buf = buf
        self._buf[:, :, self.count:n] = ks
        self.count = n

    def search(self, qs: torch.Tensor, allowed: torch.Tensor, K: int):
        """qs (B, G, Tq, d) -> idx, valid (B, G, Tq, K) among admissible stored positions."""
        scores = qs.to(self.dtype) @ self.keys.transpose(-1, -2)  # (B, G, Tq, N)
        return topk_candidates(scores, allowed[..., : self.ntotal], K)

    def grow_and_search(self, qs, ks, allowed, K):
        """Add the keys of the Tq newest positions, then search their queries (causality is in `allowed`)."""
        self.add(ks)
        return self.search(qs, allowed, K)

class HNSWIndex:
    """FAISS HNSW (inner product on L2-normalised vectors): one graph per document block and batch row,
    as a decoder keeps one index per sequence. Graph ids are positions relative to the block start.

    A query searches its block's graph for ids up to its own position (an id-range selector); when
    the block holds at most K admissible keys they are all returned exactly, with no graph search.
    The first `pin` keys of every block (attention sinks: outliers in search space that graph search
    tends to miss) are also scored exactly and compete with the graph's results for the K slots.
    `dtype=torch.float16` stores the graph's vectors in half precision (FAISS's fp16 scalar
    quantizer: half the vector bytes a search reads, and fewer cache misses; the pinned keys stay
    float32).
    """

    def __init__(self, dim: int, M: int = 32, ef_construction: int = 64, ef_search: int = 512, pin: int = 4,
                 dtype: torch.dtype = torch.float32):
        import faiss

        if dtype not in (torch.float32, torch.float16):
            raise ValueError(f"dtype must be torch.float32 or torch.float16, got {dtype}")
        self.faiss = faiss
        self.dim, self.M, self.ef_construction, self.ef_search, self.pin = dim, M, ef_construction, ef_search, pin
        self.dtype = dtype
        self.rows: list[dict[int, object]] = []
        self.pins: list[dict[int, np.ndarray]] = []
        self.count = 0

    @property
    def ntotal(self) -> int:
        return self.count

    def reset(self) -> None:
        """Forget every key and graph (a new sequence starts)."""
        self.rows, self.pins, self.count = [], [], 0

    def copy(self) -> "HNSWIndex":
        """An independent copy: adding to or searching either leaves the other as it is, and the copy
        then gives what this index would. faiss.clone_index copies each graph with the state of its
        level generator; a serialised round trip would not (later additions would draw other levels).
        TypeError for a subclass (IVFIndex's blocks are not FAISS graphs)."""
        if type(self) is not HNSWIndex:
            raise TypeError(f"{type(self).__name__} has no copy(): HNSWIndex.copy clones FAISS HNSW graphs only")
        out = object.__new__(HNSWIndex)
        out.__dict__.update(self.__dict__)
        out.rows = [{s: self.faiss.clone_index(g) for s, g in row.items()} for row in self.rows]
        out.pins = [{s: p.copy() for s, p in row.items()} for row in self.pins]
        return out

    def _new(self):
        f = self.faiss
        g = (f.IndexHNSWFlat(self.dim, self.M, f.METRIC_INNER_PRODUCT) if self.dtype == torch.float32
             else f.IndexHNSWSQ(self.dim, f.ScalarQuantizer.QT_fp16, self.M, f.METRIC_INNER_PRODUCT))
        g.hnsw.efConstruction = self.ef_construction
        return g

    def add(self, ks: torch.Tensor, starts: torch.Tensor | None = None) -> None:
        """Append search keys (B, G, Tnew, d) at positions ntotal..; `starts` (B, Tnew) gives each key's
        block start (default: one block from position 0). Each (row, group) pair has its own graphs."""
        B, G, Tn, d = ks.shape
        if starts is not None:
            starts = starts.repeat_interleave(G, dim=0)
        self._add_rows(ks.reshape(B * G, Tn, d), starts)

    def search(self, qs: torch.Tensor, allowed: torch.Tensor, K: int):
        """qs (B, G, Tq, d) -> idx, valid (B, G, Tq, K) among admissible stored positions."""
        B, G, Tq, d = qs.shape
        if self._whole(allowed, B * G, K):
            return self._search_whole(qs, K)
        al = allowed.expand(B, *allowed.shape[1:]).repeat_interleave(G, dim=0)
        idx, valid = self._search_rows(qs.reshape(B * G, Tq, d), al, K)  # (B * G, 1, Tq, K)
        return idx.view(B, G, Tq, K), valid.view(B, G, Tq, K)

    def _whole(self, allowed: torch.Tensor, rows: int, K: int) -> bool:
        """A decode step's case: one block per row, more than K keys, every query admits them all."""
        return (len(self.rows) == rows and self.count > K and all(len(r) == 1 and 0 in r for r in self.rows)
                and bool(allowed[..., : self.count].all()))

    def _search_whole(self, qs: torch.Tensor, K: int):
        """`search` when `_whole` holds: one FAISS call per row and one merge of the pinned keys for
        all rows, no per-query ranges (equal to the general path, tested)."""
        B, G, Tq, d = qs.shape
        R = B * G
        xq = qs.detach().float().cpu().numpy().reshape(R, Tq, d)
        found = [self._block_search(self.rows[r][0], np.ascontiguousarray(xq[r]), K, self.count) for r in range(R)]
        sc = np.stack([f[0] for f in found]).reshape(R * Tq, K)
        ids = np.stack([f[1] for f in found]).reshape(R * Tq, K)
        none = np.zeros((0, d), dtype=np.float32)
        pins = np.stack([self.pins[r].get(0, none) for r in range(R)])  # (R, P, d): the same P in every row
        pin_sc = np.einsum("rtd,rpd->rtp", xq, pins).reshape(R * Tq, pins.shape[1])
        idx = torch.from_numpy(self._merge(sc, ids, pin_sc, K)).view(B, G, Tq, K).to(qs.device)
        return idx.clamp(min=0), idx >= 0

    def _add_rows(self, ks: torch.Tensor, starts: torch.Tensor | None) -> None:
        B, Tn, _ = ks.shape
        if not self.rows:
            self.rows, self.pins = [{} for _ in range(B)], [{} for _ in range(B)]
        if starts is None:
            starts = torch.zeros(B, Tn, dtype=torch.long)
        x = ks.detach().float().cpu().numpy()
        st = starts.cpu().long().numpy()
        for b in range(B):
            t = 0
            while t < Tn:
                e = t
                while e < Tn and st[b, e] == st[b, t]:
                    e += 1
                g = self.rows[b].get(int(st[b, t]))
                if g is None:  # a new block: its graph (made only here, not at every add)
                    g = self.rows[b][int(st[b, t])] = self._new()
                expect = self.count + t - int(st[b, t])
                if g.ntotal != expect:
                    raise RuntimeError(f"HNSW block starting at {int(st[b, t])} holds {g.ntotal} keys, expected {expect}")
                g.add(np.ascontiguousarray(x[b, t:e]))
                head = self.pins[b].get(int(st[b, t]), np.zeros((0, self.dim), dtype=np.float32))
                if head.shape[0] < self.pin:
                    self.pins[b][int(st[b, t])] = np.concatenate([head, x[b, t:e][: self.pin - head.shape[0]]])
                t = e
        self.count += Tn

    def _ranges(self, allowed: torch.Tensor, B: int, Tq: int):
        """Each query's admissible stored positions as one range [lo, hi) (its block, up to itself):
        al (B, Tq, N), lo, hi (B, Tq) int64 numpy, any (B, Tq) bool numpy."""
        al = allowed.expand(B, 1, Tq, allowed.shape[-1])[:, 0, :, : self.count].cpu()  # (B, Tq, N)
        N = al.shape[-1]
        a8 = al.to(torch.uint8)
        lo = a8.argmax(-1)
        hi = N - a8.flip(-1).argmax(-1)
        return al, lo.numpy(), hi.numpy(), al.any(-1).numpy()

    def _graph_search(self, b: int, a: int, z: int, xq: np.ndarray, K: int) -> np.ndarray:
        """Block-relative ids (n, K) of queries xq (n, d) that all admit positions [a, z) of row b's
        block starting at a: one FAISS call (no id selector when the range is the whole graph, as in
        a decode step), then the pinned keys merged in."""
        sc, found = self._block_search(self.rows[b][a], np.ascontiguousarray(xq), K, z - a)
        pins = self.pins[b].get(a, np.zeros((0, self.dim), dtype=np.float32))[: z - a]
        return self._merge_pins(xq, sc, found, pins, K)

    def _block_search(self, g, xq: np.ndarray, K: int, n: int):
        """Scores and block-relative ids (n_q, K) of the K best of the block's first n keys (-1: none)."""
        ef = max(self.ef_search, K)
        if n == g.ntotal:
            params = self.faiss.SearchParametersHNSW(efSearch=ef)
        else:
            params = self.faiss.SearchParametersHNSW(sel=self.faiss.IDSelectorRange(0, n), efSearch=ef)
        return g.search(xq, K, params=params)

    def _search_rows(self, qs: torch.Tensor, allowed: torch.Tensor, K: int, batched: bool = True):
        """idx, valid (B, 1, Tq, K) of queries qs (B, Tq, d). The queries of a row that share their
        admissible range are searched in one FAISS call; `batched=False` makes one call per query
        (the reference the batched search is tested against: same ids)."""
        B, Tq, _ = qs.shape
        al, lo, hi, any_ok = self._ranges(allowed, B, Tq)
        idx = np.full((B, Tq, K), -1, dtype=np.int64)
        xq = qs.detach().float().cpu().numpy()
        for b in range(B):
            ts = np.flatnonzero(any_ok[b])
            if not ts.size:
                continue
            small = hi[b, ts] - lo[b, ts] <= K  # the whole range fits: every admissible key, exactly
            for t in ts[small]:
                idx[b, t, : hi[b, t] - lo[b, t]] = np.arange(lo[b, t], hi[b, t])
            ts = ts[~small]
            if batched:
                keys = lo[b, ts] * (self.count + 1) + hi[b, ts]
                _, first, inverse = np.unique(keys, return_index=True, return_inverse=True)
                groups = [ts[inverse.reshape(-1) == i] for i in range(len(first))]
            else:
                groups = [ts[i:i + 1] for i in range(ts.size)]
            for grp in groups:
                a, z = int(lo[b, grp[0]]), int(hi[b, grp[0]])
                idx[b, grp] = self._graph_search(b, a, z, xq[b, grp], K) + a
        idx_t = torch.from_numpy(idx).to(qs.device)[:, None]  # (B, 1, Tq, K)
        valid = idx_t >= 0
        idx_t = idx_t.clamp(min=0)
        valid &= al.to(qs.device)[:, None].gather(-1, idx_t)
        return idx_t, valid

    @staticmethod
    def _merge_pins(q: np.ndarray, scores: np.ndarray, ids: np.ndarray, pins: np.ndarray, K: int) -> np.ndarray:
        """Block-relative ids (n, K) of the top K among the graph's results (scores, ids (n, K), id -1
        for none) and the exactly scored pinned keys (ids 0..P-1, which replace the graph's entries
        for those ids), best first; empty slots get a large negative id, which stays negative after
        the offset. q: the queries (n, d)."""
        return HNSWIndex._merge(scores, ids, q @ pins.T if pins.shape[0] else np.zeros((len(q), 0), np.float32), K)

    @staticmethod
    def _merge(scores: np.ndarray, ids: np.ndarray, pin_scores: np.ndarray, K: int) -> np.ndarray:
        """`_merge_pins` with the pinned keys' scores (n, P) given."""
        n, P = ids.shape[0], pin_scores.shape[1]
        sc = np.where((ids >= 0) & (ids >= P), scores, -np.inf)  # the graph's pinned ids are rescored below
        all_ids = np.concatenate([ids, np.broadcast_to(np.arange(P), (n, P))], 1)
        all_sc = np.concatenate([sc, pin_scores], 1)
        order = np.argsort(-all_sc, axis=1, kind="stable")[:, :K]
        out = np.take_along_axis(all_ids, order, 1)
        out = np.where(np.isfinite(np.take_along_axis(all_sc, order, 1)), out, -(10 ** 12))
        if out.shape[1] < K:
            out = np.concatenate([out, np.full((n, K - out.shape[1]), -(10 ** 12), np.int64)], 1)
        return out

    def grow_and_search(self, qs, ks, allowed, K, chunk: int = 64):
        """Prefill as a decoder would see it: add the new keys chunk by chunk and search each chunk's
        queries right after, so a graph never holds more than chunk - 1 keys a query may not see."""
        B, Tq = qs.shape[0], qs.shape[2]
        starts = block_starts(allowed, B)  # (B, Tq)
        outs = []
        for s in range(0, Tq, chunk):
            self.add(ks[:, :, s:s + chunk], starts[:, s:s + chunk])
            outs.append(self.search(qs[:, :, s:s + chunk], allowed[..., s:s + chunk, :], K))
        return torch.cat([o[0] for o in outs], dim=2), torch.cat([o[1] for o in outs], dim=2)
