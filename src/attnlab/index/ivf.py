"""An inverted-file index for learned search keys: a decode step scores a few lists, not every key.

FAISS's IVF-flat (inner product) partitions the keys of a block into `nlist` lists around centroids
found by k-means; a query scores the centroids, then every key of its `nprobe` best lists, so a step
reads about nprobe / nlist of the keys plus the centroids, where the exact index reads them all and
an HNSW graph at K = 256 visits a large share of them (its beam must be at least K wide). The
centroids are learned from the keys themselves: until a block holds `train_at` keys it is searched
exactly (brute force over what it holds), then k-means runs once on those keys and every later key
is filed under its nearest centroid. With nprobe = nlist every list is scored and the search is
exact, which the tests use; its recall at smaller nprobe depends on how clustered the keys are,
so it is measured on keys of trained models, not on random vectors.

Blocks, id ranges, pinned sink keys and batching are those of `HNSWIndex`; only the per-block
structure differs.
"""

from __future__ import annotations

import numpy as np

from ..checks import check_int
from .retrieval import HNSWIndex


class _IVFBlock:
    """One block's keys: kept raw and searched exactly until `train_at` of them, then an IVF index."""

    def __init__(self, faiss, dim: int, nlist: int, train_at: int):
        self.faiss, self.dim, self.nlist, self.train_at = faiss, dim, nlist, train_at
        self.raw: list[np.ndarray] | None = []
        self.index = self.quantizer = None
        self.ntotal = 0

    def add(self, x: np.ndarray) -> None:
        if self.index is not None:
            self.index.add(x)
        else:
            self.raw.append(np.array(x, dtype=np.float32))
            if self.ntotal + len(x) >= self.train_at:
                self._build(np.concatenate(self.raw))
        self.ntotal += len(x)

    def _build(self, keys: np.ndarray) -> None:
        """k-means on the block's keys so far (spherical: search keys are unit vectors), then file them."""
        f = self.faiss
        self.quantizer = f.IndexFlatIP(self.dim)  # kept here: the IVF index does not own it
        index = f.IndexIVFFlat(self.quantizer, self.dim, self.nlist, f.METRIC_INNER_PRODUCT)
        index.cp.spherical = True
        index.cp.min_points_per_centroid = 1  # train_at is the user's choice; no FAISS warning below 39 per list
        index.train(keys)
        index.add(keys)
        self.index, self.raw = index, None

    def search(self, xq: np.ndarray, K: int, n: int, nprobe: int):
        """Scores and ids (n_q, K) of the best of the first n keys (id -1, score -inf: none)."""
        if self.index is not None:
            sel = None if n == self.ntotal else self.faiss.IDSelectorRange(0, n)
            params = self.faiss.SearchParametersIVF(nprobe=nprobe, sel=sel)
            return self.index.search(xq, K, params=params)
        keys = np.concatenate(self.raw)[:n] if self.raw else np.zeros((0, self.dim), np.float32)
        sc = xq @ keys.T  # (n_q, n)
        k = min(K, n)
        top = np.argpartition(-sc, k - 1, axis=1)[:, :k] if 0 < k < n else np.broadcast_to(np.arange(n), (len(xq), n))
        top_sc = np.take_along_axis(sc, top, 1)
        order = np.argsort(-top_sc, axis=1, kind="stable")
        ids, scores = np.take_along_axis(top, order, 1), np.take_along_axis(top_sc, order, 1)
        pad = K - ids.shape[1]
        return (np.pad(scores, ((0, 0), (0, pad)), constant_values=-np.inf),
                np.pad(ids, ((0, 0), (0, pad)), constant_values=-1))


class IVFIndex(HNSWIndex):
    """FAISS IVF-flat over search keys (inner product), one index per document block and batch row.

    Args:
        dim: search-vector width.
        nlist: lists (k-means centroids) per block.
        nprobe: lists a query scores (nprobe = nlist: exact search).
        train_at: keys a block holds when its centroids are learned (default 16 * nlist); until
            then it is searched exactly.
        pin: the first keys of every block, scored exactly beside the lists (attention sinks).
    """

    def __init__(self, dim: int, nlist: int = 256, nprobe: int = 16, train_at: int | None = None, pin: int = 4):
        train_at = self.check_args(nlist, nprobe, train_at)
        super().__init__(dim, pin=pin)
        self.nlist, self.nprobe, self.train_at = nlist, nprobe, train_at

    @staticmethod
    def check_args(nlist: int, nprobe: int, train_at: int | None, prefix: str = "") -> int:
        """ValueError naming the argument that cannot work, as a caller spells it (`prefix`: "ivf_" for
        a selector's options, `attnlab.index.options`); returns train_at (its default filled in)."""
        n, p, t = f"{prefix}nlist", f"{prefix}nprobe", f"{prefix}train_at"
        check_int(n, nlist)
        check_int(p, nprobe)
        if nprobe > nlist:
            raise ValueError(f"{p} ({nprobe}) must be at most {n} ({nlist})")
        train_at = 16 * nlist if train_at is None else train_at
        check_int(t, train_at)
        if train_at < nlist:
            raise ValueError(f"{t} ({train_at}) must be at least {n} ({nlist}): k-means needs a key per centroid")
        return train_at

    def _new(self):
        return _IVFBlock(self.faiss, self.dim, self.nlist, self.train_at)

    def _block_search(self, g, xq: np.ndarray, K: int, n: int):
        return g.search(xq, K, n, self.nprobe)

    @property
    def trained(self) -> bool:
        """Whether every block holds an IVF index (False while any is still searched exactly)."""
        return bool(self.rows) and all(g.index is not None for row in self.rows for g in row.values())
