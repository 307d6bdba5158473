"""The base of every configuration tree, and how a setting is declared on it.

A setting is a field of a frozen config Struct, declared once, where it lives:

    token_budget: Annotated[int, setting("prompt tokens in flight", gt=0)] = 65_536

Its type and default are the field's; its help text and its per-value check are the
``msgspec.Meta`` that ``setting`` builds; checks that span fields stay in
``__post_init__``. The composition root (``switchyard.settings``) derives the CLI flag,
the environment variable and the config-file key from the field, so nothing else
repeats it. ``ConfigStruct.__post_init__`` applies the per-value checks when a tree is
built in code, too, so a bad value is refused however it arrives.
"""

from __future__ import annotations

import functools
from typing import Annotated, Any, get_args, get_origin, get_type_hints

import msgspec

__all__ = ["ConfigStruct", "PositiveInt", "setting"]

# For an optional setting, whose constraint must sit inside the ``| None``.
PositiveInt = Annotated[int, msgspec.Meta(gt=0)]

_CONSTRAINTS = ("gt", "ge", "lt", "le", "multiple_of", "pattern", "min_length", "max_length")


def setting(
    help: str,
    *,
    flag: str | None = None,
    prefix: str | None = None,
    hidden: bool = False,
    **constraints: Any,
) -> msgspec.Meta:
    """The metadata of one setting (or, with ``prefix``, of a nested tree of settings).

    ``flag`` renames it (the default is the field name with dashes); ``prefix`` goes before
    the names of a nested tree's settings; ``hidden`` keeps a derived field off the CLI."""
    extra: dict[str, Any] = {}
    if flag is not None:
        extra["flag"] = flag
    if prefix is not None:
        extra["prefix"] = prefix
    if hidden:
        extra["hidden"] = True
    return msgspec.Meta(description=help, extra=extra or None, **constraints)


class ConfigStruct(msgspec.Struct, frozen=True, kw_only=True):
    """A node of a configuration tree: its fields' per-value checks hold however it was built."""

    def __post_init__(self) -> None:
        for name, hint in _checked_fields(type(self)):
            try:
                msgspec.convert(getattr(self, name), hint)
            except msgspec.ValidationError as exc:
                raise ValueError(f"{name}: {exc}") from None


@functools.cache
def _checked_fields(cls: type) -> tuple[tuple[str, Any], ...]:
    """The fields whose annotation carries a constraint, with that annotation."""
    hints = get_type_hints(cls, include_extras=True)
    return tuple((name, hint) for name, hint in hints.items() if _has_constraint(hint))


def _has_constraint(hint: Any) -> bool:
    if get_origin(hint) is Annotated:
        inner, *metas = get_args(hint)
        return _has_constraint(inner) or any(getattr(m, c, None) is not None for m in metas for c in _CONSTRAINTS)
    return any(_has_constraint(arg) for arg in get_args(hint))
