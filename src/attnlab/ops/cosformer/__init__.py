"""cosFormer: linear attention with a ReLU feature map and cos position reweighting
(docs/mechanisms.md).

One folder, as `attnlab.ops.scalar`: the state (`state`), the argument checks (`args`), the feature map
(`features`), the naive reference (`naive`), the chunked fast path (`chunked`), the public op that
chooses between them (`attention`) and the decode step (`step`). Imports point one way: state <- args;
features <- naive, chunked <- attention; args, features, state <- step.
"""

from .attention import cosformer_attention
from .state import CosformerState
from .step import cosformer_step, step_update

__all__ = ["CosformerState", "cosformer_attention", "cosformer_step", "step_update"]
