"""Verifiable tasks: the registry, the ``Task`` interface and the flat record schema.

A task turns problems into chat prompts and scores responses:

    task = get_task("chain_sum", min_terms=2, max_terms=2, size=1000, seed=0)
    for ex in task.examples("train", seed=0):      # Example(prompt_messages, ground_truth, metadata)
        text = format_prompt(tokenizer, ex.prompt_messages)
        s = task.score(response_text, ex)          # in [0, 1], 1 = correct
        r = reward(s, "pm1")

Problems are stored as flat string records (the schema shared with the tfds builders and grain pipelines):
``{"uid": 16-hex content id, "question": str, "answer": str, "metadata": JSON str}``. The system prompt and the
answer-format instruction are NOT stored in records: ``Task.make_example`` adds them, so prompts can be changed in
gin without rebuilding datasets.

Registered names (``task_names()``): ``"reasoning_gym"`` (``dataset=`` any reasoning-gym name), every reasoning-gym
dataset name directly (``get_task("chain_sum", ...)`` == ``get_task("reasoning_gym", dataset="chain_sum", ...)``),
the easy presets of ``reasoning_gym_tasks.EASY_PRESETS``, and the local-file tasks ``"gsm8k_file"``,
``"math_file"``.
"""

from __future__ import annotations

import abc
import dataclasses
import difflib
import inspect
import json
from typing import Any, Callable, Iterator, Mapping, Optional

import numpy as np

from treejax.data.splits import check_split
from treejax.errors import DataError

__all__ = [
    "RECORD_FIELDS",
    "Example",
    "Task",
    "check_task_name",
    "decode_record",
    "get_task",
    "register_task",
    "task_names",
]

RECORD_FIELDS = ("uid", "question", "answer", "metadata")


@dataclasses.dataclass(frozen=True)
class Example:
    """One prompt: chat messages (``[{"role": "system"|"user", "content": str}, ...]``), the ground-truth answer
    string, and metadata (always holds ``uid`` and ``question``; task-specific keys otherwise)."""

    prompt_messages: list[dict]
    ground_truth: str
    metadata: dict


def decode_record(record: Mapping[str, Any]) -> dict[str, str]:
    """A record with ``str`` values from one whose values may be ``bytes``/NumPy scalars (tfds data sources
    return ``bytes``). Raises if a schema field is missing."""
    out = {}
    for key in RECORD_FIELDS:
        if key not in record:
            raise KeyError(f"record lacks field {key!r}; it has {sorted(record)} (schema: {list(RECORD_FIELDS)})")
        value = record[key]
        if isinstance(value, np.ndarray) and value.shape == ():
            value = value.item()
        if isinstance(value, bytes):
            value = value.decode("utf-8")
        if not isinstance(value, str):
            raise TypeError(f"record field {key!r} must be str or bytes, got {type(value).__name__}")
        out[key] = value
    return out


class Task(abc.ABC):
    """A verifiable task. Subclasses implement ``records`` and ``score``.

    Attributes:
      name: registry-style name (includes the dataset for reasoning-gym tasks).
      system_prompt: optional system message added to every prompt.
      instruction: optional answer-format instruction appended to the user message (after a blank line).
      eval_options: how to give this task held-out problems (the task options to set), for error messages.
    """

    name: str
    system_prompt: Optional[str] = None
    instruction: Optional[str] = None
    eval_options: str = "set the task options that give it an eval split"

    @abc.abstractmethod
    def records(self, split: str) -> list[dict[str, str]]:
        """All records of ``split`` ("train" or "eval") in a deterministic order."""

    @abc.abstractmethod
    def score(self, response_text: str, example: Example) -> float:
        """Score in [0, 1] of a model response (1 = correct)."""

    def num_examples(self, split: str) -> int:
        return len(self.records(split))

    def make_example(self, record: Mapping[str, Any]) -> Example:
        """The chat prompt of a record (str or bytes values)."""
        rec = decode_record(record)
        metadata = json.loads(rec["metadata"])
        metadata.update(uid=rec["uid"], question=rec["question"])
        user = rec["question"] if not self.instruction else f"{rec['question']}\n\n{self.instruction}"
        messages = [{"role": "user", "content": user}]
        if self.system_prompt:
            messages.insert(0, {"role": "system", "content": self.system_prompt})
        return Example(prompt_messages=messages, ground_truth=rec["answer"], metadata=metadata)

    def examples(self, split: str, seed: Optional[int] = None) -> Iterator[Example]:
        """Examples of ``split``: stored order if ``seed`` is None, else a permutation drawn from
        ``np.random.default_rng(seed)`` (deterministic per seed). Training input should go through
        ``treejax.data.pipeline.make_prompt_pipeline`` (sharding, repeat, resumable state)."""
        recs = self.records(check_split(split))
        order = range(len(recs)) if seed is None else np.random.default_rng(seed).permutation(len(recs))
        for i in order:
            yield self.make_example(recs[int(i)])

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r})"


_REGISTRY: dict[str, Callable[..., Task]] = {}
_BUILTINS_LOADED = False


def register_task(name: str, factory: Callable[..., Task], *, overwrite: bool = False) -> None:
    """Register ``factory(**config) -> Task`` under ``name``."""
    if name in _REGISTRY and not overwrite:
        raise ValueError(f"task {name!r} is already registered")
    _REGISTRY[name] = factory


def _load_builtins() -> None:
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        from treejax.data import file_tasks, reasoning_gym_tasks  # noqa: F401  (registration side effects)


def task_names() -> list[str]:
    _load_builtins()
    return sorted(_REGISTRY)


def check_task_name(name: str) -> None:
    """Raises :class:`~treejax.errors.DataError` unless ``name`` is registered, naming up to 3 close names."""
    _load_builtins()
    if name in _REGISTRY:
        return
    close = difflib.get_close_matches(name, _REGISTRY, n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    raise DataError(f"unknown task {name!r}{hint} (all {len(_REGISTRY)} names: treejax.data.task_names())")


def get_task(name: str, **config: Any) -> Task:
    """Build the task registered under ``name`` with its config; an unknown name suggests the closest ones, and an
    option the factory does not take (or a required one that is missing) is a :class:`DataError` naming it."""
    check_task_name(name)
    factory = _REGISTRY[name]
    try:
        inspect.signature(factory).bind(**config)
    except TypeError as e:
        names = [p.name for p in inspect.signature(factory).parameters.values()
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        close = [c for key in config if key not in names for c in difflib.get_close_matches(key, names, n=1)]
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise DataError(f"task {name!r}: {e}{hint} (its options: {', '.join(names)})") from None
    return factory(**config)
