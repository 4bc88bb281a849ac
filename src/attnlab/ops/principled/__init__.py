"""Principled attention: gated logits, a learned ground state and log K margin amplification
(docs/mechanisms.md#principled-attention).

One folder per op family, as the scalar family's: the argument checks (`args`), the formula and its
naive reference (`naive`), the banded path for sliding windows and packed documents (`band`), the
tiled PyTorch path (`tiled`), the compiled CPU kernel (`cpu`), the fused Triton kernel
(`triton_kernel`; imported only when used) and the public op that chooses among them (`attention`).
Imports point one way: args, naive <- band; args, band, tiled, cpu <- attention -> triton_kernel
(lazily).
"""

from .attention import principled_attention
from .band import principled_band
from .naive import principled_naive

__all__ = ["principled_attention", "principled_band", "principled_naive"]
