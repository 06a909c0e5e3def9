"""Values of config dataclasses checked against their fields' annotations, before anything runs.

``check_types(RunConfig(...))`` walks the config and every dataclass nested in it; ``check_field(cls, name,
value)`` checks one value before the dataclass is built (its ``__post_init__`` may compare it with numbers).
A mismatch raises :class:`~treejax.errors.ConfigError` naming ``Class.field``, the expected type and the value:

    RunConfig.num_steps must be int, got 2.5 (float)

Supported annotations: ``int`` (not ``bool``), ``float`` (``int`` accepted), ``bool`` (not ``int``), ``str``,
``None``, unions (``X | Y``, ``Optional``), ``Literal[...]``, ``tuple[X, Y]`` and ``tuple[X, ...]``,
``list[X]``, ``dict[K, V]``, and classes (dataclasses included; checked with ``isinstance``). ``Any``,
``Callable`` and other typing constructs accept every value.
"""

from __future__ import annotations

import collections.abc
import dataclasses
import functools
import types
import typing
from typing import Any

from treejax.choices import check_choice
from treejax.errors import ConfigError

__all__ = ["check_field", "check_types", "conforms", "field_types", "type_name"]


@functools.cache
def field_types(cls: type) -> dict[str, Any]:
    """``{field name: resolved annotation}`` of dataclass ``cls`` (string annotations resolved)."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def _is_union(tp) -> bool:
    return typing.get_origin(tp) in (typing.Union, types.UnionType)


def conforms(value, tp) -> bool:
    """Whether ``value`` is a valid value of annotation ``tp`` (see the module docstring for the rules)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return True
    if tp is None or tp is type(None):
        return value is None
    if _is_union(tp):
        return any(conforms(value, a) for a in args)
    if origin is typing.Literal:
        return any(type(value) is type(a) and value == a for a in args)
    if tp is bool:
        return isinstance(value, bool)
    if tp is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if tp is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if origin is tuple:
        return isinstance(value, tuple) and _tuple_conforms(value, args)
    if origin is list:
        return isinstance(value, list) and all(conforms(v, args[0]) for v in value)
    if origin in (dict, collections.abc.Mapping):
        return isinstance(value, dict) and all(conforms(k, args[0]) and conforms(v, args[1])
                                               for k, v in value.items())
    if isinstance(tp, type) and origin is None:
        return isinstance(value, tp)
    return True  # Any, Callable, TypeVars, ...: not checked


def _tuple_conforms(value: tuple, args: tuple) -> bool:
    if len(args) == 2 and args[1] is Ellipsis:
        return all(conforms(v, args[0]) for v in value)
    return len(value) == len(args) and all(conforms(v, a) for v, a in zip(value, args))


def type_name(tp) -> str:
    """A short readable name of annotation ``tp`` (``int | None``, ``tuple[int, ...]``, ``'a' | 'b'``)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if tp is Any:
        return "Any"
    if tp is None or tp is type(None):
        return "None"
    if _is_union(tp):
        return " | ".join(type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(repr(a) for a in args)
    if origin is not None and args:
        inner = ", ".join("..." if a is Ellipsis else type_name(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    if isinstance(tp, type):
        return tp.__name__
    return str(tp).replace("typing.", "")


def check_field(cls: type, name: str, value) -> None:
    """Raises :class:`ConfigError` unless ``value`` is valid for field ``name`` of dataclass ``cls``."""
    tp = field_types(cls)[name]
    if not conforms(value, tp):
        literal = [a for t in (typing.get_args(tp) if _is_union(tp) else (tp,))
                   if typing.get_origin(t) is typing.Literal for a in typing.get_args(t)]
        if literal and isinstance(value, str):  # an enumerated string: the choices, closest first, and the fix
            check_choice(f"{cls.__name__}.{name}", value, literal)
        raise ConfigError(f"{cls.__name__}.{name} must be {type_name(tp)}, got {value!r} ({type(value).__name__})")


def check_types(obj) -> None:
    """Checks every field of dataclass instance ``obj``, and of each dataclass instance held by a field."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        check_field(type(obj), f.name, value)
        if dataclasses.is_dataclass(value) and not isinstance(value, type):
            check_types(value)
