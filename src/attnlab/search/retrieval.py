"""Candidate selection at a budget of K keys per query: learned (exact or FAISS HNSW), Quest,
oracle top-K and StreamingLLM sinks + window.

Every selector returns idx (B, 1, Tq, K) int64 and valid (B, 1, Tq, K) bool: one candidate set per
query token shared by all heads; filler slots (fewer than K admissible keys) have valid False.
`allowed` is the (B or 1, 1, Tq, Tk) may-attend mask (causal or block-causal).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .capture import teacher_attention

METHODS = ("learned", "learned-hnsw", "quest", "oracle", "streaming")


def check_k(K) -> int:
    if isinstance(K, bool) or not isinstance(K, int) or K <= 0:
        raise ValueError(f"K must be a positive int (keys retrieved per query), got {K!r}")
    return K


def topk_candidates(scores: torch.Tensor, allowed: torch.Tensor, K: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The K best admissible keys by score; scores (B, G, Tq, Tk) -> idx, valid (B, G, Tq, K)."""
    allowed = allowed.expand_as(scores)
    s = scores.float().masked_fill(~allowed, float("-inf"))
    kk = min(K, s.shape[-1])
    val, idx = s.topk(kk, dim=-1)
    valid = allowed.gather(-1, idx)
    if kk < K:  # fewer keys than K: filler slots
        pad = K - kk
        idx = torch.cat([idx, idx.new_zeros(*idx.shape[:-1], pad)], dim=-1)
        valid = torch.cat([valid, valid.new_zeros(*valid.shape[:-1], pad)], dim=-1)
    return idx, valid


def oracle_select(q, k, allowed, scaling: float, K: int):
    """Top-K keys of the head-averaged teacher distribution softmax(q.k * s) (the model's own q.k)."""
    return topk_candidates(teacher_attention(q, k, allowed, scaling)[:, None], allowed, K)


def streaming_select(allowed: torch.Tensor, K: int, n_sink: int = 4, batch: int | None = None):
    """StreamingLLM: the first n_sink admissible keys (attention sinks) plus the most recent ones."""
    if batch is not None:
        allowed = allowed.expand(batch, *allowed.shape[1:])
    Tk = allowed.shape[-1]
    pos = torch.arange(Tk, device=allowed.device, dtype=torch.float32)
    first = allowed.float().argmax(-1, keepdim=True).float()  # (B, 1, Tq, 1) start of the block
    sink = (pos - first) < n_sink
    score = torch.where(sink, pos + 2.0 * Tk, pos)  # sinks first, then by recency
    return topk_candidates(score.expand(allowed.shape), allowed, K)


