"""The environment interface (treejax.envs): the code tool (calls, answers, the call limit, hostile code as an
observation), the guessing game against its rules, clones that go on independently, and the gymnasium adapter
with replay clones."""

from __future__ import annotations

import math
import types

import pytest

from treejax.envs.base import GymnasiumText, StepResult, turn_ended
from treejax.envs.code_tool import CodeToolEnv, extract_code
from treejax.envs.guess import GuessNumberEnv, target_of
from treejax.envs.sandbox import SandboxConfig


class _Task:
    def score(self, text, example):  # the last number equals the example's answer
        import re
        nums = re.findall(r"-?\d+", text)
        return float(bool(nums) and nums[-1] == example["answer"])


FAST = SandboxConfig(timeout_s=2.0, memory_mb=512)


def test_extract_code():
    assert extract_code("Let me compute.\n<code>print(1 + 2)</code>") == "print(1 + 2)"
    assert extract_code("<code>\n```python\nx = 3\nprint(x)\n```\n</code>\n") == "x = 3\nprint(x)"
    assert extract_code("<code>a</code> then <code>print(2)</code>") == "print(2)"  # the call that ends the turn
    assert extract_code("Answer: 3") is None and extract_code("<code>print(1)</code> and more text") is None
    assert turn_ended("run it <code>print(1)</code>  \n", ("</code>",)) and not turn_ended("<code>x", ("</code>",))


def test_code_tool_episode():
    env = CodeToolEnv(_Task(), sandbox=FAST, max_calls=2)
    assert env.reset({"answer": "142"}) == ""
    r = env.step("Add them.\n<code>print(67 + 75)</code>")
    assert r == StepResult("\n<output>\n142\n</output>\n", 0.0, False, r.info) and r.info["tool_calls"] == 1
    r = env.step("<code>while True: pass</code>")
    assert not r.done and r.info["tool_timed_out"] and "time limit" in r.observation
    r = env.step("<code>print(1)</code>")  # no calls left: the episode ends, scored as it stands
    assert r.done and r.reward == 0.0 and r.info["call_limit"] and "no tool calls left" in r.observation
    with pytest.raises(RuntimeError, match="ended"):
        env.step("Answer: 142")
    env.reset({"answer": "142"})
    r = env.step("The sum is 142.\nAnswer: 142")
    assert r.done and r.reward == 1.0 and r.observation == "" and r.info["answered"]


def test_code_tool_clone_goes_on_independently():
    env = CodeToolEnv(_Task(), sandbox=FAST, max_calls=1)
    env.reset({"answer": "7"})
    fork = env.clone()
    assert env.step("<code>print(3 + 4)</code>").observation == "\n<output>\n7\n</output>\n"
    assert env.calls == 1 and fork.calls == 0  # the fork did not see the call
    assert fork.step("Answer: 7").reward == 1.0 and not env.done
    assert env.step("Answer: 8").reward == 0.0


def test_guessing_game_follows_its_rules():
    ex = {"target": 37}
    env = GuessNumberEnv(1, 100, max_turns=7)
    assert "from 1 to 100" in env.reset(ex)
    lo, hi, n = 1, 100, 0
    while True:  # binary search finds it within ceil(log2(101)) = 7 guesses
        g = (lo + hi) // 2
        r = env.step(f"My guess is {g}.")
        n += 1
        if r.done:
            break
        assert r.reward == 0.0 and r.observation.startswith("Higher." if g < 37 else "Lower.")
        lo, hi = (g + 1, hi) if g < 37 else (lo, g - 1)
    assert r.reward == 1.0 and r.observation == "Correct!" and n <= math.ceil(math.log2(101))
    env.reset(ex)
    assert env.step("no idea").observation == "I did not see a number. 6 guesses left."
    for _ in range(6):
        r = env.step("1")
    assert r.done and r.reward == 0.0 and r.info["turns"] == 7


def test_guessing_game_targets_and_clones():
    q = types.SimpleNamespace(metadata={"question": "round 12"})
    t = target_of(q, 1, 100)
    assert 1 <= t <= 100 and t == target_of(q, 1, 100)
    env = GuessNumberEnv()
    env.reset(q)
    env.step("50")
    fork = env.clone()
    a, b = env.step(str(t)), fork.step(str(t - 1 if t > 1 else t + 1))
    assert a.reward == 1.0 and b.reward == 0.0 and fork.turns == env.turns == 2
    with pytest.raises(ValueError, match="outside"):
        target_of({"target": 500}, 1, 100)


class _Countdown:
    """A gymnasium-shaped text environment: say the numbers from options['start'] down to 1."""

    def reset(self, seed=None, options=None):
        self.n = options["start"]
        return f"Say {self.n}.", {}

    def step(self, action):
        ok = action.strip() == str(self.n)
        self.n -= 1
        return (f"Say {self.n}." if self.n else "Done."), float(ok), self.n == 0, False, {"ok": ok}


def test_gymnasium_adapter_and_replay_clone():
    env = GymnasiumText(_Countdown, options_of=lambda ex: {"start": ex})
    assert env.reset(3) == "Say 3."
    assert env.step("3") == StepResult("Say 2.", 1.0, False, {"ok": True, "truncated": False})
    fork = env.clone()  # a fresh instance replayed to the same state
    assert fork.step("2").reward == 1.0 and env.step("9").reward == 0.0
    assert fork.step("1").done and env.step("1").done
    with pytest.raises(RuntimeError, match="ended"):
        env.step("0")
