"""A multi-turn game with feedback: guess a hidden integer in ``[low, high]``; after each guess the environment says
"higher", "lower" or "correct". Reward 1 when the number is found within ``max_turns`` guesses, else 0; a turn
without a number is a wasted guess (the observation says so). The hidden number is a hash of the example's question
(or ``example.metadata["target"]`` / ``example["target"]`` when given), so an episode is deterministic and a clone
continues it exactly. An optimal player needs ``ceil(log2(high - low + 2))`` guesses (7 for 1..100).
"""

from __future__ import annotations

import dataclasses
import hashlib
import re
from typing import Any

from treejax.envs.base import StepResult, register_env


def target_of(example: Any, low: int, high: int) -> int:
    """The hidden number of ``example`` (module docstring)."""
    meta = getattr(example, "metadata", example if isinstance(example, dict) else {})
    if isinstance(meta, dict) and "target" in meta:
        t = int(meta["target"])
        if not low <= t <= high:
            raise ValueError(f"target {t} is outside [{low}, {high}]")
        return t
    text = str(meta.get("question", example)) if isinstance(meta, dict) else str(example)
    return low + int(hashlib.sha1(text.encode()).hexdigest(), 16) % (high - low + 1)


@register_env("guess_number")
@dataclasses.dataclass
class GuessNumberEnv:
    """The guessing game (module docstring)."""

    low: int = 1
    high: int = 100
    max_turns: int = 7
    stop_strings: tuple[str, ...] = ()
    target: int | None = None
    turns: int = 0
    done: bool = False

    def __post_init__(self):
        if self.high < self.low or self.max_turns < 1:
            raise ValueError(f"GuessNumberEnv: low <= high and max_turns >= 1 required, got {self}")

    @classmethod
    def from_config(cls, config, task, sandbox) -> "GuessNumberEnv":
        """One episode's game for multi-turn rollouts: ``config.max_turns`` guesses (the task and the sandbox are
        not used: the hidden number comes from the example)."""
        return cls(max_turns=config.max_turns)

    def reset(self, example) -> str:
        self.target, self.turns, self.done = target_of(example, self.low, self.high), 0, False
        return (f"I am thinking of a whole number from {self.low} to {self.high}. You have {self.max_turns} guesses; "
                "after each I will say higher, lower or correct. Reply with one number.")

    def step(self, action: str) -> StepResult:
        if self.target is None:
            raise RuntimeError("GuessNumberEnv.step before reset")
        if self.done:
            raise RuntimeError("GuessNumberEnv.step after the episode ended")
        self.turns += 1
        nums = re.findall(r"-?\d+", action)
        left = self.max_turns - self.turns
        if not nums:
            obs, reward, found = "I did not see a number.", 0.0, False
        else:
            g = int(nums[-1])
            found = g == self.target
            obs = "Correct!" if found else ("Higher." if g < self.target else "Lower.")
            reward = 1.0 if found else 0.0
        self.done = found or left == 0
        if not self.done:
            obs += f" {left} guess{'es' if left != 1 else ''} left."
        return StepResult(obs, reward, self.done, {"turns": self.turns, "found": found})

    def clone(self) -> "GuessNumberEnv":
        return dataclasses.replace(self)


__all__ = ["GuessNumberEnv", "target_of"]
