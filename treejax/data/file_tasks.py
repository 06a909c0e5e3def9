"""Tasks from local jsonl / parquet files in GSM8K or MATH format.

Formats (field names overridable with ``question_field`` / ``answer_field``):
  - ``"gsm8k"``: ``{"question": str, "answer": "<reasoning> #### 72"}``; the ground truth is the text after the last
    ``####`` with thousands separators removed (``1,200`` -> ``1200``). An answer without ``####`` is an error.
  - ``"math"``: ``{"problem": str, "solution": "... \\boxed{\\frac{1}{2}} ..."}``; the ground truth is the content of
    the last ``\\boxed{}`` (nested braces kept). With ``answer_field="answer"`` (MATH-500 style) a plain answer is
    used as is; a value with a truncated/empty ``\\boxed{`` is an error.
Every problem in the file is kept (duplicates included), except those whose question is empty or only whitespace:
they are filtered out with a count in the log. An answer given as a number (``"answer": 72`` in jsonl,
an integer or float column in parquet) is that number as the ground truth (``"72"``; a float keeps its digits, a
whole float drops ``.0``), in either format and without a ``####`` marker or ``\\boxed{}``. Everything else that
is wrong raises :class:`~treejax.errors.DataError` naming the file and line (row, for parquet): a file with no
problems, an unparsable jsonl line, a line that is no JSON object, a missing field, a question that is not a
string, an answer that is neither a string nor a number. Other scalar fields (``level``, ``type``, ...) go into
the example metadata.

Splits: with ``eval_path`` the two files are train and eval, and a question present in both is an error (they must
not overlap). Without it, one file is split by question hash (``treejax.data.splits.split_of``) with
``eval_fraction`` (default 0: all train, no held-out problems — the training loop then refuses to start and
asks for ``eval_path`` or ``eval_fraction``, since it evaluates before and after training; no problem is moved
out of the training file without being asked). Scoring: ``verifiers.math_score`` (extraction, then numeric /
math-verify equivalence), 1 = correct.
"""

from __future__ import annotations

import functools
import json
import logging
import math
import os
from typing import Iterator, Optional

from treejax.choices import closest_first
from treejax.data import verifiers
from treejax.data.splits import check_split, question_uid, split_of
from treejax.data.task_base import Example, Task, register_task
from treejax.errors import DataError, UserFileError

log = logging.getLogger(__name__)

__all__ = ["DEFAULT_INSTRUCTION", "FileTask", "read_rows"]

DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

_DEFAULT_FIELDS = {"gsm8k": ("question", "answer"), "math": ("problem", "solution")}


def read_rows(path: str) -> Iterator[tuple[str, dict]]:
    """``(location, row)`` for each row of a ``.jsonl``/``.json`` (one object per line) or ``.parquet`` file.

    ``location`` is ``"<path>:<line>"`` (1-based line) or ``"<path>:row <i>"``; blank lines are skipped.
    """
    if not os.path.exists(path):
        raise UserFileError(f"task file not found: {path}")
    if os.path.isdir(path):
        raise DataError(f"task file {path} is a folder; name a .jsonl, .json (JSON lines) or .parquet file")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        try:
            rows = pq.read_table(path).to_pylist()
        except (OSError, ValueError) as e:  # pyarrow's ArrowIOError / ArrowInvalid
            raise DataError(f"{path}: not a readable parquet file ({e})") from None
        for i, row in enumerate(rows):
            yield f"{path}:row {i}", row
        return
    if not (path.endswith(".jsonl") or path.endswith(".json")):
        raise DataError(f"unsupported task file type {path!r}: expected .jsonl, .json (JSON lines) or .parquet")
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise DataError(f"{path}:{lineno}: not UTF-8 text ({e.reason} at byte {e.start})") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise DataError(f"{path}:{lineno}: malformed JSON line ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            yield f"{path}:{lineno}", row


def _field(row: dict, key: str, where: str, numbers: bool = False) -> str | int | float:
    """``row[key]``: a string, or with ``numbers`` also an int or a finite float (not a bool)."""
    if key not in row or row[key] is None:
        raise DataError(f"{where}: missing field {key!r} (fields present: {sorted(row)})")
    value = row[key]
    if isinstance(value, str):
        return value
    if numbers and isinstance(value, (int, float)) and not isinstance(value, bool):
        if isinstance(value, float) and not math.isfinite(value):
            raise DataError(f"{where}: field {key!r} is {value!r}, not a usable answer")
        return value
    wanted = "a string or a number" if numbers else "a string"
    raise DataError(f"{where}: field {key!r} must be {wanted}, got {type(value).__name__} {value!r:.60}")


def _number_text(value: int | float) -> str:
    """The ground-truth text of a numeric answer: ``72`` -> ``"72"``, ``72.0`` -> ``"72"``, ``1.5`` -> ``"1.5"``."""
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value) if isinstance(value, float) else str(value)


