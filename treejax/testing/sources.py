"""A :class:`~treejax.rl.rollouts.RolloutSource` without a tokenizer or verifier: fixed token prompts and a reward
computed from the forest (for tests, benchmarks and notebooks that drive :func:`treejax.rl.step.rl_step`)."""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np

from treejax.forest import Forest
from treejax.rl.rollouts import RolloutCounters, Rollouts


class FixedPromptRollouts:
    """Rolls out the same ``prompts [P, Lp]`` every step and scores leaves with ``reward_fn(forest) -> [P, W]``.

    ``greedy(params, prompts, lengths)`` with ``greedy_reward_fn(tokens [P, N], lengths [P]) -> [P]`` (optional)
    supply ReMax's greedy baseline (``estimator_inputs["greedy_reward_P"]``); without them an estimator that needs
    it is refused by the learner."""

    def __init__(self, rollout: Callable, prompts_PxLp, lengths_P, reward_fn: Callable[[Forest], jax.Array],
                 greedy: Callable | None = None, greedy_reward_fn: Callable | None = None):
        if (greedy is None) != (greedy_reward_fn is None):
            raise ValueError("FixedPromptRollouts: pass both greedy= and greedy_reward_fn=, or neither")
        self.rollout, self.reward_fn = rollout, reward_fn
        self.prompts, self.lengths = np.asarray(prompts_PxLp, np.int32), np.asarray(lengths_P, np.int32)
        self.greedy, self.greedy_reward_fn = greedy, greedy_reward_fn

    def sample(self, params, key, step) -> Rollouts:
        forest, info = self.rollout(params, self.prompts, self.lengths, key, step)
        rewards = jnp.asarray(self.reward_fn(forest), jnp.float32)
        ro = Rollouts(forest=forest, rewards_PxW=rewards, scores_PxW=None, prompts_PxLp=self.prompts,
                      lengths_P=self.lengths, counters=RolloutCounters.from_sampler(info))
        if self.greedy is not None:
            out = self.greedy(params, self.prompts, self.lengths)
            ro.estimator_inputs["greedy_reward_P"] = jnp.asarray(self.greedy_reward_fn(out.tokens, out.lengths),
                                                                 jnp.float32)
        return ro
