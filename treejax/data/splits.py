"""Content-hash identities and train/eval split assignment that cannot overlap.

A problem's identity is its question text: ``uid(q) = sha256("treejax-uid-v1\\0" + q)[:16 hex]``.
Its split is a pure function of the same text,

    u(q) = int(sha256("treejax-split-v1\\0" + q)[:8 hex], 16) / 2**32   in [0, 1)
    split(q) = "eval" if u(q) < eval_fraction else "train",

so two copies of one question (duplicates in a file, or a procedural generator producing the same problem twice —
reasoning-gym seeds item ``i`` with ``Random(seed + i)``, so seeds ``s`` and ``s+1`` share all but one item) always
land in the same split: train and eval cannot overlap whatever the seeds or sizes. Changing ``eval_fraction`` moves
questions only from train to eval (when it grows) or back, never swaps them.
"""

from __future__ import annotations

import hashlib

from treejax.errors import DataError

__all__ = ["SPLITS", "check_split", "question_uid", "split_of", "split_unit"]

SPLITS = ("train", "eval")


def question_uid(question: str) -> str:
    """Stable 64-bit content id (16 hex chars) of a question."""
    return hashlib.sha256(b"treejax-uid-v1\0" + question.encode("utf-8")).hexdigest()[:16]


def split_unit(question: str) -> float:
    """The question's point ``u(q)`` in [0, 1), uniform over questions, independent of ``question_uid``."""
    digest = hashlib.sha256(b"treejax-split-v1\0" + question.encode("utf-8")).hexdigest()
    return int(digest[:8], 16) / 2**32


def split_of(question: str, eval_fraction: float) -> str:
    """``"eval"`` if ``split_unit(question) < eval_fraction`` else ``"train"``."""
    if not 0.0 <= eval_fraction <= 1.0:
        raise ValueError(f"eval_fraction must lie in [0, 1], got {eval_fraction!r}")
    return "eval" if split_unit(question) < eval_fraction else "train"


def check_split(split: str) -> str:
    """``split`` if it is one of :data:`SPLITS`, else a :class:`~treejax.errors.DataError` naming the valid ones."""
    if split not in SPLITS:
        raise DataError(f"unknown split {split!r}; valid splits: {list(SPLITS)}")
    return split
