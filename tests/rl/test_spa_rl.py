"""SPA-RL (treejax.rl.shaping.spa): the progress head's steps, contributions, regression loss and the resulting
token advantages on a hand-computed case; its config checks; SPA-RL and OPRL composed with their states carried;
(slow) the loop's own step function with both heads in the train state, and the shipped config end to end with a
resume from a checkpoint written without the head."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.rl.shaping import SPARLShaping, ShapingInputs, apply_shapers, init_states
from treejax.rl.shaping.spa import progress_batch, spa_token_advantages, whiten_steps
from treejax.scorers.trainable import TrainableScorerConfig

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")
JUNK = 7.0  # hidden states the steps must not read (not a step's last token, or past the leaf)


def _hand_inputs():
    """One prompt, two leaves, segments of 2 tokens, E = 2. Leaf 0: 4 tokens (two steps; last tokens t = 1, 3 with
    hidden states (1, 0.5), (2, 0.5)), reward +1, outcome advantage 0.7. Leaf 1: 2 tokens (one step; t = 1 at
    (-1, 2)), reward -1, outcome advantage -0.7."""
    h = np.full((1, 2, 4, 2), JUNK, np.float32)
    h[0, 0, 1], h[0, 0, 3], h[0, 1, 1] = (1.0, 0.5), (2.0, 0.5), (-1.0, 2.0)
    mask = np.array([[[1, 1, 1, 1], [1, 1, 0, 0]]], np.float32)
    adv = mask * np.array([0.7, -0.7], np.float32)[None, :, None]
    return ShapingInputs(
        advantages=jnp.asarray(adv), loss_mask=jnp.asarray(mask), old_logp=jnp.asarray(-mask),
        rewards=jnp.asarray([[1.0, -1.0]]), scores=jnp.asarray([[1.0, 0.0]]), leaf_length=jnp.asarray([[4, 2]]),
        eps_scale=jnp.ones((1, 2)), leaf_path=jnp.asarray([[[0, 1, 2], [0, 3, -1]]]), hidden=jnp.asarray(h),
        segment_length=2)


def test_steps_are_the_segments_and_read_each_steps_last_token():
    b = progress_batch(_hand_inputs(), 2)
    np.testing.assert_array_equal(np.asarray(b.step_on_PxWxD), [[[True, True], [True, False]]])
    np.testing.assert_array_equal(np.asarray(b.hidden_PxWxDxE)[0, 0], [[1.0, 0.5], [2.0, 0.5]])
    np.testing.assert_array_equal(np.asarray(b.hidden_PxWxDxE)[0, 1, 0], [-1.0, 2.0])
    np.testing.assert_array_equal(np.asarray(b.outcome_PxW), [[1.0, -1.0]])


def test_spa_rl_hand_computed_case():
    """From a zero head, one AdamW step of lr 0.1 (the gradient at zero is dL/dw = (-4, 1), dL/db = -1; Adam's
    first step moves each weight by lr against its sign): w = (0.1, -0.1), b = 0.1. Contributions with the
    updated head: leaf 0: 0.1 - 0.05 + 0.1 = 0.15 and 0.2 - 0.05 + 0.1 = 0.25; leaf 1: -0.1 - 0.2 + 0.1 = -0.2.
    Regression loss: before 1.0, after ((0.4 - 1)^2 + (-0.2 + 1)^2) / 2 = 0.5. Whitened over the 3 steps (mean
    1/15, Bessel variance 0.0558333): a = 0.352673, 0.775880, -1.128553. Token advantages with outcome_mix 0.5:
    leaf 0: 0.5 a_0 + 0.35 = 0.526336 (t = 0, 1), 0.5 a_1 + 0.35 = 0.737940 (t = 2, 3); leaf 1: 0.5 a_0 - 0.35
    = -0.914276 (t = 0, 1), 0 past its tokens."""
    shaper = SPARLShaping(scorer=TrainableScorerConfig(learning_rate=0.1, updates=1), outcome_mix=0.5)
    x = _hand_inputs()
    adv, eps, m, states = apply_shapers((shaper,), x, init_states((shaper,), 2))
    head = states["spa_rl"].params
    np.testing.assert_allclose(np.asarray(head["w_E"]), [0.1, -0.1], rtol=2e-5)  # fp32 Adam: ~7e-6 off 0.1
    assert float(head["b"]) == pytest.approx(0.1, rel=2e-5)
    want = [[0.526336, 0.526336, 0.737940, 0.737940], [-0.914276, -0.914276, 0.0, 0.0]]
    np.testing.assert_allclose(np.asarray(adv), want, rtol=1e-4, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(eps), [1.0, 1.0])
    assert float(m["shaping/spa_rl/loss"]) == pytest.approx(1.0, rel=1e-6)
    assert float(m["shaping/spa_rl/loss_after"]) == pytest.approx(0.5, rel=1e-4)
    assert float(m["shaping/spa_rl/contribution_mean"]) == pytest.approx(0.2 / 3, rel=1e-4)
    assert float(m["shaping/spa_rl/outcome_abs_error"]) == pytest.approx(0.7, rel=1e-4)
    assert float(m["shaping/spa_rl/steps"]) == 3.0 and int(states["spa_rl"].step) == 1


def test_whitening_and_mixing_by_hand():
    c = jnp.asarray([[[0.15, 0.25], [-0.2, 99.0]]])  # the off step's value is ignored
    on = jnp.asarray([[[True, True], [True, False]]])
    mu, var = 0.2 / 3, ((0.15 - 0.2 / 3) ** 2 + (0.25 - 0.2 / 3) ** 2 + (-0.2 - 0.2 / 3) ** 2) / 2
    a = whiten_steps(c, on)
    np.testing.assert_allclose(np.asarray(a), [[[(0.15 - mu) / math.sqrt(var + 1e-8),
                                                 (0.25 - mu) / math.sqrt(var + 1e-8)],
                                                [(-0.2 - mu) / math.sqrt(var + 1e-8), 0.0]]], rtol=1e-5)
    x = _hand_inputs()
    for mix in (0.0, 1.0):  # 0: step advantages alone; 1: the estimator's unchanged
        out = np.asarray(spa_token_advantages(x.advantages, x.on, a, 2, mix))
        want = np.asarray(x.advantages) if mix == 1.0 else np.repeat(np.asarray(a), 2, axis=-1) * np.asarray(x.on)
        np.testing.assert_allclose(out, want, rtol=1e-6)


def test_filler_rows_stay_out_of_the_regression():
    """A leaf without trained tokens (a masked filler row) has no steps, no loss term and advantage 0."""
    x = _hand_inputs()
    x = x.replace(loss_mask=x.loss_mask.at[0, 1].set(0.0), advantages=x.advantages.at[0, 1].set(0.0))
    b = progress_batch(x, 2)
    assert not bool(b.leaf_on_PxW[0, 1]) and not bool(jnp.any(b.step_on_PxWxD[0, 1]))
    shaper = SPARLShaping(scorer=TrainableScorerConfig(learning_rate=0.1, updates=1))
    adv, _, m, _ = apply_shapers((shaper,), x, init_states((shaper,), 2))
    assert float(m["shaping/spa_rl/loss"]) == pytest.approx(1.0) and float(m["shaping/spa_rl/steps"]) == 2.0
    np.testing.assert_array_equal(np.asarray(adv)[1], 0.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(outcome_mix=1.5), r"SPARLShaping.outcome_mix must be in \[0, 1\].*fix: SPARLShaping.outcome_mix = 0.5$"),
    (dict(step_length=0), r"SPARLShaping.step_length must be >= 1 or None.*fix: SPARLShaping.step_length = None$"),
    (dict(scorer=0.1), r"SPARLShaping.scorer must be a TrainableScorerConfig.*fix: SPARLShaping.scorer = "
                       r"@TrainableScorerConfig\(\)$")])
def test_shaper_settings_are_checked(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        SPARLShaping(**kwargs)


@pytest.mark.parametrize("binding, match", [
    ("RunConfig.leaf_weighting = 'mass'", r"not by path mass.*fix: RunConfig.leaf_weighting = 'count'$"),
    ("TreeConfig.max_depth = 1", r"is one step of 16; fix: TreeConfig.max_depth >= 2"),
    ("SPARLShaping.step_length = 200", r"is one step of 200; fix: TreeConfig.max_depth >= 2")])
def test_run_checks_refuse_what_does_not_fit(binding, match):
    from treejax import train

    with pytest.raises(ConfigError, match=match) as e:
        train.parse([os.path.join(CONFIGS, "efficacy_spa_rl.gin")], [binding])
    assert "\n" not in str(e.value)


def test_both_trained_scorers_compose_and_carry_their_state():
    """SPA-RL then OPRL on one step's inputs, three steps in a row with their states carried (as ``TrainState.aux``
    is): each head's loss falls on the fixed batch, each counts its own updates, the structure stays the same."""
    from treejax.rl.shaping import OPRLShaping

    shapers = (SPARLShaping(scorer=TrainableScorerConfig(learning_rate=0.1, updates=1)),
               OPRLShaping(scorer=TrainableScorerConfig(learning_rate=0.1, updates=1), beta=0.5))
    x = _hand_inputs()
    states = init_states(shapers, 2)
    tree = jax.tree.structure(states)
    losses = {"spa_rl": [], "oprl": []}
    for _ in range(3):
        adv, _, m, states = apply_shapers(shapers, x, states)
        for name in losses:
            losses[name].append(float(m[f"shaping/{name}/loss"]))
        assert jax.tree.structure(states) == tree and np.all(np.asarray(adv)[1, 2:] == 0.0)
    assert all(b < a for v in losses.values() for a, b in zip(v, v[1:])), losses
    assert int(states["spa_rl"].step) == 3 and int(states["oprl"].step) == 3


