"""Checkpoint tests: exact round trip (also into an 8-device sharding), keep-N, SIGTERM save-and-exit, and
restore-then-continue == uninterrupted on the tiny update step."""

import os
import signal
import subprocess
import sys
import textwrap

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from treejax.checkpoint import Checkpointer, PreemptionHandler, abstract_state_with_shardings
from treejax.models import presets, transformer
from treejax.parallel.mesh import MeshConfig, make_mesh, logical_to_sharding, train_state_shardings
from treejax.rl import losses
from treejax.rl.optimizer import OptimizerConfig, make_optimizer
from treejax.rl.train_state import TrainState
from treejax.rl.batch import expanded_batch
from treejax.rl.layouts import Expanded
from treejax.rl.update import make_update_fn

CFG = presets.tiny_config("smollm2-135m")
TX = make_optimizer(OptimizerConfig(learning_rate=1e-2, warmup_steps=1, total_steps=10, decay="cosine"))


def _assert_tree_equal(a, b):
    la, ta = jax.tree.flatten(a)
    lb, tb = jax.tree.flatten(b)
    assert ta == tb
    for x, y in zip(la, lb):
        assert np.asarray(x).dtype == np.asarray(y).dtype
        np.testing.assert_array_equal(np.asarray(x), np.asarray(y))


def make_setup():
    """(initial state, batch(i) data function, jitted update): shared by the tests and the SIGKILL child."""
    params = transformer.init_params(CFG, jax.random.PRNGKey(0))
    state = TrainState.create(params, TX)
    B, L = 4, 12
    t = np.arange(L)[None, :]

    def batch(i):  # a deterministic "data iterator": batch i is a pure function of i
        r = np.random.default_rng(i)
        return expanded_batch(dict(
            tokens=jnp.asarray(r.integers(3, CFG.vocab_size, (B, L)), jnp.int32),
            positions=jnp.asarray(np.broadcast_to(t, (B, L)), jnp.int32),
            loss_mask=jnp.asarray(np.broadcast_to(t >= 4, (B, L)), jnp.float32),
            old_logp=jnp.full((B, L), -5.0, jnp.float32),
            advantages=jnp.asarray(np.broadcast_to(r.normal(size=(B, 1)), (B, L)), jnp.float32)))

    update = jax.jit(make_update_fn(Expanded(CFG, attention_impl="xla"), losses.LossConfig(), TX))
    return state, batch, update


@pytest.fixture(scope="module")
def setup():
    return make_setup()


@pytest.mark.devices(8)
def test_round_trip_exact_and_into_sharding(tmp_path, setup):
    state, batch, update = setup
    state, _ = update(state, batch(0))  # non-trivial optimizer state
    data = {"iterator": {"next_index": 17, "seed": 3}, "note": "x"}
    with Checkpointer(tmp_path / "ck", max_to_keep=2) as ck:
        assert ck.save(1, state, data)
        ck.wait()
        restored, rdata = ck.restore(abstract_state_with_shardings(jax.eval_shape(lambda: state)))
        _assert_tree_equal(restored, state)
        assert rdata == data
        # restore straight into an 8-device (fsdp x tensor) layout
        mesh = make_mesh(MeshConfig(data=1, fsdp=2, tensor=4))
        abstract = jax.eval_shape(lambda: state)
        p_sh = logical_to_sharding(transformer.param_logical_axes(CFG), mesh, shapes=abstract.params)
        shardings = train_state_shardings(abstract, p_sh, TX, mesh)
        sharded, _ = ck.restore(abstract_state_with_shardings(abstract, shardings))
        w = sharded.params["layers"]["w_up"]
        assert isinstance(w.sharding, NamedSharding) and w.sharding.spec == P(None, "fsdp", "tensor")
        _assert_tree_equal(jax.device_get(sharded), jax.device_get(state))


def test_keep_n_and_errors(tmp_path, setup):
    state = setup[0]
    with Checkpointer(tmp_path / "keep", max_to_keep=2) as ck:
        for s in range(4):
            ck.save(s, state, {"s": s})
        ck.wait()
        assert ck.all_steps() == [2, 3] and ck.latest_step() == 3
        with pytest.raises(FileNotFoundError, match="step 0"):
            ck.restore(abstract_state_with_shardings(state), step=0)
    with Checkpointer(tmp_path / "empty") as ck:
        with pytest.raises(FileNotFoundError, match="no checkpoint"):
            ck.restore(abstract_state_with_shardings(state))


def _run(state, batch, update, start, stop, ckpt=None, handler=None, kill_at=None):
    """A minimal loop: the data state is the next batch index; SIGTERM -> save at the step boundary and exit."""
    for i in range(start, stop):
        state, _ = update(state, batch(i))
        if kill_at is not None and i == kill_at:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives mid-run; the loop only notices at the boundary
        if handler is not None and handler.should_stop(i, ckpt):
            ckpt.save(i + 1, state, {"next_index": i + 1}, force=True)
            ckpt.wait()
            return state, i + 1
    return state, stop


