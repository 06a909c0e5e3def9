"""OPRL: an implicit process reward trained by trajectory DPO, alternately with the policy; its step rewards become
step advantages added to the outcome advantage.

Source: Liu, Wang, Wu, Huang, Li, Zhang, Jiao 2025, "Online Process Reward Learning for Agentic Reinforcement
Learning", arXiv 2509.19199 (no official code was found). The method: an implicit PRM ``pi_phi`` (a language
model) gives step ``k``'s reward ``r_k = beta log pi_phi(a_k | s_k) / pi_old(a_k | s_k)``; it is trained online,
alternating with the policy, by DPO on trajectory pairs ranked by their outcome,

    J(phi) = -E[(tau+, tau-)] log sigmoid(beta log pi_phi(tau+) / pi_old(tau+) - beta log pi_phi(tau-) / pi_old(tau-)),

and the step rewards give step-level advantages that are combined with the episode-level (outcome) advantages.

Here (``RunConfig.shapers = [@OPRLShaping()]``; one stateful shaper, its head in ``TrainState.aux["oprl"]``,
checkpointed with the run), after the estimator and the trainer's forward under the pre-update weights:

1. per response token ``t``, ``z_t = w . h_t`` (``h_t``: the last-layer hidden state at the token, detached) stands
   for the log-ratio ``log pi_phi(y_t) / pi_old(y_t)``; a leaf's implicit reward is ``s = beta sum_t z_t``;
2. the head takes ``updates`` AdamW steps on the trajectory DPO loss over every pair of a prompt's leaves with
   ``R_i > R_j`` (:class:`treejax.scorers.trainable.PreferenceBatch`: ``mean_pairs -log sigmoid(s_i - s_j)``);
3. with the updated head, step ``k``'s reward is ``r_k = beta sum_{t in step k} z_t`` (steps: the tree's segments,
   or blocks of ``step_length`` tokens), whitened over the batch's steps into ``a_k``, and

       A'_t = A_t + step_coef * a_{k(t)}         A_t: the estimator's (outcome) advantage, k(t) = floor(t / S)

Reconstructed, said plainly:

* the PRM is a linear head on the policy's own detached hidden states, not a second language model: ``z_t`` is an
  unnormalised scalar where the paper has the log-ratio of two normalised policies (so the paper's guarantee that
  the step rewards are potential-based shaping does not carry over); ``pi_old`` is the policy that sampled the
  step's rollouts, whose hidden states the head reads;
* the step advantage's normalisation (whitening over the batch's steps) and the combination ``A + step_coef a``
  (GiGPO's form, which the paper builds on) are our choices; the paper's exact normalisation was not read;
* steps are segments, not agent turns (multi-turn chains refuse shapers); every leaf slot weighs 1, so
  ``RunConfig.leaf_weighting = 'mass'`` is refused.

Metrics (``shaping/oprl/...``): ``loss`` / ``loss_after`` (the DPO loss before and after this step's updates),
``grad_norm``, ``pairs`` (preference pairs), ``pair_accuracy`` (pairs the updated head ranks right),
``step_reward_mean``.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp

from treejax.errors import ConfigError
from treejax.rl.shaping.base import Shaped, Shaper, ShapingInputs, masked_mean, register
from treejax.rl.shaping.spa import check_steps, whiten_steps
from treejax.scorers.trainable import PreferenceBatch, ScorerState, TrainableScorerConfig, init_implicit_state, \
    scorer_update


def preference_batch(x: ShapingInputs, beta: float) -> PreferenceBatch:
    """The implicit head's batch of one step: every response token of the leaves with trained tokens."""
    token_on = x.t < x.leaf_length[..., None]
    leaf_on = jnp.any(x.on, axis=-1) & (x.leaf_length > 0)
    return PreferenceBatch(hidden_PxWxTxE=jax.lax.stop_gradient(x.hidden), token_on_PxWxT=token_on & leaf_on[..., None],
                           outcome_PxW=x.rewards, leaf_on_PxW=leaf_on, beta=beta)


