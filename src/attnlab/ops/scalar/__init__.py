"""The scalar family: scalar and hybrid attention under the Gaussian and Cauchy kernels, exact,
through each query's scalar window, and approximate (docs/mechanisms.md).

One folder, as flash-linear-attention lays out an op. The family's argument checks (`args`) and its
score, once (`scores`). The exact ops: the naive reference (`naive`), the fused SDPA route (`fused`),
query chunks of explicit scores (`chunked`), the Triton kernel (`triton_kernel` and its backward
`triton_backward`, their host side `triton_op`; imported only when used, where
`attnlab.ops.common.triton_route` says they run) and the public ops that choose among them
(`attention`). Windowed attention: each query's window (`window`: its selection by dense rows in
`nearest`, by a merge-sort tree in `tree` and on the compiled CPU kernels in `window_cpu`, which also
attends; the budget rule in `budget`), the dense reference (`window_naive`), the selected-keys paths
(`selected`, `chunked`, `triton_selected`) and the public op that chooses (`windowed`). The
approximate op (`approx`) and FlexAttention's form of the formula (`flex`). Imports point one way:
scores <- args <- naive, fused, chunked <- selected; nearest, tree, window_cpu <- window <- window_naive;
triton_kernel <- triton_backward <- triton_op <- triton_selected; naive, fused, chunked <- attention
-> triton_op (lazily); window, window_naive, selected, chunked <- windowed -> triton_selected (lazily);
attention <- approx; args <- flex.
"""

from ..common.triton_route import triton_missing, triton_route
from .approx import APPROX_TOL, approx_plan, scalar_attention_approx
from .args import KERNELS, check_kernel
from .attention import hybrid_attention, scalar_attention
from .budget import budget_evictions, range_distance
from .naive import hybrid_logits, scalar_logits
from .scores import hybrid_scores, kernel_term, scalar_scores
from .window import window_indices, window_mask
from .windowed import windowed_attention

__all__ = [
    "APPROX_TOL", "KERNELS", "approx_plan", "budget_evictions", "check_kernel", "hybrid_attention", "hybrid_logits",
    "hybrid_scores", "kernel_term", "range_distance", "scalar_attention", "scalar_attention_approx", "scalar_logits",
    "scalar_scores", "triton_missing", "triton_route", "window_indices", "window_mask", "windowed_attention",
]
