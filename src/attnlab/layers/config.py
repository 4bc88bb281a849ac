"""`AttentionConfig`: one attention layer's configuration, validated.

It holds what every mechanism shares (sizes, heads, the vector heads' RoPE and scaling, the sliding
window, the output gate, the impl); what only one mechanism reads is that mechanism's options
dataclass (`attnlab.layers.options`: `ScalarOptions`, `GoatOptions`, ...), held as `options`.
Options are also keywords of AttentionConfig itself, named as TOML tables and the command line name them:
`AttentionConfig(d_model=64, n_heads=4, mechanism="goat", goat_rank=4)` is
`AttentionConfig(d_model=64, n_heads=4, mechanism="goat", options=GoatOptions(rank=4))`.

Derived fields (head sizes, head counts) are filled in `__post_init__`; any bad value raises a
ValueError that names the key, what it got and what it needs.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass

from ..checks import IMPLS
from ..ops.softmax import SCALES
from .options import MechanismOptions
from .typed_fields import field_problem

LAYER_IMPLS = (*IMPLS, "approx", "triton")  # each mechanism class says which it takes (`Attention.impls`)
# Fields every mechanism reads; each mechanism class lists the shared fields it reads beyond these (`uses`)
# and holds its own options in `Options`.
SHARED_FIELDS = ("d_model", "n_heads", "mechanism", "head_dim", "output_gate", "output_gate_scale", "output_norm", "bias",
                 "impl")
OUTPUT_GATES = (None, "elementwise", "headwise", "prenorm")


def _err(field: str, got, need: str) -> ValueError:
    return ValueError(f"AttentionConfig.{field}: got {got!r}, need {need}")


def _int(field: str, value, lo: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < lo:
        raise _err(field, value, f"an int >= {lo}")


def _pos(field: str, value) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise _err(field, value, "a number > 0")


@dataclass(init=False)
class AttentionConfig:
    """Configuration of one attention layer; `(B, T, d_model) -> (B, T, d_model)`.

    Every mechanism reads the shared fields (d_model, n_heads, mechanism, head_dim, output_gate,
    output_gate_scale, output_norm, bias, impl); the vector heads' fields below (n_kv_heads, scale, p,
    rope, rope_base, sliding_window) where its class lists them in `uses`; and its own options
    (`options`, of the class its mechanism names: `attnlab.layers.mechanism_class(name).Options`).
    A field or option it does not read must keep its default, and setting it is an error.
    docs/mechanisms.md has the math. Derived fields are filled in when left None.

    Args:
        d_model: width of the residual stream C.
        n_heads: H, the number of query heads (scalar and dot-product together).
        mechanism: a registered name: "softmax", "scalar", "hybrid", "principled", "cosformer",
            "gla", "ssd", "goat", "goat_hybrid", ... (`attnlab.layers.MECHANISMS`).
        head_dim: D, the per-head width of q, k and v (derived: d_model // n_heads).
        n_kv_heads: key/value heads of the dot-product heads (GQA); must divide their number
            (derived: all of them). The linear family needs n_kv_heads == n_heads.
        scale: softmax, and the dot-product heads of "scalar": the score scaling of
            `softmax_attention` ("sqrt_d", "ktotal", "kmean", "krms", "pnorm", "n_sqrt_d" or a
            float > 0).
        p: the p of scale "pnorm" (> 0).
        rope: every mechanism but goat and goat_hybrid: rotary position embedding on vector
            queries/keys (never on scalar ones: a scalar has no rotation).
        rope_base: RoPE's frequency base (> 0), for rope and goat_rope.
        sliding_window: softmax, goat, goat_hybrid, principled, scalar and hybrid (not with
            train_window): None (default: every earlier key), or w: each query reads only the last
            w keys, itself included (Mistral / Gemma's sliding-window attention), and the sink
            where the mechanism has one (scalar, hybrid: `sink`), as StreamingLLM keeps it. Trained
            and evaluated as such, and decoded from a cache of the last w keys (constant memory
            and cost per step at any context length). docs/mechanisms.md#sliding-window.
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
        options: the mechanism's own options, an instance of its `Options` class (None: its
            defaults; a mechanism without options holds None). Each option is also a keyword
            here by its name (`tau=0.5`, `goat_rank=4`), applied on top of `options`.

    Raises:
        ValueError: any bad value, naming the key (`AttentionConfig.<key>`), what it got and
            what it needs: a value that does not fit its type (a bool for an int, NaN), a number
            out of range, an unknown choice, a field or option the mechanism does not read set away
            from its default, or sizes that do not divide.
        TypeError: a keyword that is no field and no mechanism's option.
    """

    d_model: int
    n_heads: int
    mechanism: str = "softmax"
    head_dim: int | None = None
    n_kv_heads: int | None = None
    scale: str | float = "sqrt_d"
    p: float = 2.0
    rope: bool = False
    rope_base: float = 10000.0
    sliding_window: int | None = None
    output_gate: str | None = None
    output_gate_scale: float = 1.0
    output_norm: bool = False
    bias: bool = False
    impl: str = "auto"
    options: MechanismOptions | None = None

    def __init__(self, d_model: int, n_heads: int, mechanism: str = "softmax", head_dim: int | None = None,
                 n_kv_heads: int | None = None, scale: str | float = "sqrt_d", p: float = 2.0, rope: bool = False,
                 rope_base: float = 10000.0, sliding_window: int | None = None, output_gate: str | None = None,
                 output_gate_scale: float = 1.0, output_norm: bool = False, bias: bool = False, impl: str = "auto", *,
                 options: MechanismOptions | None = None, **keys):
        from .registry import REGISTRY  # filled by the mechanism modules, which build on this one

        given = locals()  # the signature's defaults are the fields' (tests/test_mechanism_options.py)
        for f in dataclasses.fields(self):
            if f.name != "options":
                setattr(self, f.name, given[f.name])
        if not isinstance(mechanism, str) or mechanism not in REGISTRY:
            raise _err("mechanism", mechanism, f"one of {tuple(REGISTRY)}")
        Options = REGISTRY[mechanism].Options
        known = option_keys()
        own = {k: keys.pop(k) for k in list(keys) if Options is not None and k in Options.keys()}
        for key, value in keys.items():
            if key not in known:
                raise TypeError(f"AttentionConfig got an unexpected keyword argument {key!r}")
            if value != known[key][1]:
                raise self._not_read(key, value)
        if Options is None:
            if options is not None:
                raise _err("options", options, f"None: mechanism {mechanism!r} has no options of its own")
            self.options = None
        else:
            if options is None:
                options = Options()
            elif type(options) is not Options:
                raise _err("options", options, f"a {Options.__name__} (mechanism {mechanism!r}'s options) or None")
            self.options = dataclasses.replace(options, **own)  # a copy: configure fills it
        self.__post_init__()

    def __post_init__(self):
        from .registry import REGISTRY

        found = field_problem(self) or (self.options.type_problem() if self.options is not None else None)
        if found:
            raise _err(*found)
        _int("d_model", self.d_model)
        _int("n_heads", self.n_heads)
        cls = REGISTRY[self.mechanism]
        self._check_applicable(cls)
        if self.head_dim is None:
            if self.d_model % self.n_heads:
                raise _err("head_dim", None, f"an explicit value: d_model={self.d_model} is not divisible by n_heads={self.n_heads}")
            self.head_dim = self.d_model // self.n_heads
        _int("head_dim", self.head_dim)
        self._validate_shared()
        self._check_mechanism_choices(cls, REGISTRY)
        if self.options is not None:
            self.options.check(self)
        cls.configure(self)  # the mechanism's derived fields: its head counts and groups

    def error(self, key: str, got, need: str) -> ValueError:
        """The error for a bad field or option: names its key, what it got and what it needs."""
        return _err(key, got, need)

    def value(self, key: str):
        """The value of a shared field or of an option, by its name."""
        if key in _shared_keys():
            return getattr(self, key)
        if self.options is not None and hasattr(self.options, key):
            return getattr(self.options, key)
        raise KeyError(f"{key!r} is neither a field of AttentionConfig nor an option of mechanism {self.mechanism!r}")

    def flat(self) -> dict:
        """Every shared field and option of this config by its name (`options` spread out)."""
        out = {k: getattr(self, k) for k in _shared_keys()}
        return {**out, **(self.options.flat() if self.options is not None else {})}

    def require_int(self, key: str, lo: int = 1) -> int:
        """The value of `key`, checked to be an int >= lo (ValueError naming the key otherwise);
        for a mechanism's `configure` and its options' `check`."""
        _int(key, self.value(key), lo)
        return self.value(key)

    def require_positive(self, key: str) -> float:
        """The value of `key`, checked to be a number > 0 (ValueError naming the key otherwise)."""
        _pos(key, self.value(key))
        return self.value(key)

    def _not_read(self, key: str, value) -> ValueError:
        from .registry import mechanism_class

        reads = mechanism_class(self.mechanism).options
        return _err(key, value, f"no value: mechanism {self.mechanism!r} does not use it "
                                f"(its options: {', '.join(reads) or 'none'})")

    def _check_applicable(self, cls) -> None:
        """A shared field the mechanism does not read must keep its default: setting it is an error."""
        for f in dataclasses.fields(self):
            if f.name in SHARED_FIELDS or f.name == "options" or f.name in cls.uses:
                continue
            if getattr(self, f.name) != f.default:
                raise self._not_read(f.name, getattr(self, f.name))

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

    def _validate_shared(self) -> None:
        if isinstance(self.scale, str):
            if self.scale not in SCALES:
                raise _err("scale", self.scale, f"one of {SCALES} or a float > 0")
        else:
            _pos("scale", self.scale)
        _pos("p", self.p)
        if self.rope and self.head_dim % 2:
            raise _err("rope", self.rope, f"an even head_dim to rotate pairs (head_dim={self.head_dim})")
        _pos("rope_base", self.rope_base)
        if self.sliding_window is not None:
            _int("sliding_window", self.sliding_window)
            if self.impl == "approx":
                raise _err("sliding_window", self.sliding_window, "None with impl='approx'")
        if self.output_gate not in OUTPUT_GATES:
            raise _err("output_gate", self.output_gate, f"one of {OUTPUT_GATES}")
        _pos("output_gate_scale", self.output_gate_scale)
        if self.output_gate_scale != 1.0 and self.output_gate not in ("elementwise", "headwise"):
            raise _err("output_gate_scale", self.output_gate_scale,
                       f"1.0 unless output_gate is 'elementwise' or 'headwise' (output_gate={self.output_gate!r})")
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
    def horizon(self) -> int | None:
        """The longest sequence a layer of this config takes (None: no limit)."""
        from .registry import mechanism_class

        return mechanism_class(self.mechanism).horizon(self)


@functools.cache
def _shared_keys() -> tuple[str, ...]:
    return tuple(f.name for f in dataclasses.fields(AttentionConfig) if f.name != "options")


def option_keys() -> dict[str, tuple[object, object]]:
    """Every key an AttentionConfig takes, flat (TOML's `model.attention.<key>`): its shared fields and
    every registered mechanism's options, each as key -> (type annotation, default). A key that several
    mechanisms' options share (`tau`) has one type and one default in all of them."""
    from .registry import REGISTRY

    hints = typing.get_type_hints(AttentionConfig)
    out = {f.name: (hints[f.name], f.default) for f in dataclasses.fields(AttentionConfig) if f.name != "options"}
    for cls in REGISTRY.values():
        if cls.Options is not None:
            for key, hint in cls.Options.hints().items():
                out.setdefault(key, (hint, cls.Options.defaults()[key]))
    return out
