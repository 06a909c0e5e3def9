"""Answer extraction, answer equivalence and rewards for verifiable tasks.

Pipeline for a model response ``y`` and a ground truth ``g`` (both strings):

1. **Extraction** ``a = extract_answer(y, mode)``: the answer the model *committed to* — the positionally last
   explicit answer marker (``<answer>..</answer>``, ``\\boxed{..}``/``\\fbox{..}``, ``#### ..``, "the (final) answer
   is .."). A number that only appears in the reasoning is *not* an answer (``mode="auto"``); the lenient
   ``mode="last_number"`` falls back to the last number in the text when there is no marker (the classic GSM8K
   evaluation heuristic). A truncated final ``\\boxed{`` (unbalanced braces) counts as no answer: it must not fall
   back to an earlier boxed value from the reasoning.
2. **Equivalence** ``match(a, g)``:
   - if both parse as plain numbers (integers, decimals, ``a/b``, ``\\frac{a}{b}``, thousands separators ``1,234``,
     ``-``/unicode minus, ``$``, ``%``, trailing unit words/``\\text{..}``), they are equal iff
     ``|a - g| <= max(rel_tol * max(|a|, |g|), abs_tol)`` (exact rational arithmetic, defaults ``rel_tol=1e-6``,
     ``abs_tol=1e-9``, matching math-verify's 6-digit float rounding) — except that two integers must be equal
     exactly;
   - otherwise math-verify (``math_verify.parse``/``verify``, symbolic + numeric LaTeX equivalence) decides;
   - if math-verify cannot parse either side, normalised string equality decides.
   Units are stripped, not converted: ``5 cm`` equals ``5`` and also ``5 m`` (documented approximation).
   A percentage is compared as its number: ``50%`` equals ``50``, not ``0.5``.
3. **Score** ``s in {0, 1}`` (1 = correct) and **reward** ``reward(s, "pm1") = 2 s - 1 in [-1, 1]`` or
   ``reward(s, "01") = s``. ``format_score(y, style)`` checks the answer layout separately.
"""

from __future__ import annotations

import re
import threading
from fractions import Fraction
from typing import Callable, Optional

import numpy as np

__all__ = [
    "EXTRACTION_MODES",
    "FORMAT_STYLES",
    "answers_match",
    "extract_answer",
    "extract_answer_tag",
    "extract_boxed",
    "extract_tag_or_boxed",
    "extract_gsm8k_hashes",
    "extract_answer_phrase",
    "extract_last_number",
    "format_score",
    "math_score",
    "parse_number",
    "reward",
]

# --------------------------------------------------------------------------------------------------------------
# Extraction. Each extractor returns (start_offset, answer) of its LAST match, or None.
# --------------------------------------------------------------------------------------------------------------

_Match = Optional[tuple[int, str]]

_TAG_RE = re.compile(r"<answer>\s?(.*?)\s?</answer>", re.DOTALL)
_HASHES_RE = re.compile(r"####[ \t]*([^\n]*)")
_PHRASE_RE = re.compile(
    r"(?:final\s+answer|the\s+answer)\s*(?:is|:|=)\s*:?\s*(.+?)(?=\.\s|\.$|\n|$)", re.IGNORECASE | re.DOTALL
)
_NUMBER_TOKEN_RE = re.compile(r"[-+\u2212]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:\s*/\s*\d+)?|[-+\u2212]?\.\d+")
_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\b")


