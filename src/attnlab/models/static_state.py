"""Static decode state of the layers a `StaticDecoder` reads through a key store or a recurrent
state: softmax (with its sliding window as a ring), GOAT, goat_hybrid, principled, GLA and SSD.

A `KeyStore` holds one layer's per-token entries (keys, values, and whatever else its score reads)
in buffers made once, with the position each slot holds. Without a sliding window it has max_len
slots, slot t holding position t; with a sliding window of w < max_len keys it is a ring of w slots
(position t in slot t mod w), so a step reads w keys whatever the context. A step writes its token
first, then reads every slot under the mask of the positions it may see; a prompt chunk through a
ring reads the ring and the chunk's own entries together, then keeps the chunk's last w.

Each mechanism's readout over the entries read (`Readout`) is its score written for explicit key
positions, beside the layer's own op: softmax is SDPA under the mask; GOAT adds its spectral prior
for the stored positions (`ops.goat.spectral_prior`) and each key's key-only term u, stored at
write time; principled runs `principled_naive` with the mask (K counts the keys it marks).

A `RecurrentStore` holds a GLA or SSD layer's state (B, H, Dk, Dv): a step is the op's one-token
step, a prompt chunk its chunked form from the stored state. A `CosformerStore` holds cosformer's
two sums, its step's position (the reweighting's angle) the decoder's device tensor.
"""

from __future__ import annotations

import math
import types

import torch
import torch.nn.functional as F
from torch import nn

from ..ops.common.heads import expand_heads
from ..ops.common.precision import upcast
from ..ops.cosformer import CosformerState, cosformer_attention
from ..ops.cosformer.step import step_update
from ..ops.goat import spectral_prior
from ..ops.principled.attention import check_param
from ..ops.principled.naive import principled_naive
from ..ops.scalar.naive import scalar_logits
from ..ops.gla import gla_attention, ssd_attention
from ..ops.softmax import _divisor_naive
from .static_split import split_attention

__all__ = ["KEYED", "RECURRENT", "KeyStore", "RecurrentStore", "make_state", "scalar_term", "softmax_readout",
           "softmax_step"]

KEYED = ("softmax", "goat", "goat_hybrid", "principled")  # mechanisms read through a KeyStore
RECURRENT = ("gla", "ssd", "cosformer")  # mechanisms whose state is of fixed size


class KeyStore(nn.Module):
    """One layer's entries in static buffers (module docstring).

    Args:
        entries: name -> (groups, width, dtype) of each per-token entry; buffers (B, groups, S, width).
        batch_size, max_len: B and the positions decoded.
        window: the layer's sliding window (each query reads its last `window` keys), or None.
        device: where the buffers live.
    """

    def __init__(self, entries: dict, batch_size: int, max_len: int, window: int | None, device):
        super().__init__()
        self.window = window
        self.ring = window is not None and window < max_len
        S = window if self.ring else max_len
        self.names = tuple(entries)
        for name, (groups, width, dtype) in entries.items():
            self.register_buffer(name, torch.zeros(batch_size, groups, S, width, dtype=dtype, device=device),
                                 persistent=False)
        # the position each slot holds; -1: empty (a ring's slots fill as it goes)
        self.register_buffer("kpos", torch.full((S,), -1, device=device) if self.ring
                             else torch.arange(S, device=device), persistent=False)

    def reset(self) -> None:
        if self.ring:
            self.kpos.fill_(-1)

    def write(self, new: dict, positions: torch.Tensor) -> None:
        """Entries new[name] (B, groups, T, width) at `positions` (T,); through a ring, T <= its size."""
        slots = positions % self.kpos.shape[0] if self.ring else positions
        for name in self.names:
            buf = getattr(self, name)
            buf.index_copy_(2, slots, new[name].to(buf.dtype))
        if self.ring:
            self.kpos.index_copy_(0, slots, positions)

    def read(self, new: dict, positions: torch.Tensor, n: int):
        """The tokens' entries new at `positions` written, and what they read: (entries by name
        (B, groups, m, width), their positions (m,), the mask ok (T, m)). n: the slots to read
        without a ring (the buffer's length in a step, a prompt chunk's end before)."""
        T = positions.shape[0]
        if self.ring and T > 1:  # a prompt chunk: the ring and the chunk's own entries, then keep the last
            got = {name: torch.cat([getattr(self, name), new[name].to(getattr(self, name).dtype)], 2)
                   for name in self.names}
            kpos = torch.cat([self.kpos, positions])
            m = min(T, self.kpos.shape[0])
            self.write({name: new[name][:, :, T - m :] for name in self.names}, positions[T - m :])
        else:
            self.write(new, positions)
            n = self.kpos.shape[0] if self.ring else n
            got, kpos = {name: getattr(self, name)[:, :, :n] for name in self.names}, self.kpos[:n]
        ok = (kpos[None, :] <= positions[:, None]) & (kpos[None, :] >= 0)
        if self.window is not None:
            ok = ok & (kpos[None, :] > positions[:, None] - self.window)
        return got, kpos, ok


