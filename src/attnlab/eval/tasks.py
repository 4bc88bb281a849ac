"""Accuracy on the synthetic recall tasks (MQAR, passkey) for any `logits = model(x)` callable.

A position counts as answered when the argmax of its logits equals its label (labels
-100 are not asked). Teacher-forced argmax over all answer tokens of an example equals
greedy decoding of the answer, so an example's exact match is what generation would score.
"""

from __future__ import annotations

from typing import Callable, Sequence

import torch

from ..data.synthetic import IGNORE, mqar, passkey
from ..checks import check_int, check_tensor

Model = Callable[[torch.Tensor], torch.Tensor]


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
    seed: int = 12345,
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
