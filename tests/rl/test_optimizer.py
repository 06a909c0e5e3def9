"""Optimizer tests: schedules by hand, the weight-decay mask on real param trees, one clipped AdamW step vs NumPy."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.models import presets, transformer
from treejax.rl.optimizer import OptimizerConfig, learning_rate_schedule, make_optimizer, weight_decay_mask


@pytest.mark.parametrize("decay", ["cosine", "linear", "constant"])
def test_schedules_by_hand(decay):
    cfg = OptimizerConfig(learning_rate=1.0, warmup_steps=4, total_steps=14, decay=decay, end_lr_factor=0.1)
    lr = learning_rate_schedule(cfg)
    np.testing.assert_allclose([float(lr(s)) for s in range(5)], [0.0, 0.25, 0.5, 0.75, 1.0], rtol=1e-6)
    u = 0.5  # step 9 is halfway through the 10 decay steps
    want_mid = {"cosine": 0.1 + 0.9 * (1 + math.cos(math.pi * u)) / 2, "linear": 1 - 0.9 * u, "constant": 1.0}
    want_end = {"cosine": 0.1, "linear": 0.1, "constant": 1.0}
    np.testing.assert_allclose(float(lr(9)), want_mid[decay], rtol=1e-6)
    np.testing.assert_allclose(float(lr(14)), want_end[decay], rtol=1e-6)
    np.testing.assert_allclose(float(lr(100)), want_end[decay], rtol=1e-6)


@pytest.mark.parametrize("preset", ["qwen2.5-0.5b", "qwen3-0.6b", "smollm2-135m"])
def test_decay_mask_skips_norms_and_biases(preset):
    cfg = presets.tiny_config(preset, tie_word_embeddings=False)
    shapes = jax.eval_shape(lambda: transformer.init_params(cfg, jax.random.PRNGKey(0)))
    mask = weight_decay_mask(shapes)
    flat = {"/".join(str(getattr(k, "key", k)) for k in path): v
            for path, v in jax.tree_util.tree_flatten_with_path(mask)[0]}
    for name, decayed in flat.items():
        leaf = name.split("/")[-1]
        expect = not ("norm" in leaf or leaf in ("bq", "bk", "bv"))
        assert decayed == expect, name
    assert flat["embed"] and flat["lm_head"] and not flat["final_norm"]


def test_one_clipped_adamw_step_matches_numpy():
    cfg = OptimizerConfig(learning_rate=0.1, warmup_steps=0, weight_decay=0.5, max_grad_norm=1.0, b1=0.9,
                          b2=0.99, eps=1e-8)
    tx = make_optimizer(cfg)
    params = {"w": jnp.asarray([[1.0, -2.0], [0.5, 3.0]]), "norm": jnp.asarray([1.0, 2.0])}
    grads = {"w": jnp.asarray([[3.0, 0.0], [0.0, 4.0]]), "norm": jnp.asarray([0.0, 0.0])}  # ||g|| = 5 -> x0.2
    state = tx.init(params)
    updates, _ = tx.update(grads, state, params)
    g = {k: np.asarray(v) * 0.2 for k, v in grads.items()}
    for k, p in params.items():
        m = (1 - 0.9) * g[k] / (1 - 0.9)
        v = (1 - 0.99) * g[k] ** 2 / (1 - 0.99)
        step = m / (np.sqrt(v) + 1e-8) + (0.5 * np.asarray(p) if k == "w" else 0.0)
        np.testing.assert_allclose(np.asarray(updates[k]), -0.1 * step, rtol=1e-5, atol=1e-7, err_msg=k)


def test_config_errors():
    with pytest.raises(ValueError, match="decay"):
        OptimizerConfig(decay="exp")
    with pytest.raises(ValueError, match="total_steps"):
        OptimizerConfig(warmup_steps=10, total_steps=5, decay="cosine")


def test_proximal_ewma_tracks_the_params_and_passes_updates_through():
    """PPO-EWMA's moving average: theta_prox <- d theta_prox + (1 - d) theta_new after every update, from the
    initial params; the updates are AdamW's own (the EMA link changes nothing else)."""
    from treejax.rl.optimizer import proximal_params

    params = {"w": jnp.array([1.0, -2.0, 3.0]), "b": jnp.array([0.5])}
    plain = make_optimizer(OptimizerConfig(learning_rate=0.1, warmup_steps=0))
    ewma = make_optimizer(OptimizerConfig(learning_rate=0.1, warmup_steps=0, proximal_ewma=0.75))
    s_plain, s_ewma = plain.init(params), ewma.init(params)
    p, want = params, jax.tree.map(np.asarray, params)
    for k in range(3):
        g = {"w": jnp.array([0.3, -0.1, 0.2]) * (k + 1), "b": jnp.array([1.0])}
        u_plain, s_plain = plain.update(g, s_plain, p)
        u_ewma, s_ewma = ewma.update(g, s_ewma, p)
        for a, b in zip(jax.tree.leaves(u_plain), jax.tree.leaves(u_ewma)):
            np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
        p = jax.tree.map(lambda x, u: x + u, p, u_plain)
        want = jax.tree.map(lambda e, x: 0.75 * e + 0.25 * np.asarray(x), want, p)
        for a, b in zip(jax.tree.leaves(proximal_params(s_ewma)), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), b, rtol=1e-6)
    with pytest.raises(ValueError, match="proximal_ewma"):
        proximal_params(s_plain)