def quest_bounds(q: torch.Tensor, k: torch.Tensor, page: int = 16) -> torch.Tensor:
    """Quest's per-page upper bound on q.k: sum_c max(q_c * min_c, q_c * max_c) over each page's
    per-channel key min/max. q (B, H, Tq, D), k (B, Hkv, Tk, D) -> (B, H, Tq, n_pages)."""
    B, Hkv, Tk, D = k.shape
    H = q.shape[1]
    n_pages = math.ceil(Tk / page)
    pad = n_pages * page - Tk
    kf = k.float()
    kmax = torch.nn.functional.pad(kf, (0, 0, 0, pad), value=float("-inf")).view(B, Hkv, n_pages, page, D).amax(3)
    kmin = torch.nn.functional.pad(kf, (0, 0, 0, pad), value=float("inf")).view(B, Hkv, n_pages, page, D).amin(3)
    kmax = kmax.repeat_interleave(H // Hkv, dim=1)  # (B, H, P, D)
    kmin = kmin.repeat_interleave(H // Hkv, dim=1)
    qf = q.float()
    return qf.clamp(min=0) @ kmax.transpose(-1, -2) + qf.clamp(max=0) @ kmin.transpose(-1, -2)


def quest_select(q, k, allowed, scaling: float, K: int, page: int = 16):
    """Quest-style page selection at budget K: rank pages by the softmax of their bounds (averaged
    over heads, so one set serves all heads), take the best ceil(K / page) pages, keep their
    admissible keys in page-rank order, truncated to K."""
    B, H, Tq, _ = q.shape
    Tk = k.shape[2]
    n_pages = math.ceil(Tk / page)
    al = allowed.expand(B, 1, Tq, Tk)
    al_p = torch.nn.functional.pad(al, (0, n_pages * page - Tk)).view(B, 1, Tq, n_pages, page)
    page_ok = al_p.any(-1)  # (B, 1, Tq, P)
    bound = (quest_bounds(q, k, page) * scaling).masked_fill(~page_ok, float("-inf"))
    score = torch.softmax(bound, dim=-1).nan_to_num(0.0).mean(1, keepdim=True)  # (B, 1, Tq, P)
    score = score.masked_fill(~page_ok, -1.0)
    n_sel = min(math.ceil(K / page), n_pages)
    top = score.topk(n_sel, dim=-1).indices  # (B, 1, Tq, n_sel)
    tok = (top[..., None] * page + torch.arange(page, device=q.device)).flatten(-2)  # (B, 1, Tq, n_sel*page)
    ok = al_p.gather(3, top[..., None].expand(-1, -1, -1, -1, page)).flatten(-2)
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


class ExactIndex:
    """Exact maximum-inner-product search over a growing set of search keys (B, N, d)."""

    def __init__(self):
        self.keys: torch.Tensor | None = None

    @property
    def ntotal(self) -> int:
        return 0 if self.keys is None else self.keys.shape[1]

    def reset(self) -> None:
        self.keys = None

    def add(self, ks: torch.Tensor) -> None:
        """Append search keys (B, Tnew, d) as new positions."""
        self.keys = ks.detach() if self.keys is None else torch.cat([self.keys, ks.detach()], dim=1)

    def search(self, qs: torch.Tensor, allowed: torch.Tensor, K: int):
        """qs (B, Tq, d) -> idx, valid (B, 1, Tq, K) among admissible positions."""
        scores = (qs.float() @ self.keys.float().transpose(1, 2))[:, None]  # (B, 1, Tq, N)
        return topk_candidates(scores, allowed, K)


class HNSWIndex:
    """FAISS HNSW (inner product on L2-normalised vectors), one graph per batch row, ids = positions.

    A query searches only its admissible range [lo, hi) through an id-range selector; when that
    range holds at most K keys they are all returned exactly, with no graph search.
    """

    def __init__(self, dim: int, M: int = 32, ef_construction: int = 64, ef_search: int = 128):
        import faiss

        self.faiss = faiss
        self.dim, self.M, self.ef_construction, self.ef_search = dim, M, ef_construction, ef_search
        self.graphs: list = []

    @property
    def ntotal(self) -> int:
        return self.graphs[0].ntotal if self.graphs else 0

    def reset(self) -> None:
        self.graphs = []

    def _new(self):
        g = self.faiss.IndexHNSWFlat(self.dim, self.M, self.faiss.METRIC_INNER_PRODUCT)
        g.hnsw.efConstruction = self.ef_construction
        return g

    def add(self, ks: torch.Tensor) -> None:
        if not self.graphs:
            self.graphs = [self._new() for _ in range(ks.shape[0])]
        for g, x in zip(self.graphs, ks.detach().float().cpu().numpy()):
            g.add(np.ascontiguousarray(x))

    def search(self, qs: torch.Tensor, allowed: torch.Tensor, K: int):
        B, Tq, _ = qs.shape
        al = allowed.expand(B, 1, Tq, allowed.shape[-1])[:, 0].cpu()  # (B, Tq, Tk)
        any_ok = al.any(-1)
        lo = al.float().argmax(-1)
        hi = al.shape[-1] - al.flip(-1).float().argmax(-1)
        idx = np.full((B, Tq, K), -1, dtype=np.int64)
        xq = qs.detach().float().cpu().numpy()
        for b in range(B):
            for t in range(Tq):
                if not any_ok[b, t]:
                    continue
                a, z = int(lo[b, t]), int(hi[b, t])
                if z - a <= K:
                    idx[b, t, : z - a] = np.arange(a, z)
                    continue
                params = self.faiss.SearchParametersHNSW(
                    sel=self.faiss.IDSelectorRange(a, z), efSearch=max(self.ef_search, K))
                _, found = self.graphs[b].search(xq[b, t:t + 1], K, params=params)
                idx[b, t] = found[0]
        idx_t = torch.from_numpy(idx).to(qs.device)[:, None]  # (B, 1, Tq, K)
        valid = idx_t >= 0
        idx_t = idx_t.clamp(min=0)
        valid &= al.to(qs.device)[:, None].gather(-1, idx_t)
        return idx_t, valid
