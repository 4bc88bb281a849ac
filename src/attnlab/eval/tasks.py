"""Accuracy on the synthetic recall tasks (MQAR, passkey) for any `logits = model(x)` callable.

A position counts as answered when the argmax of its logits equals its label (labels
-100 are not asked). Teacher-forced argmax over all answer tokens of an example equals
greedy decoding of the answer, so an example's exact match is what generation would score.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from .. import interrupt
from ..data.synthetic import IGNORE, mqar, passkey
from ..checks import check_int, check_tensor
from .metrics import EVAL_STOPPED

Model = Callable[[torch.Tensor], torch.Tensor]
MQAR_ATTENTION = ("region_mass", "value_share", "value_reach")  # per layer: mqar_attention_summary
MQAR_TEST_SEED = 12345  # the MQAR test sequences: a seed that no training or validation stream uses


def label_hits(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(hits, asked): (B, T) bool, argmax == label at asked positions, and where labels != -100."""
    check_tensor("logits", logits, 3)
    check_tensor("labels", labels, 2)
    if logits.shape[:2] != labels.shape:
        raise ValueError(f"logits (B, T, V) and labels (B, T) must agree in (B, T): got {tuple(logits.shape)} and {tuple(labels.shape)}")
    asked = labels != IGNORE
    return (logits.argmax(-1) == labels) & asked, asked


@torch.no_grad()
def recall_accuracy(
    model: Model,
    inputs: torch.Tensor,
    labels: torch.Tensor,
    *,
    batch_size: int = 64,
    device: torch.device | str | None = None,
) -> dict[str, float]:
    """{"token_acc": share of asked positions answered, "seq_acc": share of examples with
    every asked position answered, "asked": number of asked positions}."""
    check_tensor("inputs", inputs, 2)
    check_tensor("labels", labels, 2)
    if inputs.shape != labels.shape:
        raise ValueError(f"inputs and labels must have the same shape, got {tuple(inputs.shape)} and {tuple(labels.shape)}")
    check_int("batch_size", batch_size)
    hit_tokens = asked_tokens = hit_seqs = 0
    for i in range(0, inputs.shape[0], batch_size):
        interrupt.check(EVAL_STOPPED)
        x, y = inputs[i : i + batch_size], labels[i : i + batch_size]
        if device is not None:
            x, y = x.to(device), y.to(device)
        hits, asked = label_hits(model(x), y)
        hit_tokens += int(hits.sum())
        asked_tokens += int(asked.sum())
        hit_seqs += int((hits == asked).all(dim=1).sum())
    if asked_tokens == 0:
        raise ValueError("labels ask nothing: every entry is -100")
    return {"token_acc": hit_tokens / asked_tokens, "seq_acc": hit_seqs / inputs.shape[0], "asked": asked_tokens}


def mqar_accuracy(
    model: Model,
    *,
    vocab_size: int,
    seq_len: int,
    num_kv_pairs: int,
    num_examples: int = 256,
    seed: int = MQAR_TEST_SEED,
    power_a: float = 0.01,
    num_queries: int | None = None,
    min_gap: int = 0,
    random_non_queries: bool = True,
    batch_size: int = 64,
    device: torch.device | str | None = None,
) -> float:
    """MQAR accuracy (share of queries whose value is predicted, as Zoology reports it) on
    `num_examples` fresh examples; the default seed differs from the training default 0.

    model: any callable x (B, T) int64 -> logits (B, T, V); vocab_size, seq_len, num_kv_pairs,
    power_a, num_queries, min_gap, random_non_queries: the task as `attnlab.data.synthetic.mqar`
    generates it (num_queries None: every pair is asked; min_gap: every query that far after every
    pair token; random_non_queries False: token 0 between them). Returns a float in [0, 1]."""
    inputs, labels = mqar(
        vocab_size, seq_len, num_kv_pairs, num_examples, seed=seed, power_a=power_a, num_queries=num_queries,
        min_gap=min_gap, random_non_queries=random_non_queries,
    )
    return recall_accuracy(model, inputs, labels, batch_size=batch_size, device=device)["token_acc"]


