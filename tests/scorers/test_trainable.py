"""The trainable scorer (treejax.scorers.trainable): the progress head's loss on hand-made numbers, its update moves
it (the loss falls on a fixed batch), and its state round-trips through the run's orbax checkpoint; a checkpoint
written without it restores with a fresh one."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.scorers.trainable import (ProgressBatch, ScorerState, TrainableScorerConfig, init_progress_state,
                                       scorer_update)


def _hand_batch():
    """Two leaves: leaf 0 has two steps whose last tokens' hidden states are (1, 0.5) and (2, 0.5), outcome +1;
    leaf 1 one step at (-1, 2), outcome -1 (its second step slot is off and holds junk)."""
    h = np.array([[[[1.0, 0.5], [2.0, 0.5]], [[-1.0, 2.0], [9.0, 9.0]]]], np.float32)  # [P=1, W=2, D=2, E=2]
    on = np.array([[[True, True], [True, False]]])
    return ProgressBatch(hidden_PxWxDxE=jnp.asarray(h), step_on_PxWxD=jnp.asarray(on),
                         outcome_PxW=jnp.asarray([[1.0, -1.0]]), leaf_on_PxW=jnp.asarray([[True, True]]))


def test_progress_loss_and_one_update_by_hand():
    """c_k = w . h_k + b; L = mean_leaves (sum_k c_k - R)^2. At w = (0.5, -1), b = 0.25: leaf 0's contributions
    0.25 + 0.5 - 0.5 = 0.25 and 1.0 - 0.5 + 0.25 = 0.75 (sum 1.0, error 0), leaf 1's -0.5 - 2 + 0.25 = -2.25
    (error -1.25): L = (0 + 1.5625) / 2 = 0.78125. From zero, L = 1 and the gradient is dL/dw = -(3, 1) + (-1, 2)
    = (-4, 1), dL/db = -2 + 1 = -1, so one Adam step of lr 0.1 moves each weight by 0.1 against its gradient's
    sign: w = (0.1, -0.1), b = 0.1, and L falls to ((0.4 - 1)^2 + (-0.2 + 1)^2) / 2 = 0.5."""
    batch = _hand_batch()
    params = {"w_E": jnp.asarray([0.5, -1.0]), "b": jnp.asarray(0.25)}
    np.testing.assert_allclose(np.asarray(batch.contributions(params)), [[[0.25, 0.75], [-2.25, 0.0]]], rtol=1e-6)
    assert float(batch.loss(params)) == pytest.approx(0.78125, rel=1e-6)

    state = init_progress_state(TrainableScorerConfig(learning_rate=0.1, updates=1), hidden_size=2)
    new, m = jax.jit(scorer_update)(state, batch)
    # Adam's first step is lr * g / (|g| + eps) with fp32 bias corrections (1 - 0.999 is not exact in fp32):
    # 0.1 to ~7e-6 relative
    np.testing.assert_allclose(np.asarray(new.params["w_E"]), [0.1, -0.1], rtol=2e-5)
    assert float(new.params["b"]) == pytest.approx(0.1, rel=2e-5)
    assert float(m["loss"]) == pytest.approx(1.0, rel=1e-6) and float(m["loss_after"]) == pytest.approx(0.5, rel=1e-5)
    assert float(m["grad_norm"]) == pytest.approx(np.sqrt(16 + 1 + 1), rel=1e-6)  # |(-4, 1, -1)|
    assert int(new.step) == 1 and int(state.step) == 0  # pure: the input state is unchanged


def _signal_batch(seed=0, P=3, W=4, D=3, E=8):
    """Outcomes a linear head can fit: R = sum over a leaf's steps of a fixed linear function of h."""
    rng = np.random.default_rng(seed)
    h = rng.normal(size=(P, W, D, E)).astype(np.float32)
    on = np.arange(D)[None, None, :] < rng.integers(1, D + 1, size=(P, W))[..., None]
    w_true = rng.normal(size=E).astype(np.float32) * 0.3
    R = np.sum(np.where(on, h @ w_true, 0.0), -1).astype(np.float32)
    return ProgressBatch(jnp.asarray(h), jnp.asarray(on), jnp.asarray(R), jnp.ones((P, W), bool)), E


