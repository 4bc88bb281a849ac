"""`windowed_attention` on the compiled CPU kernels (csrc/window.cpp, built and loaded by
`attnlab.ops._ext`, their C signatures declared here): the window's selection and the attention over
the selected keys, forward and backward, at O(T x (k + w)) per head.

- `select_nearest`: each query's k nearest candidate keys in scalar space, the newest first on equal
  distances (the rule of `window.window_mask`, exactly), from one sort per head and a walk outward from
  the query's place in it: O(T log T + T k) per head, never T x T (the kernel's header states the
  algorithm). Packed documents select within their own document.
- `selected_cpu`: softmax over each query's selected keys (`window.window_indices`'s idx / ok) of the
  scalar or hybrid score, either kernel; the backward pass recomputes the scores and adds the key-side
  gradients per head, with no T x T tensor and no float atomics.

The kernels run as torch custom ops, one opaque call each in a compiled graph. The callers check every
argument first; these functions take the work dtype (float32 or float64) on the CPU.
"""

from __future__ import annotations

from typing import Optional

import torch

from .._ext import DTYPES, I64, INT, PTR, call, declare, loaded, no_autocast
from ..common.heads import expand_heads

__all__ = ["available", "select_nearest", "selected_cpu"]

declare("attnlab_window_select", [PTR] * 5 + [I64] * 6 + [INT])
declare("attnlab_window_fwd", [PTR] * 11 + [I64] * 6 + [INT, INT])
declare("attnlab_window_bwd", [PTR] * 18 + [I64] * 6 + [INT, INT])


def available(device: torch.device, dtype: torch.dtype) -> bool:
    """True when the compiled kernels take work of this device and dtype (the CPU, float32 / float64)."""
    return device.type == "cpu" and dtype in DTYPES and loaded()


def _ptr(x: Optional[torch.Tensor]) -> int:
    return 0 if x is None else x.data_ptr()


@torch.library.custom_op("attnlab::window_select", mutates_args=())
def _select(qs: torch.Tensor, ks: torch.Tensor, seg: Optional[torch.Tensor], k: int, n_prefix: int,
            local: int) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, T = qs.shape
    idx = torch.empty(B, H, T, k, dtype=torch.int64)
    ok = torch.empty(B, H, T, k, dtype=torch.bool)
    call("attnlab_window_select", qs.dtype, qs, ks, _ptr(seg), idx, ok, B, H, T, k, n_prefix, local,
              torch.get_num_threads())
    return idx, ok


@_select.register_fake
def _(qs, ks, seg, k, n_prefix, local):
    B, H, T = qs.shape
    return qs.new_empty(B, H, T, k, dtype=torch.int64), qs.new_empty(B, H, T, k, dtype=torch.bool)


