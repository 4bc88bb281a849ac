"""Grouped heads (GQA): keys and values held for G groups, read by H = r G query heads, copied to every
head (`expand_heads`) or, where they can be, viewed (`broadcast_heads`)."""

from __future__ import annotations

import torch


def expand_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """(B, G, T, D) -> (B, n, T, D) for n a multiple of G: copy i reads group i // (n // G)."""
    G = x.shape[1]
    if G == n_heads:
        return x
    return x.repeat_interleave(n_heads // G, dim=1)


def broadcast_heads(x: torch.Tensor, n_heads: int) -> torch.Tensor:
    """`expand_heads` as a view where one exists (a single group: every head reads it in place, stride 0),
    a copy otherwise. The same values, but not interchangeable with it bit for bit: a matmul may round a
    stride-0 operand differently from a copied one."""
    B, G, T, D = x.shape
    if G == n_heads:
        return x
    return x[:, :, None].expand(B, G, n_heads // G, T, D).reshape(B, n_heads, T, D)