def _ground_truth(fmt: str, text: str | int | float, key: str, where: str) -> str:
    if not isinstance(text, str):
        return _number_text(text)
    if fmt == "gsm8k":
        if "####" not in text:
            raise DataError(f"{where}: GSM8K field {key!r} has no '#### <answer>' marker: {text[-80:]!r}")
        ans = verifiers.extract_gsm8k_hashes(text)
        if ans is None:
            raise DataError(f"{where}: empty answer after '####' in field {key!r}")
        return ans.replace(",", "") if verifiers.parse_number(ans) is not None else ans
    if "\\boxed" in text or "\\fbox" in text:
        ans = verifiers.extract_boxed(text)
        if ans is None:
            raise DataError(f"{where}: field {key!r} has a truncated or empty \\boxed{{}}: {text[-80:]!r}")
        return ans
    if key == _DEFAULT_FIELDS["math"][1]:
        raise DataError(f"{where}: MATH solution field {key!r} has no \\boxed{{...}} answer")
    if not text.strip():
        raise DataError(f"{where}: empty answer field {key!r}")
    return text.strip()


class FileTask(Task):
    """GSM8K/MATH-format problems from local files (see module docstring)."""

    eval_options = ("give task_options eval_path='<held-out file>' (a second file of the same format) or "
                    "eval_fraction=0.05 (that share of the file, chosen by question hash, is held out)")

    def __init__(
        self,
        path: str,
        *,
        format: str,
        eval_path: Optional[str] = None,
        eval_fraction: float = 0.0,
        question_field: Optional[str] = None,
        answer_field: Optional[str] = None,
        system_prompt: Optional[str] = None,
        instruction: Optional[str] = DEFAULT_INSTRUCTION,
        extraction: str = "auto",
        rel_tol: float = 1e-6,
        name: Optional[str] = None,
    ):
        if format not in _DEFAULT_FIELDS:
            raise DataError(f"unknown file task format {format!r}; valid formats: {sorted(_DEFAULT_FIELDS)}")
        if extraction not in verifiers.EXTRACTION_MODES:
            raise DataError(f"unknown extraction {extraction!r}; valid (closest first): "
                            f"{closest_first(extraction, sorted(verifiers.EXTRACTION_MODES))}")
        if eval_path is not None and eval_fraction:
            raise DataError("give either eval_path or eval_fraction, not both")
        self.path, self.eval_path, self.format = path, eval_path, format
        self.eval_fraction = eval_fraction
        self.question_field = question_field or _DEFAULT_FIELDS[format][0]
        self.answer_field = answer_field or _DEFAULT_FIELDS[format][1]
        self.system_prompt, self.instruction, self.extraction, self.rel_tol = (
            system_prompt, instruction, extraction, rel_tol)
        self.name = name or f"{format}_file:{os.path.basename(path)}"
        if isinstance(eval_fraction, bool) or not isinstance(eval_fraction, (int, float)) \
                or not 0.0 <= eval_fraction <= 1.0:
            raise DataError(f"eval_fraction must be a number in [0, 1], got {eval_fraction!r}")
        self._records = self._load()

    def _read(self, path: str) -> list[dict[str, str]]:
        """The problems of ``path``; rows whose question is empty or only whitespace are filtered out with a
        count in the log (a prompt with no question trains and evaluates on nothing)."""
        out, blank, rows = [], [], 0
        for where, row in read_rows(path):
            rows += 1
            question = _field(row, self.question_field, where)
            if not question.strip():
                blank.append(where)
                continue
            answer_text = _field(row, self.answer_field, where, numbers=True)
            answer = _ground_truth(self.format, answer_text, self.answer_field, where)
            extra = {k: v for k, v in row.items() if k not in (self.question_field, self.answer_field)
                     and isinstance(v, (str, int, float, bool))}
            metadata = {**extra, "source": where}
            out.append({"uid": question_uid(question), "question": question, "answer": answer,
                        "metadata": json.dumps(metadata)})
        if blank:
            log.warning("%s: %d of %d problems have an empty or whitespace-only %r field (first at %s): filtered "
                        "out", path, len(blank), rows, self.question_field, blank[0])
        return out

    def _read_some(self, path: str) -> list[dict[str, str]]:
        records = self._read(path)
        if not records:
            raise DataError(f"task file {path} holds no problems (it is empty, has only blank lines, or every "
                            f"{self.question_field!r} field is empty)")
        return records

    def _load(self) -> dict[str, list[dict[str, str]]]:
        train = self._read_some(self.path)
        if self.eval_path is not None:
            evals = self._read_some(self.eval_path)
            train_q = {r["question"] for r in train}
            shared = [r for r in evals if r["question"] in train_q]
            if shared:
                where = json.loads(shared[0]["metadata"])["source"]
                raise DataError(
                    f"{len(shared)} eval question(s) in {self.eval_path} also appear in {self.path} "
                    f"(first at {where}); train and eval must not overlap"
                )
            return {"train": train, "eval": evals}
        split = {"train": [], "eval": []}
        for r in train:
            split[split_of(r["question"], self.eval_fraction)].append(r)
        return split

    def records(self, split: str) -> list[dict[str, str]]:
        return self._records[check_split(split)]

    def score(self, response_text: str, example: Example) -> float:
        return verifiers.math_score(response_text, example.ground_truth, extraction=self.extraction,
                                    rel_tol=self.rel_tol)


# partials keep FileTask's signature, so get_task names an unknown option before anything is read
_gsm8k_file = functools.partial(FileTask, format="gsm8k")
_math_file = functools.partial(FileTask, format="math")


register_task("gsm8k_file", _gsm8k_file)
register_task("math_file", _math_file)