def test_sigterm_save_exit_then_resume_equals_uninterrupted(tmp_path, setup):
    state0, batch, update = setup
    uninterrupted, _ = _run(state0, batch, update, 0, 5)

    with Checkpointer(tmp_path / "run") as ck, PreemptionHandler() as handler:
        _, stopped_at = _run(state0, batch, update, 0, 5, ck, handler, kill_at=1)
        assert handler.requested and handler.signal_received == signal.SIGTERM
        assert stopped_at == 2 and ck.latest_step() == 2
    assert signal.getsignal(signal.SIGTERM) != handler._handle  # handler uninstalled

    with Checkpointer(tmp_path / "run") as ck:  # a "new process": fresh manager, restore, continue
        abstract = abstract_state_with_shardings(jax.eval_shape(lambda: state0))
        resumed, data = ck.restore(abstract)
        assert int(resumed.step) == 2
        resumed, _ = _run(resumed, batch, update, data["next_index"], 5)
    _assert_tree_equal(resumed, uninterrupted)


_CHILD = """
import sys, time
sys.path.insert(0, {root!r})
from tests.test_checkpoint import make_setup
from treejax.checkpoint import Checkpointer
state, batch, update = make_setup()
ck = Checkpointer({ckdir!r}, max_to_keep=None)  # asynchronous saves
for i in range(100):
    state, _ = update(state, batch(i))
    ck.save(i + 1, state, {{"next_index": i + 1}})
    if i == 2:
        ck.wait()
        print("durable 3", flush=True)
    time.sleep(0.05)
"""


def test_sigkill_mid_run_then_resume_equals_uninterrupted(tmp_path, setup):
    """SIGKILL while asynchronous saves are in flight: only finalized checkpoints are visible, and resuming
    from the newest one reproduces the uninterrupted run exactly."""
    state0, batch, update = setup
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    ckdir = str(tmp_path / "killed")
    proc = subprocess.Popen([sys.executable, "-c", textwrap.dedent(_CHILD.format(root=root, ckdir=ckdir))],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        line = proc.stdout.readline()
        assert line.strip() == "durable 3", proc.stderr.read()
        import time

        time.sleep(0.3)  # let a few more (async) saves start
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.wait(timeout=60)
    with Checkpointer(ckdir) as ck:
        latest = ck.latest_step()
        assert latest is not None and latest >= 3
        resumed, data = ck.restore(abstract_state_with_shardings(jax.eval_shape(lambda: state0)))
    assert int(resumed.step) == latest == data["next_index"]
    target = latest + 2
    resumed, _ = _run(resumed, batch, update, data["next_index"], target)
    uninterrupted, _ = _run(state0, batch, update, 0, target)
    _assert_tree_equal(resumed, uninterrupted)


def test_restore_params_only(tmp_path):
    """Only the params come back (cast to the target dtypes), by step or the latest; mismatched names/shapes are a
    clear error; nothing is written into the checkpoint folder."""
    from treejax.checkpoint import restore_params

    params = transformer.init_params(CFG, jax.random.PRNGKey(0))
    later = jax.tree.map(lambda x: x + 1, params)
    with Checkpointer(tmp_path / "ck") as ckpt:
        ckpt.save(1, TrainState.create(params, TX), {"rl_step": 1}, force=True)
        ckpt.save(3, TrainState.create(later, TX), {"rl_step": 3}, force=True)
    listing = sorted(os.walk(tmp_path))
    got, step = restore_params(tmp_path / "ck", params)
    assert step == 3
    _assert_tree_equal(got, jax.device_get(later))
    got, step = restore_params(tmp_path / "ck", jax.tree.map(lambda x: x.astype(jnp.bfloat16), params), step=1)
    assert step == 1 and all(x.dtype == jnp.bfloat16 for x in jax.tree.leaves(got))
    np.testing.assert_array_equal(np.asarray(got["embed"], np.float32),
                                  np.asarray(params["embed"].astype(jnp.bfloat16), np.float32))
    other = transformer.init_params(presets.tiny_config("qwen2.5-0.5b"), jax.random.PRNGKey(0))
    with pytest.raises(ValueError, match="do not match"):
        restore_params(tmp_path / "ck", other)
    with pytest.raises(FileNotFoundError, match="step 2"):
        restore_params(tmp_path / "ck", params, step=2)
    with pytest.raises(FileNotFoundError):
        restore_params(tmp_path / "missing", params)
    assert sorted(os.walk(tmp_path)) == listing
