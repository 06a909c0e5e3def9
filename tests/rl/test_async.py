"""Asynchronous rollouts (:mod:`treejax.rl.collect`): the fixed-lag schedule, exactness against the synchronous
step, staleness bounds under injected delays, the importance weights, the saved queue, and the whole loop with a
sampler group and a learner group on fake CPU devices (resume equals an uninterrupted run)."""

import dataclasses
import os
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.models import presets, transformer
from treejax.precision import Precision
from treejax.rl import collect
from treejax.rl.config import AsyncConfig, RunConfig, StepConfig
from treejax.rl.layouts import Expanded
from treejax.rl.losses import LossConfig
from treejax.rl.optimizer import OptimizerConfig, make_optimizer
from treejax.rl.step import learn, make_learner, rl_step
from treejax.rl.train_state import TrainState
from treejax.rl.update import make_update_fn
from treejax.sampling.strategies import Temperature
from treejax.sampling.tree import TreeConfig, make_tree_rollout
from treejax.testing.sources import FixedPromptRollouts

STEPS = 3


@pytest.fixture(scope="module")
def setup():
    """A tiny random model, a fixed-prompt source whose reward is the share of token 7, and its learner (TIS on,
    so the behaviour log-probs enter the loss), all on device 0."""
    cfg = presets.tiny_config("smollm2-135m", vocab_size=64)
    params = transformer.init_params(cfg, jax.random.key(0))
    tree = TreeConfig(num_leaves=4, max_depth=2, segment_length=4, branch_factor=2, strategy=Temperature(1.0),
                      stop_ids=())
    prompts = np.array([[1, 5, 9, 0], [1, 11, 3, 4]], np.int32)
    lens = np.array([3, 4], np.int32)

    def reward(forest):
        valid = forest.loss_mask > 0
        return jnp.sum((forest.tokens == 7) & valid, -1) / jnp.maximum(jnp.sum(valid, -1), 1)

    source = FixedPromptRollouts(make_tree_rollout(cfg, tree), prompts, lens, reward)
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-2, warmup_steps=0, total_steps=STEPS,
                                               weight_decay=0.0))
    layout = Expanded(cfg, attention_impl="xla")
    loss = LossConfig(tis_cap=2.0, entropy_coef=0.01)
    update = jax.jit(make_update_fn(layout, loss, optimizer), donate_argnames=("state",))
    learner = make_learner(cfg, StepConfig(estimator="treepo", loss=loss), Precision().resolve("cpu"), update, layout)
    return learner, source, lambda: TrainState.create(jax.tree.map(jnp.copy, params), optimizer)


def _sync(setup):
    learner, source, init = setup
    state, rows = init(), []
    for step in range(STEPS):
        state, _, metrics, _ = rl_step(learner, state, source, jax.random.fold_in(jax.random.key(3), step), step)
        rows.append(jax.device_get(metrics))
    return state, rows


def _async(setup, k, split=False, delay_sampler=0.0, delay_learner=0.0):
    """The loop's step order over an :class:`AsyncCollector` (``k`` = max_staleness)."""
    learner, source, init = setup
    state, rows, items = init(), [], []
    key = jax.random.key(3)
    copy = lambda p: jax.device_put(learner.sampler_params(p), may_alias=False)  # noqa: E731
    slow = _Delayed(source, delay_sampler)
    col = collect.AsyncCollector(slow, copy, key, 0, STEPS, k, learner.precision.matmul_context,
                                 keep_params=(lambda p: jax.device_put(p, may_alias=False)) if split else None)
    col.publish(0, state)
    try:
        for step in range(STEPS):
            item = col.collect(step)
            state, metrics, _ = learn(learner, state, item.rollouts, jax.random.fold_in(key, step),
                                      behaviour_params=item.behaviour_params)
            col.publish(step + 1, state)
            jax.block_until_ready(state.step)
            time.sleep(delay_learner)
            rows.append(jax.device_get(metrics))
            items.append(item)
    finally:
        col.close()
    return state, rows, items, slow


