"""FAPO: Flawed-Aware Policy Optimization (Ding et al. 2025, arXiv 2510.22543; official code: verl's
``recipe/fapo/reward_fn_reasoning.py``).

A *flawed positive* is a leaf with the right final answer reached by unreliable reasoning (answer guessing,
jumps in reasoning). FAPO keeps the verifier's reward and subtracts a penalty from flawed positives only:

    R_FAPO(o) = R_RLVR(o) + R_Delta(o),     R_Delta(o) = -lambda * 1[correct(o) and flawed(o)]
    flawed(o) = judge(o) < threshold        (judge: the scorer's probability that the reasoning is sound)
    lambda    = penalty * (R_correct - R_wrong)      penalty = 0.5: lambda = 1 with +-1 rewards

The official code uses +-1 rewards and ``FLAWED_REWARD_PENALTY = 1.0``, so a flawed positive gets 0: above every
wrong answer (it is still a stepping stone early in training, when few leaves are sound) and below every sound
correct one (later, when sound positives are common, the group baseline rises above 0 and the flawed positive's
advantage turns negative: the paper's "exploit first, then suppress" without a schedule). ``penalty`` is that
lambda as a fraction of the verifier's reward gap, so ``"01"`` rewards get 0.5.

Reconstructed vs the paper and its code:

* the official GenRM (FAPO-GenRM-4B, trained for it) decodes the index of the earliest wrong step in
  ``\\boxed{}`` (``-1``: none) and a leaf is flawed iff the index is not ``-1``. Here any scorer does: by default
  the verdict-token probability ``p(Yes) / (p(Yes) + p(No))`` of "is every step correct?" (no decoding);
  ``ScorerConfig.mode = 'decode'`` with ``verdict_pattern = r'\\\\boxed\\{(-?\\d+)\\}'``, ``yes_tokens = ('-1',)``
  and ``no_tokens = ('*',)`` reads the official answer format (:func:`treejax.scorers.verdicts.parse_verdict`);
  ``scope = 'steps'`` reads the least of a PRM's per-line step scores (a process-level judge, as the GenRM's
  step index is);
* as in the official code only correct leaves are judged (wrong ones keep their reward), and a verdict that does
  not parse counts as not flawed;
* the judge is frozen (the paper trains its GenRM beforehand, apart from the policy).

Metrics: ``fapo/flawed_rate`` (flawed among the correct leaves judged), ``fapo/flawed``.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from treejax.errors import ConfigError
from treejax.rl import rewards as rewards_lib
from treejax.rl.judges.base import JudgeStage
from treejax.rl.sources.base import Stage
from treejax.scorers.config import ScorerConfig


def reward_gap(style: str) -> tuple[float, float]:
    """``(R_wrong, R_correct)`` of the verifier reward ``style``."""
    lo, hi = (float(x) for x in rewards_lib.verifier_reward(np.array([False, True]), style))
    return lo, hi


def fapo_rewards(rewards_PxW, correct_PxW, judge_PxW, style: str, penalty: float = 0.5,
                 threshold: float = 0.5) -> tuple[np.ndarray, np.ndarray]:
    """``(rewards - lambda * flawed_positive, flawed_positive)`` (module docstring); a NaN judge is not flawed."""
    lo, hi = reward_gap(style)
    judge = np.asarray(judge_PxW, np.float32)
    with np.errstate(invalid="ignore"):
        flawed = np.asarray(correct_PxW, bool) & np.isfinite(judge) & (judge < threshold)
    out = np.asarray(rewards_PxW, np.float32) - np.float32(penalty * (hi - lo)) * flawed
    return out.astype(np.float32), flawed


@dataclasses.dataclass(frozen=True)
class FAPOConfig(JudgeStage, Stage):
    """FAPO's flawed-positive penalty (module docstring). gin::

        RunConfig.rollouts = [@FAPOConfig()]
        FAPOConfig.scorer = @ScorerConfig()
        ScorerConfig.model = "smollm2-135m-instruct"     # or "policy": the policy's initial weights

    ``penalty``: lambda as a fraction of the verifier's reward gap (0.5: the official lambda = 1 with +-1
    rewards; 1.0 counts a flawed positive as wrong); ``threshold``: flawed iff the judge's score is below it;
    ``scope``: ``"verdict"`` (one judgement of the whole response) or ``"steps"`` (the least PRM step score)."""

    scorer: ScorerConfig = dataclasses.field(default_factory=ScorerConfig)
    penalty: float = 0.5
    threshold: float = 0.5
    scope: str = "verdict"

    def __post_init__(self):
        if not 0.0 < self.penalty <= 1.0:
            raise ConfigError(f"FAPOConfig.penalty must be in (0, 1] (a fraction of the gap between the correct and "
                              f"the wrong reward; above 1 a flawed positive would rank below a wrong answer), got "
                              f"{self.penalty}; fix: FAPOConfig.penalty = 0.5")
        if not 0.0 < self.threshold < 1.0:
            raise ConfigError(f"FAPOConfig.threshold must be in (0, 1), got {self.threshold}; fix: "
                              "FAPOConfig.threshold = 0.5")
        self.check_scorer()

    def judged(self, correct_PxW):
        return np.asarray(correct_PxW, bool)  # the official code judges correct leaves only

    def shape(self, rewards_PxW, correct_PxW, judge_PxW, style):
        out, flawed = fapo_rewards(rewards_PxW, correct_PxW, judge_PxW, style, self.penalty, self.threshold)
        n_correct = int(np.asarray(correct_PxW, bool).sum())
        return out, {"fapo/flawed": int(flawed.sum()),
                     "fapo/flawed_rate": float(flawed.sum() / n_correct) if n_correct else 0.0}
