"""SLATE: k continuations of one prefix that differ in the next step, each step scored by an LLM judge, advantages
among siblings (Samarinas, Chang & Zamani 2026, arXiv 2602.23440; official code ``algoprog/SLATE``).

The stage (``RunConfig.rollouts = [@SLATEConfig()]`` with ``RunConfig.estimator = "slate"``) is a wrapper of the
task source's tree rollout: the tree's nodes are the steps (fixed segments of ``TreeConfig.segment_length``
tokens) and a node's children are continuations of the same prefix that differ from the next step on. The
scorer reads every leaf's steps as a process reward model (:mod:`treejax.rl.judges.steps`) and the step scores
reach the ``slate`` estimator (:func:`treejax.rl.advantages.slate.slate`: the math, the official constants and
what is reconstructed) as ``step_judge_PxWxD``; the rewards pass unchanged.

Checks (one line with the fix each): verifier rewards (the answer step's reward is the verifier's outcome), the
``slate`` estimator (nothing else reads the step scores), ``TreeConfig.branch_factor >= 2`` (every step must have
siblings to be compared with: with one child per node only the first step would get a signal), a
``ScorerConfig``; at run time, rows that are multi-turn episodes are refused.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from treejax.errors import ConfigError
from treejax.rl.judges.steps import StepJudgeStage
from treejax.rl.sources.base import Stage
from treejax.scorers.config import ScorerConfig


@dataclasses.dataclass(frozen=True)
class SLATEConfig(StepJudgeStage, Stage):
    """SLATE's step judge (module docstring). gin::

        RunConfig.rollouts = [@SLATEConfig()]
        RunConfig.estimator = "slate"
        TreeConfig.branch_factor = 2          # k continuations of every prefix (the official k = 5)
        SLATEConfig.scorer = @ScorerConfig()
        ScorerConfig.model = "smollm2-135m-instruct"     # or "policy": the policy's initial weights

    ``scorer``: the judge, read as a process reward model (``ScorerConfig.step_template`` / ``step_tag``)."""

    supplies: ClassVar[frozenset[str]] = frozenset({"step_judge_PxWxD"})
    input_name: ClassVar[str] = "step_judge_PxWxD"
    estimator: ClassVar[str] = "slate"

    scorer: ScorerConfig = dataclasses.field(default_factory=ScorerConfig)

    def __post_init__(self):
        self.check_scorer()

    def check(self, facts) -> None:
        super().check(facts)
        if facts.tree is not None and facts.tree.branch_factor < 2:
            raise ConfigError(f"SLATEConfig compares each step with its siblings (the other continuations of its "
                              f"prefix), but TreeConfig.branch_factor = {facts.tree.branch_factor} gives every node "
                              "one child, so no step below the first has any; fix: TreeConfig.branch_factor = 2")
