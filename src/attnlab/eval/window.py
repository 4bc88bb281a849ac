"""Windowed decoding, measured without decoding: the loss a model would have if every scalar
and hybrid head read only its k nearest keys in scalar space (plus the sink), which is what
`LM.generate(..., window=k)` computes through `SortedScalarCache`, one token at a time.

`decode_window(model, k)` switches a model's full-sequence forward to that computation
(`attnlab.ops.windowed_attention`), so a windowed loss costs one forward per batch and runs
at T = 4096; `stepped_loss` is the token-by-token reference through the decode caches.
"""

from __future__ import annotations

import torch

from ..models.decode import DecodeOptions, decode_window, sorted_cache_layers  # noqa: F401 (decode_window: re-exported)
from ..models.lm import token_loss


def windowed_layers(model) -> list:
    """The attention layers of `model` that decode through the sorted scalar cache (not those that
    read a sliding window): `attnlab.models.decode.sorted_cache_layers`."""
    return [layer for _, layer in sorted_cache_layers(model)]


@torch.no_grad()
def stepped_logits(model, idx: torch.Tensor, window: int | None, budget: int | None = None,
                   compress: float | None = None, caches: list | None = None) -> torch.Tensor:
    """Logits (B, T, V) of idx (B, T) decoded token by token through the model's decode caches
    (the sorted scalar cache for scalar/hybrid layers when window is set, capped at `budget`,
    density-compressed at key span `compress`; or the given `caches`). The reference that
    `decode_window` is tested against, and the only route for compression, which has no
    batched form; O(T) steps, meant for short sequences."""
    if caches is None:
        caches = model.make_caches(idx.shape[0], window=window, budget=budget, compress=compress)
    return torch.stack([model.step(idx[:, t : t + 1], caches, pos=t) for t in range(idx.shape[1])], dim=1)


def compressed_loss(model, idx: torch.Tensor, targets: torch.Tensor, window: int, span: float,
                    exact: float | None = None) -> dict:
    """Windowed decoding with density compression at key span `span`, token by token on idx (B, T):
    its loss, the exact loss of the same tokens (computed unless given), and the share of keys the
    sorted caches still hold at the end (entries per head over tokens, mean over layers, heads and batch)."""
    caches = model.make_caches(idx.shape[0], window=window, compress=span)
    loss = next_token_loss(stepped_logits(model, idx, window, caches=caches), targets)
    if exact is None:
        with torch.no_grad():
            exact = next_token_loss(model(idx)[0], targets)
    held = [c.scalar.n_entries().float().mean().item() / len(c.scalar) for c in caches
            if c.scalar is not None and c.window is not None]
    return {"loss": loss, "exact": exact, "kept": sum(held) / len(held), "tokens": int(targets.numel())}


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> float:
    """Mean cross-entropy of logits (B, T, V) against targets (B, T) (-100 skipped)."""
    return float(token_loss(logits, targets))


__all__ = ["compressed_loss", "decode_window", "next_token_loss", "stepped_logits", "windowed_layers"]