@pytest.mark.slow  # ~90 s on 2 cores (two steps of the loop with their own update programs)
def test_ppo_ewma_ratio_is_taken_against_the_moving_average():
    """Through the loop's step: the first step's EMA equals the params (ratio 1), the second's does not (the ratio
    against theta_prox moves away from 1); the config refuses one half without the other."""
    from treejax.errors import ConfigError
    from treejax.precision import Precision
    from treejax.rl.config import RunConfig, StepConfig
    from treejax.rl.layouts import Expanded
    from treejax.rl.losses import LossConfig
    from treejax.rl.step import make_learner, rl_step
    from treejax.rl.train_state import TrainState
    from treejax.rl.update import make_update_fn
    from treejax.sampling.tree import TreeConfig, make_tree_rollout
    from treejax.testing.sources import FixedPromptRollouts

    with pytest.raises(ConfigError, match="go together"):
        RunConfig(old_logp="ewma")
    with pytest.raises(ConfigError, match="go together"):
        RunConfig(optimizer=OptimizerConfig(total_steps=3, proximal_ewma=0.9))
    cfg = presets.tiny_config("smollm2-135m", vocab_size=64)
    tree = TreeConfig(num_leaves=4, max_depth=2, segment_length=4, branch_factor=1, init_divergence=4,
                      fallback=False, stop_ids=(5,))
    source = FixedPromptRollouts(make_tree_rollout(cfg, tree), np.array([[1, 5, 9, 2]], np.int32),
                                 np.array([4], np.int32),
                                 lambda f: jnp.mean((f.tokens % 3 == 0) * f.loss_mask, -1))
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-2, warmup_steps=0, proximal_ewma=0.5))
    state = TrainState.create(transformer.init_params(cfg, jax.random.key(0)), optimizer)
    layout = Expanded(cfg, attention_impl="xla")
    loss = LossConfig(tis_cap=2.0)
    update = jax.jit(make_update_fn(layout, loss, optimizer), donate_argnames=("state",))
    learner = make_learner(cfg, StepConfig(estimator="grpo", loss=loss, old_logp="ewma", mini_batches=2),
                           Precision().resolve("cpu"), update, layout)
    state, _, m0, _ = rl_step(learner, state, source, jax.random.key(0), 0)
    state, _, m1, _ = rl_step(learner, state, source, jax.random.key(1), 1)
    m0, m1 = jax.device_get((m0, m1))
    assert abs(m0["update/first_ratio_min"] - 1) < 1e-5 and abs(m0["update/first_ratio_max"] - 1) < 1e-5
    assert max(abs(m1["update/first_ratio_min"] - 1), abs(m1["update/first_ratio_max"] - 1)) > 1e-3
    assert m1["update/skipped"] == 0.0 and np.isfinite(m1["update/loss"])
