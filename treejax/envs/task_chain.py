"""Task chains: a sequence of related problems in one episode, each verified, for skills that carry from one
problem to the next (SAGE's sequential rollouts, :mod:`treejax.rl.advantages.sage`), over any single-turn task.

A chain (the task ``"task_chain"``, :mod:`treejax.envs.task_chain_task`) is ``K`` problems of one *family* of an
inner task (the same reasoning-gym dataset, or the same question template of a generated task such as
``shell_files``), drawn in a seeded order. The episode's turns are the problems in order::

    env = TaskChainEnv(task)                 # task: a TaskChain (its inner task's verifier)
    env.reset(example)                       # -> ""  (the prompt already holds problem 1)
    env.step("... <answer>7</answer>")       # problem 1 scored by the inner verifier; the observation is the
        # -> StepResult("\\n<feedback>Correct.</feedback>\\n\\nProblem 2 of 3: ...\\n", 1/3, False,
        #               {"chain_link": 0, "chain_outcome": 1.0, "skill": True, ...})
    env.step("...")                          # problem 2, then problem 3
    env.step("...")                          # -> StepResult("", o_3 / 3, True, {"answered": True, ...})

**Turns.** Without an inner environment (``inner_environment = None``: the inner task is single-turn) every turn
answers the current problem. With one (e.g. ``"shell"`` for ``shell_files`` chains) each problem is an episode of
that environment (its tool calls are turns of the chain) and the problem ends when the inner episode does; the
inner environment is built fresh for every problem from the same ``MultiTurnConfig``.

**Observations** after problem ``k`` (text the policy never trains on): the feedback (``feedback``: ``"answer"``
says whether it was right and, if not, the true answer; ``"verdict"`` only whether it was right; ``"none"``
nothing), then with ``skills`` the skill library, then the next problem (``next_format``).

**Skills.** The skill carried from one problem to the next is, by default, the conversation itself: every earlier
problem, the policy's turns on it and the feedback stay in the context (``skills = False``; every finished problem
counts as having passed a skill on). With ``skills = True`` the policy may write ``<skill>text</skill>`` in a
problem's last turn (before the answer, which ends the turn); the text (cut at ``max_skill_chars``) joins a skill
library that the following observations list ("Skills so far:"), and only a problem whose turn wrote one passes a
skill on (``info["skill"]``).

**Rewards and info.** A problem's last turn has reward ``o_k / K`` (``o_k``: the inner verifier's score, or the
inner episode's final reward clipped to [0, 1]); other turns 0, so an episode's total reward is the chain's score
``mean_k o_k`` with unreached problems 0, also in every turn's ``info["episode_score"]`` (what the multi-turn
source reads as the slot's score, :func:`treejax.rl.multiturn.episode_score`). Every turn's info has
``chain_link`` (its problem's index) and ``chain_length``; a problem's last turn adds ``chain_outcome`` (``o_k``)
and ``skill``; the chain's last turn ``answered``. The multi-turn source turns them into SAGE's inputs
``chain_link_PxWxD``, ``chain_outcome_PxWxD`` and ``chain_skill_PxWxD`` (:func:`treejax.rl.chains.chain_arrays`).

**State** is plain immutable data (the example, its problems, the scores and skills so far) plus the inner
environment, which is cloned with it: ``clone()``'s future equals a fresh replay of the same actions.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, ClassVar, Optional

import numpy as np

from treejax.envs.base import StepResult, register_env
from treejax.errors import ConfigError

#: ``feedback`` values (module docstring).
FEEDBACK = ("answer", "verdict", "none")
#: The first user message: this header, then problem 1 (its question and the inner task's instruction).
HEADER = "You will solve {length} related problems, one at a time. Problem 1 of {length}: "
#: The observation that brings problem ``index`` (1-based) of ``length``.
NEXT_FORMAT = "\n\nProblem {index} of {length}: {question}\n"
_SKILL = re.compile(r"<skill>(.*?)</skill>", re.S)


def feedback_text(mode: str, score: float, truth: str) -> str:
    """The feedback on a finished problem (module docstring): ``""`` for ``"none"``."""
    if mode == "none":
        return ""
    verdict = "Correct." if score >= 1.0 else "Wrong." if mode == "verdict" else f"Wrong; the answer was {truth}."
    return f"\n<feedback>{verdict}</feedback>"


def parse_skill(action: str, max_chars: int) -> Optional[str]:
    """The text of the last ``<skill>...</skill>`` in ``action`` (stripped, cut at ``max_chars``), else ``None``
    (also for an empty one)."""
    hits = _SKILL.findall(action)
    text = hits[-1].strip()[:max_chars].strip() if hits else ""
    return text or None


def skills_text(skills: tuple[str, ...]) -> str:
    """The skill library as the observations list it (``""`` when empty)."""
    return "" if not skills else "\nSkills so far:" + "".join(f"\n- {s}" for s in skills)


@register_env("task_chain")
@dataclasses.dataclass
class TaskChainEnv:
    """A chain of problems as one episode (module docstring). ``task``: a
    :class:`~treejax.envs.task_chain_task.TaskChain` (its inner task, feedback and skill options); ``make_inner``:
    builds a fresh inner environment for each problem, or ``None`` (every turn answers the current problem)."""

    task: Any
    make_inner: Optional[Callable[[], Any]] = None
    stop_strings: tuple[str, ...] = ()
    example: Any = None
    links: tuple = ()
    link: int = 0
    scores: tuple[float, ...] = ()
    skills: tuple[str, ...] = ()
    inner: Any = None
    done: bool = False

    #: The tasks whose chains this environment runs (MultiTurnConfig's check refuses others).
    tasks: ClassVar[tuple[str, ...]] = ("task_chain",)
    #: Its turns carry ``chain_link`` / ``chain_outcome`` / ``skill`` (SAGE's inputs).
    chain_links: ClassVar[bool] = True

    def __post_init__(self):
        if getattr(self.task, "world", None) != "task_chain":
            raise ConfigError(f"environment 'task_chain' runs chains of problems, and task {self.task!r} is not one; "
                              "fix: RunConfig.task = 'task_chain' (the inner task in task_options['inner'])")

    @classmethod
    def from_config(cls, config, task, sandbox) -> "TaskChainEnv":
        """One episode's chain: the inner environment (``task.inner_environment``) built from the same config on
        the inner task; a chain longer than ``config.max_turns`` could never finish, so it is refused."""
        if getattr(task, "world", None) != "task_chain":
            cls(task)  # the one-line error
        K = task.chain_length
        if K > config.max_turns:
            more = "" if task.inner_environment is None else " (or more: the inner environment's calls are turns too)"
            raise ConfigError(f"task_chain: a chain of {K} problems needs at least {K} turns, "
                              f"MultiTurnConfig.max_turns is {config.max_turns}; fix: MultiTurnConfig.max_turns = {K}{more}")
        stops, make_inner = tuple(task.stop_strings), None
        if task.inner_environment is not None:
            from treejax.envs.base import get_env

            inner_cls = get_env(task.inner_environment)
            make_inner = lambda: inner_cls.from_config(config, task.inner, sandbox)  # noqa: E731
            stops += tuple(s for s in make_inner().stop_strings if s not in stops)
        return cls(task, make_inner=make_inner, stop_strings=stops)

    def reset(self, example) -> str:
        self.example, self.links = example, self.task.link_examples(example)
        self.link, self.scores, self.skills, self.done = 0, (), (), False
        self.inner = None if self.make_inner is None else self.make_inner()
        return "" if self.inner is None else self.inner.reset(self.links[0])

    def _info(self) -> dict:
        K = len(self.links)
        return {"chain_link": self.link, "chain_length": K, "episode_score": float(sum(self.scores)) / K}

    def step(self, action: str) -> StepResult:
        if self.example is None:
            raise RuntimeError("TaskChainEnv.step before reset")
        if self.done:
            raise RuntimeError("TaskChainEnv.step after the episode ended")
        info: dict = {}
        if self.inner is not None:
            r = self.inner.step(action)
            if not r.done:  # a tool turn inside the current problem
                return StepResult(r.observation, 0.0, False, {**r.info, **self._info()})
            score = float(np.clip(r.reward, 0.0, 1.0))
            info = {k: v for k, v in r.info.items() if k != "answered"}
        else:
            score = float(self.task.inner.score(action, self.links[self.link]))
        return self._end_link(action, score, info)

    def _end_link(self, action: str, score: float, info: dict) -> StepResult:
        k, K = self.link, len(self.links)
        skill = parse_skill(action, self.task.max_skill_chars) if self.task.skills else None
        if skill is not None:
            self.skills = self.skills + (skill,)
        self.scores = self.scores + (score,)
        info.update(chain_link=k, chain_length=K, chain_outcome=score,
                    skill=(skill is not None) if self.task.skills else True,
                    episode_score=float(sum(self.scores)) / K)
        self.link = k + 1
        if self.link == K:
            self.done, self.inner = True, None
            return StepResult("", score / K, True, {**info, "answered": True})
        nxt = self.links[self.link]
        obs = (feedback_text(self.task.feedback, score, self.links[k].ground_truth)
               + (skills_text(self.skills) if self.task.skills else "")
               + self.task.next_format.format(index=self.link + 1, length=K, question=nxt.metadata["question"]))
        if self.make_inner is not None:
            self.inner = self.make_inner()
            obs += self.inner.reset(nxt)
        return StepResult(obs, score / K, False, info)

    def clone(self) -> "TaskChainEnv":
        other = dataclasses.replace(self)  # the state is immutable tuples; the problems are shared, read-only
        other.inner = None if self.inner is None else self.inner.clone()
        return other


__all__ = ["FEEDBACK", "HEADER", "NEXT_FORMAT", "TaskChainEnv", "feedback_text", "parse_skill", "skills_text"]
