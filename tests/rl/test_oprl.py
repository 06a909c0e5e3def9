"""OPRL (treejax.rl.shaping.oprl) on the trainable-scorer machinery: the trajectory DPO loss, one update, the step
rewards and the resulting advantages on a hand-computed case; the pairs; the config checks; the shipped config."""

import os

import jax.numpy as jnp
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.rl.shaping import OPRLShaping, ShapingInputs, apply_shapers, init_states
from treejax.rl.shaping.oprl import preference_batch, step_rewards
from treejax.scorers.trainable import TrainableScorerConfig

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


def _inputs(rewards=(1.0, -1.0)):
    """One prompt, two leaves, segments of 2 tokens, E = 2. Leaf 0: 4 tokens at h = (1, 0), (0, 1), (1, 1), (2, 0)
    (sum (4, 2)), reward +1, outcome advantage 0.7; leaf 1: 2 tokens at (-1, 0), (0, -1) (sum (-1, -1)), then
    junk past its end, reward -1, outcome advantage -0.7."""
    h = np.full((1, 2, 4, 2), 7.0, np.float32)
    h[0, 0] = [[1, 0], [0, 1], [1, 1], [2, 0]]
    h[0, 1, :2] = [[-1, 0], [0, -1]]
    mask = np.array([[[1, 1, 1, 1], [1, 1, 0, 0]]], np.float32)
    adv = mask * np.array([0.7, -0.7], np.float32)[None, :, None]
    return ShapingInputs(
        advantages=jnp.asarray(adv), loss_mask=jnp.asarray(mask), old_logp=jnp.asarray(-mask),
        rewards=jnp.asarray([rewards]), scores=jnp.asarray([[1.0, 0.0]]), leaf_length=jnp.asarray([[4, 2]]),
        eps_scale=jnp.ones((1, 2)), leaf_path=jnp.asarray([[[0, 1, 2], [0, 3, -1]]]), hidden=jnp.asarray(h),
        segment_length=2)


def test_oprl_hand_computed_case():
    """beta = 0.5. One pair (leaf 0 > leaf 1). At w = 0 the DPO loss is log 2 = 0.693147 and its gradient
    -sigmoid(0) beta ((4, 2) - (-1, -1)) = (-1.25, -0.75): one Adam step of lr 0.1 gives w = (0.1, 0.1). Then
    s = beta w . sum h = 0.3 and -0.1, loss log(1 + e^-0.4) = 0.513015. Token rewards beta w . h_t: leaf 0 0.05,
    0.05, 0.1, 0.1; leaf 1 -0.05, -0.05. Step rewards 0.1, 0.2 | -0.1, whitened 0.218218, 0.872871 | -1.091089;
    A' = A + a: 0.918218 (t 0-1), 1.572871 (t 2-3) | -1.791089 (t 0-1), 0 past the leaf."""
    shaper = OPRLShaping(scorer=TrainableScorerConfig(learning_rate=0.1, updates=1), beta=0.5, step_coef=1.0)
    adv, _, m, states = apply_shapers((shaper,), _inputs(), init_states((shaper,), 2))
    np.testing.assert_allclose(np.asarray(states["oprl"].params["w_E"]), [0.1, 0.1], rtol=2e-5)  # fp32 Adam
    assert float(m["shaping/oprl/loss"]) == pytest.approx(0.693147, rel=1e-6)
    assert float(m["shaping/oprl/loss_after"]) == pytest.approx(0.513015, rel=1e-4)
    assert float(m["shaping/oprl/pairs"]) == 1.0 and float(m["shaping/oprl/pair_accuracy"]) == 1.0
    assert float(m["shaping/oprl/step_reward_mean"]) == pytest.approx(0.2 / 3, rel=1e-4)
    want = [[0.918218, 0.918218, 1.572871, 1.572871], [-1.791089, -1.791089, 0.0, 0.0]]
    np.testing.assert_allclose(np.asarray(adv), want, rtol=1e-4, atol=1e-6)
    assert int(states["oprl"].step) == 1


def test_pairs_and_step_sums():
    """Pairs: every (i, j) of a prompt's leaves with R_i > R_j, both with trained tokens; equal rewards give none
    (loss 0, the head does not move)."""
    b = preference_batch(_inputs(), 0.5)
    np.testing.assert_array_equal(np.asarray(b.pairs()), [[[False, True], [False, False]]])
    np.testing.assert_array_equal(np.asarray(b.token_on_PxWxT), [[[1, 1, 1, 1], [1, 1, 0, 0]]])
    tie = preference_batch(_inputs((1.0, 1.0)), 0.5)
    assert not bool(tie.pairs().any()) and float(tie.loss({"w_E": jnp.ones(2)})) == 0.0
    r, on = step_rewards(jnp.asarray([[[1.0, 2.0, 3.0, 4.0, 5.0]]]), jnp.asarray([[5]]), 2)
    np.testing.assert_array_equal(np.asarray(r), [[[3.0, 7.0, 5.0]]])
    np.testing.assert_array_equal(np.asarray(on), [[[True, True, True]]])


@pytest.mark.parametrize("kwargs, match", [
    (dict(beta=0.0), r"OPRLShaping.beta must be > 0.*fix: OPRLShaping.beta = 0.1$"),
    (dict(step_coef=-1.0), r"OPRLShaping.step_coef must be >= 0.*fix: OPRLShaping.step_coef = 1.0$"),
    (dict(step_length=0), r"OPRLShaping.step_length must be >= 1 or None.*fix: OPRLShaping.step_length = None$"),
    (dict(scorer="x"), r"OPRLShaping.scorer must be a TrainableScorerConfig.*@TrainableScorerConfig\(\)$")])
def test_settings_are_checked(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        OPRLShaping(**kwargs)


@pytest.mark.parametrize("binding, match", [
    ("RunConfig.leaf_weighting = 'mass'", r"OPRLShaping weighs every leaf slot.*RunConfig.leaf_weighting = 'count'$"),
    ("TreeConfig.max_depth = 1", r"OPRLShaping attributes the outcome.*fix: TreeConfig.max_depth >= 2")])
def test_run_checks(binding, match):
    from treejax import train

    cfg = train.parse([os.path.join(CONFIGS, "efficacy_oprl.gin")], [])
    assert [s.name for s in cfg.shapers] == ["oprl"]
    with pytest.raises(ConfigError, match=match):
        train.parse([os.path.join(CONFIGS, "efficacy_oprl.gin")], [binding])
