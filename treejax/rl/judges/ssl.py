"""SSL: tiered, progressively amplified rewards that preserve the ordering of solutions.

A reconstruction from issue 47's one-line description ("tiered, progressively amplified rewards that preserve the
ordering of solutions"). The paper, found after this was built (Wu et al. 2026, *SSL: Sweet Spot Learning for
Differentiated Guidance in Agentic Optimization*, arXiv 2601.22491; abstract only, no code), tiers by verifiable
proximity to the ground truth with no reward model; this module tiers by a judge's score instead (issue 47's
judge seam), so it is the tiering idea, not the paper's method (docs/judges.md, "SSL"). Each leaf gets a *tier*
from the verifier and the judge, and each tier a reward:

    bin(o)  = min(floor(judge(o) * L), L - 1)            L = levels judge bins per verifier outcome
                                                         (a NaN judge: bin 0, the lowest)
    tier(o) = L * correct(o) + bin(o)                    in {0, ..., K},  K = 2L - 1
    r(k)    = R_wrong + (R_correct - R_wrong) * g(k)
    g(k)    = (alpha^k - 1) / (alpha^K - 1)   (alpha > 1),     g(k) = k / K   (alpha = 1)
    R_SSL(o) = r(tier(o)) + (R(o) - R_verifier(o))       (keeps DAPO's overlong penalty and any other term)

*Tiered*: ``2L`` reward levels instead of the verifier's two. *Progressively amplified*: the gap between tier
``k`` and ``k + 1`` is ``alpha`` times the gap below it (``r(k+1) - r(k) = alpha^k * (r(1) - r(0))``), so the
higher tiers (sound correct solutions) are separated most. *Order-preserving*: ``r`` is strictly increasing in the
tier, every correct leaf outranks every wrong one whatever the judge says (a correct tier is ``>= L``), the
extremes are the verifier's rewards, and ``L = 1`` gives the verifier's reward exactly. Every leaf is judged.

Metrics: ``ssl/tier_mean`` (mean tier), ``ssl/top_tier`` (share of leaves in tier K).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from treejax.errors import ConfigError
from treejax.rl import rewards as rewards_lib
from treejax.rl.judges.base import JudgeStage
from treejax.rl.judges.fapo import reward_gap
from treejax.rl.sources.base import Stage
from treejax.scorers.config import ScorerConfig


def ssl_tiers(correct_PxW, judge_PxW, levels: int) -> np.ndarray:
    """int32 tiers ``L * correct + bin(judge)`` (module docstring)."""
    judge = np.nan_to_num(np.asarray(judge_PxW, np.float64), nan=0.0)
    bins = np.minimum(np.floor(np.clip(judge, 0.0, 1.0) * levels), levels - 1).astype(np.int32)
    return (levels * np.asarray(correct_PxW, bool).astype(np.int32) + bins).astype(np.int32)


def tier_rewards(levels: int, amplification: float, style: str) -> np.ndarray:
    """float32 ``[2L]``: ``r(k)`` for every tier ``k`` (module docstring)."""
    lo, hi = reward_gap(style)
    K = 2 * levels - 1
    k = np.arange(K + 1, dtype=np.float64)
    g = k / K if amplification == 1.0 else (amplification ** k - 1.0) / (amplification ** K - 1.0)
    return (lo + (hi - lo) * g).astype(np.float32)


def ssl_rewards(rewards_PxW, correct_PxW, judge_PxW, style: str, levels: int = 2,
                amplification: float = 2.0) -> tuple[np.ndarray, np.ndarray]:
    """``(R_SSL, tiers)`` of the leaves (module docstring)."""
    tiers = ssl_tiers(correct_PxW, judge_PxW, levels)
    base = np.asarray(rewards_lib.verifier_reward(np.asarray(correct_PxW, bool), style), np.float32)
    extra = np.asarray(rewards_PxW, np.float32) - base
    return (tier_rewards(levels, amplification, style)[tiers] + extra).astype(np.float32), tiers


@dataclasses.dataclass(frozen=True)
class SSLConfig(JudgeStage, Stage):
    """SSL's tiered rewards (module docstring). gin::

        RunConfig.rollouts = [@SSLConfig()]
        SSLConfig.scorer = @ScorerConfig()
        SSLConfig.levels = 2
        SSLConfig.amplification = 2.0

    ``levels``: judge bins per verifier outcome (``L >= 2``); ``amplification``: ``alpha >= 1``, the ratio of
    successive tier gaps; ``scope``: ``"verdict"`` or ``"steps"`` (the least PRM step score)."""

    scorer: ScorerConfig = dataclasses.field(default_factory=ScorerConfig)
    levels: int = 2
    amplification: float = 2.0
    scope: str = "verdict"

    def __post_init__(self):
        if not 2 <= self.levels <= 16:
            raise ConfigError(f"SSLConfig.levels must be in [2, 16] (1 is the verifier's reward alone: the judge "
                              f"would run for nothing), got {self.levels}; fix: SSLConfig.levels = 2")
        if not 1.0 <= self.amplification <= 100.0:
            raise ConfigError(f"SSLConfig.amplification must be in [1, 100] (below 1 the upper tiers' gaps would "
                              f"shrink, not grow), got {self.amplification}; fix: SSLConfig.amplification = 2.0")
        self.check_scorer()

    def shape(self, rewards_PxW, correct_PxW, judge_PxW, style):
        out, tiers = ssl_rewards(rewards_PxW, correct_PxW, judge_PxW, style, self.levels, self.amplification)
        return out, {"ssl/tier_mean": float(tiers.mean()),
                     "ssl/top_tier": float(np.mean(tiers == 2 * self.levels - 1))}
