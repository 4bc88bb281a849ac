"""Keep masks of full-sequence key selection: which keys each query of one op call reads when a
selector picks them (`eval.selectors`), and the learned rule that decoding through an exact-index
`DecodeSelector` reproduces in one pass (`cache.selected.learned_select`).

A keep function is keep_fn(a, b, logits) -> (b - a, b) bool (broadcast over batch and heads) for the
op's query rows a..b-1 against its keys 0..b-1, the first n_prefix of them a sink every query reads.
An `IndexedKeep` is a keep function that also gives the same keys as indices, which
`windowed_attention` reads through its O(T x m) selected-keys path instead of masking T x T scores."""

from __future__ import annotations

from typing import Callable

import torch

from ..ops.scalar.window import prefix_columns


def candidate_keys(a: int, b: int, n_prefix: int, device=None) -> torch.Tensor:
    """(b - a, b) bool: the keys query rows a..b-1 may select, the causal keys past the prefix."""
    pos_q = torch.arange(a, b, device=device)[:, None]
    pos_k = torch.arange(b, device=device)[None, :]
    return (pos_k <= pos_q) & (pos_k >= n_prefix)


def top_keys(scores: torch.Tensor, candidate: torch.Tensor, K: int) -> torch.Tensor:
    """Bool mask of the K candidates with the highest scores per row (all when fewer): scores
    (..., Tq, Tk), candidate broadcastable to them."""
    keep = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    n = min(K, scores.shape[-1])
    if n:  # ~candidate at its own (broadcast) shape, not at the scores'
        best = scores.masked_fill(~candidate, float("-inf")).topk(n, dim=-1).indices
        keep.scatter_(-1, best, True)
    return keep & candidate


def with_prefix(keep: torch.Tensor, n_prefix: int) -> torch.Tensor:
    """keep with the first n_prefix keys (the sink) read by every query."""
    if n_prefix:
        keep[..., :n_prefix] = True
    return keep


class IndexedKeep:
    """A keep function (`keep(a, b, logits)`, the mask of query rows a..b-1, the reference) that also
    holds the same keys as indices: `indices()` -> idx (B, H, T, m) int64 and ok (B, H, T, m) bool,
    laid out as `attnlab.ops.scalar.window.window_indices` lays out the window's (the prefix columns
    first, then the selected keys; ok False on unused columns)."""

    def __init__(self, keep: Callable[[int, int, torch.Tensor], torch.Tensor],
                 indices: Callable[[], tuple[torch.Tensor, torch.Tensor]]):
        self.keep, self._indices = keep, indices

    @torch.no_grad()  # keys are chosen, not differentiated
    def __call__(self, a: int, b: int, logits: torch.Tensor) -> torch.Tensor:
        return self.keep(a, b, logits)

    @torch.no_grad()
    def indices(self) -> tuple[torch.Tensor, torch.Tensor]:
        return self._indices()


def learned_indices(sq: torch.Tensor, sk: torch.Tensor, K: int, n_prefix: int, query_chunk: int = 512):
    """The keys of `learned_keep` as indices (see `IndexedKeep`): per query the prefix, then the K
    causal keys its search query scores highest. Scored in chunks of `query_chunk` query rows
    exactly as `learned_keep` scores the chunks of `windowed_attention` (the same products, the same
    top-k call), so both select the same keys, ties included."""
    B, H, T, _ = sq.shape
    m = n_prefix + min(K, T)
    idx, ok = prefix_columns(B, H, T, m, n_prefix, sq.device)
    for a in range(0, T, query_chunk):
        b = min(T, a + query_chunk)
        scores = sq[:, :, a:b] @ sk[:, :, :b].transpose(-1, -2)  # (B, H, Tq, b)
        candidate = candidate_keys(a, b, n_prefix, scores.device)  # (Tq, b)
        n = min(K, b)
        if n:  # masked in place: the products are this chunk's own (a copy of them cost 20 % at 8K)
            best = scores.masked_fill_(~candidate, float("-inf")).topk(n, dim=-1).indices
            idx[:, :, a:b, n_prefix:n_prefix + n] = best
            ok[:, :, a:b, n_prefix:n_prefix + n] = candidate.expand(scores.shape).gather(-1, best)
    return idx, ok


def learned_keep(sq: torch.Tensor, sk: torch.Tensor, K: int, n_prefix: int):
    """The learned rule's keep_fn: search queries and keys sq, sk (B, H, T_op, d), zero at the prefix
    positions; each query reads the K causal keys its search query scores highest, and the prefix."""
    def learned(a, b, logits):
        scores = sq[:, :, a:b] @ sk[:, :, :b].transpose(-1, -2)  # (B, H, Tq, b)
        return with_prefix(top_keys(scores, candidate_keys(a, b, n_prefix, scores.device), K), n_prefix)

    return learned
