"""What the linear family (cosformer, gla, ssd) shares layer-side: vector heads without
grouping, a recurrent decode state advanced by the op's `*_step` function, and a prefill that
runs the op over the whole prompt from that state (the op's `initial_state`)."""

from __future__ import annotations

from ...cache.kv import RecurrentState
from ..attention import Attention
from ..record import Projected


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

    def chunk_op(self, p: Projected, state, cache):
        """The op over all T tokens of `p` from `state`: (o (B, H, T, D), the state after them), or
        None when the mechanism has no such call (its prefill then steps token by token)."""
        return None

    def prefill_readout(self, p: Projected, cache):
        got = self.chunk_op(p, cache.state.state, cache)
        if got is None:
            return None
        o, new = got
        cache.state.update(new, steps=p.q.shape[2])
        return o  # (B, H, T, D)
