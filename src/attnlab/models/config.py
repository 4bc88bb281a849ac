"""ModelConfig, and the typed dict -> dataclass conversion it shares with the run config.

Configs are plain dataclasses. Raw values (from TOML or dotted command-line overrides)
go through `build_dataclass`, which rejects unknown keys and wrong types with an error
that names the dotted key and what is allowed; each dataclass's `__post_init__` then
checks combinations and fills derived fields.
"""

from __future__ import annotations

import dataclasses
import functools
import re
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Union

from attnlab.layers import MECHANISMS, REGISTRY, mechanism_class
from attnlab.layers.config import SHARED_FIELDS, option_keys
from attnlab.layers.typed_fields import field_problem, value_problem


def did_you_mean(name: str, allowed) -> str:
    """' (did you mean X?)' for the allowed name nearest to a mistyped one, or '' when none is near."""
    import difflib

    near = difflib.get_close_matches(name, [str(a) for a in allowed], n=1, cutoff=0.6)
    return f" (did you mean {near[0]!r}?)" if near else ""


class ConfigError(ValueError):
    """A configuration value is unknown, of the wrong type, or impossible in combination."""


# --------------------------------------------------------------------------- typed conversion


def type_name(tp) -> str:
    """A short, readable name for a type annotation (used in errors and in --help)."""
    origin = typing.get_origin(tp)
    if tp is type(None):
        return "none"
    if origin is Literal:
        return " | ".join(repr(a) for a in typing.get_args(tp))
    if origin in (Union, types.UnionType):
        return " | ".join(type_name(a) for a in typing.get_args(tp))
    if origin in (list, tuple, dict):
        args = [a for a in typing.get_args(tp) if a is not Ellipsis]
        return f"{origin.__name__}[{', '.join(type_name(a) for a in args)}]"
    if tp is Any:
        return "any"
    return getattr(tp, "__name__", str(tp))


def coerce(key: str, value, tp):
    """Check `value` against the annotation `tp` and return it in canonical form.

    ints are accepted where floats are expected; nothing else is converted. Raises
    ConfigError naming `key`, the value it got and the type or values it needs."""
    origin = typing.get_origin(tp)
    if tp is Any:
        return value
    if tp is type(None):
        if value is None:
            return None
    elif origin is Literal:
        allowed = typing.get_args(tp)
        if value in allowed and type(value) in {type(a) for a in allowed}:
            return value
        raise ConfigError(f"{key} must be one of {allowed}, got {value!r}")
    elif origin in (Union, types.UnionType):
        errors = []
        for arg in typing.get_args(tp):
            try:
                return coerce(key, value, arg)
            except ConfigError as e:
                errors.append(str(e))
        literal_errors = [e for e in errors if "must be one of" in e]
        if len(literal_errors) == 1 and isinstance(value, str) and bool not in typing.get_args(tp):
            raise ConfigError(literal_errors[0])
    elif tp is bool:
        if isinstance(value, bool):
            return value
    elif tp is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
    elif tp is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
    elif tp is str:
        if isinstance(value, str):
            return value
    elif origin is list:
        if isinstance(value, (list, tuple)):
            (arg,) = typing.get_args(tp) or (Any,)
            return [coerce(f"{key}[{i}]", v, arg) for i, v in enumerate(value)]
    elif origin is tuple:
        args = typing.get_args(tp)
        if isinstance(value, (list, tuple)):
            if len(args) == 2 and args[1] is Ellipsis:
                return tuple(coerce(f"{key}[{i}]", v, args[0]) for i, v in enumerate(value))
            if len(value) == len(args):
                return tuple(coerce(f"{key}[{i}]", v, a) for i, (v, a) in enumerate(zip(value, args)))
    elif origin is dict:
        if isinstance(value, dict):
            return dict(value)
    elif isinstance(tp, type) and isinstance(value, tp):
        return value
    raise ConfigError(f"{key} must be {type_name(tp)}, got {value!r} ({type(value).__name__})")


