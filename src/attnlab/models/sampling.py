"""Choosing the next token from a step's logits: greedy, or sampled with a temperature, top-k and top-p
(nucleus) filtering, the knobs of Hugging Face's `generate`. One function, used by `LM.generate` and
`attnlab sample`."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def check_sampling(greedy: bool, temperature: float, top_k: int | None, top_p: float | None) -> None:
    """ValueError naming the option: temperature > 0 when sampling; top_k an int >= 1 or None; top_p in
    (0, 1] or None."""
    if not greedy and not (isinstance(temperature, (int, float)) and math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be a finite float > 0 when sampling, got {temperature!r}")
    if top_k is not None and (isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 1):
        raise ValueError(f"top_k must be None or an int >= 1, got {top_k!r}")
    if top_p is not None and (isinstance(top_p, bool) or not isinstance(top_p, (int, float)) or not 0 < top_p <= 1):
        raise ValueError(f"top_p must be None or a float in (0, 1], got {top_p!r}")


def filter_logits(logits: torch.Tensor, top_k: int | None = None, top_p: float | None = None) -> torch.Tensor:
    """logits (B, V) with every token outside the top_k largest, and outside the smallest set of
    largest-probability tokens whose mass reaches top_p, set to -inf (the most likely token is always
    kept). Ties at the k-th value are kept."""
    out = logits
    if top_k is not None and top_k < logits.shape[-1]:
        kth = out.topk(top_k, dim=-1).values[..., -1:]  # (B, 1)
        out = out.masked_fill(out < kth, float("-inf"))
    if top_p is not None and top_p < 1:
        sorted_logits, order = out.sort(dim=-1, descending=True)
        probs = F.softmax(sorted_logits.float(), dim=-1)
        before = probs.cumsum(-1) - probs  # the mass of the tokens ranked above each one
        drop_sorted = before >= top_p  # keeps the first token, and each one needed to reach top_p
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        out = out.masked_fill(drop, float("-inf"))
    return out


def next_token(logits: torch.Tensor, *, greedy: bool = True, temperature: float = 1.0, top_k: int | None = None,
               top_p: float | None = None, generator: torch.Generator | None = None) -> torch.Tensor:
    """The next token (B, 1) from logits (B, V): the argmax when greedy, else a draw from
    softmax(filter_logits(logits / temperature)) with `generator`: the temperature first, so top_p
    counts the tempered mass, in the order of Hugging Face's warpers (temperature, top-k, top-p)."""
    if greedy:
        return logits.argmax(-1, keepdim=True)
    probs = F.softmax(filter_logits(logits.float() / temperature, top_k, top_p), dim=-1)
    return torch.multinomial(probs, 1, generator=generator)