# One step compiles the tree rollout, the trainer pass with hidden states and the update: 77 s measured on the
# shared 2-core machine at load 6-9 (a second step compiles them again for the updated state's placement, ~50 s
# more): slow. The default run covers the same shapers through apply_shapers (the tests above).
@pytest.mark.slow
@pytest.mark.parametrize("steps", [1, 2])
def test_rl_steps_train_the_head_in_the_train_state(steps):
    """The loop's step function (collect -> learn) with SPA-RL, then OPRL, on a tiny model (both trained scorers
    share the one compile): the trainer pass gives the hidden states, each head takes its updates before the
    policy's, their states are carried in ``TrainState.aux`` from step to step, and the advantages the update
    trains on are the shaped ones (they moved); the first PPO ratio is 1."""
    from treejax.rl.shaping import OPRLShaping
    from treejax.models import presets, transformer
    from treejax.precision import Precision
    from treejax.rl.config import StepConfig
    from treejax.rl.layouts import Expanded
    from treejax.rl.losses import LossConfig
    from treejax.rl.optimizer import OptimizerConfig, make_optimizer
    from treejax.rl.step import make_learner, rl_step
    from treejax.rl.train_state import TrainState
    from treejax.rl.update import make_update_fn
    from treejax.sampling.tree import TreeConfig, make_tree_rollout
    from treejax.testing.sources import FixedPromptRollouts

    cfg = presets.tiny_config("smollm2-135m", vocab_size=64)
    tree = TreeConfig(num_leaves=4, max_depth=3, segment_length=3, branch_factor=2, stop_ids=(5,))
    prompts, lens = np.array([[1, 5, 9, 2], [1, 11, 3, 4]], np.int32), np.array([3, 4], np.int32)
    source = FixedPromptRollouts(make_tree_rollout(cfg, tree), prompts, lens,
                                 lambda f: jnp.mean((f.tokens % 3 == 0) * f.loss_mask, -1))
    shapers = (SPARLShaping(scorer=TrainableScorerConfig(learning_rate=0.01, updates=2), outcome_mix=0.5),
               OPRLShaping(scorer=TrainableScorerConfig(learning_rate=0.01, updates=2), beta=0.5))
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3, warmup_steps=0, total_steps=10))
    layout = Expanded(cfg, attention_impl="xla")
    update = jax.jit(make_update_fn(layout, LossConfig(), optimizer), donate_argnames=("state",))
    learner = make_learner(cfg, StepConfig(estimator="grpo", shapers=shapers), Precision().resolve("cpu"), update,
                           layout)
    state = TrainState.create(transformer.init_params(cfg, jax.random.key(0)), optimizer,
                              aux=init_states(shapers, cfg.hidden_size))
    for step in range(steps):
        state, _, m, _ = rl_step(learner, state, source, jax.random.key(step), step)
        m = jax.device_get(m)
        assert m["update/skipped"] == 0.0 and np.isfinite(m["update/loss"]) and m["update/grad_norm"] > 0
        assert abs(m["update/first_ratio_min"] - 1) < 1e-5 and abs(m["update/first_ratio_max"] - 1) < 1e-5
        assert m["shaping/spa_rl/steps"] > 8 and m["shaping/spa_rl/loss_after"] < m["shaping/spa_rl/loss"]
        assert m["shaping/oprl/pairs"] > 0 and m["shaping/oprl/loss_after"] < m["shaping/oprl/loss"]
        assert m["shaping/adv_abs_mean_after"] != m["shaping/adv_abs_mean_before"]
    for name in ("spa_rl", "oprl"):
        head = state.aux[name]
        assert int(head.step) == steps and float(jnp.abs(head.params["w_E"]).sum()) > 0
        assert head.params["w_E"].shape == (cfg.hidden_size,)


