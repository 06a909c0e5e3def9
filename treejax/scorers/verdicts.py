"""Verdicts: the ids of the verdict tokens (log-prob mode) and the parser of a decoded verdict (decode mode)."""

from __future__ import annotations

import math
import re

from treejax.errors import ConfigError

_NUMBER = re.compile(r"^[-+]?\d+(\.\d+)?$")


def verdict_ids(tokenizer, tokens: tuple) -> tuple[int, ...]:
    """The id of each verdict token; each must encode to exactly one token (else one line with the fix)."""
    ids = []
    for t in tokens:
        enc = tokenizer.encode(t)
        if len(enc) != 1:
            raise ConfigError(f"ScorerConfig verdict token {t!r} is {len(enc)} tokens ({enc}) for the scorer's "
                              "tokenizer; fix: verdict tokens that are one token each (e.g. 'Yes', 'No')")
        ids.append(int(enc[0]))
    return tuple(ids)


def parse_verdict(text: str, pattern: str, yes_words=("yes",), no_words=("no",),
                  score_range: tuple | None = None) -> float:
    """The judge's verdict in [0, 1] from its decoded ``text``: the first match of ``pattern`` (its first group,
    stripped and lower-cased) is 1.0 if it is one of ``yes_words``, 0.0 if one of ``no_words`` (``"*"`` in
    ``no_words``: any other match), else a number ``x`` mapped by ``score_range = (lo, hi)`` to
    ``clip((x - lo) / (hi - lo), 0, 1)``; ``NaN`` when nothing matches or the match is none of these.

    Examples: ``<verdict>yes</verdict>`` with ``r"<verdict>\\s*(\\w+)\\s*</verdict>"`` -> 1.0; ``"Score: 7"``
    with ``r"Score:\\s*(\\d+)"`` and ``score_range = (1, 10)`` -> 0.667; FAPO's GenRM answer ``\\boxed{-1}`` (no
    erroneous step) with ``r"\\\\boxed\\{(-?\\d+)\\}"``, ``yes_words = ("-1",)``, ``no_words = ("*",)`` -> 1.0 and
    ``\\boxed{3}`` -> 0.0.
    """
    m = re.search(pattern, text)
    if m is None:
        return math.nan
    word = (m.group(1) or "").strip().lower()
    if word in {w.lower() for w in yes_words}:
        return 1.0
    if word in {w.lower() for w in no_words} or "*" in no_words:
        return 0.0
    if score_range is not None and _NUMBER.match(word):
        lo, hi = score_range
        return float(min(max((float(word) - lo) / (hi - lo), 0.0), 1.0))
    return math.nan
