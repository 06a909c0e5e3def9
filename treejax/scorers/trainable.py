"""A trainable scorer (issue 47, part (c)): a head with its own parameters and optax state, updated alternately
with the policy, one pure function per update.

    state            = init_progress_state(TrainableScorerConfig(...), hidden_size)
    state, metrics   = scorer_update(state, batch)          # `updates` optax steps on one batch, jit-able

The state is explicit (:class:`ScorerState`: ``params``, ``opt_state``, ``step``, and its static
:class:`TrainableScorerConfig`); the batch says what is fitted (:class:`ProgressBatch`: its ``loss(params)``), so
the same update serves every objective written as a batch (:class:`PreferenceBatch`: OPRL's trajectory DPO on
an implicit reward head, below the progress head). In a run the state lives in ``TrainState.aux[name]``
of the shaper that trains it (:mod:`treejax.rl.shaping.spa`) and is written to and restored from the run's orbax
checkpoint with the policy's state; a checkpoint written before the scorer existed restores with a freshly
initialised scorer (:meth:`treejax.checkpoint.Checkpointer.restore`, ``new_aux``).

**The progress head** (SPA-RL's progress estimator, :class:`ProgressBatch`). A response is cut into steps
``k = 0 .. K-1`` (a rollout tree's segments); ``h_k [E]`` is the last-layer hidden state (after the final norm)
at step ``k``'s last token, detached from the policy. The head is linear:

    c_k    = w . h_k + b                       (w_E, b: fp32, zero at the start)
    R_hat  = sum_{k < K} c_k                   (the trajectory's predicted outcome)
    L(w,b) = mean over leaves of (R_hat - R)^2 (R: the leaf's outcome reward)

i.e. the contributions are fitted so that their sum regresses the outcome (SPA-RL, Wang et al. 2025, arXiv
2505.20732, the progress estimator's objective; official code ``WangHanLinHenry/SPA-RL-Agent``
``prm/train_our_progress_model.py``: a ``Linear(vocab, 1)`` on the backbone's logits at each turn's last token,
summed over the turns, MSE against the final reward). With a frozen backbone a linear map of the logits ``E_out
h`` is a linear map of ``h`` (``u . E_out h = (E_out^T u) . h``), so the head here is the official head's family
on the hidden state itself (every ``w`` reachable when the vocabulary spans ``R^E``). Reconstructed: the official
progress model fine-tunes the whole backbone offline on explored trajectories before RL; here only the head
trains, online, on each step's rollouts, reading the policy's own trainer-pass hidden states (no second model, no
second forward).

Optimizer: ``clip_by_global_norm(max_grad_norm)`` then AdamW(``learning_rate``, ``weight_decay``), ``updates``
full-batch steps per call. Nothing here imports :mod:`treejax.rl`.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
import optax
from flax import struct

from treejax.errors import ConfigError


@dataclasses.dataclass(frozen=True)
class TrainableScorerConfig:
    """The trainable scorer's optimizer (gin: ``SPARLShaping.scorer = @TrainableScorerConfig()``).

    ``learning_rate``: its own AdamW step size (apart from the policy's ``OptimizerConfig.learning_rate``);
    ``updates``: full-batch optimizer steps per RL step; ``max_grad_norm``: the global-norm clip of its gradient;
    ``weight_decay``: AdamW's decoupled decay."""

    learning_rate: float = 1e-3
    updates: int = 4
    max_grad_norm: float = 1.0
    weight_decay: float = 0.0

    def __post_init__(self):
        if not self.learning_rate > 0:
            raise ConfigError(f"TrainableScorerConfig.learning_rate must be > 0, got {self.learning_rate}; fix: "
                              "TrainableScorerConfig.learning_rate = 1e-3")
        if self.updates < 1:
            raise ConfigError(f"TrainableScorerConfig.updates must be >= 1 (optimizer steps per RL step), got "
                              f"{self.updates}; fix: TrainableScorerConfig.updates = 4")
        if not self.max_grad_norm > 0:
            raise ConfigError(f"TrainableScorerConfig.max_grad_norm must be > 0, got {self.max_grad_norm}; fix: "
                              "TrainableScorerConfig.max_grad_norm = 1.0")
        if self.weight_decay < 0:
            raise ConfigError(f"TrainableScorerConfig.weight_decay must be >= 0, got {self.weight_decay}; fix: "
                              "TrainableScorerConfig.weight_decay = 0.0")

    def optimizer(self) -> optax.GradientTransformation:
        return optax.chain(optax.clip_by_global_norm(self.max_grad_norm),
                           optax.adamw(self.learning_rate, weight_decay=self.weight_decay))


@struct.dataclass
class ScorerState:
    """A trainable scorer's state (module docstring): one pytree, jitted, checkpointed.

    ``params``: the head (``{"w_E": [E], "b": []}`` for the progress head, fp32); ``opt_state``: its optax state
    (:meth:`TrainableScorerConfig.optimizer`); ``step``: int32 number of :func:`scorer_update` calls; ``config``:
    static (not a leaf: part of the tree structure, so a restored state updates with the saved settings)."""

    params: Any
    opt_state: Any
    step: jax.Array
    config: TrainableScorerConfig = struct.field(pytree_node=False, default_factory=TrainableScorerConfig)


def init_progress_state(config: TrainableScorerConfig, hidden_size: int) -> ScorerState:
    """A zero progress head on ``hidden_size``-wide hidden states (every contribution 0) and its fresh optimizer
    state."""
    params = {"w_E": jnp.zeros((hidden_size,), jnp.float32), "b": jnp.zeros((), jnp.float32)}
    return ScorerState(params=params, opt_state=config.optimizer().init(params), step=jnp.zeros((), jnp.int32),
                       config=config)


def progress_contributions(params: dict, hidden_PxWxDxE: jax.Array, step_on_PxWxD: jax.Array) -> jax.Array:
    """float32 ``[P, W, D]``: ``c_k = w . h_k + b`` on the steps that exist, 0 past a leaf's last step."""
    c = jnp.einsum("pwde,e->pwd", hidden_PxWxDxE.astype(jnp.float32), params["w_E"]) + params["b"]
    return jnp.where(step_on_PxWxD, c, 0.0)


@struct.dataclass
class ProgressBatch:
    """What the progress head fits in one step (module docstring).

    ``hidden_PxWxDxE``: the hidden state at each step's last token (detached; anything past a leaf's steps is
    ignored); ``step_on_PxWxD``: the step exists; ``outcome_PxW``: the leaf's outcome reward ``R``;
    ``leaf_on_PxW``: the leaf enters the loss (a leaf with steps and trained tokens)."""

    hidden_PxWxDxE: jax.Array
    step_on_PxWxD: jax.Array
    outcome_PxW: jax.Array
    leaf_on_PxW: jax.Array

    def contributions(self, params: dict) -> jax.Array:
        return progress_contributions(params, self.hidden_PxWxDxE, self.step_on_PxWxD)

    def loss(self, params: dict) -> jax.Array:
        """``mean over leaves on of (sum_k c_k - R)^2`` (0 when no leaf is on)."""
        err = jnp.sum(self.contributions(params), axis=-1) - self.outcome_PxW.astype(jnp.float32)
        on = self.leaf_on_PxW.astype(jnp.float32)
        return jnp.sum(on * jnp.square(err)) / jnp.maximum(jnp.sum(on), 1.0)


def init_implicit_state(config: TrainableScorerConfig, hidden_size: int) -> ScorerState:
    """A zero implicit-reward head (``{"w_E"}``, no bias: a per-token bias would add ``b x length`` to a
    trajectory's score, a length preference) and its fresh optimizer state."""
    params = {"w_E": jnp.zeros((hidden_size,), jnp.float32)}
    return ScorerState(params=params, opt_state=config.optimizer().init(params), step=jnp.zeros((), jnp.int32),
                       config=config)


@struct.dataclass
class PreferenceBatch:
    """What the implicit reward head fits in one step (OPRL's trajectory DPO, :mod:`treejax.rl.shaping.oprl`).

    Per token ``z_t = w . h_t`` (the head's stand-in for the log-ratio ``log pi_phi(y_t) / pi_old(y_t)``); a
    leaf's implicit reward is ``s = beta sum_t z_t`` over its response tokens; within each prompt, every pair of
    leaves with ``R_i > R_j`` is a preference ``i > j``:

        L = mean over pairs of -log sigmoid(s_i - s_j)          (0 when a prompt has no such pair)

    ``hidden_PxWxTxE``: the hidden state at each response token (detached); ``token_on_PxWxT``: the leaf's
    response tokens; ``outcome_PxW``: ``R``; ``leaf_on_PxW``: the leaf enters the pairs; ``beta``: static."""

    hidden_PxWxTxE: jax.Array
    token_on_PxWxT: jax.Array
    outcome_PxW: jax.Array
    leaf_on_PxW: jax.Array
    beta: float = struct.field(pytree_node=False, default=0.1)

    def token_rewards(self, params: dict) -> jax.Array:
        """float32 ``[P, W, T]``: ``beta z_t`` on the response tokens, 0 elsewhere."""
        z = jnp.einsum("pwte,e->pwt", self.hidden_PxWxTxE.astype(jnp.float32), params["w_E"])
        return jnp.where(self.token_on_PxWxT, self.beta * z, 0.0)

    def pairs(self) -> jax.Array:
        """bool ``[P, W, W]``: ``pairs[p, i, j]`` iff leaves ``i`` and ``j`` of prompt ``p`` are on and ``R_i >
        R_j``."""
        r, on = self.outcome_PxW, self.leaf_on_PxW
        return (r[:, :, None] > r[:, None, :]) & on[:, :, None] & on[:, None, :]

    def loss(self, params: dict) -> jax.Array:
        s = jnp.sum(self.token_rewards(params), axis=-1)
        pref = self.pairs().astype(jnp.float32)
        nll = jax.nn.softplus(-(s[:, :, None] - s[:, None, :]))  # -log sigmoid(s_i - s_j)
        return jnp.sum(pref * nll) / jnp.maximum(jnp.sum(pref), 1.0)


def scorer_update(state: ScorerState, batch: Any) -> tuple[ScorerState, dict]:
    """``state.config.updates`` optimizer steps of ``batch.loss`` from ``state``; pure (jit-able, no host reads).

    Returns the new state (``step + 1``) and scalar metrics: ``loss`` (before the first step), ``loss_after``
    (after the last) and ``grad_norm`` (of the first step's gradient, before clipping)."""
    tx = state.config.optimizer()
    loss_grad = jax.value_and_grad(batch.loss)

    def one(carry, _):
        params, opt_state = carry
        loss, g = loss_grad(params)
        upd, opt_state = tx.update(g, opt_state, params)
        return (optax.apply_updates(params, upd), opt_state), (loss, optax.tree.norm(g))

    (params, opt_state), (losses, norms) = jax.lax.scan(one, (state.params, state.opt_state), None,
                                                        length=state.config.updates)
    metrics = {"loss": losses[0], "loss_after": batch.loss(params), "grad_norm": norms[0]}
    return state.replace(params=params, opt_state=opt_state, step=state.step + 1), metrics


__all__ = ["TrainableScorerConfig", "ScorerState", "ProgressBatch", "PreferenceBatch", "init_progress_state",
           "init_implicit_state", "progress_contributions", "scorer_update"]
