"""One name registry for everything a config names by string or gin names by class.

Advantage estimators, shapers, allocators, branching rules, sampling strategies, tasks and environments each
keep one :class:`Registry`; a module registers into it when it is imported (the package's ``__init__`` imports
its members, so importing the package is what fills its registry)::

    RULES: Registry[type] = Registry("branching rule", base=BranchingRule, name_attrs=("name", "rule_name"))

    @RULES.register("fixed_average")
    @dataclasses.dataclass(frozen=True)
    class FixedAverage(BranchingRule): ...

    RULES.get("fixed_avrage")  # KeyError: unknown branching rule 'fixed_avrage'; valid names: 'fixed_average', ...

Registering a second object under a taken name is an error (names are the gin-facing API) unless
``overwrite=True`` (a notebook cell run twice, or a deliberate replacement). :func:`treejax.gin_surface.
register_configurables` gin-registers every class of the class registries by iterating them.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Generic, Iterator, TypeVar

from treejax.choices import closest_first

__all__ = ["Registry"]

T = TypeVar("T")


def _article(word: str) -> str:
    return "an" if word[:1].lower() in "aeiou" else "a"


class Registry(Generic[T]):
    """``{name: object}`` in registration order, with one way to add, look up and list.

    ``kind`` names the objects in messages (``"branching rule"``). ``base``: registered objects must be frozen
    dataclasses subclassing it (a ``TypeError`` otherwise). ``name_attrs``: attributes set to the registered
    name on the object (``cls.name``). ``check(name, obj)``: further validation, run before anything is stored.
    ``identity(obj)``: what a second registration under a taken name is compared with (``is``) to tell a repeat
    of the same registration (allowed) from a different object (an error), and what that error shows; default
    the object itself. ``error``: the exception class :meth:`get` raises for an unknown name.
    """

    def __init__(self, kind: str, *, base: type | None = None, name_attrs: tuple[str, ...] = (),
                 check: Callable[[str, T], None] | None = None, identity: Callable[[T], Any] | None = None,
                 error: type[Exception] = KeyError):
        self.kind = kind
        self.base = base
        self.name_attrs = tuple(name_attrs)
        self._check = check
        self._identity = identity or (lambda obj: obj)
        self.error = error
        self._entries: dict[str, T] = {}

    # ------------------------------------------------------------------------------------------- adding
    def add(self, name: str, obj: T, *, overwrite: bool = False) -> T:
        """Stores ``obj`` under ``name`` (validated as :meth:`register` does); returns ``obj``."""
        if self.base is not None and not (isinstance(obj, type) and dataclasses.is_dataclass(obj)
                                          and obj.__dataclass_params__.frozen and issubclass(obj, self.base)):
            raise TypeError(f"{self.kind} {name!r} must be a frozen dataclass subclassing {self.base.__name__}, "
                            f"got {obj!r}")
        if self._check is not None:
            self._check(name, obj)
        old = self._entries.get(name)
        if old is not None and self._identity(old) is not self._identity(obj) and not overwrite:
            raise ValueError(f"{_article(self.kind)} {self.kind} named {name!r} is already registered "
                             f"({self._identity(old)!r}); pass overwrite=True to replace it (e.g. when a notebook "
                             "cell runs again)")
        for attr in self.name_attrs:
            setattr(obj, attr, name)
        self._entries[name] = obj
        return obj

    def register(self, name: str, overwrite: bool = False) -> Callable[[T], T]:
        """Decorator: ``@REGISTRY.register("name")`` above a class (or function) stores it under ``name``."""

        def decorator(obj: T) -> T:
            return self.add(name, obj, overwrite=overwrite)

        return decorator

    # ------------------------------------------------------------------------------------------- reading
    def get(self, name: str) -> T:
        """The object registered under ``name``; an unknown name raises ``error`` (one line listing the valid
        names, closest first)."""
        try:
            return self._entries[name]
        except KeyError:
            raise self.error(self.unknown(name)) from None

    def unknown(self, name: str) -> str:
        """The message of :meth:`get` for an unknown ``name``."""
        ordered = closest_first(name, sorted(self._entries))
        return f"unknown {self.kind} {name!r}; valid names: {', '.join(map(repr, ordered))} (closest first)"

    def names(self) -> list[str]:
        """The registered names, sorted."""
        return sorted(self._entries)

    def classes(self) -> dict[str, T]:
        """``{name: object}`` in registration order (a copy)."""
        return dict(self._entries)

    def pop(self, name: str, default: Any = None) -> T | Any:
        """Removes ``name`` (tests and notebooks undoing a registration); returns its object or ``default``."""
        return self._entries.pop(name, default)

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[str]:
        return iter(self._entries)

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"Registry({self.kind!r}: {len(self._entries)} names)"
