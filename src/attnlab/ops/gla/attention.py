"""Gated linear attention (GLA) and the Mamba-2 SSD readout: linear attention with decay.

Both run the recurrence

    S_t = diag(exp(log_decay_t)) S_{t-1} + k_t v_t^T,    o_t = (scale q_t)^T S_t

with a state S of shape (Dk, Dv) per head. GLA has a decay per key channel,
log_decay (B, H, T, Dk); SSD has one decay per head and step, log_decay (B, H, T), which is
the Mamba-2 SSD readout y_t = C_t^T h_t with C = q, B = k (fold the step size Delta into k
and log_decay = Delta * A) and x = v; scale=1.0 gives that readout exactly.

``impl="naive"`` loops over t and applies the recurrence literally (`naive`); ``impl="fast"`` (what
``"auto"`` runs on the CPU) is the chunked form (`chunked`): causal attention inside
chunks of ``chunk_size`` steps plus state passing between chunks, memory linear in T.
SSD uses the segment-sum form (a C x C scalar decay matrix per chunk); GLA splits each chunk
into sub-chunks of at most 16 steps with an exact (c, c, Dk) decay tensor on the diagonal,
so a chunk_size that is a multiple of 16 is the efficient choice. On the CPU (float32, float64)
GLA runs the same chunked form as one compiled kernel, forward and backward (`cpu`, csrc/gla.cpp),
and falls back to `chunked` when it cannot be built. The GLA fast path gives first derivatives only
(custom autograd functions).

``impl="fla"`` runs flash-linear-attention's chunked Triton kernels (`fla`: the `fla` package,
an optional dependency imported on first use); ``"auto"`` takes it on CUDA when fla is installed and
can run the call, and the chunked form otherwise.

Both are recurrences in time: ``causal=False`` raises ValueError. 16-bit inputs are computed
in float32; the output has the input dtype and the state stays float32. The fla route differs:
q, k, v enter fla's kernels in their own dtype (16-bit products, float32 accumulation), log_decay
and both states are float32, and float32 inputs get TF32 products where the GPU has them.
"""

from __future__ import annotations

import torch

from ...checks import empty_result
from .._ext import usable
from ..common.precision import upcast
from . import fla
from .args import check_call
from .chunked import chunked_linear_attention
from .cpu import gla_cpu
from .naive import recurrence_naive


