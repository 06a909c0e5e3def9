"""XRPO's exploration allocator (arXiv 2510.06672, "hierarchical rollout planning"): spend a fixed extra budget in
phases, each on the prompts whose reward estimate the new rollouts would sharpen most.

The uncertainty of prompt ``q``'s mean reward after ``n`` rollouts is the half-width of its t confidence interval

    h_q(n) = t_{1 - alpha/2, n - 1} s_q / sqrt(n)

(``s_q``: the rewards' sample std). One phase gives one chunk of ``W`` rollouts to the prompt with the largest
priority

    Pi_q = h_q(n_q) - h_q(n_q + W)  +  lambda sqrt(log(1 + T) / n_q)

(the expected shrinkage of the interval plus a UCB-style exploration bonus; ``T``: rollouts of the step so far,
``n_q`` grows by ``W`` each time ``q`` is picked), until the budget is spent. A prompt whose ``W`` rewards are
all equal has ``s_q = 0`` and no shrinkage; the bonus is what gives it a chance (the paper's stated role of it).

Sources and choices: the priority's two terms and the t interval are the paper's; its code was not readable here,
nor were ``alpha``, ``lambda``, the bonus's exact form or the phase sizes, so: ``alpha = 0.05``, ``lambda =
0.1`` (both the defaults of public re-implementations), the ``sqrt(log(1 + T) / n)`` bonus (one of the two
forms those use), and one chunk per phase (a chunk is the sampler's unit). ``s_q`` is re-estimated only from the
pre-rollout (the extra rollouts are decoded together, after the plan). XRPO's in-context exemplars for all-fail
prompts and its novelty sharpening of advantages are not part of the allocator.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from treejax.errors import ConfigError
from treejax.rl.allocation.base import Allocator, Budget, PromptStats, register


def ci_half_width(n, s, alpha: float) -> np.ndarray:
    """``t_{1 - alpha/2, n - 1} s / sqrt(n)``; ``inf`` for ``n < 2`` (no interval yet)."""
    from scipy import stats as sp_stats  # here, not at the top: 0.5 s the CLI's fail-fast config check should not pay

    n = np.asarray(n, np.float64)
    s = np.asarray(s, np.float64)
    t = sp_stats.t.ppf(1.0 - alpha / 2.0, np.maximum(n - 1.0, 1.0))
    return np.where(n >= 2, t * s / np.sqrt(np.maximum(n, 1.0)), np.inf)


def xrpo_extra(n_P, s_P, chunk: int, budget_chunks: int, alpha: float = 0.05, lam: float = 0.1,
               room_P=None) -> np.ndarray:
    """int64[P]: extra rollouts per prompt (multiples of ``chunk``) after ``budget_chunks`` phases (module
    docstring); ties go to the lower index. ``room_P``: extra rollouts each prompt may still take (None: any)."""
    n = np.asarray(n_P, np.float64).copy()
    s = np.asarray(s_P, np.float64)
    room = np.full(len(n), np.inf) if room_P is None else np.asarray(room_P, np.float64).copy()
    extra = np.zeros(len(n), np.int64)
    total = float(n.sum())
    for _ in range(budget_chunks):
        if not np.any(room >= chunk):
            break
        shrink = np.nan_to_num(ci_half_width(n, s, alpha) - ci_half_width(n + chunk, s, alpha), posinf=1e9)
        priority = shrink + lam * np.sqrt(np.log1p(total) / np.maximum(n, 1.0))
        q = int(np.argmax(np.where(room >= chunk, priority, -np.inf)))
        room[q] -= chunk
        extra[q] += chunk
        n[q] += chunk
        total += chunk
    return extra


@register("xrpo")
@dataclasses.dataclass(frozen=True)
class XRPOAllocator(Allocator):
    """XRPO: the extra budget, chunk by chunk, to the prompts whose reward CI would shrink most (+ a bonus).

    Module docstring: the whole extra budget, one chunk per phase, by the expected
    confidence-interval shrinkage plus ``lam`` x the exploration bonus. ``chunk``: rollouts per phase (0: the
    tree's ``W``, set by the source)."""

    alpha: float = 0.05
    lam: float = 0.1
    chunk: int = 0

    def __post_init__(self):
        if not 0.0 < self.alpha < 1.0 or self.lam < 0 or self.chunk < 0:
            raise ConfigError(f"XRPOAllocator: 0 < alpha < 1, lam >= 0 and chunk >= 0 required, got {self}")

    def extra_rollouts(self, stats: PromptStats, state: dict, budget: Budget):
        n = np.asarray(stats.rollouts_P, np.float64)
        s = stats.reward_std_P * np.sqrt(n / np.maximum(n - 1.0, 1.0))  # the sample (Bessel) std
        size = self.chunk or budget.chunk
        room = np.maximum(budget.max_rollouts - n, 0.0)  # a prompt at the cap is not picked again
        return xrpo_extra(n, s, size, budget.extra // size, self.alpha, self.lam, room), state