def _entries(a, p, positions: torch.Tensor) -> dict:
    """The per-token entries a layer's store keeps, from its projections p (B, ., T, .) of the tokens
    at `positions` (T,)."""
    out = {"k": p.k, "v": p.v}
    if a.mechanism in ("goat", "goat_hybrid"):  # the key-only term at the tokens' positions
        u = a.prior.key_term_at(positions)  # (1, G, T)
        out["u"] = u[..., None].expand(p.k.shape[0], -1, -1, 1)
    if a.mechanism == "goat_hybrid":
        out["ks"] = p.ks[..., None]
    if a.mechanism == "principled":
        out["kg"] = p.kg
    return out


def scalar_term(a, p, ks: torch.Tensor) -> torch.Tensor:
    """λ φ((qs − ks)² / τ) of the tokens p against keys ks (B, H, 1 or T, m) -> (B, H, T, m)."""
    tau = p.tau.float()
    tau = tau[None, :, None, None] if tau.dim() == 1 else tau[..., None]
    x = (p.qs.float()[..., None] - ks).square() / tau
    phi = x if a.config.kernel == "gaussian" else torch.log1p(x)
    lam = getattr(a, "scalar_scale", None)
    return phi if lam is None else phi * lam.float()[None, :, None, None]


def softmax_readout(q: torch.Tensor, e: dict, ok: torch.Tensor, scale, p: float) -> torch.Tensor:
    """Softmax attention of the queries q (B, H, T, D) over the entries e ("k", "v": (B, G, m, .)) where
    ok (T, m), with the mechanism's scaling: q·k/√d, a float multiplier, or a divisor read off the
    keys each query sees (`ops.softmax._divisor_naive`, folded into the query)."""
    H, T = q.shape[1], q.shape[2]
    k, v = e["k"].to(q.dtype), e["v"].to(q.dtype)
    if scale == "sqrt_d" or not isinstance(scale, str):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=ok, enable_gqa=H != k.shape[1],
                                              scale=None if scale == "sqrt_d" else float(scale))
    c = _divisor_naive(expand_heads(k, H).to(upcast(q.dtype)), ok, scale, float(p))  # (B, H, T) or (T,)
    q = (q.to(c.dtype) / (c[..., None] if c.dim() == 3 else c.view(T, 1))).to(q.dtype)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=ok, enable_gqa=H != k.shape[1], scale=1.0)


