"""Defaults shared by the programs that build a task (``treejax.rl.config.RunConfig``, ``treejax.sft.SFTConfig``),
kept here so that neither has to import the other's configuration to get them."""

from __future__ import annotations

__all__ = ["DEFAULT_TASK_OPTIONS"]

#: The default task's options (``RunConfig`` and ``treejax.sft.SFTConfig``): a small chain_sum_2x1 set.
DEFAULT_TASK_OPTIONS = {"size": 128, "eval_size": 32, "seed": 0, "system_prompt": None,
                        "instruction": "Answer with just the number.", "extraction": "last_number"}
