"""Enumerated config values: one check, one line naming the bad value, the valid choices (closest first) and the fix.

Every config dataclass checks its enumerated fields in ``__post_init__`` with :func:`check_choice`, so a typo
fails when the config is built — from gin before any model loads, and from Python too:

    >>> RunConfig(nonfinite="rasie")
    ConfigError: RunConfig.nonfinite='rasie' is not one of 'raise', 'skip' (closest first); fix: RunConfig.nonfinite = 'raise'
"""

from __future__ import annotations

import difflib
from typing import Any, Iterable, Sequence

from treejax.errors import ConfigError

__all__ = ["check_choice", "closest_first"]


def closest_first(value: Any, choices: Iterable[Any]) -> list[Any]:
    """``choices`` sorted by similarity of their text to ``value``'s (difflib ratio; ties keep their order)."""
    choices = list(choices)
    text = str(value).lower()
    score = {i: difflib.SequenceMatcher(None, text, str(c).lower()).ratio() for i, c in enumerate(choices)}
    return [choices[i] for i in sorted(range(len(choices)), key=lambda i: -score[i])]


def check_choice(field: str, value: Any, choices: Sequence[Any], *, show=repr) -> None:
    """Raises :class:`ConfigError` unless ``value`` is one of ``choices`` (compared with ``==`` and same type
    for bools, so ``1`` is not ``True``).

    ``field`` is the gin name (``RunConfig.nonfinite``); ``show`` renders a choice as gin would read it. The
    message is one line: the value, every choice (closest first) and the binding that fixes it.
    """
    for c in choices:
        if type(c) is type(value) and c == value:
            return
    ordered = closest_first(value, choices)
    raise ConfigError(f"{field}={show(value)} is not one of {', '.join(show(c) for c in ordered)} (closest "
                      f"first); fix: {field} = {show(ordered[0])}")