def build_dataclass(cls, data: dict, prefix: str = ""):
    """Construct dataclass `cls` from a raw dict, recursing into nested dataclass fields.

    Unknown keys and wrong types raise ConfigError naming `prefix + key`; a ValueError
    raised by the dataclass's own `__post_init__` is re-raised as ConfigError."""
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'} must be a table, got {data!r}")
    hints = _type_hints(cls)
    init_fields = {f.name: f for f in dataclasses.fields(cls) if f.init}
    kwargs = {}
    for key, value in data.items():
        if key not in init_fields:
            where = f"under [{prefix.rstrip('.')}]" if prefix else "at the top level"
            raise ConfigError(
                f"unknown key {prefix}{key!s}{did_you_mean(str(key), init_fields)}; allowed keys {where}: "
                f"{', '.join(sorted(init_fields))}"
            )
        tp = hints[key]
        if dataclasses.is_dataclass(tp):
            kwargs[key] = build_dataclass(tp, value, f"{prefix}{key}.")
        else:
            kwargs[key] = coerce(f"{prefix}{key}", value, tp)
    try:
        return cls(**kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        raise ConfigError(str(e)) from e


def check_fields(obj, prefix: str) -> None:
    """Raise ConfigError naming `prefix + field` for the first field of dataclass `obj` whose value
    does not fit its annotation (bools only True/False, ints never bools, floats finite: no NaN, no
    ±inf). Every config dataclass calls this first in `__post_init__`, so values set in Python are
    held to the same rules as those read from TOML."""
    found = field_problem(obj)
    if found:
        path, got, need = found
        raise ConfigError(f"{prefix}{path} must be {need}, got {got!r}")


def field_help(f: dataclasses.Field) -> str:
    return f.metadata.get("help", "") if f.metadata else ""


def opt(default, help: str, **kw):
    """A dataclass field with a default and a help string (shown by `attnlab train --help`)."""
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda d=default: type(d)(d), metadata={"help": help}, **kw)
    return field(default=default, metadata={"help": help}, **kw)


# --------------------------------------------------------------------------- the model config


