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
