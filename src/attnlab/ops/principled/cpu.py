"""Principled attention on the compiled CPU kernel (csrc/principled.cpp, built and loaded by
`attnlab.ops._ext`, its C signatures declared here): the tiled algorithm of `tiled` (module docstring)
forward and backward in one OpenMP kernel, reading grouped k, kg and v in place.

The kernels run as torch custom ops (torch.library): torch.compile keeps each as one opaque call in
its graph, with the output shapes given by the fake implementations, instead of breaking the graph
at the ctypes call.
"""

from __future__ import annotations

import torch

from .._ext import I64, INT, PTR, call, declare, no_autocast

__all__ = ["principled_cpu"]

PRINCIPLED_BLOCK_Q = 128
PRINCIPLED_BLOCK_K = 128

declare("attnlab_principled_fwd", [PTR] * 11 + [I64] * 10 + [INT, I64, I64, INT])
declare("attnlab_principled_bwd", [PTR] * 21 + [I64] * 10 + [INT, I64, I64, INT])


@torch.library.custom_op("attnlab::principled_fwd", mutates_args=())
def _principled_fwd(q: torch.Tensor, k: torch.Tensor, qg: torch.Tensor, kg: torch.Tensor, v: torch.Tensor,
                    c: torch.Tensor, spb: torch.Tensor, gamma: torch.Tensor, causal: bool, block_q: int,
                    block_k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    B, H, Tq, D = q.shape
    ok, w0, lse2 = q.new_empty(B, H, Tq, v.shape[3]), q.new_empty(B, H, Tq), q.new_empty(B, H, Tq)
    call("attnlab_principled_fwd", q.dtype, q, k, qg, kg, v, c, spb, gamma, ok, w0, lse2,
         *_principled_sizes(q, k, qg, kg, v), int(causal), block_q, block_k, torch.get_num_threads())
    return ok, w0, lse2


@_principled_fwd.register_fake
def _(q, k, qg, kg, v, c, spb, gamma, causal, block_q, block_k):
    B, H, Tq, _ = q.shape
    return q.new_empty(B, H, Tq, v.shape[3]), q.new_empty(B, H, Tq), q.new_empty(B, H, Tq)


@torch.library.custom_op("attnlab::principled_bwd", mutates_args=())
def _principled_bwd(q: torch.Tensor, k: torch.Tensor, qg: torch.Tensor, kg: torch.Tensor, v: torch.Tensor,
                    c: torch.Tensor, spb: torch.Tensor, gamma: torch.Tensor, ok: torch.Tensor, w0: torch.Tensor,
                    lse2: torch.Tensor, d_ok: torch.Tensor, d_w0: torch.Tensor, causal: bool, block_q: int,
                    block_k: int) -> list[torch.Tensor]:
    dq, dqg, dk, dkg, dv, dc, dspb, dgamma = _principled_grads_like(q, k, qg, kg, v, c)
    call("attnlab_principled_bwd", q.dtype, q, k, qg, kg, v, c, spb, gamma, ok, w0, lse2,
         d_ok.contiguous(), d_w0.contiguous(), dq, dk, dqg, dkg, dv, dc, dspb, dgamma,
         *_principled_sizes(q, k, qg, kg, v), int(causal), block_q, block_k, torch.get_num_threads())
    return [dq, dk, dqg, dkg, dv, dc, dspb, dgamma]


@_principled_bwd.register_fake
def _(q, k, qg, kg, v, c, spb, gamma, ok, w0, lse2, d_ok, d_w0, causal, block_q, block_k):
    return list(_principled_grads_like(q, k, qg, kg, v, c))


def _principled_sizes(q, k, qg, kg, v) -> tuple[int, ...]:
    B, H, Tq, D = q.shape
    return B, H, k.shape[1], kg.shape[1], v.shape[1], Tq, k.shape[2], D, qg.shape[3], v.shape[3]


def _principled_grads_like(q, k, qg, kg, v, c):
    """Gradient buffers: k, kg, v per query head (B, H, Tk, E); the caller sums them to groups."""
    B, H, _, _ = q.shape
    Tk = k.shape[2]
    dq, dqg = torch.empty_like(q), torch.empty_like(qg)
    dk, dkg, dv = q.new_empty(B, H, Tk, k.shape[3]), q.new_empty(B, H, Tk, kg.shape[3]), q.new_empty(B, H, Tk, v.shape[3])
    return dq, dqg, dk, dkg, dv, torch.empty_like(c), torch.empty_like(c), torch.empty_like(c)


class _Principled(torch.autograd.Function):
    """csrc/principled.cpp on q (B, H, Tq, D), k (B, G, Tk, D), qg (B, H, Tq, Dg), kg (B, Gg, Tk, Dg),
    v (B, Gv, Tk, Dv) and per-query c, softplus(beta), gamma (B, H, Tq). Returns the key readout
    sum_j w_j v_j (B, H, Tq, Dv) and the ground weight w0 (B, H, Tq)."""

    @staticmethod
    @no_autocast
    def forward(ctx, q, k, qg, kg, v, c, spb, gamma, causal, block_q, block_k):
        ok, w0, lse2 = _principled_fwd(q, k, qg, kg, v, c, spb, gamma, causal, block_q, block_k)
        ctx.flags = (causal, block_q, block_k)
        ctx.groups = (k.shape[1], kg.shape[1], v.shape[1])
        ctx.save_for_backward(q, k, qg, kg, v, c, spb, gamma, ok, w0, lse2)
        return ok, w0

    @staticmethod
    @torch.autograd.function.once_differentiable
    @no_autocast
    def backward(ctx, d_ok, d_w0):
        saved = ctx.saved_tensors
        dq, dk, dqg, dkg, dv, dc, dspb, dgamma = _principled_bwd(*saved, d_ok, d_w0, *ctx.flags)
        G, Gg, Gv = ctx.groups
        dk, dkg, dv = (_group_sum(x, n) for x, n in ((dk, G), (dkg, Gg), (dv, Gv)))
        return dq, dk, dqg, dkg, dv, dc, dspb, dgamma, None, None, None


def _group_sum(x: torch.Tensor, groups: int) -> torch.Tensor:
    """(B, H, T, E) per query head -> (B, G, T, E): head h's gradient goes to group h // (H / G)."""
    B, H, T, E = x.shape
    return x if groups == H else x.view(B, groups, H // groups, T, E).sum(2)


def principled_cpu(q, k, qg, kg, v, c, spb, gamma, causal: bool, block_q: int | None, block_k: int | None):
    """Fused principled attention on checked inputs of one dtype (grouped k, kg, v are read in place).
    c, spb, gamma: broadcastable to (B, H, Tq). Returns (key readout (B, H, Tq, Dv), w0 (B, H, Tq))."""
    B, H, Tq, _ = q.shape
    rows = [x.expand(B, H, Tq).contiguous() for x in (c, spb, gamma)]
    blocks = (min(block_q or PRINCIPLED_BLOCK_Q, Tq), min(block_k or PRINCIPLED_BLOCK_K, k.shape[2]))  # tile buffers
    return _Principled.apply(*(x.contiguous() for x in (q, k, qg, kg, v)), *rows, causal, *blocks)
