"""A :class:`~treejax.rl.step.RolloutSource` without a tokenizer or verifier: fixed token prompts and a reward
computed from the forest (for tests, benchmarks and notebooks that drive :func:`treejax.rl.step.rl_step`)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from treejax.forest import Forest
from treejax.rl.step import Rollouts


class FixedPromptRollouts:
    """Rolls out the same ``prompts [P, Lp]`` every step and scores leaves with ``reward_fn(forest) -> [P, W]``.

    ``greedy_reward_fn(tokens [P, N], lengths [P]) -> [P]`` (optional) gives ReMax's greedy baseline; without it
    the source refuses estimators that need one."""

    def __init__(self, rollout: Callable, prompts_PxLp, lengths_P, reward_fn: Callable[[Forest], jax.Array],
                 greedy: Callable | None = None, greedy_reward_fn: Callable | None = None):
        self.rollout, self.reward_fn = rollout, reward_fn
        self.prompts, self.lengths = np.asarray(prompts_PxLp, np.int32), np.asarray(lengths_P, np.int32)
        self.greedy, self.greedy_reward_fn = greedy, greedy_reward_fn

    def sample(self, params, key, step) -> Rollouts:
        forest, info = self.rollout(params, self.prompts, self.lengths, key, step)
        rewards = jnp.asarray(self.reward_fn(forest), jnp.float32)
        host = {k: int(v) for k, v in info.items() if not isinstance(v, dict) and np.ndim(v) == 0}
        return Rollouts(forest=forest, rewards_PxW=rewards, scores_PxW=None, prompts_PxLp=self.prompts,
                        lengths_P=self.lengths, info=host)

    def greedy_rewards(self, params, rollouts: Rollouts) -> np.ndarray:
        if self.greedy is None or self.greedy_reward_fn is None:
            raise ValueError("this rollout source has no greedy baseline (pass greedy= and greedy_reward_fn=)")
        out = self.greedy(params, rollouts.prompts_PxLp, rollouts.lengths_P)
        return np.asarray(self.greedy_reward_fn(out.tokens, out.lengths), np.float32)
