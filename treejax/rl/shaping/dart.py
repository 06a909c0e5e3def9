"""DART's training on high-entropy steps only (Li et al. 2025, arXiv 2509.23866, "training selectively on
high-entropy steps to prioritize critical decisions"; code ``Computer-use-agents/dart-gui``).

The released trainer (``verl/trainer/ppo/ray_trainer_async.py``, the old-log-prob pass) holds the rule, commented
out, behind a setting ``entropy_filter`` (the ratio; no shipped script sets it): each training row is one agent
*step* (their step-wise GRPO splits a trajectory into its steps), its score is the mean entropy of its tokens under
the trainer's forward with the pre-update weights, and the ``k = int(ratio * rows)`` rows with the largest score are
the ones the loss keeps. Here, over one step's pool (``rho`` = :attr:`DARTEntropyMask.top_ratio`)::

    unit u (``unit = "step"``: a leaf's response, one agent step of a single-turn task; ``"token"``: one pair)
    H_u   = mean_{t in u, m_t = 1} H_t          (H_t: the trainer pass's entropy, shaping.base.STATS)
    n     = #units with a trained token,   k = max(1, floor(rho n))
    keep_u = 1 iff u is among the k largest H_u (ties: the lower flat index first)
    m_t  <- m_t keep_u(t)                       (numerator and denominator of the loss alike)

``unit = "token"`` is "Beyond the 80/20 rule" (Wang et al. 2025, arXiv 2506.01939: ``rho = 0.2`` over the batch's
tokens). **Reconstructed**: the default ``rho = 0.8`` (the paper's value could not be read; the code ships none) and
the mask on numerator and denominator (the commented code builds the mask but the loss that consumes it is not in
the release). On turn forests a step would be one policy span; shapers do not run on them
(:class:`~treejax.rl.multiturn.MultiTurnConfig` requires none), so only the two units above exist.
"""

from __future__ import annotations

import dataclasses
from typing import ClassVar

import jax.numpy as jnp

from treejax.errors import ConfigError
from treejax.rl.shaping.base import Shaped, Shaper, ShapingInputs, masked_mean, register

DART_UNITS = ("step", "token")


def top_fraction_mask(score, valid, top_ratio: float):
    """bool, ``score``'s shape: the ``max(1, floor(top_ratio n))`` largest scores among the ``n`` valid entries
    (ties: lower flat index first); nothing when ``n = 0``."""
    flat_s, flat_v = score.reshape(-1), valid.reshape(-1)
    s = jnp.where(flat_v, flat_s.astype(jnp.float32), -jnp.inf)
    order = jnp.argsort(-s, stable=True)
    rank = jnp.zeros(s.shape, jnp.int32).at[order].set(jnp.arange(s.shape[0], dtype=jnp.int32))
    n = jnp.sum(flat_v)
    k = jnp.maximum(jnp.floor(top_ratio * n.astype(jnp.float32) + 1e-6).astype(jnp.int32), 1)
    return (flat_v & (rank < k)).reshape(score.shape)


@register("dart_entropy")
@dataclasses.dataclass(frozen=True)
class DARTEntropyMask(Shaper):
    """DART: only the ``top_ratio`` highest-entropy steps (or tokens) of a step's pool stay in the loss (module
    docstring; the default ratio is a reconstruction)."""

    top_ratio: float = 0.8
    unit: str = "step"

    needs = ("entropy",)
    masks: ClassVar[bool] = True

    def __post_init__(self):
        if not 0.0 < self.top_ratio <= 1.0:
            raise ConfigError(f"DARTEntropyMask.top_ratio must be in (0, 1], got {self.top_ratio}; fix: "
                              "DARTEntropyMask.top_ratio = 0.8")
        if self.unit not in DART_UNITS:
            raise ConfigError(f"DARTEntropyMask.unit must be one of {DART_UNITS}, got {self.unit!r}")

    def keep_mask(self, entropy, on):
        """float32 ``[P, W, T]``: 1 on the pairs of the kept units (module docstring), 0 elsewhere."""
        if self.unit == "token":
            return top_fraction_mask(entropy, on, self.top_ratio).astype(jnp.float32)
        leaf_on = jnp.any(on, axis=-1)
        keep = top_fraction_mask(masked_mean(entropy, on, axis=-1), leaf_on, self.top_ratio)
        return (keep[:, :, None] & on).astype(jnp.float32)

    def shape(self, x: ShapingInputs) -> Shaped:
        on = x.on
        keep = self.keep_mask(x.entropy, on)
        kept = keep > 0
        h = x.entropy.astype(jnp.float32)
        leaf_on = jnp.any(on, axis=-1)
        stats = {"kept_frac": jnp.sum(kept) / jnp.maximum(jnp.sum(on), 1),  # a share of the tokens
                 # a share of the responses (top_ratio of them with unit="response"; the token share differs)
                 "kept_response_frac": jnp.sum(jnp.any(kept, axis=-1)) / jnp.maximum(jnp.sum(leaf_on), 1),
                 "entropy_kept": masked_mean(h, kept), "entropy_dropped": masked_mean(h, on & ~kept)}
        return Shaped(jnp.where(kept, x.advantages, 0.0), x.eps_scale, stats, keep=keep)


__all__ = ["DART_UNITS", "DARTEntropyMask", "top_fraction_mask"]
