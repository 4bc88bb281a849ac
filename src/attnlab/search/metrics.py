"""Retrieval quality against the teacher and language-model quality against full attention.

Recall@K = |S_t ∩ TopK(A^T_t)| / K and Mass@K = sum_{j in S_t} A^T_tj, averaged over the queries
that have more than K admissible keys (for the others any method keeps every key and scores 1).

Perplexity on packed contexts (`attnlab.data.packing.Packed`), the one rule of search and retrofit
evaluations: exp of the mean next-token NLL over the predictions whose input token and target lie
in the same document. The prediction of a document's first token from the previous document's EOS
is not scored (the documents are shuffled: nothing before it says what comes next); the EOS that
ends a document is scored. How far attention may look back (across documents, or block-causally
inside its own) is the forward's choice, not the score's.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from attnlab.models.lm import token_loss

from .sparse import candidate_mask

PERPLEXITY_RULE = "within documents"  # recorded beside retrofit results: the rule their perplexities follow


def retrieval_stats(idx, valid, teacher, allowed, K: int) -> dict[str, float]:
    """Sums over the non-trivial queries (more than K admissible keys), for averaging across batches.

    idx, valid (B, G, Tq, K): G candidate sets per query; teacher (B, Tq, Tk) for G = 1 or
    (B, G, Tq, Tk): each set is scored against its own group's teacher (the mean attention of the
    heads it serves), and 'n' counts (query, set) pairs. The group teacher being a mean, Mass@K
    averaged over sets equals each head's own attention mass kept by its set, averaged over heads,
    so Mass@K compares across groupings. Returns {'n', 'recall', 'mass', 'slots', 'filler'}."""
    if teacher.dim() == 3:
        teacher = teacher[:, None]
    B, G, Tq, Tk = teacher.shape
    if idx.shape[1] not in (1, G):
        raise ValueError(f"idx has {idx.shape[1]} candidate sets per query, the teacher {G}")
    idx, valid = idx.expand(B, G, *idx.shape[2:]), valid.expand(B, G, *valid.shape[2:])
    allowed = allowed.expand(B, 1, Tq, Tk)
    sel = candidate_mask(idx, valid, Tk) & allowed  # (B, G, Tq, Tk)
    hard = (allowed.sum(-1) > K).expand(B, G, Tq)
    kk = min(K, Tk)
    top = teacher.masked_fill(~allowed, -1.0).topk(kk, dim=-1).indices
    top_mask = torch.zeros_like(sel).scatter_(-1, top, True) & allowed
    recall = (sel & top_mask).sum(-1).float() / K
    mass = (teacher * sel).sum(-1)
    return {
        "n": float(hard.sum()),
        "recall": float(recall[hard].sum()),
        "mass": float(mass[hard].sum()),
        "slots": float(valid.numel()),
        "filler": float((~valid).sum()),
    }


def recall_at_k(idx, valid, teacher, allowed, K: int) -> float:
    """Mean Recall@K over queries with more than K admissible keys (nan if there are none)."""
    s = retrieval_stats(idx, valid, teacher, allowed, K)
    return s["recall"] / s["n"] if s["n"] else float("nan")


def mass_at_k(idx, valid, teacher, allowed, K: int) -> float:
    """Mean teacher mass captured by the candidates, over queries with more than K admissible keys."""
    s = retrieval_stats(idx, valid, teacher, allowed, K)
    return s["mass"] / s["n"] if s["n"] else float("nan")


@dataclass
class Tally:
    """Running sums of retrieval statistics (per layer) and token negative log-likelihoods."""

    retrieval: dict = field(default_factory=dict)
    nll: float = 0.0
    tokens: int = 0

    def add_retrieval(self, layer: int, stats: dict) -> None:
        cur = self.retrieval.setdefault(layer, {k: 0.0 for k in stats})
        for k, v in stats.items():
            cur[k] += v

    def add_nll(self, logits: torch.Tensor, input_ids: torch.Tensor, segments: torch.Tensor) -> None:
        """Next-token NLL inside each document (the prediction across a document boundary is skipped)."""
        nll, n = token_nll(logits, input_ids, segments)
        self.nll += nll
        self.tokens += n

    def summary(self) -> dict:
        out = {"ppl": math.exp(self.nll / self.tokens) if self.tokens else float("nan"), "tokens": self.tokens}
        if self.retrieval:
            tot = {k: sum(d[k] for d in self.retrieval.values()) for k in ("n", "recall", "mass", "slots", "filler")}
            out["recall"] = tot["recall"] / tot["n"] if tot["n"] else float("nan")
            out["mass"] = tot["mass"] / tot["n"] if tot["n"] else float("nan")
            out["filler_rate"] = tot["filler"] / tot["slots"] if tot["slots"] else float("nan")
            out["per_layer"] = {
                str(i): {"recall": d["recall"] / d["n"] if d["n"] else float("nan"),
                         "mass": d["mass"] / d["n"] if d["n"] else float("nan")}
                for i, d in sorted(self.retrieval.items())
            }
        return out


def token_nll(logits: torch.Tensor, input_ids: torch.Tensor, segments: torch.Tensor) -> tuple[float, int]:
    """(sum of NLL, count) of predicting token t+1 from t where both lie in the same document
    (logits (B, T, V), input_ids and segments (B, T), which go to the logits' device)."""
    input_ids, segments = input_ids.to(logits.device), segments.to(logits.device)
    same = segments[:, 1:] == segments[:, :-1]
    lp = token_loss(logits[:, :-1], input_ids[:, 1:], reduction="none")
    lp = lp.view_as(same)
    return float(lp[same].sum()), int(same.sum())


@torch.no_grad()
def perplexity(logits_of, contexts, rows: int = 1) -> float:
    """Perplexity of packed `contexts` (a `Packed`: input_ids, segments) under this module's rule:
    exp(sum of in-document next-token NLL / their count). logits_of(batch) returns the (B, T, V)
    logits of a Packed of `rows` contexts."""
    tally = Tally()
    for i in range(0, len(contexts), rows):
        b = contexts.batch(i, rows)
        tally.add_nll(logits_of(b), b.input_ids, b.segments)
    return tally.summary()["ppl"]


def rel_gap(ppl: float, ppl_full: float) -> float:
    """Relative perplexity gap (ppl - ppl_full) / ppl_full."""
    return (ppl - ppl_full) / ppl_full