def select_nearest(qs: torch.Tensor, ks: torch.Tensor, k: int, n_prefix: int, local: int,
                   seg: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Query t's k nearest keys among positions n_prefix .. t - local (of its document, with seg (B, T))
    for qs, ks (B, H, T) of the work dtype -> idx (B, H, T, k) int64 in the dense rule's order (distance,
    then newest) and ok (B, H, T, k) bool (False past the keys a query has)."""
    seg = None if seg is None else seg.to(torch.int64).contiguous()
    return _select(qs.contiguous(), ks.contiguous(), seg, k, n_prefix, local)


def _sizes(qs, q, v, idx) -> tuple[int, ...]:
    B, H, T = qs.shape
    return B * H, H, T, idx.shape[3], 0 if q is None else q.shape[3], v.shape[3]


@torch.library.custom_op("attnlab::window_fwd", mutates_args=())
def _fwd(qs: torch.Tensor, ks: torch.Tensor, tau: torch.Tensor, lam: Optional[torch.Tensor], q: Optional[torch.Tensor],
         k: Optional[torch.Tensor], v: torch.Tensor, idx: torch.Tensor, ok: torch.Tensor,
         cauchy: bool) -> tuple[torch.Tensor, torch.Tensor]:
    B, H, T = qs.shape
    o, w = v.new_empty(B, H, T, v.shape[3]), v.new_empty(idx.shape)
    call("attnlab_window_fwd", v.dtype, qs, ks, tau, _ptr(lam), _ptr(q), _ptr(k), v, idx, ok, o, w,
              *_sizes(qs, q, v, idx), int(cauchy), torch.get_num_threads())
    return o, w


@_fwd.register_fake
def _(qs, ks, tau, lam, q, k, v, idx, ok, cauchy):
    B, H, T = qs.shape
    return v.new_empty(B, H, T, v.shape[3]), v.new_empty(idx.shape)


@torch.library.custom_op("attnlab::window_bwd", mutates_args=())
def _bwd(qs: torch.Tensor, ks: torch.Tensor, tau: torch.Tensor, lam: Optional[torch.Tensor], q: Optional[torch.Tensor],
         k: Optional[torch.Tensor], v: torch.Tensor, idx: torch.Tensor, o: torch.Tensor, w: torch.Tensor,
         d_o: torch.Tensor, cauchy: bool) -> list[torch.Tensor]:
    dqs, dks, dtau, dv, dlam, dq, dk = _grads_like(qs, v, q)
    dot = q is not None  # scalar heads have no dq, dk
    call("attnlab_window_bwd", v.dtype, qs, ks, tau, _ptr(lam), _ptr(q), _ptr(k), v, idx, o, w,
              d_o.contiguous(), dqs, dks, dtau, _ptr(None if lam is None else dlam), _ptr(dq if dot else None),
              _ptr(dk if dot else None), dv, *_sizes(qs, q, v, idx), int(cauchy), torch.get_num_threads())
    return [dqs, dks, dtau, dv, dlam, dq, dk]


@_bwd.register_fake
def _(qs, ks, tau, lam, q, k, v, idx, o, w, d_o, cauchy):
    return list(_grads_like(qs, v, q))


def _grads_like(qs, v, q):
    """dqs, dks, dtau (B, H, T); dv per head; dlam per (B, H); dq, dk per head (empty for scalar heads)."""
    B, H, T = qs.shape
    D = 0 if q is None else q.shape[3]
    return (torch.empty_like(qs), torch.empty_like(qs), torch.empty_like(qs), v.new_empty(B, H, T, v.shape[3]),
            qs.new_zeros(B, H), qs.new_empty(B, H, T, D), qs.new_empty(B, H, T, D))


class _Selected(torch.autograd.Function):
    """csrc/window.cpp on qs, ks, tau (B, H, T), lam (H,) or None, q, k (B, H, T, D) or None, v (B, H, T, Dv),
    idx / ok (B, H, T, m) -> (B, H, T, Dv); k and v per query head (the caller expands and sums groups)."""

    @staticmethod
    @no_autocast
    def forward(ctx, qs, ks, tau, lam, q, k, v, idx, ok, cauchy):
        o, w = _fwd(qs, ks, tau, lam, q, k, v, idx, ok, cauchy)
        ctx.cauchy = cauchy
        ctx.save_for_backward(qs, ks, tau, lam, q, k, v, idx, o, w)
        return o

    @staticmethod
    @torch.autograd.function.once_differentiable
    @no_autocast
    def backward(ctx, d_o):
        qs, ks, tau, lam, q, k, v, idx, o, w = ctx.saved_tensors
        dqs, dks, dtau, dv, dlam, dq, dk = _bwd(qs, ks, tau, lam, q, k, v, idx, o, w, d_o, ctx.cauchy)
        hybrid = q is not None
        return (dqs, dks, dtau, None if lam is None else dlam.sum(0), dq if hybrid else None,
                dk if hybrid else None, dv, None, None, None)


def selected_cpu(qs, ks, v, tau_b, idx, ok, q, k, lam, kernel: str) -> torch.Tensor:
    """Attention of qs (B, H, T) (and q (B, H, T, D)) over the keys idx / ok (B, H, T, m) select, in the
    work dtype of v: tau_b broadcastable to (B, H, T), lam (1, H, 1) or None, k (B, G', T, D) and
    v (B, G, T, Dv) of grouped heads -> (B, H, T, Dv)."""
    B, H, T = qs.shape
    dt = v.dtype
    tau = tau_b.to(dt).expand(B, H, T).contiguous()
    lam_h = None if lam is None else lam.to(dt).reshape(H).contiguous()
    qq = None if q is None else q.to(dt).contiguous()
    kk = None if k is None else expand_heads(k, H).to(dt).contiguous()
    return _Selected.apply(qs.to(dt).contiguous(), ks.to(dt).contiguous(), tau, lam_h, qq, kk,
                           expand_heads(v, H).contiguous(), idx.contiguous(), ok.contiguous(), kernel == "cauchy")
