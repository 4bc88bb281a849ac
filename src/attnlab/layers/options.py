"""`MechanismOptions`: the base of a mechanism's own options, declared beside its code.

`AttentionConfig` holds what every mechanism shares (sizes, heads, RoPE, the output gate, the impl);
what only one mechanism reads lives in a dataclass of its own (`ScalarOptions`, `GoatOptions`, ...),
named by the mechanism's class (`Attention.Options`) and held as `AttentionConfig.options`.

Each option has one flat key, the name it has in TOML tables (`model.attention.<key>`), on the
command line and as a keyword of `AttentionConfig(...)`: the field's name, or the `key` it declares
with `option(default, key=...)` (GOAT's `rank` is `goat_rank`, cosFormer's `max_len` is
`cosformer_max_len`). A field declared with `init=False` is not an option of that class: it keeps
its default (goat_hybrid reads the hybrid's code but takes no sink).

Errors name the flat key (`AttentionConfig.<key>: got ..., need ...`), as the shared fields' do.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass, field

from .typed_fields import field_problem


def option(default, key: str | None = None, init: bool = True):
    """A field of a mechanism's options: its default and, when it differs from the field's name,
    its flat key."""
    return field(default=default, init=init, metadata={"key": key} if key else {})


@dataclass
class MechanismOptions:
    """Base class of a mechanism's options (module docstring); a subclass adds dataclass fields and,
    where a value needs more than its type, `check`."""

    @classmethod
    @functools.cache
    def keys(cls) -> dict[str, str]:
        """Flat key -> field name, for every option of this class (its init fields)."""
        return {f.metadata.get("key", f.name): f.name for f in dataclasses.fields(cls) if f.init}

    @classmethod
    @functools.cache
    def held(cls) -> dict[str, str]:
        """Flat key -> field name, for every field, the ones that are no option here (init=False) too."""
        return {f.metadata.get("key", f.name): f.name for f in dataclasses.fields(cls)}

    @classmethod
    @functools.cache
    def hints(cls) -> dict[str, object]:
        """Flat key -> the option's type annotation."""
        hints = typing.get_type_hints(cls)
        return {key: hints[name] for key, name in cls.keys().items()}

    @classmethod
    @functools.cache
    def defaults(cls) -> dict[str, object]:
        """Flat key -> the option's default."""
        by_name = {f.name: f.default for f in dataclasses.fields(cls)}
        return {key: by_name[name] for key, name in cls.keys().items()}

    @classmethod
    def from_keys(cls, keys: dict) -> "MechanismOptions":
        """The options from flat keys (each one of `cls.keys()`); missing ones take their defaults."""
        names = cls.keys()
        return cls(**{names[k]: v for k, v in keys.items()})

    def flat(self) -> dict[str, object]:
        """Flat key -> value of every option."""
        return {key: getattr(self, name) for key, name in self.keys().items()}

    def type_problem(self) -> tuple[str, object, str] | None:
        """The first option whose value does not fit its annotation, as (flat key, value, need)."""
        found = field_problem(self)
        if found is None:
            return None
        path, value, need = found
        name, sep, rest = path.partition("[")
        key = {n: k for k, n in self.keys().items()}.get(name, name)
        return key + sep + rest, value, need

    def check(self, config) -> None:
        """Check values beyond their types, with `config` (the AttentionConfig holding these options)
        for what they depend on; raise `config.error(key, got, need)`."""
