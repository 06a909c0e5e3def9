"""DECS: a decoupled token-level reward that penalises the redundant tokens after the answer is first reached.

Source: "DECS" (arXiv 2509.25827), code ``pixas/DECS`` (``src_valid/reward_manager.py::ChunkAwareGRPO``,
``src_valid/valid_ray_trainer.py::compute_grpo_proc_length_advantage_return``; defaults from
``src_valid/config/ppo_trainer.yaml``). For leaf ``i`` of a prompt's group of ``W`` leaves, with outcome reward
``r_i``, response length ``L_i``, the rollout's length budget ``L_max = T`` and ``e_i`` the end of its necessary
reasoning prefix (the first response token at which the correct answer is already in the text, the rollout
source's ``answer_step_PxW``; -1 when the leaf is wrong or never reaches it early)::

    R_{i,t} = r_i (1 + beta)                        every position t < T (past the leaf's end too: the code's padding)
    R_{i,t} = r_i + beta (1 - L_i / L_max)          for e_i <= t < L_i when leaf i is correct and e_i >= 0
    A_{i,t} = (R_{i,t} - mean_j R_{j,t}) / (std_j R_{j,t} + eps)      per position t over the group's W leaves

``beta = 0.1`` (``length_reward_beta``), ``eps = 1e-6``, ``std`` Bessel-corrected (``torch.std``). A correct leaf's
redundant tokens thus get ``beta L_i / L_max`` less reward than its necessary ones, and than every other correct
leaf's tokens at that position; incorrect leaves are unchanged. With a group of equal outcomes and no redundant
tokens every advantage is 0, as GRPO's.

What differs from the paper: DECS finds ``e_i`` with a trained judge model (``pixas/DECS_NRP_DETECTOR``) that reads
each reasoning chunk (cut before "Wait", "But", "Alternatively", ...) and says whether it already states a
correct final answer. treejax asks the task's own verifier instead (``Task.answer_reached`` on each prefix that
ends at a line break: :func:`treejax.rl.scoring.answer_steps`), which needs no second model and is exact for
tasks whose verifier extracts the final answer. DECS's curriculum batch scheduling (re-admitting all-correct
"easy" prompts in a share ``kappa`` that follows the NRP position) is a prompt-selection rule and is not here.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from treejax.forest import Forest
from treejax.rl.advantages.common import check_rewards
from treejax.rl.advantages.registry import Advantages, register_estimator


@dataclasses.dataclass(frozen=True)
class DECSOptions:
    """``beta``: DECS's ``length_reward_beta``; ``eps``: the std's guard; ``unbiased_std``: ``torch.std``'s n - 1."""

    beta: float = 0.1
    eps: float = 1e-6
    unbiased_std: bool = True

    def __post_init__(self):
        if self.beta < 0:
            raise ValueError(f"DECSOptions.beta must be >= 0, got {self.beta}")


def decs_token_rewards(forest: Forest, rewards_PxW: jax.Array, answer_step_PxW: jax.Array,
                       beta: float) -> jax.Array:
    """``R [P, W, T]`` of the module docstring."""
    P, W, T = forest.tokens.shape
    r = rewards_PxW[:, :, None].astype(jnp.float32)
    L = forest.leaf_length[:, :, None].astype(jnp.float32)
    e = answer_step_PxW[:, :, None]
    t = jnp.arange(T)[None, None, :]
    redundant = (e >= 0) & (t >= e) & (t < forest.leaf_length[:, :, None])
    return jnp.where(redundant, r + beta * (1.0 - L / T), r * (1.0 + beta))


@register_estimator("decs", DECSOptions, inputs=("answer_step_PxW",))
def decs(forest: Forest, rewards_PxW: jax.Array, options: DECSOptions = DECSOptions(), *,
         answer_step_PxW: jax.Array) -> Advantages:
    """DECS's per-position group-normalised token rewards (module docstring)."""
    rewards = check_rewards(forest, rewards_PxW)
    if answer_step_PxW.shape != rewards.shape:
        raise ValueError(f"decs: answer_step_PxW has shape {answer_step_PxW.shape}, expected {rewards.shape}")
    R = decs_token_rewards(forest, rewards, answer_step_PxW, options.beta)
    W = R.shape[1]
    mean = jnp.mean(R, axis=1, keepdims=True)
    dev = R - mean
    dev = jnp.where(jnp.all(R == R[:, :1], axis=1, keepdims=True), 0.0, dev)  # equal rewards: exactly 0
    var = jnp.sum(dev * dev, axis=1, keepdims=True) / max(W - 1 if options.unbiased_std else W, 1)
    adv = dev / (jnp.sqrt(var) + options.eps)
    mask = forest.loss_mask
    return Advantages(tokens=jnp.where(mask > 0, adv, 0.0), loss_mask=mask)


__all__ = ["DECSOptions", "decs", "decs_token_rewards"]