def softmax_step(q: torch.Tensor, e: dict, ok: torch.Tensor, scale, p: float, chunk: int | None) -> torch.Tensor:
    """`softmax_readout`, split over the keys in chunks of `chunk` (`static_split.split_attention`) for
    one query per head (a step) over a buffer of whole chunks; otherwise `softmax_readout` itself."""
    B, H, T, D = q.shape
    k, v = e["k"], e["v"]
    G, N = k.shape[1], k.shape[2]
    if chunk is None or T != 1 or N % chunk:
        return softmax_readout(q, e, ok, scale, p)
    qf = q.float()
    if isinstance(scale, str) and scale != "sqrt_d":  # a divisor read off the visible keys, folded into q
        c = _divisor_naive(expand_heads(k, H).float(), ok, scale, float(p))  # (B, H, 1) or (1,)
        qf = qf / (c[..., None] if c.dim() == 3 else c.view(1, 1))
    else:
        qf = qf * (1 / math.sqrt(D) if scale == "sqrt_d" else float(scale))
    S = N // chunk
    s = torch.einsum("bgrd,bgscd->bgrsc", qf.view(B, G, H // G, D), k.float().view(B, G, S, chunk, D))
    s = s.masked_fill(~ok.view(1, 1, 1, S, chunk), float("-inf"))  # (B, G, r, S, c)
    o = split_attention(s, v.view(B, G, S, chunk, v.shape[-1]))  # (B, G, r, Dv)
    return o.view(B, H, 1, -1).to(q.dtype)


def _readout(a, p, e: dict, kpos: torch.Tensor, positions: torch.Tensor, ok: torch.Tensor,
             chunk: int | None = None) -> torch.Tensor:
    """Layer a's readout (B, H, T, Dv) of its tokens p over the entries e at positions kpos, where ok
    (a softmax step split in chunks of `chunk` keys when given)."""
    H = p.q.shape[1]
    if a.mechanism == "softmax":
        return softmax_step(p.q, e, ok, a.config.scale, a.config.p, chunk)
    work = upcast(p.q.dtype)
    if a.mechanism == "principled":
        B, _, T, _ = p.q.shape
        prm = [check_param(name, getattr(p, name), B, H, T, p.q.to(work)) for name in ("alpha", "beta", "gamma")]
        v0 = None if p.v0 is None else p.v0.to(work).view(-1, p.v0.shape[-1])
        k, kg, v = (expand_heads(e[name], H).to(work) for name in ("k", "kg", "v"))
        o, _ = principled_naive(p.q.to(work), k, p.qg.to(work), kg, v, *prm, v0, False, visible=ok)
        return o.to(p.q.dtype)
    pr = a.prior  # GOAT: q·k/√d + the spectral prior between the positions + u_j (+ the scalar term)
    s = p.q.to(work) @ expand_heads(e["k"], H).to(work).transpose(-1, -2) / math.sqrt(p.q.shape[-1])
    prior = spectral_prior(pr.freqs, pr.lam_sym, pr.lam_asym, positions, kpos, work)[None]  # (1, G, T, m)
    s = s + expand_heads(prior + e["u"][..., 0].to(work)[:, :, None, :], H)
    if a.mechanism == "goat_hybrid":
        s = s + scalar_logits(p.qs.to(work), e["ks"][..., 0].to(work), p.tau, causal=False)
    w = torch.softmax(s.masked_fill(~ok, float("-inf")), dim=-1)
    return (w @ expand_heads(e["v"], H).to(work)).to(p.v.dtype)


class KeyedState(nn.Module):
    """A softmax, GOAT, goat_hybrid or principled layer's static state: a `KeyStore` of its entries.
    chunk: a softmax step over the whole buffer (no ring) is split in chunks of that many keys."""

    def __init__(self, a, batch_size: int, max_len: int, device, dtype, chunk: int | None = None):
        super().__init__()
        self.chunk = chunk
        c, G = a.config, a.n_kv
        entries = {"k": (G, a.qk_dim, dtype), "v": (G, c.head_dim, dtype)}
        if a.mechanism in ("goat", "goat_hybrid"):
            entries["u"] = (G, 1, torch.float32)
        if a.mechanism == "goat_hybrid":
            entries["ks"] = (c.n_heads, 1, torch.float32)
        if a.mechanism == "principled":
            entries["kg"] = (G, c.gate_dim, dtype)
        self.store = KeyStore(entries, batch_size, max_len, c.sliding_window, device)

    def reset(self) -> None:
        self.store.reset()

    def attend(self, a, p, positions: torch.Tensor, n: int) -> torch.Tensor:
        e, kpos, ok = self.store.read(_entries(a, p, positions), positions, n)
        return _readout(a, p, e, kpos, positions, ok, None if self.store.ring else self.chunk)

    def fill(self, a, p, T: int) -> torch.Tensor:
        """A whole prompt of T tokens from position 0: its entries kept (a ring: the last w), the
        layer's own op for its readout."""
        positions = torch.arange(T, device=p.q.device)
        m = min(T, self.store.kpos.shape[0])
        e = _entries(a, p, positions)
        self.store.write({name: x[:, :, T - m :] for name, x in e.items()}, positions[T - m :])
        return a.attend(p)[0]


class RecurrentStore(nn.Module):
    """A GLA or SSD layer's state (B, H, Dk, Dv) in one static buffer, in the op's compute dtype.

    A prompt chunk runs the project's own chunked form (impl="fast"; "naive" when the layer asks for
    it), never flash-linear-attention's kernels, whatever the layer's impl: the state a decoder
    starts from then depends on no autotuning (fla tunes each new shape, minutes for GLA) and on
    none of the Triton versions fla flags as miscompiling on Hopper (Triton < 3.7.1). A step is the
    op's one-token recurrence either way."""

    CHUNKED = {"gla": gla_attention, "ssd": ssd_attention}

    def __init__(self, a, batch_size: int, max_len: int, device, dtype):
        super().__init__()
        c = a.config
        self.register_buffer("state", torch.zeros(batch_size, c.n_heads, a.qk_dim, c.head_dim, dtype=upcast(dtype),
                                                  device=device), persistent=False)

    def reset(self) -> None:
        self.state.zero_()

    def attend(self, a, p, positions: torch.Tensor, n: int) -> torch.Tensor:
        if positions.shape[0] == 1:
            o, new = a.step_op(p.q[:, :, 0], p.k[:, :, 0], p.v[:, :, 0], p, self.state, None)
            o = o.unsqueeze(2)
        else:
            impl = "naive" if a.config.impl == "naive" else "fast"
            o, new = self.CHUNKED[a.mechanism](p.q, p.k, p.v, p.log_decay, initial_state=self.state, causal=True,
                                               impl=impl)
        self.state.copy_(new)
        return o

    def fill(self, a, p, T: int) -> torch.Tensor:
        self.reset()
        return self.attend(a, p, torch.arange(T, device=p.q.device), T)


class CosformerStore(nn.Module):
    """A cosformer layer's state: the sums kv (B, H, 2Dk, Dv) and k_sum (B, H, 2Dk) in static buffers;
    a step's position (the cos reweighting's angle) is the decoder's device tensor."""

    # The decoder stacks no q/k/v weights for this layer (`StaticDecoder._sync_qkv`): with the stacks as
    # graph inputs, torch 2.11's Inductor fuses the copy of the new sums into the kernel that reads the old
    # ones and the compiled step's logits come out wrong (by 0.1 on the tests' model); 2.13 is right either way
    # (tests/test_static_decode.py::test_compiled_steps_of_every_static_state_equal_generate, make test-compat).
    stack_qkv_off = True

    def __init__(self, a, batch_size: int, max_len: int, device, dtype):
        super().__init__()
        c = a.config
        self.horizon = c.cosformer_max_len
        if self.horizon is None or max_len > self.horizon:
            raise ValueError(f"max_len={max_len} is past cosformer's horizon cosformer_max_len={self.horizon} "
                             f"(its reweighting is defined for positions below it)")
        F2, dt = 2 * a.qk_dim, upcast(dtype)
        self.register_buffer("kv", torch.zeros(batch_size, c.n_heads, F2, c.head_dim, dtype=dt, device=device),
                             persistent=False)
        self.register_buffer("k_sum", torch.zeros(batch_size, c.n_heads, F2, dtype=dt, device=device), persistent=False)

    def reset(self) -> None:
        self.kv.zero_()
        self.k_sum.zero_()

    def attend(self, a, p, positions: torch.Tensor, n: int) -> torch.Tensor:
        c = a.config
        if positions.shape[0] == 1:
            o, kv, k_sum = step_update(p.q[:, :, 0], p.k[:, :, 0], p.v[:, :, 0], self.kv, self.k_sum, positions[0],
                                       self.horizon, c.cosformer_normalize)
            o = o.unsqueeze(2)
        else:  # a prompt chunk: the op from the stored sums (its start read on the host once)
            state = CosformerState(self.kv, self.k_sum, int(positions[0]), self.horizon)
            o, new = cosformer_attention(p.q, p.k, p.v, causal=True, max_len=self.horizon,
                                         normalize=c.cosformer_normalize, initial_state=state, impl=c.impl)
            kv, k_sum = new.kv, new.k_sum
        self.kv.copy_(kv)
        self.k_sum.copy_(k_sum)
        return o

    def fill(self, a, p, T: int) -> torch.Tensor:
        self.reset()
        return self.attend(a, p, torch.arange(T, device=p.q.device), T)


def make_state(a, batch_size: int, max_len: int, device, dtype, chunk: int | None = None) -> nn.Module | None:
    """The static state of layer a, or None for the scalar family (the decoder's own buffers); chunk:
    a softmax layer's exact step is split in chunks of that many keys (max_len a multiple of it)."""
    if a.mechanism in KEYED:
        return KeyedState(a, batch_size, max_len, device, dtype, chunk)
    if a.mechanism == "cosformer":
        return CosformerStore(a, batch_size, max_len, device, dtype)
    if a.mechanism in RECURRENT:
        return RecurrentStore(a, batch_size, max_len, device, dtype)
    return None


def own_code(method):
    """`method` (bound) as a function with a code object of its own. Dynamo keeps its compiled graphs,
    and counts recompiles toward `torch._dynamo.config.recompile_limit` (8), per code object: every
    decoder compiling one shared method would share that count, and a process that built more than
    8 different decoders would fail under fullgraph=True. Each decoder's own copy starts at 0, and
    its graphs go with it."""
    f = method.__func__
    code = f.__code__.replace(co_name=f"{f.__name__}_{id(method.__self__):x}")
    fn = types.FunctionType(code, f.__globals__, code.co_name, f.__defaults__, f.__closure__)
    fn.__kwdefaults__, fn.__doc__, fn.__qualname__ = f.__kwdefaults__, f.__doc__, f"{f.__qualname__}_{id(method.__self__):x}"
    return types.MethodType(fn, method.__self__)
