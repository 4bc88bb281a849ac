"""GOAT attention: dot-product scores plus a learned log-prior over positions (docs/mechanisms.md#goat).

One folder, as `attnlab.ops.scalar`: the argument checks (`args`), the prior's formula (`prior`), the
naive reference (`naive`), the fused SDPA path (`fused`), the path through the scalar family's Triton
kernel (`triton_op`), the public op that chooses among them (`attention`) and FlexAttention's form of
the formula (`flex`, which the router does not pick). Imports point one way: args, prior <- naive,
fused, triton_op <- attention; args <- flex.
"""

from .attention import goat_attention
from .prior import goat_prior, spectral_prior

__all__ = ["goat_attention", "goat_prior", "spectral_prior"]
