"""Gated linear attention (GLA) and the Mamba-2 SSD readout: linear attention with decay
(docs/mechanisms.md).

One folder, as `attnlab.ops.scalar`: the argument checks (`args`), the recurrence step by step, the
reference (`naive`), the chunked form (`chunked`, which cosformer's op also runs), GLA's compiled CPU
kernel (`cpu`), flash-linear-attention's kernels (`fla`), the public ops that choose among them
(`attention`) and the decode steps (`step`). Imports point one way: args, naive, chunked, cpu, fla
<- attention; args, naive <- step.
"""

from .attention import gla_attention, ssd_attention
from .step import gla_step, ssd_step

__all__ = ["gla_attention", "gla_step", "ssd_attention", "ssd_step"]
