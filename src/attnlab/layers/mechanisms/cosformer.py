"""mechanism = "cosformer": ReLU feature maps with the cos reweighting cos(π(i − j)/2M) and an
optional normaliser (docs/mechanisms.md#cosformer).

The horizon M is `cosformer_max_len`; without it each forward call takes M = T, and decoding
needs `make_cache(..., max_len=M)` (it equals forward on sequences of length M); static decoding
keeps the two sums in buffers (`CosformerStore`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ...cache.static import StaticState
from ...ops import cosformer_attention, cosformer_step
from ...ops.common.precision import upcast
from ...ops.cosformer import CosformerState
from ...ops.cosformer.step import step_update
from ..options import MechanismOptions
from ..record import Projected
from ..registry import register
from ._recurrent import RecurrentAttention


class CosformerStore(StaticState):
    """A cosformer layer's static state: the sums kv (B, H, 2Dk, Dv) and k_sum (B, H, 2Dk) in buffers;
    a step's position (the cos reweighting's angle) is the decoder's device tensor."""

    # The decoder stacks no q/k/v weights for this layer (`StaticDecoder._sync_qkv`): with the stacks as
    # graph inputs, torch 2.11's Inductor fuses the copy of the new sums into the kernel that reads the old
    # ones and the compiled step's logits come out wrong (by 0.1 on the tests' model); 2.13 is right either way
    # (tests/test_static_decode.py::test_compiled_steps_of_every_static_state_equal_generate, make test-compat).
    stack_qkv_off = True

    def __init__(self, layer, opts):
        super().__init__(layer)
        c = layer.config
        self.horizon = c.options.cosformer_max_len
        if self.horizon is None or opts.max_len > self.horizon:
            raise ValueError(f"max_len={opts.max_len} is past cosformer's horizon cosformer_max_len={self.horizon} "
                             f"(its reweighting is defined for positions below it)")
        F2, dt, B, dev = 2 * layer.qk_dim, upcast(opts.dtype), opts.batch_size, opts.device
        self.register_buffer("kv", torch.zeros(B, c.n_heads, F2, c.head_dim, dtype=dt, device=dev), persistent=False)
        self.register_buffer("k_sum", torch.zeros(B, c.n_heads, F2, dtype=dt, device=dev), persistent=False)

    def reset(self) -> None:
        self.kv.zero_()
        self.k_sum.zero_()

    def attend(self, p, positions: torch.Tensor, n: int, h: torch.Tensor) -> torch.Tensor:
        c = self.layer.config
        if positions.shape[0] == 1:
            o, kv, k_sum = step_update(p.q[:, :, 0], p.k[:, :, 0], p.v[:, :, 0], self.kv, self.k_sum, positions[0],
                                       self.horizon, c.options.cosformer_normalize)
            o = o.unsqueeze(2)
        else:  # a prompt chunk: the op from the stored sums (its start read on the host once)
            state = CosformerState(self.kv, self.k_sum, int(positions[0]), self.horizon)
            o, new = cosformer_attention(p.q, p.k, p.v, causal=True, max_len=self.horizon,
                                         normalize=c.options.cosformer_normalize, initial_state=state, impl=c.impl)
            kv, k_sum = new.kv, new.k_sum
        self.kv.copy_(kv)
        self.k_sum.copy_(k_sum)
        return o

    def fill(self, p, T: int) -> torch.Tensor:
        self.reset()
        return self.attend(p, torch.arange(T, device=p.q.device), T, None)


@dataclass
class CosformerOptions(MechanismOptions):
    """Mechanism "cosformer"'s options.

    Args:
        cosformer_normalize: keep cosFormer's normaliser (True) or drop it.
        cosformer_max_len: the horizon M of the cos reweighting cos(π(i−j)/2M); None:
            M = T of each forward call (the original choice); decoding then needs
            `make_cache(..., max_len=M)` and equals forward on sequences of length M.
    """

    cosformer_normalize: bool = True
    cosformer_max_len: int | None = None

    def check(self, config) -> None:
        if self.cosformer_max_len is not None:
            config.require_int("cosformer_max_len")


@register
class CosformerAttention(RecurrentAttention):
    mechanism = "cosformer"
    prenorm_gate = True  # output_gate="prenorm" gates its normaliser
    Options = CosformerOptions
    uses = ("n_kv_heads", "rope", "rope_base")

    @classmethod
    def model_defaults(cls, max_seq_len: int) -> dict:
        # one fixed horizon M for training and decoding (None would make M the length of each call)
        return {**super().model_defaults(max_seq_len), **({"cosformer_max_len": max_seq_len} if max_seq_len else {})}

    @classmethod
    def horizon(cls, config) -> int | None:
        return config.options.cosformer_max_len

    def attend(self, p: Projected, values=None, impl: str | None = None):
        c = self.config
        v = p.v if values is None else values
        if p.docs is not None:  # each document's own length is its horizon unless one is configured
            max_len = c.options.cosformer_max_len
        else:
            max_len = c.options.cosformer_max_len or max(p.q.shape[2], 1)
        o, _ = cosformer_attention(p.q, p.k, v, causal=True, max_len=max_len, normalize=c.options.cosformer_normalize,
                                   impl=impl or c.impl, docs=p.docs)
        return o, None

    def init_cache(self, cache, window, max_len) -> None:
        super().init_cache(cache, window, max_len)
        cache.max_len = max_len or self.config.options.cosformer_max_len
        if cache.max_len is None:
            raise ValueError(
                "max_len is needed to decode cosformer (the horizon M of its cos reweighting): "
                "pass make_cache(..., max_len=M) or set AttentionConfig.cosformer_max_len"
            )

    def chunk_op(self, p: Projected, state, cache, impl: str | None = None):
        c = self.config
        return cosformer_attention(p.q, p.k, p.v, causal=True, max_len=cache.max_len, normalize=c.options.cosformer_normalize,
                                   initial_state=state, impl=impl or c.impl)

    def step_op(self, q, k, v, p: Projected, state, cache):
        return cosformer_step(q, k, v, state, max_len=cache.max_len, normalize=self.config.options.cosformer_normalize)

    def static_state(self, opts) -> CosformerStore:
        return CosformerStore(self, opts)