def step_rewards(token_rewards_PxWxT: jax.Array, leaf_length_PxW: jax.Array, step_length: int
                 ) -> tuple[jax.Array, jax.Array]:
    """``(r [P, W, D], step_on [P, W, D])``: the token rewards summed over each step of ``step_length`` tokens."""
    P, W, T = token_rewards_PxWxT.shape
    D = -(-T // step_length)
    padded = jnp.pad(token_rewards_PxWxT, ((0, 0), (0, 0), (0, D * step_length - T)))
    r = jnp.sum(padded.reshape(P, W, D, step_length), axis=-1)
    step_on = jnp.arange(D, dtype=jnp.int32)[None, None, :] * step_length < leaf_length_PxW[..., None]
    return r, step_on


@register("oprl")
@dataclasses.dataclass(frozen=True)
class OPRLShaping(Shaper):
    """OPRL's implicit step rewards as step advantages (module docstring). gin::

        RunConfig.shapers = [@OPRLShaping()]
        OPRLShaping.scorer = @TrainableScorerConfig()
        OPRLShaping.beta = 0.1            # DPO's temperature
        OPRLShaping.step_coef = 1.0       # A' = A + step_coef x whitened step reward

    ``step_length``: tokens per step (``None``: the tree's segments)."""

    needs = ("hidden",)
    stateful = True
    scorer: TrainableScorerConfig = dataclasses.field(default_factory=TrainableScorerConfig)
    beta: float = 0.1
    step_coef: float = 1.0
    step_length: int | None = None

    def __post_init__(self):
        if not isinstance(self.scorer, TrainableScorerConfig):
            raise ConfigError(f"OPRLShaping.scorer must be a TrainableScorerConfig, got {self.scorer!r}; fix: "
                              "OPRLShaping.scorer = @TrainableScorerConfig()")
        if not self.beta > 0:
            raise ConfigError(f"OPRLShaping.beta must be > 0 (DPO's temperature), got {self.beta}; fix: "
                              "OPRLShaping.beta = 0.1")
        if not self.step_coef >= 0:
            raise ConfigError(f"OPRLShaping.step_coef must be >= 0, got {self.step_coef}; fix: "
                              "OPRLShaping.step_coef = 1.0")
        if self.step_length is not None and self.step_length < 1:
            raise ConfigError(f"OPRLShaping.step_length must be >= 1 or None (the tree's segments), got "
                              f"{self.step_length}; fix: OPRLShaping.step_length = None")

    def check_run(self, cfg) -> None:
        check_steps("OPRLShaping", cfg, self.step_length)

    def init_state(self, hidden_size: int) -> ScorerState:
        return init_implicit_state(self.scorer, hidden_size)

    def shape(self, x: ShapingInputs) -> Shaped:
        raise TypeError("OPRLShaping is stateful: apply it with shape_stateful (apply_shapers does)")

    def shape_stateful(self, x: ShapingInputs, state: Any) -> tuple[Shaped, Any]:
        S = self.step_length or x.segment_length
        batch = preference_batch(x, self.beta)
        state, fit = scorer_update(state, batch)  # the PRM's step first, then the policy's reads it
        tok = batch.token_rewards(state.params)
        r, step_on = step_rewards(tok, x.leaf_length, S)
        step_on = step_on & batch.leaf_on_PxW[..., None]
        a = whiten_steps(r, step_on)
        k = jnp.minimum(x.t[0, 0] // S, r.shape[-1] - 1)
        adv = jnp.where(x.on, x.advantages + self.step_coef * jnp.take(a, k, axis=-1), 0.0)
        s = jnp.sum(tok, axis=-1)
        pairs = batch.pairs()
        right = jnp.sum(jnp.where(pairs, s[:, :, None] > s[:, None, :], False).astype(jnp.float32))
        n = jnp.sum(pairs.astype(jnp.float32))
        metrics = {**fit, "pairs": n, "pair_accuracy": right / jnp.maximum(n, 1.0),
                   "step_reward_mean": masked_mean(r, step_on)}
        return Shaped(adv, x.eps_scale, metrics), state


__all__ = ["OPRLShaping", "preference_batch", "step_rewards"]
