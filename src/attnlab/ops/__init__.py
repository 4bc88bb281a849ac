"""Functional attention ops on bare tensors.

Vectors are (B, H, T, D); scalar queries/keys are (B, H, T). Every op has a naive
reference that follows its formula and a fast path that never builds a T x T matrix on
its default route, selected by ``impl="auto" | "naive" | "fast"``.
"""

from .softmax import softmax_attention
from .scalar import hybrid_attention, hybrid_logits, scalar_attention, scalar_logits
from .principled import principled_attention
from .cosformer import CosformerState, cosformer_attention, cosformer_step
from .gla import gla_attention, gla_step, ssd_attention, ssd_step
from .goat import goat_attention, goat_prior
from .scalar import approx_plan, scalar_attention_approx
from .scalar import budget_evictions, range_distance, window_indices, window_mask, windowed_attention

__all__ = [
    "softmax_attention",
    "scalar_attention",
    "scalar_attention_approx",
    "approx_plan",
    "hybrid_attention",
    "principled_attention",
    "cosformer_attention",
    "gla_attention",
    "ssd_attention",
    "goat_attention",
    "goat_prior",
    "cosformer_step",
    "gla_step",
    "ssd_step",
    "CosformerState",
    "scalar_logits",
    "hybrid_logits",
    "budget_evictions",
    "range_distance",
    "window_indices",
    "window_mask",
    "windowed_attention",
]