def gla_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor, *,
                  scale: float | None = None, initial_state: torch.Tensor | None = None, causal: bool = True,
                  impl: str = "auto", chunk_size: int = 64, cu_seqlens=None,
                  docs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Gated linear attention: S_t = diag(exp(log_decay_t)) S_{t-1} + k_t v_t^T, o_t = (scale q_t)^T S_t.

    Args:
        q: queries (B, H, T, Dk).
        k: keys (B, H, T, Dk).
        v: values (B, H, T, Dv).
        log_decay: the log of each key channel's decay (B, H, T, Dk), finite and <= 0.
        scale: a float > 0 multiplying q; None for 1/sqrt(Dk).
        initial_state: the state (B, H, Dk, Dv) to start from, in the compute dtype (float32 for
            16-bit inputs); None for zeros.
        causal: must be True (a recurrence in time has no non-causal form).
        impl: ``"naive"`` applies the recurrence step by step; ``"fast"`` runs the chunked form
            (the compiled kernel on the CPU when it can be built); ``"fla"`` runs
            flash-linear-attention's ``chunk_gla`` (CUDA, fla installed); ``"auto"`` is ``"fla"``
            where it can run and ``"fast"`` elsewhere.
        chunk_size: steps per chunk of the chunked form, an int >= 1 (a multiple of 16 is the
            efficient choice); the fla route picks its own.
        cu_seqlens: packed documents, flash-linear-attention's convention (`attnlab.ops.common.packed`): an
            int32/int64 tensor (or list) of N + 1 offsets [0, ..., T] into one packed row (B = 1).
            The state restarts from zero at every document's first step, so each document's output
            and gradients equal running it alone, and the final state is each document's,
            (N, H, Dk, Dv) (an empty document's is zero). The chunked form keeps its shapes (masks
            inside and between chunks, no host sync); the fla route hands cu_seqlens to fla's varlen
            kernel ("auto" on CUDA where fla can run), which reads them on the host to plan its chunks.
            The compiled CPU kernel does not take documents: packed calls run the PyTorch chunked form.
        docs: packed documents as (B, T) integer ids, a document being a run of equal ids in its row
            (any batch size): as cu_seqlens, with the final state of each row (its last document's),
            (B, H, Dk, Dv); never the fla route (impl="fla" raises). Give at most one of the two;
            neither comes with an initial_state.

    Returns:
        o (B, H, T, Dv) in q's dtype, and the final state (B, H, Dk, Dv) in the compute dtype,
        which ``gla_step`` or a later call (as initial_state) continues from ((N, H, Dk, Dv), one per
        document, with cu_seqlens).

    Raises:
        TypeError: q, k, v or log_decay is not a tensor, not floating or not of q's dtype; scale
            is not a float; initial_state is not in the compute dtype.
        ValueError: shapes that do not fit, another device, NaN or inf in any input, log_decay
            > 0, scale <= 0, causal=False, a chunk_size that is not a positive int, an unknown
            impl, or impl="fla" where it cannot run (the message says why); cu_seqlens that is not
            an int tensor of offsets from 0 to T (non-decreasing) or comes with B != 1; docs of
            another shape or device; both; or packed documents with an initial_state.
    """
    return _run(q, k, v, log_decay, scale, initial_state, causal, impl, chunk_size, True, "gla_attention",
                cu_seqlens, docs)


def ssd_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, log_decay: torch.Tensor, *,
                  scale: float | None = None, initial_state: torch.Tensor | None = None, causal: bool = True,
                  impl: str = "auto", chunk_size: int = 64, cu_seqlens=None,
                  docs: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Mamba-2 SSD readout: the GLA recurrence with one decay per head and step.

    Args:
        q: queries, Mamba-2's C (B, H, T, Dk).
        k: keys, Mamba-2's B with the step size folded in (B, H, T, Dk).
        v: values, Mamba-2's x (B, H, T, Dv).
        log_decay: the log of each head's decay per step (B, H, T), finite and <= 0.
        scale: a float > 0 multiplying q; None for 1/sqrt(Dk) (1.0 gives the plain Mamba-2
            readout).
        initial_state: the state (B, H, Dk, Dv) to start from, in the compute dtype; None for
            zeros.
        causal: must be True (a recurrence in time has no non-causal form).
        impl: ``"naive"`` applies the recurrence step by step; ``"fast"`` runs the chunked
            (segment-sum) form; ``"fla"`` runs flash-linear-attention's ``chunk_simple_gla``
            (CUDA, fla installed); ``"auto"`` is ``"fla"`` where it can run and ``"fast"``
            elsewhere.
        chunk_size: steps per chunk of the chunked form, an int >= 1; the fla route picks its own.
        cu_seqlens: packed documents in one row (B = 1), as `gla_attention` takes them: the state
            restarts at each document's start (in the chunked and the naive forms) and the final
            state is each document's, (N, H, Dk, Dv).
        docs: packed documents as (B, T) ids, as `gla_attention` takes them.

    Returns:
        o (B, H, T, Dv) in q's dtype, and the final state (B, H, Dk, Dv), which ``ssd_step`` or
        a later call continues from ((N, H, Dk, Dv) with cu_seqlens).

    Raises:
        TypeError: as `gla_attention`.
        ValueError: as `gla_attention`, with log_decay of shape (B, H, T).
    """
    return _run(q, k, v, log_decay, scale, initial_state, causal, impl, chunk_size, False, "ssd_attention",
                cu_seqlens, docs)


def _run(q, k, v, log_decay, scale, initial_state, causal, impl, chunk_size, vector, op, cu_seqlens=None, docs=None):
    (B, H, T, Dk, Dv), scale, packed = check_call(q, k, v, log_decay, scale, initial_state, causal, impl, chunk_size,
                                                  vector, op, cu_seqlens, docs)
    if (docs is None and fla.use_fla(impl, q, k, v, log_decay, initial_state, vector)) and T > 0:
        cu = None if packed is None else packed.cu
        return fla.fla_attention(q, k, v, log_decay, scale, initial_state, vector, cu)
    out_dtype, dt = q.dtype, upcast(q.dtype)
    q, k, v, log_decay = (x.to(dt) for x in (q, k, v, log_decay))
    q = q * scale
    state = torch.zeros(B, H, Dk, Dv, dtype=dt, device=q.device) if initial_state is None else initial_state
    if T == 0:
        if packed is not None and packed.cu is not None:  # every document is empty: zero states
            state = torch.zeros(packed.cu.shape[0] - 1, H, Dk, Dv, dtype=dt, device=q.device)
        return empty_result((B, H, 0, Dv), q, k, v, log_decay).to(out_dtype), state
    if impl == "naive":
        o, state = recurrence_naive(q, k, v, log_decay if vector else log_decay[..., None], state, packed)
    elif packed is not None:
        o, state = chunked_linear_attention(q, k, v, log_decay, state, chunk_size, packed.starts, packed.cu)
    elif vector and usable(q):
        o, state = gla_cpu(q, k, v, log_decay, state, chunk_size)
    else:
        o, state = chunked_linear_attention(q, k, v, log_decay, state, chunk_size)
    return o.to(out_dtype), state