@dataclass
class ModelConfig:
    """A decoder-only LM: sizes, and the attention mechanism of each layer by name.

    `attn` is one mechanism name for every layer or a list with one name per layer.
    `attention` holds further `attnlab.layers.AttentionConfig` fields shared by all layers
    (heads in value groups, τ mode, gate, sink, ...); `layer_attention` optionally
    overrides some of them per layer (a list of tables, one per layer).
    """

    vocab_size: int = opt(0, "vocabulary size; 0 takes it from the tokenizer")
    d_model: int = opt(64, "residual stream width C")
    n_layers: int = opt(2, "number of transformer blocks")
    n_heads: int = opt(4, "attention heads per layer")
    attn: Union[str, list[str]] = opt("softmax", f"mechanism per layer, a name or a list of names: {', '.join(MECHANISMS)}")
    attention: dict[str, Any] = opt({}, "AttentionConfig fields shared by every layer (see model.attention.*)")
    layer_attention: list[dict[str, Any]] = opt([], "per-layer AttentionConfig overrides: a list of n_layers tables")
    d_ff: int = opt(0, "SwiGLU hidden width; 0 means 8/3 * d_model rounded up to a multiple of 16")
    tie_embeddings: bool = opt(True, "share the token embedding with the output head")
    norm_eps: float = opt(1e-5, "RMSNorm epsilon")
    pos_embedding: Literal["none", "learned"] = opt("none", "absolute position embedding added to the tokens ('none': RoPE in dot-product heads only)")
    max_seq_len: int = opt(0, "sequence length the model is built for: learned position table, cosFormer horizon; 0 takes data.seq_len")
    init_std: float = opt(0.02, "std of the normal init of linear and embedding weights")

    layer_attn: list[str] = field(init=False, default_factory=list)  # derived: one name per layer
    ffn_hidden: int = field(init=False, default=0)  # derived: SwiGLU hidden width

    def __post_init__(self):
        check_fields(self, "model.")
        for name in ("d_model", "n_layers", "n_heads"):
            if getattr(self, name) < 1:
                raise ConfigError(f"model.{name} must be >= 1, got {getattr(self, name)}")
        if self.vocab_size < 0:
            raise ConfigError(f"model.vocab_size must be >= 0 (0 = from the tokenizer), got {self.vocab_size}")
        if self.d_ff < 0 or self.max_seq_len < 0:
            raise ConfigError("model.d_ff and model.max_seq_len must be >= 0")
        names = [self.attn] * self.n_layers if isinstance(self.attn, str) else list(self.attn)
        if len(names) != self.n_layers:
            raise ConfigError(
                f"model.attn lists {len(names)} mechanisms but model.n_layers is {self.n_layers}: "
                f"give one name per layer or a single name"
            )
        for i, name in enumerate(names):
            if name not in REGISTRY:
                where = "model.attn" if isinstance(self.attn, str) else f"model.attn[{i}]"
                raise ConfigError(f"{where} must be one of {tuple(REGISTRY)}, got {name!r}"
                                  f"{did_you_mean(str(name), REGISTRY)}")
        if self.layer_attention and len(self.layer_attention) != self.n_layers:
            raise ConfigError(
                f"model.layer_attention has {len(self.layer_attention)} tables but model.n_layers is {self.n_layers}"
            )
        self.layer_attn = names
        self.ffn_hidden = self.d_ff or 16 * -(-(8 * self.d_model // 3) // 16)
        self.attention_configs()  # validates every layer's attention now, before any work

    def attention_configs(self) -> list:
        """One validated `AttentionConfig` per layer (errors name model.attention.<field>)."""
        from attnlab.layers import AttentionConfig

        return [attention_config(AttentionConfig, self, i) for i in range(self.n_layers)]


_MODEL_OWNED = ("mechanism", "d_model", "n_heads")


@functools.lru_cache(maxsize=None)
def _type_hints(cls) -> dict:
    """typing.get_type_hints of a config class, read once (it evaluates every annotation's text); callers
    only read it."""
    return typing.get_type_hints(cls)


def attention_config(cls, cfg: ModelConfig, layer: int):
    """Build layer `layer`'s AttentionConfig from the model's shared and per-layer tables.

    A key of the shared table `model.attention` reaches the layers whose mechanism reads it (see
    each mechanism's `options`); one that no layer reads is an error, and so is a key of a layer's
    own table `model.layer_attention[i]` that its mechanism does not read. Defaults that depend on
    the model come from the mechanism: RoPE on its vector queries/keys where it has them
    (`rope_default`), the cosFormer horizon M = max_seq_len (one horizon for training and decoding)."""
    keys = option_keys()
    hints = {key: hint for key, (hint, _) in keys.items()}
    allowed = set(keys) - set(_MODEL_OWNED)
    mechanism = cfg.layer_attn[layer]
    reads = set(SHARED_FIELDS) | set(mechanism_class(mechanism).options)
    raw, sources = {}, {}
    for key, value in cfg.attention.items():
        if key in allowed and key not in reads:  # for other layers; checked here, then left out
            where = f"model.attention.{key}"
            found = value_problem(coerce(where, value, hints[key]), hints[key], where)
            if found:
                raise ConfigError(f"{found[0]} must be {found[2]}, got {found[1]!r}")
            if not any(key in mechanism_class(m).options for m in cfg.layer_attn):
                raise ConfigError(
                    f"{where} applies to no layer of this model: no mechanism of {sorted(set(cfg.layer_attn))} "
                    f"reads it; remove it"
                )
            continue
        raw[key], sources[key] = value, "model.attention"
    if cfg.layer_attention:
        raw.update(cfg.layer_attention[layer])
        sources.update({k: f"model.layer_attention[{layer}]" for k in cfg.layer_attention[layer]})
    kwargs = {}
    for key, value in raw.items():
        where = f"{sources[key]}.{key}"
        if key in _MODEL_OWNED:
            owner = "model.attn" if key == "mechanism" else f"model.{key}"
            raise ConfigError(f"{where} is set by {owner}; remove it from {sources[key]}")
        if key not in allowed:
            raise ConfigError(f"unknown key {where}{did_you_mean(key, allowed)}; allowed keys: {', '.join(sorted(allowed))}")
        kwargs[key] = coerce(where, value, hints[key])
    for key, value in mechanism_class(mechanism).model_defaults(cfg.max_seq_len).items():
        if kwargs.get(key) is None:
            kwargs[key] = value
    try:
        return cls(mechanism=mechanism, d_model=cfg.d_model, n_heads=cfg.n_heads, **kwargs)
    except ConfigError:
        raise
    except (ValueError, TypeError) as e:
        def dotted(m):
            name = m.group(1)
            if name in _MODEL_OWNED:
                return "model.attn" if name == "mechanism" else f"model.{name}"
            return f"{sources.get(name, 'model.attention')}.{name}"

        msg = re.sub(rf"{cls.__name__}\.(\w+)", dotted, str(e))
        hint = ""
        if len(set(cfg.layer_attn)) > 1 and "model.attention." in msg:
            hint = "; set mechanism-specific fields per layer in model.layer_attention"
        raise ConfigError(f"{msg} (layer {layer}, attn={mechanism!r}{hint})") from e


# --------------------------------------------------------------------------- comparing saved configs


def _plain(cfg: ModelConfig) -> dict:
    return {f.name: getattr(cfg, f.name) for f in dataclasses.fields(cfg) if f.init}


def model_config_changes(saved: dict, new: ModelConfig, ignore: tuple[str, ...] = ()) -> list[tuple[str, Any, Any]]:
    """(dotted key, saved value, new value) for every setting in which `new` builds a different
    model than `saved`, a ModelConfig stored as a plain dict (as checkpoints hold it).

    Compared: the plain fields (minus `ignore`), the mechanism of each layer (reported as
    model.attn), and, when those agree, every resolved AttentionConfig field of each layer, so a
    default written out explicitly is no change. A saved config that this version no longer
    accepts is compared as written, key by key."""
    try:
        before = build_dataclass(ModelConfig, dict(saved), "model.")
    except ConfigError:
        mine = _plain(new)
        keys = sorted((set(saved) | set(mine)) - set(ignore))
        return [(f"model.{k}", saved.get(k), mine.get(k)) for k in keys if saved.get(k) != mine.get(k)]
    changes = []
    for name, value in _plain(before).items():
        if name not in ("attn", "attention", "layer_attention", *ignore) and value != getattr(new, name):
            changes.append((f"model.{name}", value, getattr(new, name)))
    if before.layer_attn != new.layer_attn:
        changes.append(("model.attn", before.attn, new.attn))
    if changes:
        return changes  # shapes or mechanisms differ: every derived attention field would too
    seen = set()
    for i, (a, b) in enumerate(zip(before.attention_configs(), new.attention_configs())):
        per_layer = set(before.layer_attention[i] if before.layer_attention else ()) | set(
            new.layer_attention[i] if new.layer_attention else ())
        old, new_ = a.flat(), b.flat()
        for name in dict.fromkeys([*old, *new_]):
            old_value, new_value = old.get(name), new_.get(name)
            key = f"model.layer_attention[{i}].{name}" if name in per_layer else f"model.attention.{name}"
            if old_value != new_value and key not in seen:
                seen.add(key)
                changes.append((key, old_value, new_value))
    return changes


def format_changes(changes: list[tuple[str, Any, Any]]) -> str:
    """'model.d_model was 32, now 64; ...' for the list `model_config_changes` returns."""
    return "; ".join(f"{key} was {old!r}, now {new!r}" for key, old, new in changes)
