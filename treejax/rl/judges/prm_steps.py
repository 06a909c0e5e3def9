"""The PRM's step scores for any estimator: a wrapper stage that scores every step (segment) of every leaf with the
scorer read as a process reward model and hands them to :class:`~treejax.rl.shaping.prm.PRMStepReward`, which adds
them to the estimator's advantages as a per-step term (the math is the shaper's docstring).

Unlike SLATE and MAPO, whose estimators read the judged steps as their own inputs, this pairs the PRM with any
estimator (GRPO, TreePO, ...)::

    RunConfig.rollouts = [@PRMStepsConfig()]
    RunConfig.shapers = [@PRMStepReward()]
    PRMStepsConfig.scorer = @ScorerConfig()
    ScorerConfig.model = "smollm2-135m-instruct"     # or "policy": a frozen copy of the policy's initial weights

The scoring is :mod:`treejax.rl.judges.steps`' (one teacher-forced pass per distinct leaf, a copied slot takes its
first copy's scores, NaN past a leaf's steps); the rewards pass unchanged. Steps are the tree's fixed segments:
the stage refuses multi-turn episodes (turn forests), whose nodes have no fixed length for the shaper's
``k(t) = t // S``. Refused in one line: no ``PRMStepReward`` among the shapers (nothing would read the scores),
and the shaper without this stage.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from treejax.errors import ConfigError
from treejax.rl.judges.steps import StepJudgeStage
from treejax.rl.sources.base import Stage
from treejax.scorers.config import ScorerConfig


@dataclasses.dataclass(frozen=True)
class PRMStepsConfig(StepJudgeStage, Stage):
    """The PRM that scores every step for :class:`~treejax.rl.shaping.prm.PRMStepReward` (module docstring).
    ``scorer``: the PRM (``ScorerConfig.step_template`` / ``step_tag``)."""

    supplies: ClassVar[frozenset[str]] = frozenset({"prm_steps_PxWxD"})
    input_name: ClassVar[str] = "prm_steps_PxWxD"

    scorer: ScorerConfig = dataclasses.field(default_factory=ScorerConfig)

    def __post_init__(self):
        self.check_scorer()

    def check(self, facts) -> None:
        if "prm_steps" not in facts.shapers:
            raise ConfigError("RunConfig.rollouts: PRMStepsConfig scores every step for the PRMStepReward shaper, "
                              "but RunConfig.shapers has none, so nothing would read the scores; fix: "
                              "RunConfig.shapers = [@PRMStepReward()]")


__all__ = ["PRMStepsConfig"]
