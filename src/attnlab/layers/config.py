"""`AttentionConfig`: every choice of the `Attention` layer in one validated dataclass.

Derived fields (head sizes, head counts) are filled in `__post_init__`; any bad value raises a
ValueError that names the field, what it got and what it needs.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..checks import IMPLS
from ..ops.scalar import KERNELS
from ..ops.softmax import SCALES
from .params import TAU_PARAMS
from .typed_fields import field_problem

# Fields every mechanism reads; each mechanism class lists the others it reads in `options`.
LAYER_IMPLS = (*IMPLS, "approx", "triton")  # each mechanism class says which it takes (`Attention.impls`)
SHARED_FIELDS = ("d_model", "n_heads", "mechanism", "head_dim", "output_gate", "output_gate_scale", "output_norm", "bias",
                 "impl")
TAU_MODES = ("global", "head", "token")
PARAM_FORMS = ("constant", "layer", "head", "query")
V0_FORMS = ("zero", "layer", "head")
OUTPUT_GATES = (None, "elementwise", "headwise", "prenorm")
GOAT_WIDTHS = ("shared", "extra")
GOAT_PRIOR_INITS = ("alibi", "zero")


def _err(field: str, got, need: str) -> ValueError:
    return ValueError(f"AttentionConfig.{field}: got {got!r}, need {need}")


def _int(field: str, value, lo: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise _err(field, value, f"an int >= {lo}")


def _pos(field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise _err(field, value, "a number > 0")


@dataclass
class AttentionConfig:
    """Configuration of one attention layer; `(B, T, d_model) -> (B, T, d_model)`.

    Every mechanism reads the shared fields (d_model, n_heads, mechanism, head_dim, output_gate,
    output_gate_scale, output_norm, bias, impl) and the fields its class lists in `options`
    (`attnlab.layers.mechanism_class(name).options`); a field it does not read must keep its
    default, and setting it is an error. Each field below says which mechanisms read it;
    docs/mechanisms.md has the math. Derived fields are filled in when left None.

    Args:
        d_model: width of the residual stream C.
        n_heads: H, the number of query heads (scalar and dot-product together).
        mechanism: a registered name: "softmax", "scalar", "hybrid", "principled", "cosformer",
            "gla", "ssd", "goat", "goat_hybrid", ... (`attnlab.layers.MECHANISMS`).
        head_dim: D, the per-head width of q, k and v (derived: d_model // n_heads).
        n_kv_heads: key/value heads of the dot-product heads (GQA); must divide their number
            (derived: all of them). The linear family needs n_kv_heads == n_heads.
        n_scalar_heads: mechanism "scalar" only: how many of the H heads are scalar heads
            (derived: all). The other H - n_scalar_heads heads are standard softmax dot-product
            heads, and the head outputs are concatenated: the proposal's hybrid architecture.
        n_value_groups: G, value groups read by the scalar heads (grouped value attention; head h
            reads group h // (H_s / G)); must divide n_scalar_heads (derived: one group per
            scalar head). For "hybrid", use n_kv_heads instead.
        scale: softmax, and the dot-product heads of "scalar": the score scaling of
            `softmax_attention` ("sqrt_d", "ktotal", "kmean", "krms", "pnorm", "n_sqrt_d" or a
            float > 0).
        p: the p of scale "pnorm" (> 0).
        rope: every mechanism but goat and goat_hybrid: rotary position embedding on vector
            queries/keys (never on scalar ones: a scalar has no rotation).
        rope_base: RoPE's frequency base (> 0), for rope and goat_rope.
        tau: scalar, hybrid, goat_hybrid: the temperature form, "global" (one τ), "head" (one
            per head) or "token" (one per head and token, from the input). Kept positive.
        tau_init: τ at initialisation (> 1e-6).
        tau_param: "softplus" (τ = 1e-6 + softplus(raw)) or "log" (τ = 1e-6 + exp(raw)): the
            parameter the optimizer moves; in log space a step changes τ relatively.
        tau_max: optional upper cap: τ = 1e-6 + (tau_max − 1e-6)·sigmoid(raw), smooth, ≤ tau_max
            (> tau_init).
        scalar_gain: "hybrid" only: None (default), or a learned per-head scale λ on the scalar
            term, q·k/√d − λ(qs − ks)²/τ, starting at this value. 0.0 starts exactly at standard
            attention with a nonzero gradient on λ (docs/retrofit.md).
        sink: scalar, hybrid: add a learned sink: one extra key, visible to every query, with fixed scalar key
            `sink_key` (and a zero vector key for hybrid heads) and a learned value per value
            group.
        sink_key: the sink's scalar key.
        sink_weight: with sink: None (default; the sink's term in the normaliser is e^score like
            any key's), or a learned per-head weight w on that term, w·e^score, starting at this
            value (>= 0; the layer uses |w|). 0.0 starts with no sink mass and a nonzero gradient
            on w (docs/retrofit.md#the-sink).
        train_window: scalar, hybrid: None (default: exact attention), or k: every scalar/hybrid head reads only
            each query's k nearest keys in scalar space (newest first among equal distances), the
            sink, and the local window: what the sorted cache decodes with, in training too
            (ops.windowed_attention, O(T·k) memory). Decoding then defaults to the sorted cache
            with window k. Not with impl "approx".
        sliding_window: softmax, goat, goat_hybrid, principled, scalar and hybrid (not with
            train_window): None (default: every earlier key), or w: each query reads only the last
            w keys, itself included (Mistral / Gemma's sliding-window attention), and the sink
            where the mechanism has one (scalar, hybrid: `sink`), as StreamingLLM keeps it. Trained
            and evaluated as such, and decoded from a cache of the last w keys (constant memory
            and cost per step at any context length). docs/mechanisms.md#sliding-window.
        local_window: with train_window: the last w keys are always read (a ring buffer in
            decoding) and the k nearest are taken among the older keys (default 0).
        kernel: scalar, hybrid: the scalar term's kernel, "gaussian" (default, −(qs − ks)²/τ) or
            "cauchy" (−log(1 + (qs − ks)²/τ), weights 1/(1 + (qs − ks)²/τ), heavier-tailed as in
            ZETA). Both select the same nearest keys, so the sorted cache and train_window carry
            over; "cauchy" has no fused path (query chunks; docs/mechanisms.md). Not with impl "approx".
        alpha: principled (docs/mechanisms.md#principled-attention): the form of α, "constant"
            (the alpha_init value), "layer" (one learned scalar), "head" (one per head) or
            "query" (learned from q_i per head).
        beta: principled: the form of β, as alpha.
        gamma: principled: the form of γ, as alpha.
        alpha_init: principled: α's initial value (standard attention is the limit of α, β and
            γ at -inf; large negative values approach it).
        beta_init: principled: β's initial value.
        gamma_init: principled: γ's initial value.
        v0: principled: the ground value, "zero", "layer" (one learned vector) or "head" (one
            per head).
        gate_dim: principled: width of the gate projections qg, kg (derived: head_dim).
        cosformer_normalize: cosformer: keep cosFormer's normaliser (True) or drop it.
        cosformer_max_len: cosformer: the horizon M of the cos reweighting cos(π(i−j)/2M); None:
            M = T of each forward call (the original choice); decoding then needs
            `make_cache(..., max_len=M)` and equals forward on sequences of length M.
        gla_rank: gla: rank of the low-rank decay gate.
        gla_normalizer: gla: divides the gate's log-sigmoid (> 0).
        goat_rank: goat and goat_hybrid (as the next four): R, frequencies of the
            relative-position Fourier prior.
        goat_abs_rank: M, absolute Fourier features of the key-only term's network.
        goat_base: base of both frequency ladders, w_r = base^(−r/(R−1)).
        goat_train_len: positions are normalised by this length in the key-only term (a model
            sets it to its max_seq_len), so a layer's output never depends on T.
        goat_width: "shared" (default), the content q·k uses head_dim − 2R − 1 dims and the
            prior the rest; "extra", q·k keeps all head_dim dims and the prior is appended (as a
            retrofit of a pretrained head needs; goat_hybrid too, its scalar term's two columns
            appended as well). goat_hybrid also reads the scalar options above, but no sink.
        goat_prior_init: goat: "alibi" (default: the authors' init, ALiBi recency slopes) or
            "zero": the log-prior starts at exactly 0 (zero spectral weights, network output and
            bump; a linear slope from 0), every piece with a nonzero gradient.
        goat_rope: goat: RoPE on GOAT's q and k (with rope_base; default off: the prior carries
            position); a retrofit of a RoPE model turns it on.
        output_gate: None, "elementwise" or "headwise": a post-readout sigmoid gate from the layer
            input, zero-initialised weights (starts at sigmoid(0) = 0.5), applied before the
            output projection. "prenorm" (cosformer only): the gate on the numerator over a
            per-head gate on the normaliser, σ(g) / σ(g').
        output_gate_scale: c in the gate c·σ(x W_g) (elementwise, headwise; default 1). With
            c = 2 the gate starts at exactly 1, the identity (docs/retrofit.md).
        output_norm: RMS-normalise each head's readout over its channels, times a learned scale
            per head and channel (starting at 1), before the output gate and W_O: a linear-attention
            readout, unnormalised (GLA, SSD), enters W_O at unit scale whatever its sum's size, as
            in flash-linear-attention's GLA layer (its RMSNorm on the output). Default False.
        bias: biases in the q/k/v/output projections.
        impl: the ops' "auto", "naive" or "fast"; "approx" (mechanism "scalar" only): the scalar
            heads run `attnlab.ops.scalar_attention_approx`
            (docs/mechanisms.md#approximate-scalar-attention), dot-product heads and decoding
            stay exact; "triton" (mechanisms scalar, hybrid, principled, without a sliding or trained
            window): their Triton kernels, which "auto" picks on CUDA (on the CPU they run under
            TRITON_INTERPRET=1 only, for tests).

    Raises:
        ValueError: any bad value, naming the field (`AttentionConfig.<field>`), what it got and
            what it needs: a value that does not fit its type (a bool for an int, NaN), a number
            out of range, an unknown choice, a field the mechanism does not read set away from
            its default, or sizes that do not divide.
    """

    d_model: int
    n_heads: int
    mechanism: str = "softmax"
    head_dim: int | None = None
    n_kv_heads: int | None = None
    n_scalar_heads: int | None = None
    n_value_groups: int | None = None
    scale: str | float = "sqrt_d"
    p: float = 2.0
    rope: bool = False
    rope_base: float = 10000.0
    tau: str = "head"
    tau_init: float = 0.1
    tau_param: str = "softplus"
    tau_max: float | None = None
    scalar_gain: float | None = None
    sink: bool = False
    sink_key: float = 0.0
    sink_weight: float | None = None
    train_window: int | None = None
    sliding_window: int | None = None
    local_window: int = 0
    kernel: str = "gaussian"
    alpha: str = "head"
    beta: str = "head"
    gamma: str = "head"
    alpha_init: float = 0.0
    beta_init: float = 0.0
    gamma_init: float = 0.0
    v0: str = "zero"
    gate_dim: int | None = None
    cosformer_normalize: bool = True
    cosformer_max_len: int | None = None
    gla_rank: int = 16
    gla_normalizer: float = 16.0
    goat_rank: int = 8
    goat_abs_rank: int = 8
    goat_base: float = 10000.0
    goat_train_len: int = 1024
    goat_width: str = "shared"
    goat_prior_init: str = "alibi"
    goat_rope: bool = False
    output_gate: str | None = None
    output_gate_scale: float = 1.0
    output_norm: bool = False
    bias: bool = False
    impl: str = "auto"

    def __post_init__(self):
        from .registry import REGISTRY  # filled by the mechanism modules, which build on this one

        found = field_problem(self)
        if found:
            raise _err(*found)
        _int("d_model", self.d_model)
        _int("n_heads", self.n_heads)
        if self.mechanism not in REGISTRY:
            raise _err("mechanism", self.mechanism, f"one of {tuple(REGISTRY)}")
        cls = REGISTRY[self.mechanism]
        self._check_applicable(cls)
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise _err("head_dim", None, f"an explicit value: d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
            self.head_dim = self.d_model // self.n_heads
        _int("head_dim", self.head_dim)
        self._validate_options()
        self._check_mechanism_choices(cls, REGISTRY)
        cls.configure(self)  # the mechanism's derived fields: its head counts and groups

    def error(self, field: str, got, need: str) -> ValueError:
        """The error for a bad field: names it, what it got and what it needs."""
        return _err(field, got, need)

    def require_int(self, field: str, lo: int = 1) -> int:
        """The value of `field`, checked to be an int >= lo (ValueError naming the field otherwise);
        for a mechanism's `configure`."""
        _int(field, getattr(self, field), lo)
        return getattr(self, field)

    def require_positive(self, field: str) -> float:
        """The value of `field`, checked to be a number > 0 (ValueError naming the field otherwise);
        for a mechanism's `configure`."""
        _pos(field, getattr(self, field))
        return getattr(self, field)

    def _check_applicable(self, cls) -> None:
        """A field the mechanism does not read must keep its default: setting it is an error."""
        for f in dataclasses.fields(self):
            if f.name in SHARED_FIELDS or f.name in cls.options:
                continue
            if getattr(self, f.name) != f.default:
                raise _err(
                    f.name, getattr(self, f.name),
                    f"no value: mechanism {self.mechanism!r} does not use it (its options: {', '.join(cls.options) or 'none'})",
                )

    def set_vector_heads(self, n_dot: int, grouped: bool = True) -> None:
        """Derive n_kv_heads for `n_dot` vector-scoring heads: all of them by default, else a
        divisor of them (GQA); `grouped=False` for mechanisms without grouped keys/values."""
        if n_dot == 0:
            self.n_kv_heads = 0
            return
        if self.n_kv_heads is None:
            self.n_kv_heads = n_dot
        _int("n_kv_heads", self.n_kv_heads)
        if n_dot % self.n_kv_heads:
            raise _err("n_kv_heads", self.n_kv_heads, f"a divisor of the {n_dot} dot-product heads")
        if not grouped and self.n_kv_heads != n_dot:
            raise _err("n_kv_heads", self.n_kv_heads, f"n_heads={n_dot}: {self.mechanism} has no grouped keys/values")

    def _validate_options(self) -> None:
        if isinstance(self.scale, str):
            if self.scale not in SCALES:
                raise _err("scale", self.scale, f"one of {SCALES} or a float > 0")
        else:
            _pos("scale", self.scale)
        _pos("p", self.p)
        if (self.rope or self.goat_rope) and self.head_dim % 2:
            raise _err("rope", self.rope, f"an even head_dim to rotate pairs (head_dim={self.head_dim})")
        _pos("rope_base", self.rope_base)
        if self.tau not in TAU_MODES:
            raise _err("tau", self.tau, f"one of {TAU_MODES}")
        if isinstance(self.tau_init, bool) or not isinstance(self.tau_init, (int, float)) or not self.tau_init > 1e-6:
            raise _err("tau_init", self.tau_init, "a number > 1e-6 (the floor that keeps τ positive)")
        if self.tau_param not in TAU_PARAMS:
            raise _err("tau_param", self.tau_param, f"one of {TAU_PARAMS}")
        if self.tau_max is not None:
            _pos("tau_max", self.tau_max)
            if not self.tau_init < self.tau_max:
                raise _err("tau_max", self.tau_max, f"a value > tau_init={self.tau_init}")
        if self.sink_weight is not None:
            w = self.sink_weight
            if isinstance(w, bool) or not isinstance(w, (int, float)) or not 0 <= w < math.inf:
                raise _err("sink_weight", w, "a finite number >= 0 (the sink's weight in the normaliser) or None")
            if not self.sink:
                raise _err("sink_weight", w, "None unless sink is true (it weighs the sink's term)")
        if self.train_window is not None:
            _int("train_window", self.train_window)
            if self.impl == "approx":
                raise _err("train_window", self.train_window, "None with impl='approx' (the window is its own selection)")
        _int("local_window", self.local_window, 0)
        if self.sliding_window is not None:
            _int("sliding_window", self.sliding_window)
            if self.train_window is not None:
                raise _err("sliding_window", self.sliding_window,
                           f"None with train_window={self.train_window} (the window's local part is local_window)")
            if self.impl == "approx":
                raise _err("sliding_window", self.sliding_window, "None with impl='approx'")
        if self.kernel not in KERNELS:
            raise _err("kernel", self.kernel, f"one of {KERNELS}")
        if self.kernel != "gaussian" and self.impl == "approx":
            raise _err("kernel", self.kernel, "'gaussian' with impl='approx' (the approximation is the Gaussian's)")
        if self.local_window and self.train_window is None:
            raise _err("local_window", self.local_window, "0 unless train_window is set (the ring beside the window)")
        for name in ("alpha", "beta", "gamma"):
            if getattr(self, name) not in PARAM_FORMS:
                raise _err(name, getattr(self, name), f"one of {PARAM_FORMS}")
        if self.v0 not in V0_FORMS:
            raise _err("v0", self.v0, f"one of {V0_FORMS}")
        if self.gate_dim is not None:
            _int("gate_dim", self.gate_dim)
        if self.cosformer_max_len is not None:
            _int("cosformer_max_len", self.cosformer_max_len)
        _int("gla_rank", self.gla_rank)
        _pos("gla_normalizer", self.gla_normalizer)
        if self.output_gate not in OUTPUT_GATES:
            raise _err("output_gate", self.output_gate, f"one of {OUTPUT_GATES}")
        _pos("output_gate_scale", self.output_gate_scale)
        if self.output_gate_scale != 1.0 and self.output_gate not in ("elementwise", "headwise"):
            raise _err("output_gate_scale", self.output_gate_scale,
                       f"1.0 unless output_gate is 'elementwise' or 'headwise' (output_gate={self.output_gate!r})")
        if self.goat_width not in GOAT_WIDTHS:
            raise _err("goat_width", self.goat_width, f"one of {GOAT_WIDTHS}")
        if self.goat_prior_init not in GOAT_PRIOR_INITS:
            raise _err("goat_prior_init", self.goat_prior_init, f"one of {GOAT_PRIOR_INITS}")
        if self.impl not in LAYER_IMPLS:
            raise _err("impl", self.impl, f"one of {LAYER_IMPLS}")

    def _check_mechanism_choices(self, cls, registry) -> None:
        """The choices only some mechanisms take, as their classes declare them (`Attention.impls`,
        `Attention.prenorm_gate`)."""
        def taking(pred) -> str:
            return ", ".join(repr(n) for n, c in registry.items() if pred(c))

        if self.output_gate == "prenorm" and not cls.prenorm_gate:
            raise _err("output_gate", self.output_gate, f"'prenorm' only with mechanism {taking(lambda c: c.prenorm_gate)} "
                       "(the normalised linear attention it gates the normaliser of)")
        # train_window reaches only the mechanisms whose options list it (scalar, hybrid: `_check_applicable`),
        # and their kernels train through it
        if self.impl == "triton" and ("triton" not in cls.impls or self.sliding_window is not None):
            raise _err("impl", self.impl, f"one of {IMPLS} here: 'triton' is for mechanisms "
                       f"{taking(lambda c: 'triton' in c.impls)} without a sliding window (their Triton kernels have "
                       "none; scalar and hybrid heads train through their train_window in one)")
        if self.impl == "approx" and "approx" not in cls.impls:
            raise _err("impl", self.impl, f"one of the exact paths {IMPLS} for mechanism {self.mechanism!r}: 'approx' "
                       f"(approximate scalar attention) exists only for mechanism {taking(lambda c: 'approx' in c.impls)}; "
                       "set it per layer with model.layer_attention")

    @property
    def n_dot_heads(self) -> int:
        """Heads that score with vectors (every head except the scalar ones)."""
        return self.n_heads - (self.n_scalar_heads or 0)

    @property
    def horizon(self) -> int | None:
        """The longest sequence a layer of this config takes (None: no limit)."""
        from .registry import mechanism_class

        return mechanism_class(self.mechanism).horizon(self)
