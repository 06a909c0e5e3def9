"""Tasks from local jsonl / parquet files in GSM8K or MATH format.

Formats (field names overridable with ``question_field`` / ``answer_field``):
  - ``"gsm8k"``: ``{"question": str, "answer": "<reasoning> #### 72"}``; the ground truth is the text after the last
    ``####`` with thousands separators removed (``1,200`` -> ``1200``). An answer without ``####`` is an error.
  - ``"math"``: ``{"problem": str, "solution": "... \\boxed{\\frac{1}{2}} ..."}``; the ground truth is the content of
    the last ``\\boxed{}`` (nested braces kept). With ``answer_field="answer"`` (MATH-500 style) a plain answer is
    used as is; a value with a truncated/empty ``\\boxed{`` is an error.
Every problem in the file is kept (duplicates included); an unparsable jsonl line, a missing field or a non-string
value raises an error naming the file and line (row, for parquet). Other scalar fields (``level``, ``type``, ...) go
into the example metadata.

Splits: with ``eval_path`` the two files are train and eval, and a question present in both is an error (they must
not overlap). Without it, one file is split by question hash (``treejax.data.splits.split_of``) with
``eval_fraction`` (default 0: all train). Scoring: ``verifiers.math_score`` (extraction, then numeric / math-verify
equivalence), 1 = correct.
"""

from __future__ import annotations

import json
import os
from typing import Any, Iterator, Optional

from treejax.data import verifiers
from treejax.data.splits import check_split, question_uid, split_of
from treejax.data.tasks import Example, Task, register_task
from treejax.errors import UserFileError

__all__ = ["DEFAULT_INSTRUCTION", "FileTask", "read_rows"]

DEFAULT_INSTRUCTION = "Please reason step by step, and put your final answer within \\boxed{}."

_DEFAULT_FIELDS = {"gsm8k": ("question", "answer"), "math": ("problem", "solution")}


def read_rows(path: str) -> Iterator[tuple[str, dict]]:
    """``(location, row)`` for each row of a ``.jsonl``/``.json`` (one object per line) or ``.parquet`` file.

    ``location`` is ``"<path>:<line>"`` (1-based line) or ``"<path>:row <i>"``; blank lines are skipped.
    """
    if not os.path.exists(path):
        raise UserFileError(f"task file not found: {path}")
    if path.endswith(".parquet"):
        import pyarrow.parquet as pq

        for i, row in enumerate(pq.read_table(path).to_pylist()):
            yield f"{path}:row {i}", row
        return
    if not (path.endswith(".jsonl") or path.endswith(".json")):
        raise ValueError(f"unsupported task file type {path!r}: expected .jsonl, .json (JSON lines) or .parquet")
    with open(path, encoding="utf-8") as f:
        for lineno, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{lineno}: malformed JSON line ({e.msg} at column {e.colno})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
            yield f"{path}:{lineno}", row


def _field(row: dict, key: str, where: str) -> str:
    if key not in row or row[key] is None:
        raise KeyError(f"{where}: missing field {key!r} (fields present: {sorted(row)})")
    value = row[key]
    if not isinstance(value, str):
        raise TypeError(f"{where}: field {key!r} must be a string, got {type(value).__name__}")
    return value


def _ground_truth(fmt: str, text: str, key: str, where: str) -> str:
    if fmt == "gsm8k":
        if "####" not in text:
            raise ValueError(f"{where}: GSM8K field {key!r} has no '#### <answer>' marker: {text[-80:]!r}")
        ans = verifiers.extract_gsm8k_hashes(text)
        if ans is None:
            raise ValueError(f"{where}: empty answer after '####' in field {key!r}")
        return ans.replace(",", "") if verifiers.parse_number(ans) is not None else ans
    if "\\boxed" in text or "\\fbox" in text:
        ans = verifiers.extract_boxed(text)
        if ans is None:
            raise ValueError(f"{where}: field {key!r} has a truncated or empty \\boxed{{}}: {text[-80:]!r}")
        return ans
    if key == _DEFAULT_FIELDS["math"][1]:
        raise ValueError(f"{where}: MATH solution field {key!r} has no \\boxed{{...}} answer")
    if not text.strip():
        raise ValueError(f"{where}: empty answer field {key!r}")
    return text.strip()


class FileTask(Task):
    """GSM8K/MATH-format problems from local files (see module docstring)."""

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
            raise ValueError(f"unknown file task format {format!r}; valid formats: {sorted(_DEFAULT_FIELDS)}")
        if extraction not in verifiers.EXTRACTION_MODES:
            raise ValueError(f"unknown extraction {extraction!r}; valid: {sorted(verifiers.EXTRACTION_MODES)}")
        if eval_path is not None and eval_fraction:
            raise ValueError("give either eval_path or eval_fraction, not both")
        self.path, self.eval_path, self.format = path, eval_path, format
        self.eval_fraction = eval_fraction
        self.question_field = question_field or _DEFAULT_FIELDS[format][0]
        self.answer_field = answer_field or _DEFAULT_FIELDS[format][1]
        self.system_prompt, self.instruction, self.extraction, self.rel_tol = (
            system_prompt, instruction, extraction, rel_tol)
        self.name = name or f"{format}_file:{os.path.basename(path)}"
        split_of("", eval_fraction)  # validates the fraction
        self._records = self._load()

    def _read(self, path: str) -> list[dict[str, str]]:
        out = []
        for where, row in read_rows(path):
            question = _field(row, self.question_field, where)
            answer_text = _field(row, self.answer_field, where)
            answer = _ground_truth(self.format, answer_text, self.answer_field, where)
            extra = {k: v for k, v in row.items() if k not in (self.question_field, self.answer_field)
                     and isinstance(v, (str, int, float, bool))}
            metadata = {**extra, "source": where}
            out.append({"uid": question_uid(question), "question": question, "answer": answer,
                        "metadata": json.dumps(metadata)})
        return out

    def _load(self) -> dict[str, list[dict[str, str]]]:
        train = self._read(self.path)
        if self.eval_path is not None:
            evals = self._read(self.eval_path)
            train_q = {r["question"] for r in train}
            shared = [r for r in evals if r["question"] in train_q]
            if shared:
                where = json.loads(shared[0]["metadata"])["source"]
                raise ValueError(
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


def _gsm8k_file(path: str, **cfg: Any) -> FileTask:
    return FileTask(path, format="gsm8k", **cfg)


def _math_file(path: str, **cfg: Any) -> FileTask:
    return FileTask(path, format="math", **cfg)


register_task("gsm8k_file", _gsm8k_file)
register_task("math_file", _math_file)
