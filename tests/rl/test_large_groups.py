"""BroRL-size groups: W = 256 rollouts of one prompt through the loop's step on CPU, with micro-batches, and the
update's compiled working memory below the mini-batch's full logits (the loss never holds P x W x T x V at once)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest


@pytest.mark.slow  # 94 s on 2 cores beside the full suite (a 256-row rollout and two update compiles)
def test_w256_runs_and_the_update_never_holds_all_logits():
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

    W, V, micro = 256, 8192, 8
    cfg = presets.tiny_config("smollm2-135m", vocab_size=V)
    tree = TreeConfig(num_leaves=W, max_depth=2, segment_length=4, branch_factor=1, init_divergence=W,
                      fallback=False, stop_ids=(5,))
    prompts, lens = np.array([[1, 5, 9, 2]], np.int32), np.array([4], np.int32)
    reward = lambda f: jnp.mean((f.tokens % 3 == 0) * f.loss_mask, -1)  # noqa: E731  (varied rewards)
    source = FixedPromptRollouts(make_tree_rollout(cfg, tree), prompts, lens, reward)
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3, warmup_steps=0, total_steps=10))
    state = TrainState.create(transformer.init_params(cfg, jax.random.key(0)), optimizer)
    layout = Expanded(cfg, attention_impl="xla", chunk_size=256)
    loss = LossConfig()
    step_cfg = StepConfig(estimator="grpo", loss=loss, mini_batches=2, micro_batches=micro)
    update = jax.jit(make_update_fn(layout, loss, optimizer, num_micro_batches=micro), donate_argnames=("state",))
    learner = make_learner(cfg, step_cfg, Precision().resolve("cpu"), update, layout)
    state, ro, m, _ = rl_step(learner, state, source, jax.random.key(0), 0)
    m = jax.device_get(m)
    assert ro.forest.num_leaves == W and m["update/skipped"] == 0.0 and np.isfinite(m["update/loss"])
    assert abs(m["update/first_ratio_min"] - 1) < 1e-5 and abs(m["update/first_ratio_max"] - 1) < 1e-5
    adv = learner.estimator(ro.forest, ro.rewards_PxW, {}).leaves
    assert abs(float(jnp.mean(adv))) < 1e-5 and float(jnp.std(adv)) > 0.5  # one group of 256, normalised

    # the update's working memory on one mini-batch against the logits of all its tokens
    pool = layout.pool(ro, jnp.zeros(ro.forest.tokens.shape), ro.forest.loss_mask, jnp.ones((1, W)))
    batch = layout.assemble(pool, layout.plan(pool, jnp.arange(pool.units // 2)))
    stats = update.lower(state, batch).compile().memory_analysis()
    rows, length = batch.inputs.tokens.shape
    full_logits = rows * length * V * 4
    assert stats is not None and stats.temp_size_in_bytes < full_logits / 4, (stats.temp_size_in_bytes, full_logits)
