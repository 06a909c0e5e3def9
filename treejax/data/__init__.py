"""Verifiable tasks, verifiers, prompt formatting, tfds builders and grain pipelines.

Stages: ``tasks.get_task`` (problems + scorer) -> ``tfds_builders.build_task_dataset`` (optional, array_record on
disk) -> ``pipeline.make_prompt_pipeline`` (sharded, shuffled, resumable prompt batches) ->
``Task.make_example`` + ``prompts.format_prompt`` (chat template) -> sampler -> ``Task.score`` ->
``verifiers.reward``.
"""

from treejax.data.pipeline import make_prompt_dataset, make_prompt_pipeline
from treejax.data.prompts import format_prompt
from treejax.data.tasks import Example, Task, decode_record, get_task, register_task, task_names
from treejax.data.verifiers import answers_match, extract_answer, format_score, math_score, reward

__all__ = [
    "Example",
    "Task",
    "answers_match",
    "decode_record",
    "extract_answer",
    "format_prompt",
    "format_score",
    "get_task",
    "make_prompt_dataset",
    "make_prompt_pipeline",
    "math_score",
    "register_task",
    "reward",
    "task_names",
]
