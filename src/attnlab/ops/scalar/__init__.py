"""The scalar family: scalar and hybrid attention under the Gaussian and Cauchy kernels, exact,
through each query's scalar window, and approximate (docs/mechanisms.md).

One folder, as flash-linear-attention lays out an op: the family's argument checks (`args`), the formula
and its naive reference (`naive`), the fused SDPA route (`fused`), query chunks of explicit scores
(`chunked`), the Triton kernels (`triton_kernel` and its backward `triton_backward` on the arithmetic of
`triton_math`, their host side `triton_op`, and `triton_selected` for training through the window; imported only when used, where
`route` says they run), the public ops that choose among them (`attention`), windowed attention
(`window`: its selection by dense rows in `nearest`, by a merge-sort tree in `tree` and on the compiled
CPU kernels in `window_cpu`, which also attends; its selected-keys path in `selected`; the budget rule
in `budget`), the approximate op (`approx`) and FlexAttention's form of the formula (`flex`). Imports
point one way: args <- naive <- fused, chunked <- selected <- window; nearest, tree, window_cpu <- window;
triton_math <- triton_kernel <- triton_backward <- triton_op <- route <- window, attention; budget <- window;
attention <- approx; naive <- flex.
"""

from .approx import APPROX_TOL, approx_plan, scalar_attention_approx
from .attention import hybrid_attention, scalar_attention
from .route import triton_missing, triton_route
from .naive import hybrid_logits, hybrid_scores, kernel_term, scalar_logits, scalar_scores
from .args import KERNELS, check_kernel
from .budget import budget_evictions, range_distance
from .window import window_indices, window_mask, windowed_attention

__all__ = [
    "APPROX_TOL", "KERNELS", "approx_plan", "budget_evictions", "check_kernel", "hybrid_attention", "hybrid_logits",
    "hybrid_scores", "kernel_term", "range_distance", "scalar_attention", "scalar_attention_approx", "scalar_logits",
    "scalar_scores", "triton_missing", "triton_route", "window_indices", "window_mask", "windowed_attention",
]