class _Delayed:
    """A source that sleeps before sampling and records when each step was sampled, and how many versions existed."""

    def __init__(self, inner, delay):
        self.inner, self.delay, self.started = inner, delay, []

    def sample(self, params, key, step):
        time.sleep(self.delay)
        self.started.append(step)
        return self.inner.sample(params, key, step)


def test_max_staleness_zero_equals_the_synchronous_step_bit_for_bit(setup):
    with jax.default_matmul_precision("highest"):
        sync_state, sync_rows = _sync(setup)
        state, rows, items, _ = _async(setup, 0)
    for a, b in zip(jax.tree.leaves(sync_state.params), jax.tree.leaves(state.params)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    for a, b in zip(sync_rows, rows):
        assert {k: float(v) for k, v in a.items()} == {k: float(v) for k, v in b.items() if k in a}
    assert [i.version for i in items] == list(range(STEPS))
    assert [i.host["async/staleness"] for i in items] == [0] * STEPS
    # a queued item round-trips through the checkpoint's JSON text
    ro = items[-1].rollouts
    text = collect.encode_queue([collect.Collected(3, 2, ro, {"time/rollout_s": 0.5})])
    assert isinstance(text, str) and text.isascii()
    (back,) = collect.decode_queue(text)
    assert (back.step, back.version, back.host) == (3, 2, {"time/rollout_s": 0.5})
    for a, b in zip(jax.tree.leaves(ro.forest), jax.tree.leaves(back.rollouts.forest)):
        np.testing.assert_array_equal(np.asarray(a), b)
    np.testing.assert_array_equal(np.asarray(ro.rewards_PxW), back.rollouts.rewards_PxW)
    assert collect.decode_queue(None) == []


def test_staleness_is_the_bound_and_the_weights_split_exactly(setup):
    """k = 1: step i learns from version max(0, i - 1). The staleness importance weight (trainer log-probs under
    the current vs the sampling parameters) is exactly 1 where nothing is stale and not 1 after an update; the
    full weight pi_prox / q then moves away from 1 further than the sampler's numerics alone."""
    with jax.default_matmul_precision("highest"):
        _, rows, items, _ = _async(setup, 1, split=True)
    assert [i.version for i in items] == [0, 0, 1]
    assert [i.host["async/staleness"] for i in items] == [0, 1, 1]
    first = rows[0]
    assert float(first["offpolicy/stale_iw_min"]) == float(first["offpolicy/stale_iw_max"]) == 1.0
    for row in rows[1:]:
        assert float(row["offpolicy/stale_iw_max"]) > 1.0 > float(row["offpolicy/stale_iw_min"])
        assert float(row["mismatch/abs_max"]) > float(row["mismatch/numerics_abs_max"])
    # on-policy (step 0) the whole mismatch is the numerics part
    assert float(first["mismatch/numerics_abs_max"]) == float(first["mismatch/abs_max"])


@pytest.mark.parametrize("k", [1, 2])
def test_staleness_stays_bounded_under_a_slow_learner_and_a_slow_sampler(k, monkeypatch):
    """Scheduling only (a fake source, no model): whichever side is slow, step j is sampled with version j - k
    exactly, never before that version was published, and the queue never holds more than k + 1 steps."""
    monkeypatch.setattr(collect, "rollout_metrics", lambda ro: {"reward/mean": 0.0})
    published, log = {}, []

    class Source:
        def __init__(self, delay):
            self.delay = delay

        def sample(self, params, key, step):
            log.append((step, params, max(published)))
            time.sleep(self.delay)
            return collect.Rollouts(None, None, None, None, None)

    for delay_sampler, delay_learner in ((0.0, 0.05), (0.05, 0.0)):
        published.clear(), log.clear()
        col = collect.AsyncCollector(Source(delay_sampler), lambda v: v, jax.random.key(0), 0, 12, k)
        lengths = []

        class State:
            def __init__(self, v):
                self.params = v

        try:
            published[0] = True
            col.publish(0, State(0))
            for step in range(12):
                item = col.collect(step)
                lengths.append(item.host["async/queued"])
                assert item.version == max(0, step - k)
                published[step + 1] = True
                col.publish(step + 1, State(step + 1))  # dispatched; the "update" then takes delay_learner
                time.sleep(delay_learner)
        finally:
            col.close()
        assert [s for s, _, _ in log] == list(range(12))
        for step, version, newest in log:
            assert version == max(0, step - k) <= newest
        assert max(lengths) <= k
        if delay_learner:  # a fast sampler runs the full k steps ahead
            assert max(lengths) == k


def test_a_failing_sampler_surfaces_in_the_learner():
    class Source:
        def sample(self, params, key, step):
            raise ValueError("bad rollout")

    col = collect.AsyncCollector(Source(), lambda v: v, jax.random.key(0), 0, 3, 1)

    class State:
        params = 0

    col.publish(0, State())
    with pytest.raises(ValueError, match="bad rollout"):
        col.collect(0)
    col.close()


def test_device_split_and_config_errors():
    devs = list(range(4))
    on = AsyncConfig(enabled=True, sampler_devices=1)
    assert collect.split_devices(AsyncConfig(), devs) == (devs, devs)
    assert collect.split_devices(on, devs) == ([0], [1, 2, 3])
    assert collect.split_devices(AsyncConfig(enabled=True), [0]) == ([0], [0])
    with pytest.raises(ConfigError, match="works on one device only .* fix: AsyncConfig.sampler_devices = 2"):
        collect.split_devices(AsyncConfig(enabled=True), devs)
    with pytest.raises(ConfigError, match="leaves no device to learn on"):
        collect.split_devices(AsyncConfig(enabled=True, sampler_devices=4), devs)
    with pytest.raises(ConfigError, match="run in one process"):
        collect.split_devices(on, devs, process_count=2)
    with pytest.raises(ConfigError, match="AsyncConfig.max_staleness must be an int >= 0"):
        AsyncConfig(max_staleness=-1)
    with pytest.raises(ConfigError, match="AsyncConfig.enabled = False; fix: AsyncConfig.enabled = True"):
        RunConfig(async_rollouts=AsyncConfig(max_staleness=2))
    with pytest.raises(ConfigError, match="split_staleness needs RunConfig.old_logp = 'trainer'"):
        RunConfig(old_logp="sampler", async_rollouts=AsyncConfig(enabled=True, split_staleness=True))


def _cli(tiny_checkpoint, log_dir, *extra):
    from treejax import train

    params = [f"RunConfig.model = '{tiny_checkpoint}'", f"RunConfig.log_dir = '{log_dir}'", "RunConfig.num_steps = 3",
              "RunConfig.prompts_per_step = 2", "TreeConfig.num_leaves = 4", "TreeConfig.max_depth = 2",
              "TreeConfig.segment_length = 4", "EvalConfig.num_problems = 2", "EvalConfig.max_new_tokens = 4",
              "OptimizerConfig.learning_rate = 1e-3", "LossConfig.entropy_coef = 0.01", "LossConfig.tis_cap = 2.0",
              "RunConfig.tree_picture_every = 0", "RunConfig.checkpoint_every = 1", "RunConfig.keep_checkpoints = 3",
              "RunConfig.async_rollouts = @AsyncConfig()", "AsyncConfig.enabled = True",
              "AsyncConfig.max_staleness = 1", "AsyncConfig.sampler_devices = 4", *extra]
    return train.main(["--quiet"] + sum((["--gin_param", p] for p in params), []))


def _same_row(a, b):
    timing = lambda row: {k: v for k, v in row.items() if not k.startswith("time/") and k != "async/queued"}  # noqa
    return timing(a) == timing(b)


def test_the_loop_with_a_sampler_group_resumes_from_its_saved_queue(tiny_checkpoint, tmp_path):
    """The real loop, 4 fake devices sampling and 4 learning, k = 1: steps learn from versions 0, 0, 1; the
    checkpoint of step 1 holds the queued rollouts of steps 2 and 3 (versions 0 and 1) and the prompt pipeline
    after them; a run resumed from it learns exactly what the uninterrupted run learned (same rows, same bytes)."""
    import json
    import shutil

    straight = _cli(tiny_checkpoint, tmp_path / "a")
    assert [h["async/staleness"] for h in straight["history"]] == [0, 1, 1]
    assert straight["async"]["max_staleness"] == 1 and straight["async"]["mean_staleness"] == pytest.approx(2 / 3)
    assert 0 < straight["async"]["learner_busy"] < 1 and straight["steps_per_s"] > 0
    with open(tmp_path / "a" / "checkpoints" / "1" / "data" / "metadata") as f:  # orbax's JsonSave file
        data = json.load(f)
    queued = collect.decode_queue(data["rollout_queue"])
    assert [(q.step, q.version) for q in queued] == [(1, 0), (2, 1)]
    shutil.copytree(tmp_path / "a" / "checkpoints" / "1", tmp_path / "b" / "checkpoints" / "1")
    resumed = _cli(tiny_checkpoint, tmp_path / "b")
    assert [h["step"] for h in resumed["history"]] == [1, 2, 3]
    for a, b in zip(straight["history"], resumed["history"]):
        assert _same_row(a, b), (a, b)
    with open(os.path.join(straight["hf_export"], "model.safetensors"), "rb") as f:
        with open(os.path.join(resumed["hf_export"], "model.safetensors"), "rb") as g:
            assert f.read() == g.read()


def test_the_shipped_async_config_parses_and_warns_without_the_behaviour_weight():
    from treejax import train
    from treejax.rl.config import OffPolicyWarning

    cfg = train.parse([os.path.join(os.path.dirname(__file__), "..", "..", "configs", "efficacy_slots_k8_async.gin")],
                      [])
    assert cfg.async_rollouts == AsyncConfig(enabled=True, max_staleness=1, sampler_devices=1)
    assert cfg.loss.tis_cap == 2.0
    train.check_devices(cfg)  # 1 sampler + 7 learner devices of the 8 fake ones
    with pytest.warns(OffPolicyWarning, match="without the behaviour weight"):
        dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, tis_cap=None))


