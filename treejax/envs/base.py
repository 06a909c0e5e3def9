"""The environment interface of multi-turn rollouts: text in, text out, host-side Python between decode chunks.

An episode is a conversation: the task's prompt, then turns of *actions* (text the policy samples, ending on one
of the environment's ``stop_strings``, an end-of-sequence token or the turn's token cap) and *observations* (text
the environment answers, appended to the conversation and never trained on):

    obs0 = env.reset(example)                  # text appended after the prompt ("" for none)
    result = env.step(action_text)             # StepResult(observation, reward, done, info)

``clone()`` returns an independent copy in the same state: a tree rollout that forks a conversation forks its
environment with its KV cache, and both branches go on independently. :class:`ReplayClone` gives any
deterministic environment ``clone()`` by replaying the action history into a fresh instance (for environments
whose state cannot be copied, e.g. one that holds a process).

:class:`GymnasiumText` adapts an environment in gymnasium's shape (``reset(seed=, options=) -> (obs, info)``,
``step(action) -> (obs, reward, terminated, truncated, info)``; text observations and actions, as GEM and
TextArena environments have) to this interface. Environments here: :mod:`treejax.envs.code_tool` (a Python tool
for math / reasoning-gym tasks), :mod:`treejax.envs.guess` (a number-guessing game with feedback) and
:mod:`treejax.envs.retrieval` (BM25 search and a calculator over a generated multi-hop world) and
:mod:`treejax.envs.shell` (a small shell language, parsed to an AST, over an in-memory file system).

Multi-turn rollouts (``MultiTurnConfig.environment``) name an environment registered with :func:`register_env`:
a class whose ``from_config(config, task, sandbox)`` builds one episode's environment from the
``MultiTurnConfig``, the run's task and the code sandbox's limits (``SandboxConfig``). Registered here:
``"code_tool"``, ``"guess_number"``, ``"retrieval"``, ``"shell"``, ``"task_chain"`` and ``"simulated_user"``
(:mod:`treejax.envs.simulated_user`).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Protocol

from treejax.errors import ConfigError
from treejax.registry import Registry


@dataclasses.dataclass(frozen=True)
class StepResult:
    """One environment step: the ``observation`` text to append, the step's ``reward``, whether the episode is
    ``done``, and ``info`` (host metrics: tool calls, seconds, errors)."""

    observation: str
    reward: float
    done: bool
    info: dict = dataclasses.field(default_factory=dict)


class Environment(Protocol):
    """The interface (module docstring). ``stop_strings``: a turn ends when the action's text ends with one."""

    stop_strings: tuple[str, ...]

    def reset(self, example: Any) -> str: ...

    def step(self, action: str) -> StepResult: ...

    def clone(self) -> "Environment": ...


def tool_step(env: Any, action: str, parse: Callable[[str], Any], run: Callable[[Any], tuple[str, dict]],
              calls_word: str = "tool calls", tag: str = "output") -> StepResult:
    """One step of a tool protocol (the code tool, retrieval, the shell): ``parse(action)`` is the call that ends
    the turn or ``None`` for the answer turn, which ends the episode with ``env.task.score(action, env.example)``;
    a call past ``env.max_calls`` ends it with that turn's score and an error observation; otherwise
    ``run(call) -> (body, info)`` answers ``"\\n<output>\\nbody\\n</output>\\n"`` with reward 0 and
    ``{"tool_calls": n, **info}`` (``tag``: the observation's tag, ``output`` by default; the simulated user's
    replies come back in ``<user>``). ``env`` holds ``task, example, calls, done, max_calls`` (updated here)."""
    name = type(env).__name__
    if env.example is None:
        raise RuntimeError(f"{name}.step before reset")
    if env.done:
        raise RuntimeError(f"{name}.step after the episode ended")
    call = parse(action)
    if call is None:  # the answer turn
        env.done = True
        return StepResult("", float(env.task.score(action, env.example)), True,
                          {"tool_calls": env.calls, "answered": True})
    if env.calls >= env.max_calls:
        env.done = True
        return StepResult(f"\n<{tag}>\n[error] no {calls_word} left ({env.max_calls} per episode)\n</{tag}>\n",
                          float(env.task.score(action, env.example)), True,
                          {"tool_calls": env.calls, "answered": False, "call_limit": True})
    body, info = run(call)
    env.calls += 1
    return StepResult(f"\n<{tag}>\n{body}\n</{tag}>\n", 0.0, False, {"tool_calls": env.calls, **info})


