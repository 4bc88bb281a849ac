"""What the linear family (cosformer, gla, ssd) shares layer-side: vector heads without
grouping, a recurrent decode state advanced by the op's `*_step` function, and a prefill that
runs the op over the whole prompt from that state (the op's `initial_state`); GLA's and SSD's
static decode state (`RecurrentStore`)."""

from __future__ import annotations

import torch

from ...cache.kv import RecurrentState
from ...cache.static import StaticState
from ...ops.common.precision import upcast
from ..attention import Attention
from ..record import Projected


class RecurrentStore(StaticState):
    """A GLA or SSD layer's static state (B, H, Dk, Dv) in one buffer, in the op's compute dtype.

    A prompt chunk runs the project's own chunked form (impl="fast"; "naive" when the layer asks for
    it), never flash-linear-attention's kernels, whatever the layer's impl: the state a decoder
    starts from then depends on no autotuning (fla tunes each new shape, minutes for GLA) and on
    none of the Triton versions fla flags as miscompiling on Hopper (Triton < 3.7.1). A step is the
    op's one-token recurrence either way (`step_op`); a chunk, the layer's `chunk_op`."""

    def __init__(self, layer, opts):
        super().__init__(layer)
        c = layer.config
        self.register_buffer("state", torch.zeros(opts.batch_size, c.n_heads, layer.qk_dim, c.head_dim,
                                                  dtype=upcast(opts.dtype), device=opts.device), persistent=False)

    def reset(self) -> None:
        self.state.zero_()

    def attend(self, p, positions: torch.Tensor, n: int, h: torch.Tensor) -> torch.Tensor:
        a = self.layer
        if positions.shape[0] == 1:
            o, new = a.step_op(p.q[:, :, 0], p.k[:, :, 0], p.v[:, :, 0], p, self.state, None)
            o = o.unsqueeze(2)
        else:
            o, new = a.chunk_op(p, self.state, None, impl="naive" if a.config.impl == "naive" else "fast")
        self.state.copy_(new)
        return o

    def fill(self, p, T: int) -> torch.Tensor:
        self.reset()
        return self.attend(p, torch.arange(T, device=p.q.device), T, None)


class RecurrentAttention(Attention):
    recurrent = True
    rope_default = False  # the family carries position in its own way (reweighting, decays)

    @classmethod
    def configure(cls, config) -> None:
        config.set_vector_heads(config.n_heads, grouped=False)

    def takes_documents(self, device) -> bool:
        """Packed documents in one pass on every path: the op's `docs` restarts the recurrence at every
        document's first token from a zero state (masks in the chunked form, no host sync). On CUDA
        that is the chunked form, not fla's kernels, which take documents only as cu_seqlens and read
        those on the host."""
        return True

    def init_cache(self, cache, window, max_len) -> None:
        cache.state = RecurrentState(cache.batch_size)

    def step_op(self, q, k, v, p: Projected, state, cache):
        """The op's one-token step: (o (B, H, D), new state)."""
        raise NotImplementedError(f"{type(self).__name__} must define step_op()")

    def step_readout(self, p: Projected, cache):
        q, k, v = p.q[:, :, 0], p.k[:, :, 0], p.v[:, :, 0]  # (B, H, D)
        o, new = self.step_op(q, k, v, p, cache.state.state, cache)
        cache.state.update(new)
        return o.unsqueeze(2)  # (B, H, 1, D)

    def chunk_op(self, p: Projected, state, cache, impl: str | None = None):
        """The op over all T tokens of `p` from `state`: (o (B, H, T, D), the state after them), or
        None when the mechanism has no such call (its prefill then steps token by token); impl: the
        op's impl (default: the layer's)."""
        return None

    def prefill_readout(self, p: Projected, cache):
        got = self.chunk_op(p, cache.state.state, cache)
        if got is None:
            return None
        o, new = got
        cache.state.update(new, steps=p.q.shape[2])
        return o  # (B, H, T, D)
