"""A Python code tool for math and reasoning-gym tasks: the model writes code between ``<code>`` and ``</code>``,
the sandbox runs it (:mod:`treejax.envs.sandbox`), and its output comes back between ``<output>`` and
``</output>``; a turn without code is the answer, scored by the task's verifier.

    env = CodeToolEnv(task)
    env.reset(example)                                   # -> "" (the task's prompt is the conversation's start)
    env.step("Let me add them.\\n<code>print(67 + 75)</code>")
        # -> StepResult("\\n<output>\\n142\\n</output>\\n", 0.0, False, {"tool_calls": 1, ...})
    env.step("The sum is 142.\\nAnswer: 142")           # -> StepResult("", 1.0, True, {...}) (task.score)

A turn ends on ``</code>`` (``stop_strings``), so the sampler hands over as soon as a call is complete. Each call
runs in a fresh interpreter (nothing persists between calls: a snippet that needs earlier values recomputes them).
At most ``max_calls`` calls: a call past the limit ends the episode with the verifier's score of that turn and an
error observation. ``instructions`` is the text a run adds to the system prompt so the model knows the protocol.
The state is plain data (the example, the call count): ``clone()`` copies it. Constructing one checks that the
sandbox's isolation layer works (:func:`~treejax.envs.sandbox.check_isolation`, once per process).
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from treejax.envs.base import StepResult, register_env, tool_step
from treejax.envs.sandbox import SandboxConfig, check_isolation, run_python

INSTRUCTIONS = ("You can run Python code: write it between <code> and </code> and print what you need; the printed "
                "output comes back between <output> and </output>. When you know the answer, reply without code "
                "and give the final answer on the last line as 'Answer: <answer>'.")

def extract_code(action: str) -> str | None:
    """The code of the call that ends ``action`` (``<code>...</code>`` at its end; Markdown fences inside are
    dropped), or ``None`` when the turn ends without one (an answer)."""
    text = action.rstrip()
    start = text.rfind("<code>")
    if not text.endswith("</code>") or start < 0:
        return None
    code = text[start + len("<code>"):-len("</code>")].strip("\n")
    fence = re.match(r"^\s*```(?:python|py)?\s*\n(.*?)\n\s*```\s*$", code, re.S)
    return fence.group(1) if fence else code


@register_env("code_tool")
@dataclasses.dataclass
class CodeToolEnv:
    """The code tool (module docstring). ``task``: anything with ``score(text, example) -> float`` (a treejax
    task); ``sandbox``: the limits of one call; ``max_calls``: tool calls per episode."""

    task: Any
    sandbox: SandboxConfig = SandboxConfig()
    max_calls: int = 4
    stop_strings: tuple[str, ...] = ("</code>",)
    instructions: str = INSTRUCTIONS
    example: Any = None
    calls: int = 0
    done: bool = False

    def __post_init__(self):
        if self.max_calls < 0:
            raise ValueError(f"CodeToolEnv.max_calls must be >= 0, got {self.max_calls}")
        check_isolation(self.sandbox)  # once per process (cached): a missing isolation layer fails here, not mid-run

    @classmethod
    def from_config(cls, config, task, sandbox: SandboxConfig) -> "CodeToolEnv":
        """One episode's tool for multi-turn rollouts: the run's ``task``, ``sandbox``'s limits per call and
        ``config.max_turns - 1`` calls (the last turn is for the answer)."""
        return cls(task, sandbox=sandbox, max_calls=config.max_turns - 1)

    def reset(self, example) -> str:
        self.example, self.calls, self.done = example, 0, False
        return ""

    def step(self, action: str) -> StepResult:
        return tool_step(self, action, extract_code, self._run)

    def _run(self, code: str) -> tuple[str, dict]:
        result = run_python(code, self.sandbox)
        return result.observation().rstrip(), {"tool_seconds": result.seconds, "tool_error": not result.ok,
                                               "tool_timed_out": result.timed_out}

    def clone(self) -> "CodeToolEnv":
        return dataclasses.replace(self)  # plain data; the task and the sandbox limits are shared, read-only


__all__ = ["CodeToolEnv", "INSTRUCTIONS", "extract_code"]
