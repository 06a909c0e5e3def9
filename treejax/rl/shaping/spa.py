"""SPA-RL: a progress estimator, trained alternately with the policy, whose per-step contributions sum to the
outcome; the contributions become step-level advantages.

Source: Wang, Leong, Wang, Wang, Li 2025, "SPA-RL: Reinforcing LLM Agents via Stepwise Progress Attribution",
arXiv 2505.20732; official code ``WangHanLinHenry/SPA-RL-Agent`` (``prm/train_our_progress_model.py``: the
progress model; ``prm/rl_data_org.py``: the step rewards; ``ppo/``: PPO on them). The method: a *progress
estimator* gives each step ``k`` of a trajectory a contribution ``c_k``, trained so that the contributions add up
to the trajectory's outcome; each step's reward in RL is its contribution plus a grounding signal.

Here, per RL step (``RunConfig.shapers = [@SPARLShaping()]``; one stateful shaper, its head in
``TrainState.aux["spa_rl"]``, checkpointed with the run), after the estimator and the trainer's forward under the
pre-update weights:

1. steps = the response's segments (``step_length = None``: ``Forest.segment_length``, a rollout tree's nodes;
   else blocks of ``step_length`` tokens); ``h_k`` = the last-layer hidden state at step ``k``'s last token
   (``Shaper.needs = ("hidden",)``: the same trainer forward, detached);
2. the progress head (:mod:`treejax.scorers.trainable`) takes ``updates`` AdamW steps on
   ``L = mean_leaves (sum_k c_k - R)^2``, ``c_k = w . h_k + b``, ``R`` the estimator's reward of the leaf
   (``scorer_update``: the scorer's update, then the policy's, every RL step);
3. with the updated head, the step advantage is the contribution whitened over the step's batch of steps, and a
   token's advantage mixes it with the estimator's (outcome) advantage of the token:

       a_k  = (c_k - mean(c)) / sqrt(var(c) + 1e-8)      (over every step of every trained leaf; var: Bessel)
       A'_t = (1 - outcome_mix) * a_{k(t)} + outcome_mix * A_t        k(t) = floor(t / step_length)

``outcome_mix = 0`` is SPA's step advantages alone, ``1`` the estimator's unchanged (the head still trains).

Reconstructed vs the paper and its code (said plainly):

* the official progress model is the SFT backbone fine-tuned offline (MSE of the summed turn values against the
  final reward) before RL, then frozen; here a linear head on the policy's own detached hidden states trains
  online, alternating with the policy (issue 47's form). The official head is ``Linear(vocab, 1)`` on the
  logits at each turn's end, a linear function of the hidden state, as here;
* the official step reward is ``c_k + g_k`` with a grounding signal ``g_k`` (0.5 when the environment accepted
  the action, 0 for "Nothing happens", 0.5 at the last step) fed to PPO with a learned critic. Single-turn math
  has no environment to ground actions, so ``g = 0``; treejax has no critic, so the step reward becomes the
  step's advantage directly: with contributions whose sum is the return (a reward redistribution, RUDDER's
  argument), the expected reward still to come after a step is 0, so the step's own reward is its advantage;
  the batch whitening stands in for the critic's baseline and scale, and the outcome mix keeps the verifier's
  group-relative signal (the issue's "optionally mixed with the outcome");
* steps are the tree's segments, not agent turns (multi-turn chains refuse shapers: ``NO_SHAPERS``); every leaf
  slot weighs 1 in the regression and the whitening, so ``RunConfig.leaf_weighting = 'mass'`` is refused.

A property to know: the sum constraint spreads a leaf's outcome over its steps, so when every leaf fails alike a
short leaf's steps carry more of the outcome each (``R / K``) than a long leaf's, and the whitened step advantages
favour longer responses; ``outcome_mix`` dilutes it.

Metrics (``shaping/spa_rl/...``): ``loss`` / ``loss_after`` (the regression before and after this step's
updates), ``grad_norm``, ``contribution_mean``, ``outcome_abs_error`` (mean ``|sum_k c_k - R|`` after),
``steps`` (steps in the whitening).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from treejax.errors import ConfigError
from treejax.rl.shaping.base import Shaped, Shaper, ShapingInputs, masked_mean, register
from treejax.scorers.trainable import (ProgressBatch, ScorerState, TrainableScorerConfig, init_progress_state,
                                       scorer_update)


def check_steps(name: str, cfg, step_length: int | None) -> None:
    """What a step-attributing shaper (SPA-RL, OPRL) needs of the run ``cfg`` (a ``RunConfig``): leaf slots that
    weigh 1 each, and responses of at least two steps; else one :class:`ConfigError` line with the fix."""
    if cfg.leaf_weighting != "count":
        raise ConfigError(f"{name} weighs every leaf slot once in its scorer's loss and its step whitening, not by "
                          f"path mass (RunConfig.leaf_weighting = {cfg.leaf_weighting!r}); fix: "
                          "RunConfig.leaf_weighting = 'count'")
    S = step_length or cfg.rollout.segment_length
    if -(-cfg.rollout.max_length // S) < 2:
        raise ConfigError(f"{name} attributes the outcome to a response's steps, but a response of at most "
                          f"{cfg.rollout.max_length} tokens is one step of {S}; fix: TreeConfig.max_depth >= 2 (or "
                          f"{name}.step_length below the response length)")


def progress_batch(x: ShapingInputs, step_length: int) -> ProgressBatch:
    """The progress head's batch of one step: each leaf's steps of ``step_length`` response tokens (the last one
    partial), the hidden state at each step's last token, the leaf's reward; a leaf without trained tokens (a
    filler row, an unused slot) is off."""
    T = x.loss_mask.shape[-1]
    D = -(-T // step_length)
    k = jnp.arange(D, dtype=jnp.int32)[None, None, :]
    length = x.leaf_length[..., None]
    leaf_on = jnp.any(x.on, axis=-1) & (x.leaf_length > 0)
    step_on = (k * step_length < length) & leaf_on[..., None]
    end = jnp.clip(jnp.minimum((k + 1) * step_length, length) - 1, 0, T - 1)  # each step's last token
    hidden = jax.lax.stop_gradient(x.hidden)
    h = jnp.take_along_axis(hidden, end[..., None], axis=2)  # [P, W, D, E]
    return ProgressBatch(hidden_PxWxDxE=h, step_on_PxWxD=step_on, outcome_PxW=x.rewards, leaf_on_PxW=leaf_on)


def whiten_steps(c_PxWxD: jax.Array, step_on_PxWxD: jax.Array, eps: float = 1e-8) -> jax.Array:
    """``(c - mean) / sqrt(var + eps)`` over the steps on (``var`` with Bessel's correction); 0 off them."""
    on = step_on_PxWxD
    n = jnp.sum(on.astype(jnp.float32))
    mu = masked_mean(c_PxWxD, on)
    var = jnp.sum(jnp.where(on, jnp.square(c_PxWxD - mu), 0.0)) / jnp.maximum(n - 1.0, 1.0)
    return jnp.where(on, (c_PxWxD - mu) * jax.lax.rsqrt(var + eps), 0.0)


def spa_token_advantages(adv_PxWxT: jax.Array, on_PxWxT: jax.Array, step_adv_PxWxD: jax.Array, step_length: int,
                         outcome_mix: float) -> jax.Array:
    """``A'_t = (1 - outcome_mix) a_{floor(t / step_length)} + outcome_mix A_t`` on the trained tokens, 0 off."""
    T, D = adv_PxWxT.shape[-1], step_adv_PxWxD.shape[-1]
    k = jnp.minimum(jnp.arange(T, dtype=jnp.int32) // step_length, D - 1)
    a_t = jnp.take(step_adv_PxWxD, k, axis=-1)
    return jnp.where(on_PxWxT, (1.0 - outcome_mix) * a_t + outcome_mix * adv_PxWxT, 0.0)


@register("spa_rl")
@dataclasses.dataclass(frozen=True)
class SPARLShaping(Shaper):
    """SPA-RL's progress estimator and step advantages (module docstring). gin::

        RunConfig.shapers = [@SPARLShaping()]
        SPARLShaping.scorer = @TrainableScorerConfig()
        TrainableScorerConfig.learning_rate = 1e-3      # the head's own AdamW step (not the policy's)
        SPARLShaping.outcome_mix = 0.5                  # 0: step advantages only; 1: the estimator's only

    ``step_length``: tokens per step (``None``: the tree's segments)."""

    needs = ("hidden",)
    stateful = True
    scorer: TrainableScorerConfig = dataclasses.field(default_factory=TrainableScorerConfig)
    outcome_mix: float = 0.5
    step_length: int | None = None

    def __post_init__(self):
        if not isinstance(self.scorer, TrainableScorerConfig):
            raise ConfigError(f"SPARLShaping.scorer must be a TrainableScorerConfig, got {self.scorer!r}; fix: "
                              "SPARLShaping.scorer = @TrainableScorerConfig()")
        if not 0.0 <= self.outcome_mix <= 1.0:
            raise ConfigError(f"SPARLShaping.outcome_mix must be in [0, 1] (the estimator's share of each token's "
                              f"advantage), got {self.outcome_mix}; fix: SPARLShaping.outcome_mix = 0.5")
        if self.step_length is not None and self.step_length < 1:
            raise ConfigError(f"SPARLShaping.step_length must be >= 1 or None (the tree's segments), got "
                              f"{self.step_length}; fix: SPARLShaping.step_length = None")

    def check_run(self, cfg) -> None:
        check_steps("SPARLShaping", cfg, self.step_length)

    def init_state(self, hidden_size: int) -> ScorerState:
        return init_progress_state(self.scorer, hidden_size)

    def shape(self, x: ShapingInputs) -> Shaped:
        raise TypeError("SPARLShaping is stateful: apply it with shape_stateful (apply_shapers does)")

    def shape_stateful(self, x: ShapingInputs, state: Any) -> tuple[Shaped, Any]:
        S = self.step_length or x.segment_length
        batch = progress_batch(x, S)
        state, fit = scorer_update(state, batch)  # the scorer's step first, then the policy's reads it
        c = batch.contributions(state.params)
        step_adv = whiten_steps(c, batch.step_on_PxWxD)
        adv = spa_token_advantages(x.advantages, x.on, step_adv, S, self.outcome_mix)
        err = jnp.abs(jnp.sum(c, axis=-1) - batch.outcome_PxW)
        metrics = {**fit, "contribution_mean": masked_mean(c, batch.step_on_PxWxD),
                   "outcome_abs_error": masked_mean(err, batch.leaf_on_PxW),
                   "steps": jnp.sum(batch.step_on_PxWxD.astype(jnp.float32))}
        return Shaped(adv, x.eps_scale, metrics), state


__all__ = ["SPARLShaping", "check_steps", "progress_batch", "whiten_steps", "spa_token_advantages"]
