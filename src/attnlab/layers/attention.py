"""`Attention`: one causal self-attention layer, `(B, T, C) -> (B, T, C)`, for every mechanism.

    x ──project──> per-head tensors ──attend (the mechanism's op)──> readout o (B, H, T, D)
      ──finish: output gate, W_O──> y

`Attention(config)` returns the class registered for `config.mechanism` (see `attnlab.layers.mechanisms`):
each mechanism is one module holding its parameters, its projection, its full-sequence attend, its
decode cache and step, and the inputs it records. This base class keeps what every mechanism shares:
input checks, the vector q/k/v projections with RoPE that most mechanisms use, the output gate and
projection, the record, the attention weights for analysis, and the decode loop (`make_cache`, `step`),
which calls the same op as the forward with one query against every cached key. The math of each
mechanism is in docs/mechanisms.md; adding one is walked through in docs/adding-a-mechanism.md.
"""

from __future__ import annotations

from typing import ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from ..cache.kv import KVCache
from ..cache.options import DecodeOptions, KeyRule, check_key_rule
from ..checks import IMPLS
from ..data.packing import positions_in_doc
from .config import AttentionConfig
from .options import MechanismOptions
from .gate import OutputGate
from .inputs import check_layer_input, check_start
from .layer_cache import LayerCache
from .record import AttentionRecord, Projected
from .rope import RotaryEmbedding


OUT_NORM_EPS = 1e-6  # output_norm's epsilon; its learned scale is flat, H·Dv values: no weight decay, as norms


def heads(x: torch.Tensor, n: int, d: int) -> torch.Tensor:
    """(B, T, n*d) -> (B, n, T, d)."""
    B, T, _ = x.shape
    return x.view(B, T, n, d).transpose(1, 2)


