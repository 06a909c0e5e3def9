"""Reward shaping and filters applied between the verifier and the advantage estimator."""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp


def verifier_reward(correct_PxW: jax.Array, style: Literal["pm1", "01"] = "pm1") -> jax.Array:
    """Verifier outcome (bool or {0,1}) -> reward: ``"pm1"`` gives +1 / -1 (TreePO, math_verify on the last
    \\boxed{}), ``"01"`` gives 1 / 0."""
    c = jnp.asarray(correct_PxW).astype(bool)
    if style == "pm1":
        return jnp.where(c, 1.0, -1.0).astype(jnp.float32)
    if style == "01":
        return c.astype(jnp.float32)
    raise ValueError(f"unknown reward style {style!r}; valid: 'pm1', '01'")


def overlong_penalty(length_PxW: jax.Array, max_length: int, buffer: int, factor: float = 1.0) -> jax.Array:
    """DAPO's soft overlong punishment (Yu et al. 2025, arXiv 2503.14476, Eq. 13), added to the reward:

        penalty(L) = factor * max(min(-(L - (L_max - L_buf)) / L_buf, 0), -1)

    0 up to ``L_max - L_buf`` tokens, then linear down to ``-factor`` at ``L_max``; DAPO defines -1 beyond
    ``L_max`` (the clip at -1; responses never exceed ``L_max`` in practice, so verl's unclipped form agrees).
    TreePO uses buffer 512, factor 1.0, L_max 7168.
    """
    if buffer <= 0 or buffer > max_length:
        raise ValueError(f"overlong buffer must be in (0, max_length={max_length}], got {buffer}")
    over = jnp.asarray(length_PxW, jnp.float32) - (max_length - buffer)
    return factor * jnp.clip(-over / buffer, -1.0, 0.0)


def zero_std_prompts(rewards_PxW: jax.Array) -> jax.Array:
    """bool[P]: prompts whose W rewards are all equal (reward std 0): no group-relative signal.

    DAPO's dynamic sampling drops these and the trainer refills the batch with new prompts; the test is exact
    (max == min), so float noise never keeps a degenerate group."""
    r = jnp.asarray(rewards_PxW)
    return jnp.max(r, axis=-1) == jnp.min(r, axis=-1)


def dynamic_sampling_keep(rewards_PxW: jax.Array) -> jax.Array:
    """bool[P]: prompts DAPO's dynamic sampling keeps (reward std > 0)."""
    return ~zero_std_prompts(rewards_PxW)
