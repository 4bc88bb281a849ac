"""Principled attention: gated logits, a learned ground state and log K margin amplification
(docs/mechanisms.md#principled-attention).

One folder per op family, as the scalar family's: the naive reference and its sliding-window band
(`naive`), the public op with its tiled fast path and the dispatch among paths (`attention`), and
the fused Triton kernel (`triton_kernel`; imported only when used). Imports point one way:
naive <- attention -> triton_kernel (lazily).
"""

from .attention import principled_attention
from .naive import principled_band, principled_naive

__all__ = ["principled_attention", "principled_band", "principled_naive"]