def _match_answer_tag(text: str) -> _Match:
    matches = list(_TAG_RE.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    return m.start(), m.group(1).strip()


def _balanced_group(text: str, open_index: int) -> Optional[int]:
    """Index just past the ``}`` matching the ``{`` at ``open_index``; None if the braces never close."""
    depth = 0
    i = open_index
    while i < len(text):
        ch = text[i]
        if ch == "\\" and i + 1 < len(text) and text[i + 1] in "{}":
            i += 2  # escaped brace \{ or \} inside the answer (sets): not structural
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return i + 1
        i += 1
    return None


def _match_boxed(text: str) -> _Match:
    """Last ``\\boxed{...}`` / ``\\fbox{...}`` (nested braces allowed) or ``\\boxed 5``.

    If the last ``\\boxed`` is truncated (its braces never close) the response has no final answer: returns
    ``(start, "")`` so that the earlier, complete boxed values from the reasoning are NOT used.
    """
    starts = [m for m in _BOXED_RE.finditer(text)]
    if not starts:
        return None
    m = starts[-1]
    j = m.end()
    while j < len(text) and text[j] == " ":
        j += 1
    if j < len(text) and text[j] == "{":
        end = _balanced_group(text, j)
        if end is None:
            return m.start(), ""
        return m.start(), text[j + 1 : end - 1].strip()
    # "\boxed 5" form: up to whitespace or "$".
    tail = re.match(r"\s*([^\s$]+)", text[m.end() :])
    return (m.start(), tail.group(1)) if tail else (m.start(), "")


def _match_hashes(text: str) -> _Match:
    matches = list(_HASHES_RE.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    return m.start(), m.group(1).strip()


def _match_phrase(text: str) -> _Match:
    matches = list(_PHRASE_RE.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    return m.start(), m.group(1).strip()


def _match_last_number(text: str) -> _Match:
    matches = list(_NUMBER_TOKEN_RE.finditer(text))
    if not matches:
        return None
    m = matches[-1]
    return m.start(), m.group(0).strip()


def _value(m: _Match) -> Optional[str]:
    if m is None or m[1] == "":
        return None
    return _strip_wrappers(m[1])


def _strip_wrappers(ans: str) -> str:
    """Remove math delimiters and trailing sentence punctuation around an extracted answer."""
    ans = ans.strip()
    for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
        if ans.startswith(left) and ans.endswith(right) and len(ans) >= len(left) + len(right):
            ans = ans[len(left) : len(ans) - len(right)].strip()
    if ans.startswith("\\boxed"):
        inner = _match_boxed(ans)
        if inner is not None and inner[1]:
            ans = inner[1]
    return ans.rstrip(".").strip()


def extract_answer_tag(text: str) -> Optional[str]:
    """Content of the last ``<answer>...</answer>`` (reasoning-gym's convention, same regex as its
    ``reasoning_gym.utils.extract_answer``)."""
    return _value(_match_answer_tag(text))


def extract_boxed(text: str) -> Optional[str]:
    """Content of the last ``\\boxed{...}``/``\\fbox{...}``, nested braces included; None if absent or truncated."""
    return _value(_match_boxed(text))


def extract_gsm8k_hashes(text: str) -> Optional[str]:
    """Text after the last ``####`` (GSM8K's answer marker), to the end of its line."""
    return _value(_match_hashes(text))


def extract_answer_phrase(text: str) -> Optional[str]:
    """Answer after the last "the answer is" / "final answer:" phrase, up to the end of its sentence."""
    return _value(_match_phrase(text))


def extract_last_number(text: str) -> Optional[str]:
    """The last number-like token in the text (lenient fallback, not used by default)."""
    return _value(_match_last_number(text))


_MARKER_MATCHERS: tuple[Callable[[str], _Match], ...] = (
    _match_answer_tag,
    _match_boxed,
    _match_hashes,
    _match_phrase,
)


def _extract_auto(text: str) -> Optional[str]:
    found = [m for m in (f(text) for f in _MARKER_MATCHERS) if m is not None]
    if not found:
        return None
    # The positionally last marker is the committed answer ("the answer is $\boxed{5}$" -> the boxed one starts
    # later and wins; ties never happen because markers start with different characters).
    return _value(max(found, key=lambda m: m[0]))


def extract_tag_or_boxed(text: str) -> Optional[str]:
    """The positionally last of the final ``<answer>...</answer>`` and the last complete ``\\boxed{...}``: a
    model asked for tags that closes with ``\\boxed{}`` (common for math-tuned models) is read as it wrote,
    while no looser marker ("the answer is", the last number) is accepted. A boxed value inside the tags is
    unwrapped; a truncated final ``\\boxed{`` after a complete tag leaves the tag's answer (the tag was
    written first and closed)."""
    found = [m for m in (_match_answer_tag(text), _match_boxed(text)) if m is not None and m[1] != ""]
    return _value(max(found, key=lambda m: m[0])) if found else None


def _extract_last_number_fallback(text: str) -> Optional[str]:
    ans = _extract_auto(text)
    return ans if ans is not None else extract_last_number(text)


EXTRACTION_MODES: dict[str, Callable[[str], Optional[str]]] = {
    "auto": _extract_auto,
    "tags": extract_answer_tag,
    "tags_or_boxed": extract_tag_or_boxed,
    "boxed": extract_boxed,
    "gsm8k": extract_gsm8k_hashes,
    "phrase": extract_answer_phrase,
    "last_number": _extract_last_number_fallback,
}


def extract_answer(text: str, mode: str = "auto") -> Optional[str]:
    """The final answer of a response, or None when it gives none.

    Modes: ``auto`` (positionally last of answer tags / boxed / #### / "the answer is"), ``tags``,
    ``tags_or_boxed`` (positionally last of the answer tags and ``\\boxed{}``, nothing looser), ``boxed``,
    ``gsm8k`` (####), ``phrase``, ``last_number`` (``auto`` falling back to the last number in the text).
    """
    try:
        fn = EXTRACTION_MODES[mode]
    except KeyError:
        raise ValueError(f"unknown extraction mode {mode!r}; valid modes: {sorted(EXTRACTION_MODES)}") from None
    if not isinstance(text, str):
        raise TypeError(f"response must be a str, got {type(text).__name__}")
    return fn(text)


# --------------------------------------------------------------------------------------------------------------
# Numbers.
# --------------------------------------------------------------------------------------------------------------

_NUM = r"(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+"
_UNIT = r"(?:\\text\{[^{}]*\}|\\mathrm\{[^{}]*\}|\\mbox\{[^{}]*\}|[A-Za-z]{2,}\.?|\^\{?\\circ\}?|°|\s)*"
_NUMBER_RE = re.compile(rf"^(?P<sign>[-+]?)\s*(?:(?P<num>{_NUM})(?:\s*/\s*(?P<den>{_NUM}))?)\s*(?P<unit>{_UNIT})$")
_FRAC_RE = re.compile(
    r"^(?P<sign>[-+]?)\s*\\[dt]?frac\s*\{\s*(?P<num>[-+]?\d+(?:\.\d+)?)\s*\}\s*\{\s*(?P<den>\d+(?:\.\d+)?)\s*\}"
    rf"\s*(?P<unit>{_UNIT})$"
)
_FRAC_SHORT_RE = re.compile(rf"^(?P<sign>[-+]?)\s*\\[dt]?frac(?P<num>\d)(?P<den>\d)\s*(?P<unit>{_UNIT})$")


def _normalise_number_text(s: str) -> str:
    s = s.strip().replace("\u2212", "-").replace("\u2013", "-")
    s = re.sub(r"^[A-Za-z]\s*=\s*", "", s)  # "x = 5"
    for junk in ("\\$", "$", "\\%", "%", "\\!", "\\,", "\\;", "\\ ", "{,}"):
        s = s.replace(junk, "" if junk != "{,}" else ",")
    s = re.sub(r"\\left|\\right", "", s)
    s = s.strip()
    if s.startswith("(") and s.endswith(")") and s.count("(") == 1:
        s = s[1:-1].strip()  # "(-3)"
    return s.rstrip(".").strip()


def parse_number(s: Optional[str]) -> Optional[Fraction]:
    """Exact rational value of a plain-number answer, or None when it is not one.

    Accepts ``-1,234.5``, ``3/4``, ``\\frac{3}{4}``, ``\\dfrac34``, ``$18``, ``50%``, ``12 cm``, ``12\\text{ cm}``,
    ``x = 5``, unicode minus. Rejects anything with other symbols (``2\\sqrt{3}``, ``5x``, ``(1, 2)``).
    """
    if s is None:
        return None
    t = _normalise_number_text(s)
    if not t:
        return None
    for pattern in (_FRAC_RE, _FRAC_SHORT_RE, _NUMBER_RE):
        m = pattern.match(t)
        if m is None:
            continue
        num = Fraction(m.group("num").replace(",", ""))
        den_text = m.groupdict().get("den")
        if den_text is not None:
            den = Fraction(den_text.replace(",", ""))
            if den == 0:
                return None
            num = num / den
        return -num if m.group("sign") == "-" else num
    return None


def _numbers_close(a: Fraction, b: Fraction, rel_tol: float, abs_tol: float) -> bool:
    if a.denominator == 1 and b.denominator == 1:
        return a == b  # two integers: exact (a relative tolerance would accept 1000001 for 1000000)
    diff = abs(a - b)
    return diff <= max(Fraction(rel_tol) * max(abs(a), abs(b)), Fraction(abs_tol))


# --------------------------------------------------------------------------------------------------------------
# Symbolic equivalence (math-verify) and string fallback.
# --------------------------------------------------------------------------------------------------------------


def _normalise_string(s: str) -> str:
    s = _strip_wrappers(s)
    s = re.sub(r"\\text\{([^{}]*)\}", r"\1", s)
    s = re.sub(r"\\left|\\right|\\!|\\,|\\;|\s+", "", s)
    return s.lower()


def _math_verify_equal(pred: str, gold: str) -> Optional[bool]:
    """math-verify's verdict, or None when it parses nothing from either side.

    math-verify's timeout uses ``signal.alarm``, which only works on the main thread: elsewhere (grain/thread
    pools) the timeout is switched off.
    """
    from math_verify import parse, verify

    on_main = threading.current_thread() is threading.main_thread()
    parse_timeout = 5 if on_main else None
    verify_timeout = 5 if on_main else None
    gold_p = parse(f"${gold}$", parsing_timeout=parse_timeout)
    pred_p = parse(f"${pred}$", parsing_timeout=parse_timeout)
    if not gold_p or not pred_p:
        return None
    return bool(verify(gold_p, pred_p, timeout_seconds=verify_timeout))


def answers_match(pred: Optional[str], gold: str, *, rel_tol: float = 1e-6, abs_tol: float = 1e-9) -> bool:
    """Whether an extracted answer equals the ground truth (see module docstring for the rules)."""
    if pred is None:
        return False
    pred, gold = pred.strip(), gold.strip()
    if not pred:
        return False
    pn, gn = parse_number(pred), parse_number(gold)
    if pn is not None and gn is not None:
        return _numbers_close(pn, gn, rel_tol, abs_tol)
    verdict = _math_verify_equal(pred, gold)
    if verdict is not None:
        return verdict
    return _normalise_string(pred) == _normalise_string(gold)


def math_score(
    response: str, gold: str, *, extraction: str = "auto", rel_tol: float = 1e-6, abs_tol: float = 1e-9
) -> float:
    """1.0 if the response's final answer (``extract_answer(response, extraction)``) equals ``gold``, else 0.0."""
    return float(answers_match(extract_answer(response, extraction), gold, rel_tol=rel_tol, abs_tol=abs_tol))


# --------------------------------------------------------------------------------------------------------------
# Rewards.
# --------------------------------------------------------------------------------------------------------------

REWARD_SCALES = ("pm1", "01")


def reward(score, scale: str = "pm1"):
    """Map a score ``s in [0, 1]`` (1 = correct) to a reward: ``"pm1"``: ``2 s - 1`` (±1 for binary scores),
    ``"01"``: ``s``. Elementwise on arrays; jittable (the range check runs only on concrete NumPy/Python values).
    """
    if scale not in REWARD_SCALES:
        raise ValueError(f"unknown reward scale {scale!r}; valid scales: {list(REWARD_SCALES)}")
    if isinstance(score, (int, float, np.ndarray, np.generic)):
        arr = np.asarray(score, dtype=np.float64)
        if np.any(~np.isfinite(arr)) or np.any(arr < 0.0) or np.any(arr > 1.0):
            raise ValueError(f"scores must lie in [0, 1], got {score!r}")
    return 2.0 * score - 1.0 if scale == "pm1" else 1.0 * score


_THINK_ANSWER_RE = re.compile(r"^\s*<think>(?:(?!</?think>).)*</think>\s*<answer>(?:(?!</?answer>).)+</answer>\s*$", re.DOTALL)
_ANSWER_ONLY_RE = re.compile(r"<answer>(?:(?!</?answer>).)+</answer>\s*$", re.DOTALL)


def _format_answer_tags(text: str) -> bool:
    return text.count("<answer>") == 1 and bool(_ANSWER_ONLY_RE.search(text))


def _format_think_answer(text: str) -> bool:
    return text.count("<think>") == 1 and bool(_THINK_ANSWER_RE.match(text))


def _format_boxed(text: str) -> bool:
    found = _BOXED_RE.findall(text)
    return len(found) == 1 and extract_boxed(text) is not None


def _format_gsm8k(text: str) -> bool:
    return text.count("####") == 1 and extract_gsm8k_hashes(text) is not None


FORMAT_STYLES: dict[str, Callable[[str], bool]] = {
    "answer_tags": _format_answer_tags,  # exactly one non-empty <answer>..</answer>, nothing after it
    "think_answer": _format_think_answer,  # <think>..</think><answer>..</answer> and nothing else (DeepSeek-R1 style)
    "boxed": _format_boxed,  # exactly one complete, non-empty \boxed{..}
    "gsm8k": _format_gsm8k,  # exactly one "#### answer"
}


def format_score(text: str, style: str) -> float:
    """1.0 if the response follows the answer format ``style`` (see ``FORMAT_STYLES``), else 0.0."""
    try:
        fn = FORMAT_STYLES[style]
    except KeyError:
        raise ValueError(f"unknown format style {style!r}; valid styles: {sorted(FORMAT_STYLES)}") from None
    return float(fn(text))
