"""Verifiable tasks, verifiers, prompt formatting, tfds builders and grain pipelines.

Stages: ``tasks.get_task`` (problems + scorer) -> ``tfds_builders.build_task_dataset`` (optional, array_record on
disk) -> ``pipeline.make_prompt_pipeline`` (sharded, shuffled, resumable prompt batches) ->
``Task.make_example`` + ``prompts.format_prompt`` (chat template) -> sampler -> ``Task.score`` ->
``verifiers.reward``.

The names below load on first use (PEP 562): importing ``treejax.data.defaults`` (as ``RunConfig`` does) must not
pull in grain and orbax, so that ``treejax-train``'s config check answers a typo before the heavy imports.
"""

import importlib

_EXPORTS = {
    "make_prompt_dataset": "pipeline", "make_prompt_pipeline": "pipeline",
    "format_prompt": "prompts",
    "Example": "tasks", "Task": "tasks", "decode_record": "tasks", "get_task": "tasks", "register_task": "tasks",
    "task_names": "tasks",
    "answers_match": "verifiers", "extract_answer": "verifiers", "format_score": "verifiers", "math_score": "verifiers",
    "reward": "verifiers",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        value = getattr(importlib.import_module(f"treejax.data.{_EXPORTS[name]}"), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"treejax.data.{name}")
    except ModuleNotFoundError as e:
        if e.name != f"treejax.data.{name}":
            raise
        raise AttributeError(f"module 'treejax.data' has no attribute {name!r}") from None


def __dir__():
    return sorted(set(globals()) | set(_EXPORTS))
