"""The ``Task`` interface, the flat record schema and the task registry that task modules register into
(:mod:`treejax.data.tasks` looks names up, loading the built-in task modules on first use)."""

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
from treejax.registry import Registry

__all__ = ["RECORD_FIELDS", "TASKS", "Example", "Task", "build_task", "decode_record", "register_task"]

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

    def answer_reached(self, prefix_text: str, example: Example) -> bool:
        """The prefix-verification hook: does this prefix of a response already state the correct final answer?
        (DECS's necessary-reasoning prefix, :func:`treejax.rl.scoring.answer_steps`.) Default: the verifier
        accepts the prefix as a whole response; a task whose verifier needs a complete response (a closing tag,
        a full program) overrides it."""
        return self.score(prefix_text, example) >= 1.0

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


#: Every task factory by name (:mod:`treejax.data.tasks` looks names up, with its own error for unknown ones).
def check_generated_task_options(name: str, templates: Optional[tuple], known: Any, size: int, eval_size: int,
                                 extraction: str) -> tuple:
    """The options every generated question set shares (the retrieval and shell worlds' tasks): ``templates`` a
    non-empty subset of ``known`` (``None``: all of them, returned as a tuple), ``size, eval_size >= 0`` with at
    least one question, ``extraction = 'answer_line'``; a :class:`DataError` naming the task ``name`` otherwise."""
    templates = tuple(known) if templates is None else tuple(templates)
    if not templates or any(t not in known for t in templates):
        raise DataError(f"{name}: templates must be a non-empty subset of {tuple(known)}, got {templates!r}")
    if size < 0 or eval_size < 0 or size + eval_size == 0:
        raise DataError(f"{name}: size, eval_size >= 0 and size + eval_size > 0 required, got {size}, {eval_size}")
    if extraction != "answer_line":
        raise DataError(f"{name}: extraction must be 'answer_line' (the last 'Answer:' line), got {extraction!r}; "
                        "fix: RunConfig.task_options['extraction'] = 'answer_line'")
    return templates


TASKS: Registry[Callable[..., Task]] = Registry("task", error=DataError)


def register_task(name: str, factory: Callable[..., Task], *, overwrite: bool = False) -> None:
    """Register ``factory(**config) -> Task`` under ``name``."""
    TASKS.add(name, factory, overwrite=overwrite)


def build_task(name: str, **config: Any) -> Task:
    """The task registered under ``name`` built with ``config``; an option its factory does not take (or a required
    one that is missing) is a :class:`DataError` naming it and the closest option. :func:`treejax.data.tasks.get_task`
    is the entry point (it loads the built-in tasks and checks the name first)."""
    factory = TASKS.get(name)
    try:
        inspect.signature(factory).bind(**config)
    except TypeError as e:
        names = [p.name for p in inspect.signature(factory).parameters.values()
                 if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        close = [c for key in config if key not in names for c in difflib.get_close_matches(key, names, n=1)]
        hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
        raise DataError(f"task {name!r}: {e}{hint} (its options: {', '.join(names)})") from None
    return factory(**config)
