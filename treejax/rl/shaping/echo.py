"""ECHO's training-side shaping: entropy-confidence advantage shaping and a per-sample clip range.

Source: ECHO (arXiv 2602.02150), code ``user683/ECHO`` at 6f7b311: ``verl/trainer/ppo/core_algos.py::
apply_hybrid_advantage_shaping`` / ``_compute_tail_confidence`` and ``verl/workers/actor/dp_actor.py::
_compute_topk_confidence`` (defaults from ``verl/trainer/config/ppo_trainer.yaml``, ``algorithm.hybrid_adv``).
Both signals come from the trainer's no-gradient forward that recomputes the old log-probs (never the sampler),
per trained token ``t`` of leaf ``i``::

    H_t      entropy of the next-token distribution
    C_t      top-k confidence: the mean of the k = 5 largest probabilities, (1/k) sum_{j<=k} p_(j)   (<= 1/k)
             (confidence = "topk_prob"); the code's fallback when its fused kernels are on -- the setting of its
             released TTRL scripts -- is the sampled token's probability C_t = exp(log p(y_t))
             (confidence = "sampled_prob")
    S_t      = clip(alpha whiten(H)_t + beta whiten(1 - C)_t, -s_max, s_max)
             whiten: (x - mean) / sqrt(var + 1e-8) over every trained token of the step, Bessel-corrected var
    A'_t     = A_t (1 + m S_t) + a (S_t - mean_{group} S)        every token, whatever the sign of A
             mean_{group}: token-pooled over all trained tokens of the prompt's leaves

Per-sample clip range (``adaptive_clip``): the tail confidence ``C_tail,i`` is the mean of ``C_t`` over leaf
``i``'s last ``tail_window`` = 16 trained tokens (all of them when shorter), clipped to [0, 1], and

    eps_i = eps_min + (eps_max - eps_min) sigmoid(kappa (1 - C_tail,i)),   eps_min 0.05, eps_max 0.2, kappa 4

ECHO uses ``eps_i`` for both sides of the clip. treejax's loss multiplies ``LossConfig.eps_low`` / ``eps_high`` by a
per-leaf scale, so the shaper sets ``scale_i = eps_i / eps_max``: with ECHO's symmetric 0.2 / 0.2 clip this is
exactly ``eps_i`` on both sides; with clip-higher (0.2 / 0.28) both sides shrink by the same factor. Defaults are
the code's: ``alpha = beta = 1``, ``s_max = 2``, ``m = 0.1``, ``a = 0`` (additive term off), ``k = 5``. With the
top-k-probability confidence ``C <= 0.2``, so ``eps_i`` stays within [0.194, 0.197] (nearly constant); with the
sampled-probability confidence it spans [0.05, 0.2].
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from treejax.choices import check_choice
from treejax.rl.shaping.base import Shaped, Shaper, ShapingInputs, masked_mean, register, whiten

CONFIDENCES = ("topk_prob", "sampled_prob")


def tail_mean(x_PxWxX: jax.Array, on_PxWxX: jax.Array, window: int) -> jax.Array:
    """``[P, W]`` mean of ``x`` over each leaf's last ``window`` pairs that are ``on`` (all of them when fewer)."""
    on = on_PxWxX.astype(jnp.int32)
    from_end = jnp.cumsum(on[..., ::-1], axis=-1)[..., ::-1]  # 1 at the last trained pair, 2 at the one before...
    return masked_mean(x_PxWxX, (on > 0) & (from_end <= window), axis=-1)


@register("echo")
@dataclasses.dataclass(frozen=True)
class EchoShaping(Shaper):
    """ECHO: A (1 + m S) from whitened entropy and top-k confidence, and a per-leaf clip from tail confidence.

    Formulas in the module docstring; ``shaping=False`` keeps only the clip, ``adaptive_clip=False`` only the
    shaping."""

    alpha: float = 1.0
    beta: float = 1.0
    s_max: float = 2.0
    mult_coef: float = 0.1
    add_coef: float = 0.0
    confidence_top_k: int = 5
    confidence: str = "topk_prob"
    shaping: bool = True
    adaptive_clip: bool = True
    tail_window: int = 16
    eps_min: float = 0.05
    eps_max: float = 0.2
    kappa: float = 4.0

    needs = ("entropy", "topk")

    def __post_init__(self):
        check_choice("EchoShaping.confidence", self.confidence, CONFIDENCES)
        if self.confidence_top_k < 1 or self.tail_window < 1:
            raise ValueError("EchoShaping.confidence_top_k and tail_window must be >= 1")
        if not 0 < self.eps_min <= self.eps_max:
            raise ValueError(f"EchoShaping: need 0 < eps_min <= eps_max, got {self.eps_min}, {self.eps_max}")
        if self.s_max <= 0:
            raise ValueError(f"EchoShaping.s_max must be > 0, got {self.s_max}")
        if not (self.shaping or self.adaptive_clip):
            raise ValueError("EchoShaping with shaping=False and adaptive_clip=False does nothing")

    @property
    def top_k(self) -> int:
        return self.confidence_top_k

    def token_confidence(self, x: ShapingInputs) -> jax.Array:
        """``C_t [P, W, X]`` (module docstring), clipped to [0, 1]."""
        if self.confidence == "topk_prob":
            c = jnp.mean(jnp.exp(x.topk_logp[..., : self.confidence_top_k]), axis=-1)
        else:
            c = jnp.exp(x.old_logp)
        return jnp.clip(c, 0.0, 1.0)

    def shape(self, x: ShapingInputs) -> Shaped:
        on = x.on
        conf = jnp.where(on, self.token_confidence(x), 0.0)
        adv, eps_scale, metrics = x.advantages, x.eps_scale, {}
        if self.shaping:
            s = jnp.clip(self.alpha * whiten(x.entropy, on) + self.beta * whiten(1.0 - conf, on), -self.s_max,
                         self.s_max)
            s = jnp.where(on, s, 0.0)
            adv = adv * (1.0 + self.mult_coef * s)
            if self.add_coef:
                group_s = masked_mean(s, on, axis=(1, 2))  # token-pooled per prompt
                adv = adv + self.add_coef * (s - group_s[:, None, None])
            adv = jnp.where(on, adv, 0.0)
            metrics["score_abs_mean"] = masked_mean(jnp.abs(s), on)
            metrics["clip_frac"] = masked_mean((jnp.abs(s) >= self.s_max).astype(jnp.float32), on)
        if self.adaptive_clip:
            tail = jnp.clip(tail_mean(conf, on, self.tail_window), 0.0, 1.0)
            eps = self.eps_min + (self.eps_max - self.eps_min) * jax.nn.sigmoid(self.kappa * (1.0 - tail))
            eps_scale = eps_scale * eps / self.eps_max
            leaf_on = jnp.any(on, axis=-1)
            metrics["eps_mean"] = masked_mean(eps, leaf_on)
        metrics["confidence_mean"] = masked_mean(conf, on)
        return Shaped(adv, eps_scale, metrics)


__all__ = ["EchoShaping", "tail_mean", "CONFIDENCES"]