@pytest.mark.slow  # two runs of the whole CLI on the tiny model (~2 x 60 s on 2 cores)
def test_shipped_config_runs_and_resumes_a_checkpoint_made_without_it(tiny_checkpoint, tmp_path):
    """``configs/efficacy_spa_rl.gin`` end to end for one step; and a GRPO run's checkpoint (no scorer state)
    resumed with SPA-RL on: the policy restores, the head starts fresh and trains."""
    from treejax import train

    common = [f"RunConfig.model = '{tiny_checkpoint}'", "RunConfig.prompts_per_step = 2",
              "TreeConfig.num_leaves = 4", "TreeConfig.init_divergence = 4", "TreeConfig.max_depth = 2",
              "TreeConfig.segment_length = 4", "EvalConfig.num_problems = 2", "EvalConfig.max_new_tokens = 2",
              "EvalConfig.batch_size = 2", "RunConfig.eval_every = 0", "RunConfig.mini_batches = 1",
              "RunConfig.dynamic_sampling = False"]

    def run(gin, log_dir, steps, *extra):
        params = common + [f"RunConfig.log_dir = '{log_dir}'", f"RunConfig.num_steps = {steps}", *extra]
        return train.main(["--gin_file", os.path.join(CONFIGS, gin), "--quiet"]
                          + sum((["--gin_param", p] for p in params), []))

    row = run("efficacy_spa_rl.gin", tmp_path / "spa", 1)["history"][0]
    assert np.isfinite(row["update/loss"]) and row["shaping/spa_rl/steps"] > 0
    run("efficacy_grpo.gin", tmp_path / "resume", 1, "RunConfig.checkpoint_every = 1")
    summary = run("efficacy_spa_rl.gin", tmp_path / "resume", 2, "RunConfig.log_dir_mode = 'resume'")
    assert [h["step"] for h in summary["history"]] == [1, 2] and "shaping/spa_rl/loss" in summary["history"][1]
    assert summary["history"][1]["shaping/spa_rl/loss"] > 0
