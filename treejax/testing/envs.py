"""A deterministic toy tool environment that a tiny *random* model over :class:`~treejax.testing.tokenizers.
CharTokenizer`'s characters can drive (``'0'`` .. ``'n'``: digits, ``:;<=>?@``, upper case, ``[\\]^_```, ``a`` ..
``n``; no spaces), so notebooks and tests can run trees of turns offline with tool calls, tool errors and answers.

It has :class:`~treejax.envs.code_tool.CodeToolEnv`'s shape (a turn is a tool call or the answer; the same ``info``
keys, so :func:`treejax.viz.draw_turn_tree` reads both alike), with a rule for each turn's text instead of Python:

* a turn whose text ends with an upper-case letter is a **tool call**; its "code" is the whole turn. The toy tool
  fails when the code holds one of ``:;<=>?@[\\]^_``` (observation ``<ERR=c>``, ``c`` the first such character),
  else it prints the sum of the code's digits (``<OUT=n>``). Reward 0; the episode goes on. A call past
  ``max_calls`` ends the episode without an answer (``<ERR=LIMIT>``, reward 0);
* any other turn is the **answer**: the last digit of its text (no digit: no answer). Reward 1 when that digit is
  within ``tolerance`` of the hidden target digit, else 0; the episode ends.

The target is ``example["target"]`` (a digit) when given, else a hash of the example's text
(:func:`treejax.envs.guess.target_of` on ``[0, 9]``). Turns end on the sampler's turn cap or a stop token
(``stop_strings`` is empty). The state is plain data: ``clone()`` copies it.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any

from treejax.envs.base import StepResult
from treejax.envs.guess import target_of

TOOL_ERROR_CHARS = ":;<=>?@[\\]^_`"


@dataclasses.dataclass
class ToyToolEnv:
    """The toy tool (module docstring): ``max_calls`` tool calls per episode, answers within ``tolerance`` of the
    target digit score 1."""

    max_calls: int = 3
    tolerance: int = 2
    stop_strings: tuple[str, ...] = ()
    target: int | None = None
    calls: int = 0
    done: bool = False

    def __post_init__(self):
        if self.max_calls < 0 or self.tolerance < 0:
            raise ValueError(f"ToyToolEnv: max_calls >= 0 and tolerance >= 0 required, got {self}")

    def reset(self, example: Any) -> str:
        self.target, self.calls, self.done = target_of(example, 0, 9), 0, False
        return ""

    def step(self, action: str) -> StepResult:
        if self.target is None:
            raise RuntimeError("ToyToolEnv.step before reset")
        if self.done:
            raise RuntimeError("ToyToolEnv.step after the episode ended")
        text = action.strip()
        if text[-1:].isupper():  # a tool call
            if self.calls >= self.max_calls:
                self.done = True
                return StepResult("<ERR=LIMIT>", 0.0, True,
                                  {"tool_calls": self.calls, "answered": False, "call_limit": True})
            self.calls += 1
            bad = [c for c in text if c in TOOL_ERROR_CHARS]
            obs = f"<ERR={bad[0]}>" if bad else f"<OUT={sum(int(c) for c in text if c.isdigit())}>"
            return StepResult(obs, 0.0, False, {"tool_calls": self.calls, "tool_error": bool(bad)})
        self.done = True
        digits = re.findall(r"\d", text)
        if not digits:
            return StepResult("", 0.0, True, {"tool_calls": self.calls, "answered": False})
        reward = float(abs(int(digits[-1]) - self.target) <= self.tolerance)
        return StepResult("", reward, True, {"tool_calls": self.calls, "answered": True, "answer": int(digits[-1])})

    def clone(self) -> "ToyToolEnv":
        return dataclasses.replace(self)


class ScriptedToolEnv:
    """A scripted environment for tests of multi-turn sources: a turn ends on ``'5'``; the first ``tool_turns``
    turns are tool calls answered ``"OK"`` (``info``: ``tool_seconds`` 0 and ``tool_error`` on the turns listed in
    ``error_turns``, 1-based), the next turn is the answer (``answered``), scoring 1 when ``win`` is None and the
    answer holds a ``'3'``, else ``float(win)``; ``tool_info`` is merged into every tool turn's info (e.g. a
    ``tool_call`` or an ``action_signature`` for the sources that read them). Plain-data state: ``clone()`` copies
    it."""

    stop_strings = ("5",)

    def __init__(self, tool_turns: int = 2, error_turns: tuple[int, ...] = (), win: bool | None = None,
                 tool_info: dict | None = None):
        self.tool_turns, self.error_turns, self.win, self.n = tool_turns, tuple(error_turns), win, 0
        self.tool_info = dict(tool_info or {})

    def reset(self, example):
        self.n = 0
        return ""

    def step(self, action: str):
        self.n += 1
        if self.n <= self.tool_turns:
            return StepResult("OK", 0.0, False, {"tool_seconds": 0.0, "tool_error": self.n in self.error_turns,
                                                 **self.tool_info})
        score = float("3" in action) if self.win is None else float(self.win)
        return StepResult("", score, True, {"answered": True})

    def clone(self) -> "ScriptedToolEnv":
        c = ScriptedToolEnv(self.tool_turns, self.error_turns, self.win, self.tool_info)
        c.n = self.n
        return c


def tiny_multiturn_base(examples: list, seed: int = 5):
    """``(base, params)`` for a :class:`~treejax.rl.multiturn.MultiTurnRollouts` over a tiny random model and
    :class:`~treejax.testing.tokenizers.CharTokenizer`: two prompts (``examples`` their examples), two independent
    slots of at most 32 tokens, token 63 ends a sequence, rewards ``2 s - 1``; ``params`` from ``seed``."""
    import types

    import jax
    import numpy as np

    from treejax.models import presets, transformer
    from treejax.sampling import decode, tree
    from treejax.sampling.strategies import Temperature
    from treejax.testing.tokenizers import CharTokenizer

    cfg = presets.tiny_config("smollm2-135m", vocab_size=64)
    rollout = types.SimpleNamespace(tree_config=tree.independent_config(2, 32, 8, strategy=Temperature(1.0),
                                                                        stop_ids=(63,)))
    base = types.SimpleNamespace(pipeline=None, task=None, tokenizer=CharTokenizer(), rollout=rollout,
                                 sampler_fns=decode.make_model_fns(cfg, attention="dense", cache_dtype="float32"),
                                 draw=lambda: (examples, np.array([[1, 2, 3], [1, 4, 0]], np.int32),
                                               np.array([3, 2], np.int32)),
                                 rewards=lambda s, n: (2.0 * s - 1.0).astype(np.float32))
    return base, transformer.init_params(cfg, jax.random.key(seed))


__all__ = ["ScriptedToolEnv", "TOOL_ERROR_CHARS", "ToyToolEnv", "tiny_multiturn_base"]


#: The bindings that shrink a shipped multi-turn config to one step on the tiny model (:func:`run_shipped_multiturn`).
ONE_STEP_MULTITURN = ("RunConfig.num_steps = 1", "RunConfig.prompts_per_step = 2", "TreeConfig.num_leaves = 4",
                      "TreeConfig.init_divergence = 4", "EvalConfig.num_problems = 4", "EvalConfig.max_new_tokens = 8",
                      "EvalConfig.batch_size = 4", "MultiTurnConfig.turn_tokens = 16", "RunConfig.export_hf = False",
                      "RunConfig.tree_picture_every = 0", "OptimizerConfig.total_steps = 1",
                      "RunConfig.mini_batches = 1")


def shipped_multiturn_argv(config: str, model: str, log_dir, extra: tuple = ()) -> list[str]:
    """``treejax-train``'s arguments for one step of ``configs/<config>`` (:func:`run_shipped_multiturn`'s)."""
    import os

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    params = [f"RunConfig.model = '{model}'", f"RunConfig.log_dir = '{log_dir}'", *ONE_STEP_MULTITURN, *extra]
    return ["--gin_file", os.path.join(root, "configs", config), "--quiet"] + sum((["--gin_param", p] for p in params), [])


def check_shipped_multiturn_row(summary: dict) -> dict:
    """What every one-step run of a shipped multi-turn config must give: one history row, every one of the 8 leaf
    slots ended (done, out of turns or out of tokens), a finite mean reward. Returns that row."""
    import math

    assert len(summary["history"]) == 1, summary["history"]
    last = summary["history"][-1]
    ended = sum(last[f"multiturn/status/{s}"] for s in ("done", "max_turns", "max_tokens"))
    assert ended == 2 * 4, f"{ended} of 8 leaf slots ended"
    assert math.isfinite(last["reward/mean"]), last["reward/mean"]
    return last


def run_shipped_multiturn(config: str, model: str, log_dir, extra: tuple = ()) -> dict:
    """``configs/<config>`` through ``treejax.train.main`` for one step of 2 prompts x 4 leaf slots on ``model``
    (:data:`ONE_STEP_MULTITURN`, then ``extra``, which may override them). Checks what every such run must give:
    one history row, every slot ended (done, out of turns or out of tokens), a finite mean reward. Returns that
    row."""
    from treejax import train

    return check_shipped_multiturn_row(train.main(shipped_multiturn_argv(config, model, log_dir, extra)))
