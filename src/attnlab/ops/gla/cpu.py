"""GLA's chunked form on the compiled CPU kernel (csrc/gla.cpp, built and loaded by `attnlab.ops._ext`,
its C signatures declared here): the per-channel decay of `chunked` forward and backward in one OpenMP
kernel. The kernels run as torch custom ops, one opaque call each in a compiled graph."""

from __future__ import annotations

import torch

from .._ext import I64, INT, PTR, call, declare, no_autocast

__all__ = ["gla_cpu"]

GLA_SUB_CHUNK = 16

declare("attnlab_gla_fwd", [PTR] * 8 + [I64] * 6 + [INT])
declare("attnlab_gla_bwd", [PTR] * 14 + [I64] * 6 + [INT])


@torch.library.custom_op("attnlab::gla_fwd", mutates_args=())
def _gla_fwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, s0: torch.Tensor,
             chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """o (B, H, T, V) and the states (B, H, N + 1, K, V): the entry state of every chunk, then the final state."""
    B, H, T, K = q.shape
    V, N = v.shape[3], -(-T // chunk)
    o, states = q.new_empty(B, H, T, V), q.new_empty(B, H, N + 1, K, V)
    g = q.new_empty(B, H, N, K)
    call("attnlab_gla_fwd", q.dtype, q, k, v, a, s0, o, states, g, *_gla_sizes(q, v, chunk), torch.get_num_threads())
    return o, states


@_gla_fwd.register_fake
def _(q, k, v, a, s0, chunk):
    B, H, T, K = q.shape
    return q.new_empty(B, H, T, v.shape[3]), q.new_empty(B, H, -(-T // chunk) + 1, K, v.shape[3])


@torch.library.custom_op("attnlab::gla_bwd", mutates_args=())
def _gla_bwd(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, a: torch.Tensor, states: torch.Tensor,
             d_o: torch.Tensor, d_final: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    dq, dk, dv, da = (torch.empty_like(x) for x in (q, k, v, a))
    ds0, dstates = torch.empty_like(states[:, :, 0]), torch.empty_like(states)
    B, H, N1 = states.shape[:3]
    g = q.new_empty(B, H, N1 - 1, q.shape[3])
    call("attnlab_gla_bwd", q.dtype, q, k, v, a, states, d_o.contiguous(), d_final.contiguous(), dq, dk, dv, da,
         ds0, dstates, g, *_gla_sizes(q, v, chunk), torch.get_num_threads())
    return [dq, dk, dv, da, ds0]


@_gla_bwd.register_fake
def _(q, k, v, a, states, d_o, d_final, chunk):
    return [torch.empty_like(x) for x in (q, k, v, a)] + [states.new_empty(states[:, :, 0].shape)]


def _gla_sizes(q, v, chunk: int) -> tuple[int, ...]:
    B, H, T, K = q.shape
    return B * H, T, K, v.shape[3], chunk, min(GLA_SUB_CHUNK, chunk)


class _GLA(torch.autograd.Function):
    """csrc/gla.cpp: q (pre-scaled), k (B, H, T, K), v (B, H, T, V), log-decay a (B, H, T, K),
    initial state (B, H, K, V). Returns o (B, H, T, V) and the final state (B, H, K, V)."""

    @staticmethod
    @no_autocast
    def forward(ctx, q, k, v, a, s0, chunk):
        o, states = _gla_fwd(q, k, v, a, s0, chunk)
        ctx.chunk = chunk
        ctx.save_for_backward(q, k, v, a, states)
        return o, states[:, :, -1].clone()

    @staticmethod
    @torch.autograd.function.once_differentiable
    @no_autocast
    def backward(ctx, d_o, d_final):
        q, k, v, a, states = ctx.saved_tensors
        dq, dk, dv, da, ds0 = _gla_bwd(q, k, v, a, states, d_o, d_final, ctx.chunk)
        return dq, dk, dv, da, ds0, None


def gla_cpu(q, k, v, log_decay, state, chunk_size: int):
    """GLA on checked inputs of one dtype (q already scaled): returns o (B, H, T, V) and the final state."""
    return _GLA.apply(*(x.contiguous() for x in (q, k, v, log_decay, state)), min(chunk_size, q.shape[2]))
