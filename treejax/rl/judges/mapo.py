"""MAPO: per-turn judge scores of multi-turn episodes, Monte-Carlo returns over turns, advantages mixing turn-level
and batch-level normalisation (Zhang et al. 2026, arXiv 2603.06194; no official code found).

The stage (``RunConfig.rollouts = [@MultiTurnConfig(), @MAPOConfig()]`` with ``RunConfig.estimator = "mapo"``) is
a wrapper of the multi-turn source: the scorer reads every episode's turns as a process reward model (each turn
the policy's tokens and the observation appended after them; :mod:`treejax.rl.judges.steps`) and the turn scores
reach the ``mapo`` estimator (:func:`treejax.rl.advantages.mapo.mapo`: the math and what is reconstructed) as
``turn_judge_PxWxD``; the rewards pass unchanged.

Checks (one line with the fix each): verifier rewards (the final turn's outcome), turn forests before it (a
multi-turn planner: ``needs = {"turn_forest"}``), the ``mapo`` estimator (nothing else reads the turn scores), a
``ScorerConfig``.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from treejax.rl.judges.steps import StepJudgeStage
from treejax.rl.sources.base import Stage
from treejax.scorers.config import ScorerConfig


@dataclasses.dataclass(frozen=True)
class MAPOConfig(StepJudgeStage, Stage):
    """MAPO's turn judge (module docstring). gin::

        RunConfig.rollouts = [@MultiTurnConfig(), @MAPOConfig()]
        RunConfig.estimator = "mapo"
        MAPOConfig.scorer = @ScorerConfig()
        ScorerConfig.model = "smollm2-135m-instruct"     # or "policy": the policy's initial weights

    ``scorer``: the judge, read as a process reward model over the episode's turns."""

    needs: ClassVar[frozenset[str]] = frozenset({"turn_forest"})
    supplies: ClassVar[frozenset[str]] = frozenset({"turn_judge_PxWxD"})
    input_name: ClassVar[str] = "turn_judge_PxWxD"
    estimator: ClassVar[str] = "mapo"
    turns: ClassVar[bool] = True

    scorer: ScorerConfig = dataclasses.field(default_factory=ScorerConfig)

    def __post_init__(self):
        self.check_scorer()