class Attention(nn.Module):
    """Causal self-attention configured by an `AttentionConfig`; see the module docstring.

    A mechanism subclass sets the class attributes below and implements `attend` and
    `step_readout`, and `build`, `project` and `init_cache` where the defaults (vector q/k/v for
    every head, a plain KV cache) do not fit.

    Args:
        config: the layer's configuration; `Attention(config)` builds the class registered for
            ``config.mechanism``.

    Raises:
        TypeError: config is not an AttentionConfig.
        ValueError: a subclass given a config of another mechanism.
    """

    mechanism: ClassVar[str] = ""
    Options: ClassVar[type[MechanismOptions] | None] = None  # its own options (AttentionConfig.options); None: none
    uses: ClassVar[tuple[str, ...]] = ()  # the shared AttentionConfig fields it reads beyond SHARED_FIELDS
    options: ClassVar[tuple[str, ...]] = ()  # every key it reads beyond SHARED_FIELDS: `uses`, then its Options' keys
    recurrent: ClassVar[bool] = False  # linear family: decodes from a state; weights unnormalised
    scalar: ClassVar[bool] = False  # has scalar heads (qs, ks, τ): regularizers, the sorted cache
    sorted_decode: ClassVar[bool] = False  # its scalar heads decode through the sorted cache, read keys by a KeyRule
    rope_default: ClassVar[bool] = True  # RoPE on its vector queries/keys unless configured
    impls: ClassVar[tuple[str, ...]] = IMPLS  # the AttentionConfig.impl values it takes
    prenorm_gate: ClassVar[bool] = False  # takes output_gate="prenorm" (a gate on its normaliser)

    def __init_subclass__(cls, **kwargs):
        super().__init_subclass__(**kwargs)
        cls.options = (*cls.uses, *(cls.Options.keys() if cls.Options is not None else ()))

    def __new__(cls, config: AttentionConfig | None = None, *args, **kwargs):
        if cls is Attention:
            if not isinstance(config, AttentionConfig):
                raise TypeError(f"config must be an AttentionConfig, got {type(config).__name__}")
            from .registry import mechanism_class

            cls = mechanism_class(config.mechanism)
        return super().__new__(cls)

    def __init__(self, config: AttentionConfig):
        super().__init__()
        if not isinstance(config, AttentionConfig):
            raise TypeError(f"config must be an AttentionConfig, got {type(config).__name__}")
        if config.mechanism != self.mechanism:
            raise ValueError(f"{type(self).__name__} implements mechanism {self.mechanism!r}, got {config.mechanism!r}")
        self.config = c = config
        self.n_scalar = self.scalar_heads(c)  # heads with scalar queries/keys
        self.n_dot, self.n_kv = self.vector_heads(c), c.n_kv_heads  # vector-scoring heads and their kv groups
        self.build(c)
        self.gate = OutputGate(c.output_gate, c.d_model, c.n_heads, c.head_dim, c.output_gate_scale) if c.output_gate else None
        self.out_norm = nn.Parameter(torch.ones(c.n_heads * c.head_dim)) if c.output_norm else None
        self.wo = nn.Linear(c.n_heads * c.head_dim, c.d_model, bias=c.bias)
        self.last: AttentionRecord | None = None

    # ------------------------------------------------------------------ per mechanism

    @classmethod
    def configure(cls, config: AttentionConfig) -> None:
        """Fill the mechanism's derived fields of `config` and check its options (ValueError
        naming the field). Called by `AttentionConfig.__post_init__`."""

    @classmethod
    def scalar_heads(cls, config: AttentionConfig) -> int:
        """How many heads take scalar queries/keys (they come first)."""
        return 0

    @classmethod
    def vector_heads(cls, config: AttentionConfig) -> int:
        """How many heads score with vector queries/keys (a hybrid head does both)."""
        return config.n_heads

    @classmethod
    def model_defaults(cls, max_seq_len: int) -> dict:
        """Defaults of this mechanism's options inside a model built for max_seq_len tokens."""
        return {"rope": cls.rope_default} if "rope" in cls.options else {}

    @classmethod
    def horizon(cls, config: AttentionConfig) -> int | None:
        """The longest sequence a layer of this config can take (None: no limit)."""
        return None

    def build(self, c: AttentionConfig) -> None:
        """Create the mechanism's parameters from c, the layer's config (``self.config``): by default
        q, k, v projections (and RoPE) for every head."""
        self.build_vectors(c, c.n_heads)

    def project(self, x: torch.Tensor, start_pos: int = 0, qkv=None) -> Projected:
        """x (B, T, C) at absolute positions start_pos.. -> the per-head tensors (see `Projected`):
        by default q, k (rotated when RoPE is on) and v of every head. qkv: `vectors`' fused weights."""
        self.check_start(start_pos)
        q, k, v = self.vectors(x, self.config.n_heads, qkv)
        q, k = self.rotate(q, k, start_pos)
        return Projected(start_pos=start_pos, q=q, k=k, v=v)

    def attend(self, p: Projected, values=None, impl: str | None = None):
        """Attend over the whole sequence (causal).

        Args:
            p: the per-head tensors of `project` (T tokens).
            values: replaces every head's values (for `attention_weights`), shape (B, G, T[+1], Dv)
                with G = `value_groups` (T + 1 with a sink); None for the projected values.
            impl: the ops' path, ``"auto"``, ``"naive"`` or ``"fast"``; None for ``config.impl``.

        Returns:
            The readout (B, H, T, D) (Dv = the values' width when values is given), and the
            scalar-op inputs to record (qs, ks, values, tau, q_score, k_score, n_prefix), or
            None for mechanisms without scalar heads.
        """
        raise NotImplementedError(f"{type(self).__name__} must define attend()")

    @property
    def value_groups(self) -> int:
        """How many value groups `attend(values=...)` takes."""
        return self.n_kv

    @property
    def prefix_keys(self) -> int:
        """Keys before the sequence's own that every query reads (a sink: 1), as `attention_weights`
        returns them."""
        return 0

    def init_cache(self, cache: LayerCache, window: int | None, max_len: int | None) -> None:
        """Set up `cache`, the new LayerCache `make_cache` made, for decoding with `window` (the sorted
        cache's, scalar/hybrid heads; or None) and `max_len` (the cosformer horizon, or None): by
        default a plain KV cache of the vector heads."""
        cache.kv = KVCache(cache.batch_size, window=self.config.sliding_window)

    def step_readout(self, p: Projected, cache: LayerCache) -> torch.Tensor:
        """Readout (B, H, 1, D) of one token's projections `p`, appending to `cache`."""
        raise NotImplementedError(f"{type(self).__name__} must define step_readout()")

    def prefill_readout(self, p: Projected, cache: LayerCache) -> torch.Tensor | None:
        """Readout (B, H, T, D) of T tokens' projections `p` at once, appending them to `cache`;
        or None, having changed nothing, when this cache takes one token at a time.

        By default `step_readout`: a step appends its keys and calls the op with fewer queries than
        keys (causal, bottom-right aligned), which is the same call for T queries as for one. A
        mechanism whose step reads only token 0 of `p` overrides this (the linear family)."""
        return self.step_readout(p, cache)

    # ------------------------------------------------------------------ shared pieces

    def build_vectors(self, c: AttentionConfig, n_heads: int, qk_dim: int | None = None) -> None:
        """q (n_heads) and k (n_kv groups) projections of width qk_dim (default head_dim), v of width
        head_dim, and RoPE when configured."""
        D, self.qk_dim = c.head_dim, qk_dim or c.head_dim
        self.wq = nn.Linear(c.d_model, n_heads * self.qk_dim, bias=c.bias)
        self.wk = nn.Linear(c.d_model, self.n_kv * self.qk_dim, bias=c.bias)
        self.wv = nn.Linear(c.d_model, self.n_kv * D, bias=c.bias)
        self.rope = RotaryEmbedding(self.qk_dim, c.rope_base) if c.rope else None

    def vectors(self, x: torch.Tensor, n_heads: int, qkv=None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The vector projections of x, before RoPE.

        Args:
            x: the layer input (B, T, C).
            n_heads: the query heads to project (the vector-scoring heads of the layer).
            qkv: (weight, bias or None): wq, wk and wv stacked into one matrix (`fused_qkv`), as a
                decoder keeps them between steps; None stacks them here, at every call (training).

        Returns:
            q (B, n_heads, T, qk_dim), k (B, n_kv, T, qk_dim) and v (B, n_kv, T, head_dim).
        """
        d, D = self.qk_dim, self.config.head_dim
        if qkv is None and self.fusable():  # one matmul (wrapped ones, LoRA's, apart)
            qkv = self.fused_qkv()
        if qkv is not None:
            out = F.linear(x, *qkv)
            q, k, v = out.split([n_heads * d, self.n_kv * d, self.n_kv * D], dim=-1)
            return heads(q, n_heads, d), heads(k, self.n_kv, d), heads(v, self.n_kv, D)
        return heads(self.wq(x), n_heads, d), heads(self.wk(x), self.n_kv, d), heads(self.wv(x), self.n_kv, D)

    def fusable(self) -> bool:
        """Whether wq, wk and wv are plain linear maps, projected as one matmul (`fused_qkv`)."""
        return all(type(getattr(self, n, None)) is nn.Linear for n in ("wq", "wk", "wv"))

    def fused_qkv(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """wq, wk and wv stacked: (weight (q + k + v out, C), bias or None), in `vectors`' order."""
        bias = None if self.wq.bias is None else torch.cat([self.wq.bias, self.wk.bias, self.wv.bias])
        return torch.cat([self.wq.weight, self.wk.weight, self.wv.weight]), bias

    def rotate(self, q: torch.Tensor, k: torch.Tensor, start_pos: int) -> tuple[torch.Tensor, torch.Tensor]:
        """q (B, H, T, qk_dim) and k (B, G, T, qk_dim) rotated by RoPE at absolute positions
        start_pos.. (start_pos: token 0's, an int >= 0; unchanged without RoPE)."""
        if self.rope is None:
            return q, k
        return self.rope.rotate_pair(q, k, start_pos)

    def check_input(self, x, name: str = "x") -> None:
        """x: a finite floating (B, T, d_model) tensor in the layer's dtype (`inputs.check_layer_input`)."""
        check_layer_input(x, self.config.d_model, self.wo.weight.dtype, name)

    check_start = staticmethod(check_start)

    def _finish(self, o: torch.Tensor, x: torch.Tensor):
        if self.out_norm is not None:
            B, H, T, D = o.shape
            o = F.rms_norm(o, (D,), eps=OUT_NORM_EPS) * self.out_norm.view(H, 1, D).to(o.dtype)
        if self.gate is not None:  # the gate applied in the copy to W_O's layout (OutputGate.gated)
            y, g = self.gate.gated(o, x)
            return self.wo(y), g
        B, H, T, D = o.shape
        return self.wo(o.transpose(1, 2).reshape(B, T, H * D)), None  # (B, T, C)

    def finish(self, o: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """Readout o (B, H, T, D) and the layer input x (B, T, C) -> output (B, T, C): gate, then W_O."""
        return self._finish(o, x)[0]

    # ------------------------------------------------------------------ forward and analysis

    def forward(self, x: torch.Tensor, record: bool = False, docs: torch.Tensor | None = None,
                key_rule: KeyRule | None = None) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C). record=True keeps an `AttentionRecord` in `self.last`. docs (B, T):
        packed documents' ids, where `takes_documents` allows them: each token attends within its own
        document only, at positions counted from the document's first token (RoPE). key_rule: the
        `KeyRule` of the keys a `sorted_decode` layer's scalar heads read; None: every key (or its trained window)."""
        self.check_input(x)
        check_key_rule(key_rule, self)
        if docs is not None and (key_rule is not None or not self.takes_documents(x.device)):
            raise ValueError(f"docs: mechanism {self.mechanism!r} with these settings does not keep packed documents "
                             f"apart on {x.device} (see takes_documents); attnlab.models.LM re-pads them instead")
        doc_pos = None if docs is None else positions_in_doc(docs)
        p = self.project(x, 0 if docs is None else doc_pos)
        p.docs, p.doc_pos, p.key_rule = docs, doc_pos, key_rule
        o, scal = self.attend(p)
        y, g = self._finish(o, x)
        if record:
            rec = AttentionRecord(self.mechanism, p, o, g, causal=True, impl=self.config.impl)
            if scal is not None:
                rec.qs, rec.ks, _, rec.tau, rec.q_score, rec.k_score, rec.n_prefix = scal
            self.last = rec
        return y

    def takes_documents(self, device: torch.device) -> bool:
        """Whether `forward(x, docs=...)` keeps packed documents apart on `device` in one pass over
        the packed sequence (an op that masks other documents inside its kernel, no re-padding).
        None does by default; `attnlab.models.LM` re-pads documents for a model with any layer that
        does not."""
        return False

    def triton_route(self, device: torch.device) -> bool:
        """Whether this layer's ops run the Triton kernels on `device` (`ops.scalar.triton_route`)."""
        from ..ops.common.triton_route import triton_route

        return triton_route(self.config.impl, device)

    def attention_weights(self, x: torch.Tensor, key_rule: KeyRule | None = None) -> torch.Tensor:
        """The mixing weights of every head, from the naive ops.

        Every mechanism's readout is linear in v, so the weights are its output with v = I.
        Principled rows sum to 1 − w0 (the ground weight is left out). For the linear family this
        is the effective causal matrix A with o = A v: cosformer's normalised scores, GLA/SSD's
        decayed scale·q·k (not normalised). Materialises T×T (and T×T values): for small T.

        Args:
            x: the layer input (B, T, C), checked as in `forward`.
            key_rule: the scalar heads' `KeyRule`, as `forward` takes it.

        Returns:
            (B, H, T, T), or (B, H, T, T+1) with a sink (column 0 is the sink; dot-product heads
            of a mixed layer put 0 there), in x's dtype.

        Raises:
            TypeError: x is not a floating tensor of the layer's dtype.
            ValueError: x is not (B, T, d_model), or holds NaN or inf.
        """
        self.check_input(x)
        check_key_rule(key_rule, self)
        p = self.project(x, 0)
        p.key_rule = key_rule
        B, T = x.shape[:2]
        n_keys = T + self.prefix_keys
        eye = torch.eye(n_keys, dtype=x.dtype, device=x.device).expand(B, self.value_groups, n_keys, n_keys)
        return self.attend(p, values=eye, impl="naive")[0]

    # ------------------------------------------------------------------ decode

    def make_cache(self, batch_size: int, *, window: int | None = None, max_len: int | None = None,
                   budget: int | None = None, compress: float | None = None, exact: bool = False) -> LayerCache:
        """A new, empty decode cache for `step` and `prefill`.

        A layer trained through a window (`train_window`) decodes through it when window is None;
        exact=True decodes it over every key instead (what the window saves, or costs).

        Args:
            batch_size: B, the batch of every step; an int >= 1.
            window: (scalar/hybrid heads only) use the sorted scalar cache attending the `window`
                nearest keys instead of the exact cache; None for every key.
            max_len: (cosformer) the position horizon M; None for config.cosformer_max_len.
            budget: (with window) after each step the sorted cache keeps at most `budget` keys per
                head (`SortedScalarCache.evict_to_budget`); an int >= 1 or None.
            compress: (with window) after each step the sorted cache merges every aligned run of 4
                keys spanning <= compress (`compress_density`); a finite float >= 0 or None.
            exact: decode a window-trained layer over every key; takes no window.

        Raises:
            ValueError: an argument out of range or not an int (a float for compress), a window
                for a layer without scalar heads, max_len for a mechanism other than cosformer,
                budget or compress without a window, exact that is not a bool or comes with a
                window.
        """
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if window is not None and not self.n_scalar:
            raise ValueError(
                f"window is for scalar and hybrid heads; mechanism {self.mechanism!r} has none (got window={window!r})"
            )
        if max_len is not None and "cosformer_max_len" not in self.options:
            raise ValueError(f"max_len is the cosformer horizon; mechanism {self.mechanism!r} takes none (got {max_len!r})")
        DecodeOptions(window=window, budget=budget, compress=compress, exact=exact)  # the values, as every decode checks them
        cache = LayerCache(batch_size, window=window, budget=budget, compress=None if compress is None else float(compress),
                           exact=exact)
        self.init_cache(cache, window, max_len)
        return cache

    def step(self, x_t: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        """One decode token: x_t (B, 1, C) -> y_t (B, 1, C); appends to `cache`. T steps equal
        `forward` on the whole sequence."""
        if not isinstance(cache, LayerCache):
            raise TypeError(f"cache must come from make_cache, got {type(cache).__name__}")
        self.check_input(x_t, "x_t")
        if x_t.shape[1] != 1:
            raise ValueError(f"x_t must be one token (B, 1, d_model), got {tuple(x_t.shape)}")
        if x_t.shape[0] != cache.batch_size:
            raise ValueError(f"x_t has batch {x_t.shape[0]}, the cache was made for batch_size={cache.batch_size}")
        o = self.step_readout(self.project(x_t, cache.pos), cache)
        cache.pos += 1
        return self.finish(o, x_t)  # (B, 1, C)

    def prefill(self, x: torch.Tensor, cache: LayerCache) -> torch.Tensor:
        """T tokens at once: x (B, T, C) -> y (B, T, C), appending them to `cache` (empty or not).
        Equals T calls of `step` (one parallel op call instead of T; tested for every mechanism)."""
        if not isinstance(cache, LayerCache):
            raise TypeError(f"cache must come from make_cache, got {type(cache).__name__}")
        self.check_input(x)
        if x.shape[0] != cache.batch_size:
            raise ValueError(f"x has batch {x.shape[0]}, the cache was made for batch_size={cache.batch_size}")
        T = x.shape[1]
        if T == 0:
            return x.new_zeros(x.shape)
        o = self.prefill_readout(self.project(x, cache.pos), cache)
        if o is None:  # this cache (e.g. a sorted cache that evicts) takes one token at a time
            return torch.cat([self.step(x[:, t : t + 1], cache) for t in range(T)], dim=1)
        cache.pos += T
        return self.finish(o, x)  # (B, T, C)

    def extra_repr(self) -> str:
        """The line `print(layer)` shows: mechanism, heads, head size, kv heads, scalar heads."""
        c = self.config
        return f"mechanism={c.mechanism}, heads={c.n_heads}, head_dim={c.head_dim}, kv_heads={self.n_kv}, scalar_heads={self.n_scalar}"
