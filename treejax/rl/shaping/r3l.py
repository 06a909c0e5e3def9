"""R3L's Positive Amplification (Shi et al. 2026, *R3L: Reflect-then-Retry Reinforcement Learning with
Language-Guided Exploration, Pivotal Credit, and Positive Amplification*, arXiv 2601.03715; official code
``shiweijiezero/R3L``, whose trainer names the rule ``opmd_reweight_adv``; the reweighting function itself lives in
the Trinity-RFT package it builds on and could not be read).

The abstract's rule: "Positive Amplification upweights successful trajectories to ensure positive signals guide
the optimization process" (failures dominate hard tasks, and the retried rows are off-policy). **Reconstructed**
as a constant factor ``alpha >= 1`` on every token advantage of a successful leaf::

    A'_t = alpha * A_t    if the leaf is correct (verifier score >= 1; R3L's successful retries included)
    A'_t = A_t            otherwise

With GRPO's group baseline a correct leaf's advantage is positive (binary rewards), so this scales exactly the
positive signals; ``alpha = 1`` is the identity (tested). Successes are ``ShapingInputs.scores``
(``Rollouts.correct_PxW``: the reward's scores, which :class:`~treejax.rl.judges.r3l.R3LConfig` sets for its
retried rows). Metrics: ``shaping/r3l_amplify/amplified`` (correct leaves with a trained token),
``positive_share_before`` / ``positive_share_after`` (the share of ``sum |A|`` on positive advantages).
"""

from __future__ import annotations

import dataclasses

import jax.numpy as jnp

from treejax.errors import ConfigError
from treejax.rl.shaping.base import Shaped, Shaper, ShapingInputs, register


def positive_share(adv, on):
    """``sum_{A > 0} |A| / sum |A|`` over the trained pairs (0 when all are 0)."""
    a = jnp.where(on, adv.astype(jnp.float32), 0.0)
    return jnp.sum(jnp.maximum(a, 0.0)) / jnp.maximum(jnp.sum(jnp.abs(a)), 1e-12)


@register("r3l_amplify")
@dataclasses.dataclass(frozen=True)
class PositiveAmplification(Shaper):
    """R3L's Positive Amplification (module docstring): ``A' = factor * A`` on correct leaves. gin:
    ``RunConfig.shapers = [@PositiveAmplification()]``, ``PositiveAmplification.factor = 2.0``."""

    factor: float = 2.0

    def __post_init__(self):
        if not 1.0 <= self.factor <= 100.0:
            raise ConfigError(f"PositiveAmplification.factor must be in [1, 100] (1: no amplification), got "
                              f"{self.factor}; fix: PositiveAmplification.factor = 2.0")

    def shape(self, x: ShapingInputs) -> Shaped:
        on = x.on
        success_PxW = x.scores >= 1.0
        scale = jnp.where(success_PxW, jnp.float32(self.factor), jnp.float32(1.0))[..., None]
        adv = jnp.where(on, x.advantages * scale, 0.0)
        metrics = {"amplified": jnp.sum(success_PxW & jnp.any(on, axis=-1)),
                   "positive_share_before": positive_share(x.advantages, on),
                   "positive_share_after": positive_share(adv, on)}
        return Shaped(adv, x.eps_scale, metrics)


__all__ = ["PositiveAmplification", "positive_share"]
