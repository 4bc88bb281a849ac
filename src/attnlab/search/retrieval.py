"""Candidate selection at a budget of K keys per query: learned (exact, FAISS HNSW or FAISS IVF), native
(the model's own post-RoPE q and k, exact or FAISS HNSW), Quest, oracle top-K, StreamingLLM
sinks + window, and the scalar selection read from a sorted array (`sorted`, in `sorted.py`).

Every selector returns idx (B, G, Tq, K) int64 and valid (B, G, Tq, K) bool: G candidate sets per
query token, set g serving the H / G consecutive query heads g*H/G.. (G = 1: one set shared by all
heads); filler slots (fewer than K admissible keys) have valid False.
`allowed` is the (B or 1, 1, Tq, Tk) may-attend mask (causal or block-causal).
"""

from __future__ import annotations


import torch

from attnlab.checks import check_groups

from ..index.retrieval import ExactIndex, HNSWIndex, block_starts, topk_candidates  # noqa: F401 (re-exported)
from .capture import teacher_attention

# The methods that read dot-product projections or none (what `search eval` runs by default), and every
# selector: these and `sorted`, which reads a one-dimensional distance space (`sorted.py`).
METHODS = ("learned", "learned-hnsw", "learned-ivf", "native", "native-hnsw", "quest", "oracle", "streaming")
SELECTORS = (*METHODS, "sorted")
PROJECTED = ("learned", "learned-hnsw", "learned-ivf", "sorted")  # the methods that read trained projections


def check_group_spec(groups, allow_none: bool = False):
    """A groups setting before the model is known: a positive int or 'kv' (None where allowed)."""
    ok = groups == "kv" or (isinstance(groups, int) and not isinstance(groups, bool) and groups > 0)
    if not (ok or (allow_none and groups is None)):
        raise ValueError(f"groups must be a positive int or 'kv' (one candidate set per KV head), got {groups!r}")
    return groups


def resolve_groups(groups, dims) -> int:
    """'kv' -> the model's KV-head count; an int must divide the query heads."""
    return check_groups(dims.n_heads, dims.n_kv_heads if groups == "kv" else groups, "groups")


def oracle_select(q, k, allowed, scaling: float, K: int, groups: int = 1):
    """Top-K keys of the teacher distribution softmax(q.k * s) (the model's own q.k), averaged over
    the heads of each of the `groups` candidate groups."""
    return topk_candidates(teacher_attention(q, k, allowed, scaling, groups=groups), allowed, K)


def native_vectors(q: torch.Tensor, k: torch.Tensor, groups: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    """Search vectors made of the model's own post-RoPE queries and keys, one space per candidate set.

    q (B, H, Tq, D), k (B, Hkv, Tk, D) -> qn (B, G, Tq, m * D), kn (B, G, Tk, m * D) with
    qn[g, t] . kn[g, s] = the mean over the set's heads h of q_h[t] . k_kv(h)[s]: the set's mean
    logit (up to the positive scaling), so maximum inner product search over (qn, kn) ranks keys as
    the heads' average score does. The m key blocks are the KV heads the set reads, the query block
    of KV head j the sum of the set's queries that read it, divided by the heads per set. When the
    sets read different numbers of KV heads, every set gets all Hkv blocks (zeros where unread)."""
    B, H, Tq, D = q.shape
    Hkv = k.shape[1]
    G = check_groups(H, groups, "groups")
    n, r = H // G, H // Hkv  # heads per set, query heads per KV head
    reads = [sorted({h // r for h in range(g * n, (g + 1) * n)}) for g in range(G)]
    if len({len(j) for j in reads}) > 1:
        reads = [list(range(Hkv))] * G
    qn = q.new_zeros(B, G, Tq, len(reads[0]), D)
    for g, kv in enumerate(reads):
        for h in range(g * n, (g + 1) * n):
            qn[:, g, :, kv.index(h // r)] += q[:, h]
    kv = torch.tensor(reads, device=k.device)  # (G, m)
    kn = k[:, kv]  # (B, G, m, Tk, D)
    return (qn / n).flatten(-2), kn.transpose(2, 3).flatten(-2)


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


