"""Flags as data: a program's flags are tuples of specs, defined on a ``FlagValues`` in one call.

The originals' command lines have 40-70 flags each; written as absl ``DEFINE_*`` calls they made
200-line functions and three styles in three programs. Here each flag is one spec (name,
default, help, type and bounds) in a tuple the program composes (``shared_flags.TPU_FLAGS``, its run
flags, its own), and ``define`` turns them into absl flags: names, defaults, bounds and help are
exactly what the ``DEFINE_*`` call would have made. A default of another family or variant is
``dataclasses.replace(spec, default=...)`` or ``with_defaults``.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable, Mapping
from typing import Any

from absl import flags

__all__ = ["Flag", "Bool", "Enum", "Float", "Int", "Str", "define", "with_defaults"]


@dataclasses.dataclass(frozen=True)
class Flag:
    """One absl flag, as data.

    Attributes:
      name: the flag's name (``--name``).
      default: its default value.
      help: its help text.
      kind: ``string``, ``integer``, ``float``, ``bool`` or ``enum``.
      enum_values: the choices of an ``enum``.
      lower_bound, upper_bound: bounds of an ``integer`` or ``float`` (None: unbounded).
    """

    name: str
    default: Any
    help: str
    kind: str = "string"
    enum_values: tuple[str, ...] = ()
    lower_bound: float | None = None
    upper_bound: float | None = None

    def define(self, fv: flags.FlagValues) -> None:
        """Defines this flag on ``fv`` with the absl call of its kind."""
        if self.kind == "enum":
            flags.DEFINE_enum(
                self.name, self.default, list(self.enum_values), self.help, flag_values=fv
            )
        elif self.kind == "integer":
            flags.DEFINE_integer(
                self.name,
                self.default,
                self.help,
                lower_bound=None if self.lower_bound is None else int(self.lower_bound),
                upper_bound=None if self.upper_bound is None else int(self.upper_bound),
                flag_values=fv,
            )
        elif self.kind == "float":
            flags.DEFINE_float(
                self.name,
                self.default,
                self.help,
                lower_bound=self.lower_bound,
                upper_bound=self.upper_bound,
                flag_values=fv,
            )
        elif self.kind == "bool":
            flags.DEFINE_bool(self.name, self.default, self.help, flag_values=fv)
        else:
            flags.DEFINE_string(self.name, self.default, self.help, flag_values=fv)


def Int(name: str, default: int | None, help: str, *, lower: int | None = None) -> Flag:
    """An integer flag (``lower``: the smallest value absl accepts)."""
    return Flag(name, default, help, "integer", lower_bound=lower)


def Float(
    name: str,
    default: float | None,
    help: str,
    *,
    lower: float | None = None,
    upper: float | None = None,
) -> Flag:
    """A float flag (``lower``/``upper``: the bounds absl checks)."""
    return Flag(name, default, help, "float", lower_bound=lower, upper_bound=upper)


def Bool(name: str, default: bool, help: str) -> Flag:
    """A boolean flag (``--name`` / ``--noname``)."""
    return Flag(name, default, help, "bool")


def Str(name: str, default: str | None, help: str) -> Flag:
    """A string flag."""
    return Flag(name, default, help, "string")


def Enum(name: str, default: str, values: Iterable[str], help: str) -> Flag:
    """A flag that takes one of ``values``."""
    return Flag(name, default, help, "enum", enum_values=tuple(values))


def with_defaults(specs: Iterable[Flag], defaults: Mapping[str, Any]) -> tuple[Flag, ...]:
    """``specs`` with the defaults of ``defaults`` (by flag name) in place of their own."""
    return tuple(
        dataclasses.replace(s, default=defaults[s.name]) if s.name in defaults else s for s in specs
    )


def define(fv: flags.FlagValues, *groups: Iterable[Flag]) -> None:
    """Defines every flag of ``groups`` on ``fv``, in order."""
    for group in groups:
        for spec in group:
            spec.define(fv)