def mqar_pair_attention(weights: Sequence[torch.Tensor], inputs: torch.Tensor, labels: torch.Tensor,
                        num_kv_pairs: int, reach: float = 0.01) -> list[dict[str, torch.Tensor]]:
    """Where each layer's attention goes at the MQAR query positions, per query.

    At every asked position (labels != -100) the query token is one of the pairs' keys and the
    label its value. Per layer and query, with the heads' weights averaged: "region" on all
    2 * num_kv_pairs pair tokens, "values" on the num_kv_pairs value tokens, "value" on the
    queried value token (the answer); and "reach", 1 where some head gives the queried value at
    least `reach` of its weight (a window that does not select the value gives it none).
    `mqar_attention_summary` turns these into the reported means.

    Args:
        weights: per layer, its mixing weights (B, H, T, T + n_prefix), prefix columns (a sink)
            first, as `attention_weights` returns them.
        inputs: (B, T) as `attnlab.data.synthetic.mqar` makes them: the pairs open each sequence
            (key, value, key, value, ...), their keys distinct.
        labels: (B, T), the values at the asked positions, -100 elsewhere.
        num_kv_pairs: the pairs per sequence.
        reach: the weight on the queried value that counts as reaching it, in (0, 1].

    Returns:
        Per layer {"region", "values", "value", "reach"}: (Q,) float32 on the weights' device, one
        entry per asked position in row-major order.

    Raises:
        ValueError: shapes that disagree, no asked position, or a query token that is none of its
            sequence's keys.
    """
    check_tensor("inputs", inputs, 2)
    check_tensor("labels", labels, 2)
    if inputs.shape != labels.shape:
        raise ValueError(f"inputs and labels must have the same shape, got {tuple(inputs.shape)} and {tuple(labels.shape)}")
    B, T = inputs.shape
    P = check_int("num_kv_pairs", num_kv_pairs)
    if isinstance(reach, bool) or not isinstance(reach, (int, float)) or not 0 < reach <= 1:
        raise ValueError(f"reach must be a number in (0, 1], got {reach!r}")
    if 2 * P > T:
        raise ValueError(f"num_kv_pairs={P} needs {2 * P} pair tokens, more than the {T} positions of inputs")
    rows, cols = (labels != IGNORE).nonzero(as_tuple=True)
    if rows.numel() == 0:
        raise ValueError("labels ask nothing: every entry is -100")
    match = inputs[rows, : 2 * P : 2] == inputs[rows, cols].unsqueeze(1)  # (Q, P)
    if not bool(match.any(1).all()):
        raise ValueError("a query token is none of its sequence's pair keys: inputs and labels are not MQAR's")
    value_at = 2 * match.float().argmax(1) + 1  # (Q,) the queried value's position
    out = []
    for i, w in enumerate(weights):
        check_tensor(f"weights[{i}]", w, 4)
        if w.shape[0] != B or w.shape[2] != T or w.shape[3] < T:
            raise ValueError(f"weights[{i}] must be (B={B}, H, T={T}, T + n_prefix), got {tuple(w.shape)}")
        wq = w[rows.to(w.device), :, cols.to(w.device), w.shape[3] - T :].float()  # (Q, H, T)
        at = value_at.to(w.device).view(-1, 1, 1).expand(-1, wq.shape[1], 1)
        value = wq.gather(2, at).squeeze(2)  # (Q, H)
        out.append({"region": wq[:, :, : 2 * P].sum(2).mean(1), "values": wq[:, :, 1 : 2 * P : 2].sum(2).mean(1),
                    "value": value.mean(1), "reach": (value.amax(1) >= reach).float()})
    return out


def mqar_attention_summary(parts: Sequence[dict[str, torch.Tensor]]) -> dict[str, float]:
    """One layer's `mqar_pair_attention` entries (over batches) as the reported means:
    "region_mass", the heads' mean weight on the pair tokens; "value_share", their weight on the
    queried value over their weight on all values (1 / num_kv_pairs for a head blind to which pair
    is asked; 1 for one that reads the answer alone; None when no weight reaches a value); and
    "value_reach", the share of queries whose value some head reads (`reach`)."""
    if not parts:
        raise ValueError("parts is empty: give the entries of at least one batch")
    cat = {name: torch.cat([p[name] for p in parts]) for name in ("region", "values", "value", "reach")}
    values = float(cat["values"].sum())
    return {"region_mass": float(cat["region"].mean()), "value_share": float(cat["value"].sum()) / values if values > 0 else None,
            "value_reach": float(cat["reach"].mean())}


def passkey_accuracy(
    model: Model,
    tokenizer,
    *,
    lengths: Sequence[int],
    depths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0),
    num_examples: int = 8,
    seed: int = 12345,
    digits: int = 5,
    filler: str | None = None,
    batch_size: int = 8,
    device: torch.device | str | None = None,
) -> dict[tuple[int, float], float]:
    """Share of examples whose whole passkey is retrieved, per (length, depth).

    model: any callable x (B, T) int64 -> logits (B, T, V); tokenizer: the run's tokenizer; lengths:
    prompt lengths in tokens; depths: where the passkey sits, 0 (start) .. 1 (end); digits: the
    passkey's length; filler: the haystack sentence (default `attnlab.data.synthetic`'s). Teacher
    forced: an example counts when the argmax at every answer token is right. Returns
    {(length, depth): share}; ValueError when lengths or depths is empty."""
    if not lengths or not depths:
        raise ValueError(f"lengths and depths must be non-empty, got {list(lengths)} and {list(depths)}")
    out = {}
    for L in lengths:
        for d in depths:
            inputs, labels = passkey(tokenizer, L, d, num_examples, seed=seed, digits=digits, filler=filler)
            acc = recall_accuracy(model, inputs, labels, batch_size=batch_size, device=device)
            out[(int(L), float(d))] = acc["seq_acc"]
    return out
