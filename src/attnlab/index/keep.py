"""Keep masks of full-sequence key selection: which keys each query of one op call reads when a
selector picks them (`eval.selectors`), and the learned rule that decoding through an exact-index
`DecodeSelector` reproduces in one pass (`cache.selected.selected_prefill`).

A keep function is keep_fn(a, b, logits) -> (b - a, b) bool (broadcast over batch and heads) for the
op's query rows a..b-1 against its keys 0..b-1, the first n_prefix of them a sink every query reads."""

from __future__ import annotations

import torch


def candidate_keys(a: int, b: int, n_prefix: int, device=None) -> torch.Tensor:
    """(b - a, b) bool: the keys query rows a..b-1 may select, the causal keys past the prefix."""
    pos_q = torch.arange(a, b, device=device)[:, None]
    pos_k = torch.arange(b, device=device)[None, :]
    return (pos_k <= pos_q) & (pos_k >= n_prefix)


def top_keys(scores: torch.Tensor, candidate: torch.Tensor, K: int) -> torch.Tensor:
    """Bool mask of the K candidates with the highest scores per row (all when fewer): scores
    (..., Tq, Tk), candidate broadcastable to them."""
    candidate = candidate.expand(scores.shape)
    keep = torch.zeros(scores.shape, dtype=torch.bool, device=scores.device)
    n = min(K, scores.shape[-1])
    if n:
        best = scores.masked_fill(~candidate, float("-inf")).topk(n, dim=-1).indices
        keep.scatter_(-1, best, True)
    return keep & candidate


def with_prefix(keep: torch.Tensor, n_prefix: int) -> torch.Tensor:
    """keep with the first n_prefix keys (the sink) read by every query."""
    if n_prefix:
        keep[..., :n_prefix] = True
    return keep


def learned_keep(sq: torch.Tensor, sk: torch.Tensor, K: int, n_prefix: int):
    """The learned rule's keep_fn: search queries and keys sq, sk (B, H, T_op, d), zero at the prefix
    positions; each query reads the K causal keys its search query scores highest, and the prefix."""
    def learned(a, b, logits):
        scores = sq[:, :, a:b] @ sk[:, :, :b].transpose(-1, -2)  # (B, H, Tq, b)
        return with_prefix(top_keys(scores, candidate_keys(a, b, n_prefix, scores.device), K), n_prefix)

    return learned
