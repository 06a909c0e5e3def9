"""A fake planner and scorer for the SAPO tests (``test_sapo.py`` and its 2-process worker)."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from treejax.forest import forest_from_paths
from treejax.rl.rollouts import RolloutCounters, Rollouts

#: The re-scored log-prob every response token gets from :func:`fake_score`.
FAKE_LOGP = -0.25


class _Pipeline:
    def get_state(self):
        return {}


class FakeSource:
    """Three prompt rows of 3 independent chains of 2 tokens per step. Token ``[p, w, t] = 1000 node + 100 step +
    10 p + w``; rewards: row 0 mixed, row 1 all -1 (zero advantage), row 2 mixed; sampler log-probs ``-1 - node``."""

    pipeline = _Pipeline()
    estimator_inputs = ()

    def __init__(self, node: int):
        self.node, self.last = node, None

    def sample(self, params, key, step):
        P, W = 3, 3
        paths = np.array([[[0, 1], [0, 2], [0, 3]]] * P)
        tokens = (1000 * self.node + 100 * step + 10 * np.arange(P)[:, None, None] + np.arange(W)[None, :, None]
                  + np.zeros((1, 1, 2), np.int64)).astype(np.int32)
        f = forest_from_paths(paths, np.full((P, W), 2), 2, tokens=tokens,
                              logprobs=np.full((P, W, 2), -1.0 - self.node, np.float32))
        rewards = np.array([[1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [1.0, 1.0, -1.0]], np.float32) + 0.01 * self.node
        scores = (rewards > 0).astype(np.float32)
        self.last = Rollouts(forest=f, rewards_PxW=jnp.asarray(rewards), scores_PxW=scores,
                             prompts_PxLp=np.full((P, 4), 10 * self.node + step, np.int32),
                             lengths_P=np.full(P, 4, np.int32), counters=RolloutCounters(),
                             examples=[f"n{self.node}s{step}p{p}" for p in range(P)], reward_scores_PxW=scores)
        return self.last


def fake_score(weights, fns, prompts, lengths, tokens, token_lengths):
    """:func:`treejax.sampling.decode.score_tokens`'s signature: ``FAKE_LOGP`` on every response token."""
    t = np.arange(np.asarray(tokens).shape[1])[None]
    return np.where(t < np.asarray(token_lengths)[:, None], FAKE_LOGP, 0.0).astype(np.float32)
