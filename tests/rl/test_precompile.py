"""The packed layout's ladder compiled ahead of time (``treejax.rl.precompile``): after the first ``learn`` the
update and the log-prob pass of every other row count exist as executables, a later mini-batch of that layout runs
them with no compile, and they compute what the jitted functions compute."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from treejax.compile_cache import compile_clock
from treejax.models import presets
from treejax.models import transformer as T
from treejax.parallel.mesh import MeshConfig, make_mesh, place_train_state, sharded_update
from treejax.precision import Precision
from treejax.rl import losses, packing
from treejax.rl.config import StepConfig
from treejax.rl.layouts import make_layout
from treejax.rl.optimizer import OptimizerConfig, make_optimizer
from treejax.rl.rollouts import Rollouts
from treejax.rl.step import learn, make_learner
from treejax.rl.train_state import TrainState
from treejax.rl.update import make_update_fn
from treejax.sampling import strategies as S
from treejax.sampling import tree

CFG = presets.tiny_config("qwen2.5-0.5b", true_vocab_size=250)
TC = tree.TreeConfig(num_leaves=4, max_depth=3, segment_length=4, branch_factor=2, stop_ids=tuple(range(3, 30)),
                     strategy=S.Temperature(1.0), max_response_length=10, row_buckets=1)


def test_ladder_of_row_counts():
    f = packing.LayoutFloor()
    assert f.ladder() == []
    f.start((1, 64, 16), max_rows=4)
    assert f.ladder() == [2, 4]
    f.grow((2, 64, 16))
    assert f.ladder() == [4]
    g = packing.LayoutFloor()
    g.start((2, 64, 16), max_rows=6)  # row_multiple 2, 5 trees: rows 2, 4, then one tree per row (6)
    assert g.ladder() == [4, 6]


def test_ladder_compiled_ahead_runs_without_compiling_and_equals_jit():
    params = T.init_params(CFG, jax.random.key(0))
    prompts = np.random.RandomState(1).randint(60, 250, (2, 6)).astype(np.int32)
    lens = np.array([6, 3], np.int32)
    forest, _ = tree.make_tree_rollout(CFG, TC)(jax.tree.map(lambda x: x * 8.0 if x.ndim >= 2 else x, params),
                                               prompts, lens, jax.random.key(8))
    rewards = jnp.asarray(np.random.RandomState(2).choice([-1.0, 1.0], (2, TC.num_leaves)), jnp.float32)
    ro = Rollouts(forest=forest, rewards_PxW=rewards, scores_PxW=None, prompts_PxLp=prompts, lengths_P=lens)
    loss = losses.LossConfig()
    opt = make_optimizer(OptimizerConfig(learning_rate=1e-3, warmup_steps=0))
    cfg = StepConfig(estimator="grpo", loss=loss, old_logp="trainer", attention_impl="xla",
                     packing=packing.PackingConfig(row_length=256, attention_impl="xla"))
    layout = make_layout(CFG, cfg.packing, attention_impl="xla")
    mesh = make_mesh(MeshConfig(1, 1, 1), devices=jax.devices()[:1])
    state, state_sh = place_train_state(params, T.param_logical_axes(CFG), lambda p: TrainState.create(p, opt), opt,
                                        mesh)
    update = sharded_update(make_update_fn(layout, loss, opt), state_sh, mesh)
    learner = make_learner(CFG, cfg, Precision().resolve("cpu"), update, layout)

    state, _, info = learn(learner, state, ro, jax.random.key(3))  # 2 trees, 1 mini-batch: rows 1 -> [2]
    floor = layout.floor
    R, L, Wr = floor.shape
    assert (R, floor.ladder()) == (1, [2])
    floor.thread.join()
    assert floor.precompiled == 2  # (update, log-prob pass) x rung 2
    assert len(learner.logprobs.compiled) == 1

    # a mini-batch packed into the 2-row rung: no compile, and the same numbers as the jitted functions
    floor.shape = (2, L, Wr)
    pool = layout.pool(ro, jnp.ones(forest.tokens.shape), forest.loss_mask, jnp.ones((2, TC.num_leaves)))
    plan = layout.plan(pool, np.arange(2))
    assert plan.shape == (2, L, Wr)
    batch = learner.place(layout.assemble(pool, plan))
    b = learner.layout.assemble(dataclasses.replace(pool, batch=pool.batch.replace(
        old_logp=pool.batch.sampler_logp)), plan)  # the fields learn's update batches carry
    spare = jax.block_until_ready(jax.tree.map(jnp.copy, state))  # the update donates its state
    clock = compile_clock()
    before = clock.programs
    logp = learner.logprobs(state.params, batch)
    new_state, m = learner.update(spare, b)
    jax.block_until_ready((logp, new_state.params))
    assert clock.programs == before and np.isfinite(float(m["loss"]))  # both ran the executables made ahead
    np.testing.assert_array_equal(np.asarray(logp), np.asarray(learner.logprobs.jitted(state.params, batch)))


def test_stop_ladder_ends_the_compiles():
    """``stop_ladder`` (the loop's end): no compile starts after it, and it returns once the running one is done."""
    import threading
    import time

    from treejax.rl.precompile import precompile_ladder

    calls, stop = [], threading.Event()

    def slow(x):
        calls.append(x.shape[0])
        time.sleep(0.2)

    t = precompile_ladder([2, 4, 8, 16], [(slow, (jnp.zeros((1, 3)),), 0)], stop=stop)
    time.sleep(0.05)
    stop.set()
    t.join(timeout=5)
    assert not t.is_alive() and calls == [2]