def test_update_moves_the_head_and_the_loss_falls_on_a_fixed_batch():
    batch, E = _signal_batch()
    state = init_progress_state(TrainableScorerConfig(learning_rate=0.02, updates=3), E)
    update = jax.jit(scorer_update)
    losses = []
    for _ in range(8):
        state, m = update(state, batch)
        losses.append(float(m["loss"]))
        assert float(m["loss_after"]) < float(m["loss"])
    assert all(b < a for a, b in zip(losses, losses[1:])) and losses[-1] < 0.05 * losses[0]
    assert int(state.step) == 8 and float(jnp.abs(state.params["w_E"]).sum()) > 0


def test_scorer_state_round_trips_through_a_checkpoint(tmp_path):
    """A scorer state in ``TrainState.aux`` saved by the run's Checkpointer restores to equal arrays, and the
    restored state's next update equals the saved one's (params, optimizer moments and metrics)."""
    from treejax.checkpoint import Checkpointer, abstract_state_with_shardings
    from treejax.rl.train_state import TrainState
    import optax

    batch, E = _signal_batch(1)
    cfg = TrainableScorerConfig(learning_rate=0.02, updates=2, weight_decay=0.01)
    scorer = init_progress_state(cfg, E)
    for _ in range(3):
        scorer, _ = scorer_update(scorer, batch)
    opt = optax.adam(1e-3)
    state = TrainState.create({"w": jnp.arange(3.0)}, opt, aux={"spa_rl": scorer})
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(3, state, {"rl_step": 3}, force=True)
    fresh = TrainState.create({"w": jnp.zeros(3)}, opt, aux={"spa_rl": init_progress_state(cfg, E)})
    with Checkpointer(tmp_path / "ck") as ck:
        restored, data = ck.restore(abstract_state_with_shardings(jax.eval_shape(lambda: fresh)))
    assert data["rl_step"] == 3 and isinstance(restored.aux["spa_rl"], ScorerState)
    assert restored.aux["spa_rl"].config == cfg and int(restored.aux["spa_rl"].step) == 3
    for a, b in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
    n1, m1 = scorer_update(restored.aux["spa_rl"], batch)
    n2, m2 = scorer_update(scorer, batch)
    for a, b in zip(jax.tree.leaves((n1, m1)), jax.tree.leaves((n2, m2))):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


def test_a_checkpoint_without_the_scorer_restores_with_a_fresh_one(tmp_path):
    """A run's checkpoint written before the scorer existed (``aux = {}``) restores its params, optimizer state
    and step, and the scorer from ``new_aux``; without ``new_aux`` the missing entry is a one-line error."""
    from treejax.checkpoint import Checkpointer, abstract_state_with_shardings
    from treejax.rl.train_state import TrainState
    import optax

    opt = optax.adam(1e-3)
    old = TrainState.create({"w": jnp.arange(3.0)}, opt).replace(step=jnp.asarray(5, jnp.int32))
    with Checkpointer(tmp_path / "ck") as ck:
        ck.save(5, old, {"rl_step": 5}, force=True)
    head = init_progress_state(TrainableScorerConfig(), 4)
    new = TrainState.create({"w": jnp.zeros(3)}, opt, aux={"spa_rl": head})
    abstract = abstract_state_with_shardings(jax.eval_shape(lambda: new))
    with Checkpointer(tmp_path / "ck") as ck:
        with pytest.raises(ValueError, match=r"holds no state for \['spa_rl'\].*new_aux"):
            ck.restore(abstract)
        restored, _ = ck.restore(abstract, new_aux=new.aux)
    np.testing.assert_array_equal(np.asarray(restored.params["w"]), [0.0, 1.0, 2.0])
    assert int(restored.step) == 5
    assert jax.tree.structure(restored) == jax.tree.structure(new)
    for a, b in zip(jax.tree.leaves(restored.aux), jax.tree.leaves(new.aux)):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))


@pytest.mark.parametrize("field, value, fix", [("learning_rate", 0.0, "learning_rate = 1e-3"),
                                               ("updates", 0, "updates = 4"),
                                               ("max_grad_norm", -1.0, "max_grad_norm = 1.0"),
                                               ("weight_decay", -0.1, "weight_decay = 0.0")])
def test_config_errors_are_one_line_with_the_fix(field, value, fix):
    with pytest.raises(ConfigError, match=f"TrainableScorerConfig.{field}.*fix: TrainableScorerConfig.{fix}$") as e:
        TrainableScorerConfig(**{field: value})
    assert "\n" not in str(e.value)
