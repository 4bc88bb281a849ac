"""Softmax (dot-product) attention with the scalings of "Alternatives to the Scaled Dot Product"
(docs/mechanisms.md#softmax-attention).

One folder, as `attnlab.ops.scalar`: the argument checks and the scalings' names (`args`), the naive
reference (`naive`), the fast path (`fused`) and the public op that chooses between them
(`attention`). Imports point one way: args, naive, fused <- attention.
"""

from .args import SCALES
from .attention import document_attention, softmax_attention
from .naive import divisor_naive

_divisor_naive = divisor_naive  # the name attnlab.experiments.scalings imports

__all__ = ["SCALES", "divisor_naive", "document_attention", "softmax_attention"]
