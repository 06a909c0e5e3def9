"""Rollout replay (treejax.rl.replay): which rows are replayed, their masks and ages, the buffer's FIFO, age and
informative-row rules, and the buffer's checkpoint round trip."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.forest import forest_from_paths
from treejax.rl.replay import ReplayConfig, ReplayRollouts
from treejax.rl.rollouts import RolloutCounters, Rollouts


class _Pipeline:
    def get_state(self):
        return {}


class _Source:
    """Two prompt rows of 3 independent chains per step; row 0's rewards differ, row 1's are all equal; the step
    is written into the tokens so a replayed row says where it came from."""

    pipeline = _Pipeline()
    estimator_inputs = ()

    def sample(self, params, key, step):
        paths = np.array([[[0, 1], [0, 2], [0, 3]]] * 2)
        tokens = np.full((2, 3, 2), step, np.int32)
        tokens[1] += 100
        f = forest_from_paths(paths, np.full((2, 3), 2), 2, tokens=tokens,
                              logprobs=np.full((2, 3, 2), -0.5 - step, np.float32))
        rewards = np.array([[1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], np.float32)
        return Rollouts(forest=f, rewards_PxW=jnp.asarray(rewards), scores_PxW=(rewards > 0).astype(np.float32),
                        prompts_PxLp=np.full((2, 4), step, np.int32), lengths_P=np.full(2, 4, np.int32),
                        counters=RolloutCounters(), examples=[f"q{step}a", f"q{step}b"],
                        reward_scores_PxW=(rewards > 0).astype(np.float32))


def test_replayed_rows_masks_ages_and_fifo():
    src = ReplayRollouts(_Source(), ReplayConfig(rows=2, capacity=3, max_age=2))
    ro = src.sample(None, None, 0)
    assert ro.num_rows == 4 and ro.main_rows == 2
    assert np.all(np.asarray(ro.forest.loss_mask)[2:] == 0)  # nothing to replay yet: masked copies
    assert ro.extra_metrics["replay/replayed_rows"] == 0
    assert len(src.buffer) == 1  # only the informative row (row 0) entered
    src.sample(None, None, 1)
    ro = src.sample(None, None, 2)
    tok = np.asarray(ro.forest.tokens)
    assert tok[2, 0, 0] == 1 and tok[3, 0, 0] == 0  # newest first: step 1's row, then step 0's
    assert np.all(np.asarray(ro.forest.loss_mask)[2:, :, :2] == 1)
    np.testing.assert_array_equal(np.asarray(ro.forest.logprobs)[2, 0], [-1.5, -1.5])  # behaviour log-probs kept
    assert ro.extra_metrics["replay/mean_age"] == 1.5 and ro.extra_metrics["replay/max_age"] == 2
    assert ro.examples[2:] == ["q1a", "q0a"]
    ro = src.sample(None, None, 5)  # every row is now older than max_age = 2: none is replayed
    assert ro.extra_metrics["replay/replayed_rows"] == 0 and len(src.buffer) == 1
    for s in range(6, 10):
        src.sample(None, None, s)
    assert len(src.buffer) == 3  # capacity


def test_buffer_round_trips_through_the_checkpoint_state():
    a = ReplayRollouts(_Source(), ReplayConfig(rows=2, capacity=4, max_age=3))
    for s in range(3):
        a.sample(None, None, s)
    b = ReplayRollouts(_Source(), ReplayConfig(rows=2, capacity=4, max_age=3))
    b.set_state(a.state())
    x, y = a.sample(None, None, 3), b.sample(None, None, 3)
    for name in ("tokens", "logprobs", "loss_mask", "leaf_path"):
        np.testing.assert_array_equal(np.asarray(getattr(x.forest, name)), np.asarray(getattr(y.forest, name)))
    assert x.extra_metrics == y.extra_metrics


def test_config_checks():
    from treejax.rl.config import RunConfig
    from treejax.rl.losses import LossConfig

    with pytest.raises(ConfigError, match="tis_cap"):
        RunConfig(rollouts=[ReplayConfig()])
    with pytest.raises(ConfigError, match="rows >= 1"):
        ReplayConfig(rows=0)
    cfg = RunConfig(rollouts=[ReplayConfig(rows=2)], loss=LossConfig(tis_cap=2.0))
    assert cfg.step_rows() == cfg.prompts_per_step + 2
