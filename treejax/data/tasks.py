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
``"math_file"``, the retrieval world's multi-hop questions ``"retrieval_multihop"``
(:mod:`treejax.envs.retrieval_corpus`) and the shell world's file-system questions ``"shell_files"``
(:mod:`treejax.envs.shell_task`) and chains of any task's problems ``"task_chain"`` (:mod:`treejax.envs.task_chain_task`).
"""

from __future__ import annotations

import difflib
from typing import Any

from treejax.data.task_base import RECORD_FIELDS, TASKS, Example, Task, build_task, decode_record, register_task
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

_BUILTINS_LOADED = False


def _load_builtins() -> None:
    global _BUILTINS_LOADED
    if not _BUILTINS_LOADED:
        _BUILTINS_LOADED = True
        # registration side effects; imported on first use: reasoning_gym_tasks imports reasoning-gym (~1 s)
        from treejax.data import file_tasks, reasoning_gym_tasks  # noqa: F401
        from treejax.envs import retrieval_corpus  # noqa: F401  (the retrieval world's questions)
        from treejax.envs import shell_task  # noqa: F401  (the shell world's questions)
        from treejax.envs import task_chain_task  # noqa: F401  (chains of any task's problems)
        from treejax.envs import user_task  # noqa: F401  (the simulated users' goals)
        from treejax.envs import travel_task  # noqa: F401  (the travel world's planning requests)


def task_names() -> list[str]:
    _load_builtins()
    return TASKS.names()


def check_task_name(name: str) -> None:
    """Raises :class:`~treejax.errors.DataError` unless ``name`` is registered, naming up to 3 close names."""
    _load_builtins()
    if name in TASKS:
        return
    close = difflib.get_close_matches(name, list(TASKS), n=3, cutoff=0.6)
    hint = f"; did you mean {' or '.join(map(repr, close))}?" if close else ""
    raise DataError(f"unknown task {name!r}{hint} (all {len(TASKS)} names: treejax.data.task_names())")


def get_task(name: str, **config: Any) -> Task:
    """Build the task registered under ``name`` with its config; an unknown name suggests the closest ones, and an
    option the factory does not take (or a required one that is missing) is a :class:`DataError` naming it."""
    check_task_name(name)
    return build_task(name, **config)
