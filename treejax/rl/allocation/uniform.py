"""``uniform``: every prompt gets the pre-rollout's ``W`` rollouts and nothing more (treejax without allocation)."""

from __future__ import annotations

import dataclasses

import numpy as np

from treejax.rl.allocation.base import Allocator, Budget, PromptStats, register


@register("uniform")
@dataclasses.dataclass(frozen=True)
class Uniform(Allocator):
    """No extra rollouts: ``extra_P = 0`` (the baseline every allocator is compared with)."""

    def extra_rollouts(self, stats: PromptStats, state: dict, budget: Budget):
        return np.zeros(stats.num_prompts, np.int64), state
