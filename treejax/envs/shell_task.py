"""The shell world's questions (:mod:`treejax.envs.shell`) as the treejax task ``"shell_files"``: each question on
its own generated file system, with its reference actions (``metadata["reference_actions"]``, and as tool calls
``metadata["reference_calls"]``: ``{"name": "shell", "args": {"command": ...}}``) and an exact-answer verifier."""

from __future__ import annotations

import functools
import hashlib
import json
from typing import Optional

import numpy as np

from treejax.data.splits import check_split
from treejax.data.task_base import Example, Task, check_generated_task_options, register_task
from treejax.envs.shell import INSTRUCTION, TEMPLATES, final_answer, generate_fs, make_question
from treejax.errors import DataError


class ShellTask(Task):
    """The shell world's questions (module docstring) as a task. ``size`` / ``eval_size``: questions per split
    (templates in turn, each question on its own file system; train and eval seeds are disjoint); ``seed``;
    ``num_files``: files per file system; ``extraction``: ``"answer_line"`` (the only mode)."""

    eval_options = "give task_options eval_size=N (> 0) for N held-out questions"
    world = "shell"  # the environment 'shell' runs on this task's file systems

    def __init__(self, *, size: int = 512, eval_size: int = 64, seed: int = 0, templates: Optional[tuple] = None,
                 num_files: int = 24, max_output_chars: int = 800, system_prompt: Optional[str] = None,
                 instruction: Optional[str] = INSTRUCTION, extraction: str = "answer_line", name: str = "shell_files"):
        templates = check_generated_task_options("shell_files", templates, TEMPLATES, size, eval_size, extraction)
        generate_fs(0, num_files)  # checks num_files
        if max_output_chars < 1:
            raise DataError(f"shell_files: max_output_chars must be >= 1, got {max_output_chars}")
        self.max_output_chars = max_output_chars
        self.size, self.eval_size, self.seed, self.templates = size, eval_size, seed, templates
        self.num_files, self.system_prompt, self.instruction, self.name = num_files, system_prompt, instruction, name

    @functools.lru_cache(maxsize=2)
    def records(self, split: str) -> list[dict[str, str]]:
        train = check_split(split) == "train"
        out = []
        for i in range(self.size if train else self.eval_size):
            fs_seed = int(np.random.default_rng([self.seed, 0 if train else 1, i]).integers(2 ** 31))
            q = make_question(self.templates[i % len(self.templates)], fs_seed, self.num_files)
            meta = {k: v for k, v in q.items() if k not in ("question", "answer")}
            meta["reference_calls"] = [{"name": "shell", "args": {"command": c}} for c in q["reference_actions"]]
            uid = hashlib.sha256(f"shell-v1\0{fs_seed}\0{q['question']}".encode()).hexdigest()[:16]
            out.append({"uid": uid, "question": q["question"], "answer": q["answer"], "metadata": json.dumps(meta)})
        return out

    def score(self, response_text: str, example: Example) -> float:
        """1.0 when the final answer (:func:`final_answer`) is exactly the truth."""
        return float(final_answer(response_text) == example.ground_truth.strip())


register_task("shell_files", ShellTask)

__all__ = ["ShellTask"]