def step_all(envs: list, actions: list[str]) -> tuple[list[StepResult], list[float]]:
    """``(results, seconds)``: ``envs[i].step(actions[i])`` for every ``i`` and the host seconds each took. Envs
    whose class has a ``step_batch(envs, actions)`` classmethod (the simulated user: one batched decode of the
    users' replies) are stepped together, once per class at the position of its first env, their time shared
    evenly; every other env is stepped on its own, in order (exactly the calls a loop of ``step`` makes)."""
    results: list = [None] * len(envs)
    seconds = [0.0] * len(envs)
    groups: dict[type, list[int]] = {}
    for i, env in enumerate(envs):
        if callable(getattr(type(env), "step_batch", None)):
            groups.setdefault(type(env), []).append(i)
    for i, env in enumerate(envs):
        if results[i] is not None:
            continue
        idx = groups.get(type(env), [i]) if type(env) in groups else [i]
        t = time.perf_counter()
        out = (type(env).step_batch([envs[j] for j in idx], [actions[j] for j in idx]) if type(env) in groups
               else [env.step(actions[i])])
        dt = (time.perf_counter() - t) / len(idx)
        for j, r in zip(idx, out):
            results[j], seconds[j] = r, dt
    return results, seconds


def turn_ended(text: str, stop_strings: tuple[str, ...]) -> bool:
    """Whether an action's text (so far) ends a turn: it ends with one of ``stop_strings`` (trailing whitespace
    ignored)."""
    t = text.rstrip()
    return any(t.endswith(s) for s in stop_strings)


#: Every environment class multi-turn rollouts can name, by name (module docstring).
ENVS: Registry[type] = Registry("environment", error=ConfigError)


def register_env(name: str, overwrite: bool = False):
    """Class decorator registering an environment class (one with ``from_config(config, task, sandbox)``) under
    ``name``, the value of ``MultiTurnConfig.environment`` that selects it."""

    def decorator(cls):
        if not callable(getattr(cls, "from_config", None)):
            raise TypeError(f"environment {name!r} must have a from_config(config, task, sandbox) classmethod, got "
                            f"{cls!r}")
        return ENVS.add(name, cls, overwrite=overwrite)

    return decorator


def get_env(name: str) -> type:
    """The environment class registered under ``name`` (a ``ConfigError`` listing the valid names otherwise)."""
    return ENVS.get(name)


def env_names() -> list[str]:
    """The registered environment names, sorted."""
    return ENVS.names()


class ReplayClone:
    """``clone()`` by deterministic replay: a fresh instance from ``self.factory()``, ``reset`` with the same
    example, then every action so far. Subclasses call :meth:`_record_reset` / :meth:`_record_step`."""

    factory: Callable[[], Any]

    def _record_reset(self, example) -> None:
        self._example, self._actions = example, []

    def _record_step(self, action: str) -> None:
        self._actions.append(action)

    def clone(self):
        other = self.factory()
        other.reset(self._example)
        for a in self._actions:
            other.step(a)
        return other


class GymnasiumText(ReplayClone):
    """A gymnasium-shaped text environment as an :class:`Environment` (module docstring). ``make()`` builds the
    wrapped environment; ``options_of(example)`` gives ``reset``'s options for a task example (``seed`` fixed for
    determinism, so replay clones are exact)."""

    def __init__(self, make: Callable[[], Any], options_of: Callable[[Any], dict] = lambda ex: {},
                 stop_strings: tuple[str, ...] = (), seed: int = 0):
        self.make, self.options_of, self.stop_strings, self.seed = make, options_of, tuple(stop_strings), seed
        self.factory = lambda: GymnasiumText(make, options_of, stop_strings, seed)
        self.env, self.done = None, False

    def reset(self, example) -> str:
        self._record_reset(example)
        self.env, self.done = self.make(), False
        obs, _ = self.env.reset(seed=self.seed, options=self.options_of(example))
        return str(obs)

    def step(self, action: str) -> StepResult:
        if self.env is None:
            raise RuntimeError("GymnasiumText.step before reset")
        if self.done:
            raise RuntimeError("GymnasiumText.step after the episode ended")
        self._record_step(action)
        obs, reward, terminated, truncated, info = self.env.step(action)
        self.done = bool(terminated or truncated)
        return StepResult(str(obs), float(reward), self.done, {**dict(info or {}), "truncated": bool(truncated)})


__all__ = ["ENVS", "Environment", "GymnasiumText", "ReplayClone", "StepResult", "env_names", "get_env", "register_env",
           "step_all", "tool_step", "turn_ended"]
