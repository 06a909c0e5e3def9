"""RAPO's advantages over a turn forest: a reward-aware scaled outcome advantage plus a step-level tool-call term.

The rollout side of RAPO (curriculum pruning and per-prompt replay) is the wrapper stage
:class:`treejax.rl.rapo.RAPOConfig`; this estimator is its credit side and runs with or without it.

Input ``tool_match_PxWxD [P, W, D]`` (the multi-turn source's, :func:`treejax.rl.tool_match.tool_match_rewards`):
for leaf slot ``w`` and its turn at depth ``t + 1``, the score in [0, 1] of that turn's tool call under the
one-to-one matching of the slot's calls against the question's reference calls (0 for an unmatched call, so a
second search for an entity already found earns nothing), NaN where the turn made no call or does not exist.
Statistics use :func:`.info_gain.group_normalize` (weighted by ``Forest.leaf_weight``, population std with a
1e-8 floor inside the root, std 1 for a group of one, exactly 0 for a group of equal values).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from treejax.errors import ConfigError
from treejax.forest import Forest
from treejax.rl.advantages.common import broadcast_segments
from treejax.rl.advantages.info_gain import group_normalize
from treejax.rl.advantages.registry import Advantages, register_estimator
from treejax.rl.advantages.matchtir import tool_match_inputs


@dataclasses.dataclass(frozen=True)
class RAPOOptions:
    """``scale_power`` (alpha): the power of the reward-aware group scale ``(4 p (1 - p))^alpha`` (0: GRPO's plain
    z-score); ``success_reward``: a slot with reward ``>=`` it counts as a success for ``p`` (1.0: a solved
    episode under both ``reward_style`` s); ``step_weight`` (beta): weight of the step-level tool-call term;
    ``scale_by_std`` / ``eps``: both normalisations divide by ``std + eps``."""

    scale_power: float = 0.25
    success_reward: float = 1.0
    step_weight: float = 0.5
    scale_by_std: bool = True
    eps: float = 1e-6

    def __post_init__(self):
        for name, fix in (("scale_power", 0.25), ("step_weight", 0.5)):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ConfigError(f"RAPOOptions.{name} must be a finite number >= 0, got {v!r}; fix: "
                                  f"RAPOOptions.{name} = {fix}")
        if not (isinstance(self.success_reward, (int, float)) and math.isfinite(self.success_reward)):
            raise ConfigError(f"RAPOOptions.success_reward must be a finite number, got {self.success_reward!r}; "
                              "fix: RAPOOptions.success_reward = 1.0")
        if not (isinstance(self.eps, (int, float)) and self.eps > 0 and math.isfinite(self.eps)):
            raise ConfigError(f"RAPOOptions.eps must be a finite number > 0, got {self.eps!r}; fix: "
                              "RAPOOptions.eps = 1e-6")


def reward_aware_scale(rewards_PxW, used_PxW, weight_PxW, success_reward: float, power: float):
    """float32[P]: ``g_p = (4 p_p (1 - p_p))^power`` with ``p_p`` the leaf-weighted share of prompt p's used slots
    whose reward is ``>= success_reward``; ``power = 0`` gives 1 everywhere (also for ``p`` = 0 or 1)."""
    w = jnp.where(used_PxW, weight_PxW, 0.0).astype(jnp.float32)
    win = (jnp.asarray(rewards_PxW, jnp.float32) >= success_reward).astype(jnp.float32)
    p = jnp.sum(w * win, axis=-1) / jnp.maximum(jnp.sum(w, axis=-1), 1e-30)
    if power == 0:
        return jnp.ones_like(p)
    return jnp.power(jnp.clip(4.0 * p * (1.0 - p), 0.0, 1.0), jnp.float32(power))


def rapo_turns(forest: Forest, rewards_PxW, options: RAPOOptions, tool_match_PxWxD):
    """``(advantages [P, W, D], step term [P, W, D], scaled outcome term [P, W], scale [P])`` of :func:`rapo`."""
    R, valid, m = tool_match_inputs(forest, rewards_PxW, tool_match_PxWxD)
    P, W, D = valid.shape
    lw = forest.leaf_weights()
    used = forest.leaf_path[:, :, 0] >= 0
    g = reward_aware_scale(R, used, lw, options.success_reward, options.scale_power)
    outcome = g[:, None] * group_normalize(R, used, lw, options.scale_by_std, options.eps)  # [P, W]
    tool = valid & jnp.isfinite(m)
    flat = lambda x: x.reshape((P, W * D))  # noqa: E731  (one group per prompt: all its slots' tool turns)
    weight = flat(jnp.broadcast_to(lw[:, :, None], (P, W, D)))
    step = group_normalize(flat(jnp.where(tool, m, 0.0)), flat(tool), weight, options.scale_by_std,
                           options.eps).reshape((P, W, D))
    adv = jnp.where(valid, outcome[:, :, None] + jnp.float32(options.step_weight) * step, 0.0)
    return adv, step, outcome, g


@register_estimator("rapo", RAPOOptions, inputs=("tool_match_PxWxD",))
def rapo(forest: Forest, rewards_PxW, options: RAPOOptions = RAPOOptions(), *, tool_match_PxWxD) -> Advantages:
    r"""RAPO's credit assignment for agentic search (issue 48's "reward-aware advantage scaling" and "step-level
    tool-call reward"; the rollout side, curriculum pruning and per-prompt replay, is
    :class:`treejax.rl.rapo.RAPOConfig`). Per prompt p, over its W slots (leaf weights ``lambda_w``)::

        p_p       = sum_w lambda_w 1[R_w >= success_reward] / sum_w lambda_w          (the group's success rate)
        g_p       = (4 p_p (1 - p_p))^alpha                                          (reward-aware scale)
        A^o_w     = g_p (R_w - mean_p R) / (std_p R + eps)                           (scaled outcome advantage)
        r_{w,t}   = tool_match_{w,t}                                                 (step-level tool-call reward)
        A^s_{w,t} = (r_{w,t} - mean r) / (std r + eps)     over p's tool turns (all slots)
        A_{w,t}   = A^o_w + beta A^s_{w,t}  on tool turns,   A^o_w on the answer turn

    broadcast to each turn's policy tokens (0 on observations); ``segments`` holds ``A`` per (slot, turn).

    Sources and what is reconstructed. The project's issue names RAPO's four parts for agentic search (curriculum
    pruning, reward-aware advantage scaling, per-prompt replay, a step-level tool-call reward). The paper that
    describes exactly these was not found (a search found only a different RAPO, arXiv 2603.03078, "Retrieval-
    Augmented Policy Optimization", whose parts are retrieved off-policy step traces and importance shaping), so
    every formula here is this reconstruction's choice, made to fit the parts' names:

    * the scale ``g_p`` weighs a group by its outcome variance ``p (1 - p)`` (largest at p = 1/2, where a group
      carries the most information), which damps the z-score's blow-up of rare outcomes (GRPO gives the single
      success among 8 slots ``+2.65``; with alpha = 0.25 it gets ``2.65 * 0.4375^0.25 = 2.15``). alpha = 0 is GRPO;
      with +-1 rewards and alpha = 0.5 the scale equals the group's std, so ``A^o = R - mean`` (Dr.GRPO), i.e.
      alpha interpolates between the two. The scale is applied to the outcome term only: a group with one outcome
      for all slots (``g = 0``) keeps its step-level signal, where it is most useful;
    * the step reward is the matched tool-call score of MatchTIR's matching (:mod:`treejax.rl.tool_match`: the
      retrieval world's questions ship their reference searches), immediate rather than MatchTIR's rewards-to-go,
      z-scored over the prompt's tool turns and added with weight beta = 0.5 (ours).
    """
    adv, _, _, _ = rapo_turns(forest, rewards_PxW, options, tool_match_PxWxD)
    tokens = broadcast_segments(adv, forest.segment_index, forest.loss_mask)
    return Advantages(tokens=tokens, loss_mask=forest.loss_mask, segments=adv)


__all__ = ["RAPOOptions", "rapo", "rapo_turns", "reward_aware_scale"]