@pytest.mark.slow  # ~120 s on 2 cores; the default suite resumes from a saved queue above
def test_sigterm_stops_both_sides_and_the_resumed_run_equals_the_uninterrupted_one(tiny_checkpoint, tmp_path,
                                                                                   monkeypatch):
    """SIGTERM during step 1 of an asynchronous run: the loop finishes the step, waits for the sampler thread to
    go as far as it can, saves the queue and stops both; rerunning the command resumes to the same result."""
    import signal

    from treejax import viz

    straight = _cli(tiny_checkpoint, tmp_path / "a", "RunConfig.tree_picture_every = 1")
    original, calls = viz.draw_tree, []

    def draw_and_preempt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)
        return original(*args, **kwargs)

    monkeypatch.setattr(viz, "draw_tree", draw_and_preempt)
    stopped = _cli(tiny_checkpoint, tmp_path / "b", "RunConfig.tree_picture_every = 1",
                   "RunConfig.checkpoint_every = 0")
    assert stopped["preempted_at"] == 1 and stopped["stopped_by"] == "SIGTERM"
    assert not [t for t in threading.enumerate() if t.name == "treejax-sampler"]
    monkeypatch.setattr(viz, "draw_tree", original)
    resumed = _cli(tiny_checkpoint, tmp_path / "b", "RunConfig.tree_picture_every = 1",
                   "RunConfig.checkpoint_every = 0")
    for a, b in zip(straight["history"], resumed["history"]):
        assert _same_row(a, b), (a, b)
    with open(os.path.join(straight["hf_export"], "model.safetensors"), "rb") as f:
        with open(os.path.join(resumed["hf_export"], "model.safetensors"), "rb") as g:
            assert f.read() == g.read()
