"""`MechanismOptions`: the base of a mechanism's own options, declared beside its code.

`AttentionConfig` holds what every mechanism shares (sizes, heads, RoPE, the output gate, the impl);
what only one mechanism reads lives in a dataclass of its own (`ScalarOptions`, `GoatOptions`, ...),
named by the mechanism's class (`Attention.Options`) and held as `AttentionConfig.options`.

Each option has one name everywhere: its field's name is its key in TOML tables
(`model.attention.<key>`), on the command line and as a keyword of `AttentionConfig(...)`, so an
option that only one mechanism has carries its name (`goat_rank`, `cosformer_max_len`, `gla_rank`) and
options the scalar family shares keep theirs (`tau`, `sink`). A field declared with `init=False` is
not an option of that class: it keeps its default (goat_hybrid reads the hybrid's code but takes no
sink).

Errors name the option (`AttentionConfig.<key>: got ..., need ...`), as the shared fields' errors name them.
"""

from __future__ import annotations

import dataclasses
import functools
import typing
from dataclasses import dataclass

from .typed_fields import field_problem


@dataclass
class MechanismOptions:
    """Base class of a mechanism's options (module docstring); a subclass adds dataclass fields and,
    where a value needs more than its type, `check`."""

    @classmethod
    @functools.cache
    def keys(cls) -> tuple[str, ...]:
        """The options of this class: its init fields' names, in order."""
        return tuple(f.name for f in dataclasses.fields(cls) if f.init)

    @classmethod
    @functools.cache
    def hints(cls) -> dict[str, object]:
        """Option -> its type annotation."""
        hints = typing.get_type_hints(cls)
        return {key: hints[key] for key in cls.keys()}

    @classmethod
    @functools.cache
    def defaults(cls) -> dict[str, object]:
        """Option -> its default."""
        return {f.name: f.default for f in dataclasses.fields(cls) if f.init}

    def flat(self) -> dict[str, object]:
        """Option -> its value."""
        return {key: getattr(self, key) for key in self.keys()}

    def type_problem(self) -> tuple[str, object, str] | None:
        """The first option whose value does not fit its annotation, as (its name, value, need)."""
        return field_problem(self)

    def check(self, config) -> None:
        """Check values beyond their types, with `config` (the AttentionConfig holding these options)
        for what they depend on; raise `config.error(key, got, need)`."""
