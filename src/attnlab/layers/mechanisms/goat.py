"""mechanism = "goat": dot-product attention plus GOAT's learned log-prior over positions
(docs/mechanisms.md#goat; arXiv 2601.15380). The op is `attnlab.ops.goat_attention`; this module
owns the prior's parameters (`GoatPrior`) and evaluates its key-only term for the positions at hand.

GOAT carries position in its prior and takes no RoPE by default. Each head's width is shared: the
content dot product uses head_dim − 2R − 1 dims and the prior the rest, as in the authors' module,
so the fused kernel runs at the head size of standard attention.

For a retrofit of a pretrained RoPE model (docs/retrofit.md): `goat_width="extra"` keeps all
head_dim dims for q·k and appends the prior's 2R + 1 columns, `goat_rope=True` keeps the model's
rotation, and `goat_prior_init="zero"` starts the log-prior at exactly 0, so the layer starts as
the model's softmax attention.

Static decoding (`attnlab.models.StaticDecoder`) keeps each token's key, value and key-only term u
(at its position, when written) in a `KeyedState` and scores the keys read with the spectral prior
between the stored positions (`goat_readout`, which goat_hybrid shares).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ...checks import trusted
from ...ops import goat_attention
from ...ops.common.heads import expand_heads
from ...ops.common.precision import upcast
from ...ops.goat import spectral_prior
from ..attention import Attention
from ..options import MechanismOptions
from ..rope import RotaryEmbedding
from ..record import Projected
from ..registry import register
from .keyed_static import KeyedState, kv_entries

GOAT_WIDTHS = ("shared", "extra")
GOAT_PRIOR_INITS = ("alibi", "zero")


@dataclass
class GoatPriorOptions(MechanismOptions):
    """GOAT's log-prior over positions, as goat and goat_hybrid take it.

    Args:
        goat_rank: R, frequencies of the relative-position Fourier prior.
        goat_abs_rank: M, absolute Fourier features of the key-only term's network.
        goat_base: base of both frequency ladders, w_r = base^(−r/(R−1)).
        goat_train_len: positions are normalised by this length in the key-only term (a
            model sets it to its max_seq_len), so a layer's output never depends on T.
        goat_width: "shared" (default), the content q·k uses head_dim − 2R − 1 dims and the
            prior the rest; "extra", q·k keeps all head_dim dims and the prior is appended (as a
            retrofit of a pretrained head needs; goat_hybrid too, its scalar term's two columns
            appended as well).
    """

    extra: ClassVar[int] = 0  # head columns besides the prior's that the content q·k gives up (goat_hybrid: 2)

    goat_rank: int = 8
    goat_abs_rank: int = 8
    goat_base: float = 10000.0
    goat_train_len: int = 1024
    goat_width: str = "shared"

    def check(self, config) -> None:
        """GOAT's options, and room for the prior in each head: the content dot product uses
        head_dim − 2R − 1 − extra dims, so the augmented vectors are head_dim wide (as wide as v)
        and the fused kernel costs what standard attention of that head size costs."""
        super().check(config)
        for key in ("goat_rank", "goat_abs_rank", "goat_train_len"):
            config.require_int(key)
        config.require_positive("goat_base")
        if self.goat_width not in GOAT_WIDTHS:
            raise config.error("goat_width", self.goat_width, f"one of {GOAT_WIDTHS}")
        if self.goat_width == "shared" and content_dim(config) < 1:
            raise config.error("goat_rank", self.goat_rank, f"2·goat_rank + {1 + self.extra} < head_dim={config.head_dim} "
                               "(the prior shares the head's width)")


@dataclass
class GoatOptions(GoatPriorOptions):
    """Mechanism "goat"'s options: the prior's (`GoatPriorOptions`) and its start and rotation.

    Args:
        goat_prior_init: "alibi" (default: the authors' init, ALiBi recency slopes) or
            "zero": the log-prior starts at exactly 0 (zero spectral weights, network output and
            bump; a linear slope from 0), every piece with a nonzero gradient.
        goat_rope: RoPE on GOAT's q and k (with rope_base; default off: the prior carries
            position); a retrofit of a RoPE model turns it on.
    """

    goat_prior_init: str = "alibi"
    goat_rope: bool = False

    def check(self, config) -> None:
        super().check(config)
        if self.goat_prior_init not in GOAT_PRIOR_INITS:
            raise config.error("goat_prior_init", self.goat_prior_init, f"one of {GOAT_PRIOR_INITS}")
        if self.goat_rope and content_dim(config) % 2:
            raise config.error("goat_rope", True, f"an even q·k width to rotate pairs; it is {content_dim(config)} "
                               f"(goat_width={self.goat_width!r}; 'extra' keeps head_dim={config.head_dim})")


def content_dim(config) -> int:
    """Width of the content q·k: head_dim less the prior's 2R + 1 columns (and the options' `extra`
    more), or all of head_dim with goat_width="extra"."""
    o = config.options
    if o.goat_width == "extra":
        return config.head_dim
    return config.head_dim - 2 * o.goat_rank - 1 - o.extra


def alibi_slopes(n: int) -> torch.Tensor:
    """ALiBi's geometric head slopes for n heads: 2^(−8i/p) for i = 1..p when n = p is a power of
    two; otherwise those of the power below, then every other slope of the power above."""
    def powers(p: int) -> list[float]:
        return [2.0 ** (-8.0 * i / p) for i in range(1, p + 1)]

    p = 2 ** int(math.floor(math.log2(n)))
    slopes = powers(p) + (powers(2 * p)[0::2][: n - p] if n > p else [])
    return torch.tensor(slopes, dtype=torch.float32)


class GoatPrior(nn.Module):
    """GOAT's learnable log-prior for G key groups: spectral weights lam_sym, lam_asym (G, R) over
    the frequencies base^(−r/(R−1)), and the key-only term

        u_j = gain_g · f(features of j) + bump_g · [j = 0] + softplus(slope_g) · j   (the last: causal only)

    with f a two-layer SiLU network (hidden width 4, no output bias) of [cos ν_m j, sin ν_m j, j / L, log(1 + j) / log(1 + L)],
    L = train_len. Initialised as the authors do: lam_sym ~ N(0, 0.01²), lam_asym = 0, f's weights
    ~ N(0, init_scale²), gain 1, bump 0, slopes the ALiBi slopes of G heads.

    init="zero": the prior starts at exactly 0 with a gradient on every piece: lam_sym = 0, f's output
    weights 0 (its hidden layer random), and the slope is slope_raw itself (starting at 0; softplus
    could only reach 0 in the limit), so u_j = gain_g · f + bump_g · [j = 0] + slope_g · j."""

    def __init__(self, n_groups: int, rank: int, abs_rank: int, base: float, train_len: int,
                 causal: bool = True, init_scale: float = 1e-3, init: str = "alibi"):
        super().__init__()
        if init not in ("alibi", "zero"):
            raise ValueError(f"init must be 'alibi' or 'zero', got {init!r}")
        self.causal, self.train_len, self.init = causal, train_len, init
        self.register_buffer("freqs", base ** (-torch.arange(rank, dtype=torch.float32) / max(rank - 1, 1)))
        self.register_buffer("abs_freqs", base ** (-torch.arange(abs_rank, dtype=torch.float32) / max(abs_rank - 1, 1)))
        self.lam_sym = nn.Parameter(torch.randn(n_groups, rank) * 1e-2)
        self.lam_asym = nn.Parameter(torch.zeros(n_groups, rank))
        n_in = 2 * abs_rank + 2
        hidden = min(2 * n_in, 4)
        # no output bias: a constant added to every u_j cancels in the softmax (its gradient is zero)
        self.fc1, self.fc2 = nn.Linear(n_in, hidden), nn.Linear(hidden, 1, bias=False)
        nn.init.normal_(self.fc1.weight, std=init_scale)
        nn.init.zeros_(self.fc1.bias)
        nn.init.normal_(self.fc2.weight, std=init_scale)
        self.gain = nn.Parameter(torch.ones(n_groups))
        self.bump = nn.Parameter(torch.zeros(n_groups))
        slopes = alibi_slopes(n_groups)
        self.slope_raw = nn.Parameter(slopes + torch.log(-torch.expm1(-slopes)))  # softplus^-1
        if init == "zero":
            with torch.no_grad():
                self.lam_sym.zero_()
                self.fc2.weight.zero_()
                self.slope_raw.zero_()

    def key_term(self, n_keys: int, start: int = 0) -> torch.Tensor:
        """u for key positions start .. start + n_keys − 1: (1, G, n_keys), float32."""
        return self.key_term_at(torch.arange(start, start + n_keys, device=self.freqs.device))

    def key_term_in_docs(self, doc_pos: torch.Tensor) -> torch.Tensor:
        """u of packed documents' keys at their positions inside their documents, doc_pos (B, T)
        (`Projected.doc_pos`): (B, G, T), float32."""
        B, T = doc_pos.shape
        u = self.key_term_at(doc_pos.reshape(-1))  # (1, G, B * T)
        return u[0].view(-1, B, T).transpose(0, 1)

    def key_term_at(self, positions: torch.Tensor) -> torch.Tensor:
        """u for the key positions given (n,), an integer tensor: (1, G, n), float32."""
        t = positions.to(device=self.freqs.device, dtype=torch.float32)
        ph = t[:, None] * self.abs_freqs[None, :]  # (n, M)
        L = float(self.train_len)
        feats = torch.cat([ph.cos(), ph.sin(), (t / L)[:, None], (torch.log1p(t) / math.log1p(L))[:, None]], dim=-1)
        f = self.fc2(F.silu(self.fc1(feats))).squeeze(-1).float()  # (n,)
        u = self.gain[:, None] * f[None, :] + self.bump[:, None] * (t == 0).float()[None, :]
        if self.causal:
            slope = self.slope_raw if self.init == "zero" else F.softplus(self.slope_raw)
            u = u + slope[:, None] * t[None, :]
        return u[None]  # (1, G, n)


def goat_values(layer, p: Projected, positions: torch.Tensor) -> dict:
    """A GOAT layer's static entries of the tokens p at `positions` (T,): keys, values and the
    key-only term u at those positions (B, G, T, 1)."""
    u = layer.prior.key_term_at(positions)  # (1, G, T)
    return {"k": p.k, "v": p.v, "u": u[..., None].expand(p.k.shape[0], -1, -1, 1)}


def goat_readout(layer, p: Projected, e: dict, kpos: torch.Tensor, positions: torch.Tensor, ok: torch.Tensor,
                 scalar_term=None) -> torch.Tensor:
    """The readout (B, H, T, Dv) of the tokens p at `positions` over the stored entries e at kpos where
    ok: softmax of q·k/√d + the spectral prior between the positions + u_j (+ scalar_term(work), the
    hybrid's scalar logits (B, H, T, m) in the compute dtype)."""
    H, work, pr = p.q.shape[1], upcast(p.q.dtype), layer.prior
    s = p.q.to(work) @ expand_heads(e["k"], H).to(work).transpose(-1, -2) / math.sqrt(p.q.shape[-1])
    prior = spectral_prior(pr.freqs, pr.lam_sym, pr.lam_asym, positions, kpos, work)[None]  # (1, G, T, m)
    s = s + expand_heads(prior + e["u"][..., 0].to(work)[:, :, None, :], H)
    if scalar_term is not None:
        s = s + scalar_term(work)
    w = torch.softmax(s.masked_fill(~ok, float("-inf")), dim=-1)
    return (w @ expand_heads(e["v"], H).to(work)).to(p.v.dtype)


@register
class GoatAttention(Attention):
    mechanism = "goat"
    Options = GoatOptions
    uses = ("n_kv_heads", "rope_base", "sliding_window")

    @classmethod
    def configure(cls, config) -> None:
        config.set_vector_heads(config.n_heads)

    @classmethod
    def model_defaults(cls, max_seq_len: int) -> dict:
        return {**super().model_defaults(max_seq_len), **({"goat_train_len": max_seq_len} if max_seq_len else {})}

    def build(self, c) -> None:
        self.build_vectors(c, c.n_heads, content_dim(c))
        o = c.options
        if o.goat_rope:  # an option of its own, so a model-wide `rope` never reaches GOAT layers
            self.rope = RotaryEmbedding(self.qk_dim, c.rope_base)
        self.prior = GoatPrior(self.n_kv, o.goat_rank, o.goat_abs_rank, o.goat_base, o.goat_train_len,
                               init=o.goat_prior_init)

    def takes_documents(self, device) -> bool:
        """Packed documents in one pass: the prior's spectral part reads i − j, the same in any
        document, and the key-only term is evaluated at each key's position inside its document."""
        return True

    def goat(self, q, k, v, impl, start: int = 0, docs=None, doc_pos=None, **scalar):
        """The op over keys at positions start .. start + Tk − 1 (a sliding window's cache holds the
        last ones only: the key-only term follows their positions); with packed documents' ids docs
        (B, Tk), at each key's position inside its document, doc_pos."""
        pr = self.prior
        u = pr.key_term(k.shape[2], start) if docs is None else pr.key_term_in_docs(doc_pos)
        return goat_attention(q, k, v, pr.freqs, pr.lam_sym, pr.lam_asym, u, causal=True, impl=impl,
                              window=self.config.sliding_window, docs=docs, **scalar)

    def attend(self, p: Projected, values=None, impl: str | None = None):
        return self.goat(p.q, p.k, p.v if values is None else values, impl or self.config.impl, docs=p.docs,
                         doc_pos=p.doc_pos), None

    def step_readout(self, p: Projected, cache):
        full = cache.kv.append(k=p.k, v=p.v)  # one query against every cached key: the op's offset form
        start = cache.pos + p.k.shape[2] - full["k"].shape[2]  # the first held key's position
        with trusted(full["k"], full["v"]):  # checked token by token at append, not again each step
            return self.goat(p.q, full["k"], full["v"], self.config.impl, start)

    # ------------------------------------------------------------------ static decoding (keyed_static.py)

    def static_state(self, opts) -> KeyedState:
        return KeyedState(self, opts)

    def static_entries(self, dtype) -> dict:
        return {**kv_entries(self, dtype), "u": (self.n_kv, 1, torch.float32)}

    def static_values(self, p: Projected, positions) -> dict:
        return goat_values(self, p, positions)

    def static_readout(self, p: Projected, e: dict, kpos, positions, ok, chunk):
        return goat_readout(self, p, e, kpos, positions, ok)
