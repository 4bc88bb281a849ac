"""`windowed_attention`'s selected-keys path (the module docstring of `attnlab.ops.scalar.window`):
each query row scores, normalises and reads only the keys `window_indices` selected for it."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from .._sdpa import expand_heads, upcast
from .chunked import chunk_bias, selected_kernel_attention
from .fused import _augment
from .args import _scalar_scale, _tau


def _selected_chunk(qa, ka, vals, idx, ok):
    """Query rows qa (B, H, c, E) over keys ka (B, H, b, E), vals (B, H, b, Dv), reading only the keys
    idx / ok (B, H, c, m) select: one fused SDPA call with their additive mask -> (B, H, c, Dv)."""
    keep = chunk_bias(idx, ok, ka.shape[2], qa.dtype)
    width = max(qa.shape[-1], vals.shape[-1])
    pad = lambda x: F.pad(x, (0, width - x.shape[-1])) if x.shape[-1] < width else x  # noqa: E731
    out = F.scaled_dot_product_attention(pad(qa), pad(ka), pad(vals), attn_mask=keep, scale=1.0)
    return out[..., : vals.shape[-1]]


def checked_indices(keep_fn, B: int, H: int, T: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The idx / ok of a keep_fn with indices (`attnlab.index.keep.IndexedKeep`), checked for the
    selected-keys path: int64 and bool (B, H, T, m) on the op's device, every index in 0 .. T - 1 and
    a key its query sees (<= t) where ok, and at least one key per query."""
    out = keep_fn.indices()
    idx, ok = out if isinstance(out, tuple) and len(out) == 2 else (None, None)
    if not (isinstance(idx, torch.Tensor) and isinstance(ok, torch.Tensor) and idx.dtype == torch.long
            and ok.dtype == torch.bool and idx.dim() == 4 and tuple(idx.shape[:3]) == (B, H, T)
            and idx.shape == ok.shape and idx.device == ok.device == device):
        got = tuple(type(x).__name__ if not isinstance(x, torch.Tensor) else f"{x.dtype} {tuple(x.shape)}"
                    for x in (out if isinstance(out, tuple) else (out,)))
        raise ValueError(f"keep_fn.indices() must return (idx int64, ok bool), both (B, H, T, m) = ({B}, {H}, {T}, m) "
                         f"on {device}, got {got}")
    pos = torch.arange(T, device=device).view(1, 1, T, 1)
    if not bool(((idx >= 0) & (idx < T) & ((idx <= pos) | ~ok)).all()):
        raise ValueError("keep_fn.indices(): an index outside 0 .. T - 1, or a kept one after its query (> t)")
    if T and not bool(ok.any(-1).all()):  # an empty softmax would be NaN
        raise ValueError("keep_fn.indices() must keep at least one key each query sees")
    return idx, ok


def selected_attention(qs, ks, v, tau, idx, ok, q, k, query_chunk, scalar_scale=None, kernel: str = "gaussian"):
    """The selected-keys path of `windowed_attention` over the keys idx / ok (B, H, T, m) select
    (`window.window_indices`): under the Gaussian kernel the scores are the fused path's augmented dot
    products ([q / sqrt(d), q'] . [k, k'], `fused._augment`), masked to each query's selected keys
    chunk by chunk, each chunk recomputed in the backward pass; another kernel forms the chunk's
    scores explicitly (`chunked.selected_kernel_attention`)."""
    from torch.utils.checkpoint import checkpoint

    B, H, T = qs.shape
    cdt = upcast(v.dtype)
    if kernel != "gaussian":
        return selected_kernel_attention(qs, ks, v, tau, idx, ok, q, k, kernel, scalar_scale, query_chunk)
    inv_tau = 1.0 / _tau(tau, B, H, T, cdt, qs.device)
    if scalar_scale is not None:  # -lam (qs - ks)^2 / tau: lam folds into 1 / tau (of any sign)
        inv_tau = inv_tau * _scalar_scale(scalar_scale, H, cdt, qs.device)
    qa, ka = _augment(qs, ks, inv_tau, cdt, True)  # (B, H, T, 2)
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
