"""One attention function registered with transformers that lets chosen layers see their native Q/K/V.

Layers without a handler delegate straight to transformers' SDPA function, so the model keeps
its fast path. A forward pre-hook on each handled self-attention module records the hidden state
entering it (the input of q_proj/k_proj), which the search projections read.
"""

from __future__ import annotations

from typing import Callable, Protocol

import torch

ATTN_NAME = "attnlab_search"


class Handler(Protocol):
    def __call__(
        self, module, hidden: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
        allowed: torch.Tensor, scaling: float,
    ) -> torch.Tensor | None:
        """Return the attention output (B, T, H, D), or None to fall back to SDPA."""


def _sdpa():
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    return sdpa_attention_forward


def allowed_mask(attention_mask, q_len: int, kv_len: int, device) -> torch.Tensor:
    """The boolean (B or 1, 1, Tq, Tk) 'may attend' mask behind whatever transformers passed.

    None means plain causal with the queries at the end of the keys (prefill or decode).
    """
    if attention_mask is None:
        qpos = torch.arange(kv_len - q_len, kv_len, device=device)
        return (torch.arange(kv_len, device=device)[None, :] <= qpos[:, None])[None, None]
    if attention_mask.dim() != 4:
        raise ValueError(f"attention_mask must be 4-D here, got shape {tuple(attention_mask.shape)}")
    if attention_mask.dtype == torch.bool:
        return attention_mask[..., -kv_len:]
    return (attention_mask > torch.finfo(attention_mask.dtype).min / 2)[..., -kv_len:]


def attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Dispatch: a module with an `_attnlab_handler` gets native post-RoPE q (B, H, Tq, D) and
    k, v (B, Hkv, Tk, D); all others run transformers' SDPA."""
    handler: Callable | None = getattr(module, "_attnlab_handler", None)
    if handler is not None:
        scale = scaling if scaling is not None else query.shape[-1] ** -0.5
        allowed = allowed_mask(attention_mask, query.shape[2], key.shape[2], query.device)
        hidden = getattr(module, "_attnlab_hidden", None)
        out = handler(module, hidden, query, key, value, allowed, scale)
        if out is not None:
            return out, None
    return _sdpa()(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)


def register_attention() -> None:
    """Make ATTN_NAME a valid attn_implementation (attention and mask interfaces); idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, sdpa_mask

    AttentionInterface.register(ATTN_NAME, attention_forward)
    ALL_MASK_ATTENTION_FUNCTIONS.register(ATTN_NAME, sdpa_mask)


def _record_hidden(module, args, kwargs):
    h = kwargs.get("hidden_states", args[0] if args else None)
    module._attnlab_hidden = h


class Installed:
    """Handlers on some attention modules; `remove()` restores the model exactly."""

    def __init__(self, model, handlers: dict):
        from .hf_model import attention_modules

        register_attention()
        self.model = model
        self.prev_impl = model.config._attn_implementation
        mods = attention_modules(model)
        self.mods, self.hooks = [], []
        for i, h in handlers.items():
            m = mods[i]
            m._attnlab_handler = h
            self.hooks.append(m.register_forward_pre_hook(_record_hidden, with_kwargs=True))
            self.mods.append(m)
        _set_impl(model, ATTN_NAME)

    def remove(self) -> None:
        for h in self.hooks:
            h.remove()
        for m in self.mods:
            for name in ("_attnlab_handler", "_attnlab_hidden"):
                if hasattr(m, name):
                    delattr(m, name)
        _set_impl(self.model, self.prev_impl)
        self.hooks, self.mods = [], []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.remove()


def _set_impl(model, name: str) -> None:
    try:
        model.set_attn_implementation(name)
    except (AttributeError, ValueError, KeyError):
        model.config._attn_implementation = name
