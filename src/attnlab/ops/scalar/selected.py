"""`windowed_attention`'s selected-keys path under the Gaussian kernel (the module docstring of
`windowed`): each query row scores, normalises and reads only the keys `window.window_indices` (or an
indexed keep_fn, `args.checked_indices`) selected for it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from ..common.heads import expand_heads
from ..common.precision import upcast
from .args import scalar_scale_tensor, tau_tensor
from .chunked import chunk_bias
from .fused import augment


def _selected_chunk(qa, ka, vals, idx, ok):
    """Query rows qa (B, H, c, E) over keys ka (B, H, b, E), vals (B, H, b, Dv), reading only the keys
    idx / ok (B, H, c, m) select: one fused SDPA call with their additive mask -> (B, H, c, Dv)."""
    keep = chunk_bias(idx, ok, ka.shape[2], qa.dtype)
    width = max(qa.shape[-1], vals.shape[-1])
    pad = lambda x: F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x  # noqa: E731
    out = F.scaled_dot_product_attention(pad(qa), pad(ka), pad(vals), attn_mask=keep, scale=1.0)
    return out[..., : vals.shape[-1]]


def selected_attention(qs, ks, v, tau, idx, ok, q, k, query_chunk, scalar_scale=None):
    """The selected-keys path of `windowed_attention` under the Gaussian kernel over the keys idx / ok
    (B, H, T, m) select (`window.window_indices`): the scores are the fused path's augmented dot
    products ([q / sqrt(d), q'] . [k, k'], `fused.augment`), masked to each query's selected keys
    chunk by chunk, each chunk recomputed in the backward pass. (Another kernel forms the chunk's
    scores explicitly: `chunked.selected_kernel_attention`.)"""
    from torch.utils.checkpoint import checkpoint

    B, H, T = qs.shape
    cdt = upcast(v.dtype)
    inv_tau = 1.0 / tau_tensor(tau, B, H, T, cdt, qs.device)
    if scalar_scale is not None:  # -lam (qs - ks)^2 / tau: lam folds into 1 / tau (of any sign)
        inv_tau = inv_tau * scalar_scale_tensor(scalar_scale, H, cdt, qs.device)
    qa, ka = augment(qs, ks, inv_tau, cdt, True)  # (B, H, T, 2)
    if q is not None:
        qa = torch.cat([q.to(cdt) * (1.0 / math.sqrt(q.shape[-1])), qa], dim=-1)
        ka = torch.cat([expand_heads(k, H).to(cdt), ka], dim=-1)
    vals = expand_heads(v, H).to(cdt)
    grad = torch.is_grad_enabled() and any(isinstance(x, torch.Tensor) and x.requires_grad
                                           for x in (qs, ks, v, q, k, tau, scalar_scale))
    outs = []
    for a in range(0, T, query_chunk):
        b = min(T, a + query_chunk)
        args = (qa[:, :, a:b], ka[:, :, :b], vals[:, :, :b], idx[:, :, a:b], ok[:, :, a:b])
        outs.append(checkpoint(_selected_chunk, *args, use_reentrant=False) if grad else _selected_chunk(*args))
    if not outs:
        return v.new_zeros(B, H, 0, v.shape[-1])
    return torch.cat(outs, dim=2).to(v.dtype)
