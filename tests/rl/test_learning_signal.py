"""End-to-end learning signal: tree rollouts -> rewards -> TreePO advantages -> PPO updates on a tiny random model.

Task: reward = share of a target token among the response tokens. 30 CPU steps of TreePO must raise the mean
reward far beyond its start; the same loop with the advantages' sign flipped or zeroed must not.
"""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.models import presets, transformer
from treejax.precision import Precision
from treejax.rl.losses import LossConfig
from treejax.rl.optimizer import OptimizerConfig, make_optimizer
from treejax.rl.config import StepConfig
from treejax.rl.layouts import Expanded
from treejax.rl.step import make_learner, rl_step
from treejax.rl.train_state import TrainState
from treejax.rl.update import make_update_fn
from treejax.sampling.strategies import Temperature
from treejax.sampling.tree import TreeConfig, make_tree_rollout
from treejax.testing.sources import FixedPromptRollouts

TARGET = 7
STEPS = 30


def _share(forest):
    valid = forest.loss_mask > 0
    return jnp.sum((forest.tokens == TARGET) & valid, -1) / jnp.maximum(jnp.sum(valid, -1), 1)


CFG = presets.tiny_config("smollm2-135m", vocab_size=64)
TREE = TreeConfig(num_leaves=8, max_depth=2, segment_length=4, branch_factor=2, strategy=Temperature(1.0),
                  stop_ids=())


@functools.lru_cache(maxsize=None)
def _programs():
    """The rollout, the update and the learner (its estimator and log-prob programs: the same for every sign),
    built (and compiled) once for the three runs."""
    optimizer = make_optimizer(OptimizerConfig(learning_rate=3e-3, warmup_steps=0, total_steps=STEPS,
                                               weight_decay=0.0))
    layout = Expanded(CFG, attention_impl="xla")
    update = jax.jit(make_update_fn(layout, LossConfig(), optimizer), donate_argnames=("state",))
    fns = make_learner(CFG, StepConfig(estimator="treepo"), Precision().resolve("cpu"), update, layout)
    return make_tree_rollout(CFG, TREE), optimizer, fns


def _train(sign: float) -> list[float]:
    """30 steps of :func:`treejax.rl.step.rl_step` (the loop's step) with the reward scaled by ``sign``."""
    cfg = CFG
    params = transformer.init_params(cfg, jax.random.key(0))
    rollout, optimizer, fns = _programs()
    prompts = np.array([[1, 5, 9, 0], [1, 11, 3, 4], [1, 20, 0, 0], [1, 30, 31, 32]], np.int32)
    lens = np.array([3, 4, 2, 4], np.int32)
    history = []

    def reward(forest):  # records the unscaled share; a flipped / zeroed reward flips / zeroes the advantages
        share = _share(forest)
        history.append(float(share.mean()))
        return sign * share

    source = FixedPromptRollouts(rollout, prompts, lens, reward)
    state = TrainState.create(params, optimizer)
    for step in range(STEPS):
        state, _, metrics, _ = rl_step(fns, state, source, jax.random.fold_in(jax.random.key(2), step), step)
        assert float(metrics["update/skipped"]) == 0.0
    return history


@pytest.fixture(scope="module")
def runs():
    return {sign: _train(sign) for sign in (1.0, -1.0, 0.0)}


def test_treepo_raises_reward(runs):
    h = runs[1.0]
    start, end = np.mean(h[:3]), np.mean(h[-5:])
    assert end > 0.3, f"target-token share only reached {end:.3f} (start {start:.3f})"
    assert end > start + 0.25


def test_flipped_or_zeroed_advantages_do_not_learn(runs):
    learned = np.mean(runs[1.0][-5:])
    for sign in (-1.0, 0.0):
        end = np.mean(runs[sign][-5:])
        assert end < 0.1, f"sign {sign}: share reached {end:.3f}"
        assert end < learned - 0.2
