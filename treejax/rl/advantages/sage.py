"""SAGE: GRPO over sequential rollouts of a task chain with a skill-integrated reward.

Inputs (the multi-turn source on the ``task_chain`` environment, :func:`treejax.rl.chains.chain_arrays`), each
``[P, W, D]``: ``chain_link_PxWxD`` (int: the problem a turn works on, -1 for no turn), ``chain_outcome_PxWxD``
(indexed by problem ``k``: its verifier score ``o_k``, 0 when the episode did not finish it, NaN past the chain)
and ``chain_skill_PxWxD`` (indexed by ``k``: ``u_k = 1`` when problem ``k`` passed a skill on). Statistics use
:func:`.info_gain.group_normalize` (weighted by ``Forest.leaf_weight``, population std, std 1 for a group of one,
exactly 0 for a group of equal values).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
import numpy as np

from treejax.forest import Forest
from treejax.rl.advantages.common import broadcast_segments, check_rewards
from treejax.rl.advantages.info_gain import group_normalize, turn_layout
from treejax.rl.advantages.registry import Advantages, register_estimator


def _number(x, lo: float, hi: float = math.inf) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and lo <= x <= hi


@dataclasses.dataclass(frozen=True)
class SAGEOptions:
    """``skill_weight`` (lambda): weight of the credit a solved problem's skill gets from the later problems'
    success; ``use_weight`` (mu): weight of the bonus a solved problem gets when a skill was carried into it;
    ``gamma``: how the later problems count in that credit (0: only the next one, SAGE's chains of two; 1: all of
    them equally); ``scale_by_std`` / ``eps``: the per-problem group normalisation divides by ``std + eps``."""

    skill_weight: float = 1.0
    use_weight: float = 0.5
    gamma: float = 0.0
    scale_by_std: bool = True
    eps: float = 1e-6

    def __post_init__(self):
        if not _number(self.skill_weight, 0.0) or not _number(self.use_weight, 0.0):
            raise ValueError(f"SAGEOptions: skill_weight and use_weight must be finite numbers >= 0, got "
                             f"{self.skill_weight!r}, {self.use_weight!r}; fix: SAGEOptions.skill_weight = 1.0")
        if not _number(self.gamma, 0.0, 1.0):
            raise ValueError(f"SAGEOptions.gamma must be in [0, 1], got {self.gamma!r}; fix: SAGEOptions.gamma = 0.0")
        if not (_number(self.eps, 0.0) and self.eps > 0):
            raise ValueError(f"SAGEOptions.eps must be a finite number > 0, got {self.eps!r}")


def later_weights(depth: int, gamma: float) -> np.ndarray:
    """float32[D, D]: ``M[k, j] = gamma^(j - k - 1)`` for ``j > k``, else 0 (``0^0 = 1``: with ``gamma = 0`` only
    the next problem counts)."""
    k, j = np.meshgrid(np.arange(depth), np.arange(depth), indexing="ij")
    return np.where(j > k, np.power(float(gamma), np.maximum(j - k - 1, 0)), 0.0).astype(np.float32)


def skill_integrated_rewards(chain_outcome_PxWxD, chain_skill_PxWxD, options: SAGEOptions):
    """``(r [P, W, D], member [P, W, D])``: each problem's skill-integrated reward (0 past the chain) and whether the
    problem is in the chain (:func:`sage`'s ``r_k``)."""
    o = jnp.asarray(chain_outcome_PxWxD, jnp.float32)
    member = jnp.isfinite(o)
    o = jnp.where(member, o, 0.0)
    u = jnp.where(member, jnp.asarray(chain_skill_PxWxD, jnp.float32), 0.0)
    D = o.shape[-1]
    M = jnp.asarray(later_weights(D, options.gamma))
    num = jnp.einsum("pwj,kj->pwk", o, M)
    den = jnp.einsum("pwj,kj->pwk", member.astype(jnp.float32), M)
    credit = jnp.where(den > 0, num / jnp.maximum(den, 1e-30), 0.0)  # c_k: the later problems' weighted success
    carried = jnp.concatenate([jnp.zeros_like(u[..., :1]), jax.lax.cummax(u, axis=u.ndim - 1)[..., :-1]], axis=-1)
    r = o + jnp.float32(options.skill_weight) * u * o * credit + jnp.float32(options.use_weight) * carried * o
    return jnp.where(member, r, 0.0), member


def sage_turns(forest: Forest, rewards_PxW, options: SAGEOptions, chain_link_PxWxD, chain_outcome_PxWxD,
               chain_skill_PxWxD):
    """``(advantages per turn [P, W, D], per problem [P, W, D], rewards per problem [P, W, D])`` of :func:`sage`."""
    check_rewards(forest, rewards_PxW)
    _, valid, _ = turn_layout(forest)
    P, W, D = valid.shape
    for name, x in (("chain_link_PxWxD", chain_link_PxWxD), ("chain_outcome_PxWxD", chain_outcome_PxWxD),
                    ("chain_skill_PxWxD", chain_skill_PxWxD)):
        if tuple(jnp.shape(x)) != (P, W, D):
            raise ValueError(f"{name} has shape {tuple(jnp.shape(x))}, the forest has [P, W, D] = {(P, W, D)}")
    r, member = skill_integrated_rewards(chain_outcome_PxWxD, chain_skill_PxWxD, options)
    member = member & (forest.leaf_path[:, :, :1] >= 0)  # used slots only
    lw = jnp.broadcast_to(forest.leaf_weights()[:, :, None], (P, W, D))
    t = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  ([P, D, W]: one group per prompt and problem)
    per_link = t(group_normalize(t(r), t(member), t(lw), options.scale_by_std, options.eps))
    link = jnp.asarray(chain_link_PxWxD, jnp.int32)
    on = valid & (link >= 0) & (link < D)
    adv = jnp.where(on, jnp.take_along_axis(per_link, jnp.clip(link, 0, D - 1), axis=-1), 0.0)
    return adv, per_link, r


@register_estimator("sage", SAGEOptions, inputs=("chain_link_PxWxD", "chain_outcome_PxWxD", "chain_skill_PxWxD"))
def sage(forest: Forest, rewards_PxW, options: SAGEOptions = SAGEOptions(), *, chain_link_PxWxD,
         chain_outcome_PxWxD, chain_skill_PxWxD) -> Advantages:
    r"""SAGE (Skill Augmented GRPO for self-Evolution; Wang et al. 2025, "Reinforcement Learning for Self-Improving
    Agent with Skill Library", arXiv 2512.17102): *sequential rollouts*, each rollout one pass over a chain of
    similar tasks, with what the agent learnt on earlier tasks (its skills) available on the later ones, and a
    *skill-integrated reward* that adds to the outcome reward the credit of skills that were made and used.

    Per slot ``w`` (one sequential rollout) and problem ``k < K`` of the chain, with outcomes ``o_k`` in [0, 1] and
    ``u_k = 1`` when problem ``k`` passed a skill on::

        c_k  = sum_{j > k} gamma^(j-k-1) o_j / sum_{j > k} gamma^(j-k-1)     (0 for the last problem)
        a_k  = max_{j < k} u_j                                               (a skill was carried into problem k)
        r_k  = o_k + skill_weight * u_k * o_k * c_k + use_weight * a_k * o_k
        A_k  = (r_k - mean_p r_k) / (std_p r_k + eps)     over the prompt's slots, problem by problem (GRPO)

    and every turn of problem ``k`` (its answer turn, and its tool turns with an inner environment) gets ``A_k``,
    broadcast to its policy tokens (0 on observations); ``segments`` holds it per (slot, turn). The slot's chain
    score ``R_w`` (``rewards_PxW``) is not read: the signal is per problem.

    What is reconstructed, and why. Only the paper's abstract was available here (the project's method notes,
    ``reference/methods.md``, have no SAGE card; no constants were given). The abstract fixes the structure: a
    rollout iterates over a chain of similar tasks, skills generated on earlier tasks accumulate and are available
    to later ones, and a skill-integrated reward complements the outcome reward; the method is built on GRPO.
    Chosen here: (1) the group of a problem's advantage is the prompt's slots at the *same position of the same
    chain* (every slot of a prompt runs the same chain, so this is GRPO's same-question group); (2) the skill
    credit ``u_k o_k c_k`` is gated by the problem's own success (a skill from a failed attempt earns nothing) and
    paid by the later problems' success, so the reward of a later problem credits the skill carried from an earlier
    one; ``gamma = 0`` reads only the next problem, the paper's chains of two tasks; (3) the use bonus ``a_k o_k``
    rewards solving a problem with a skill carried in. In the default chain environment the skill is the
    conversation itself (``u_k = 1`` for every finished problem, so ``a_k = 1`` for ``k >= 1`` and the use bonus is
    a constant factor within each problem's group: only the credit term matters); with its skill library
    (``task_options['skills'] = True``) ``u_k`` is whether the problem's turn wrote a ``<skill>``. The paper's
    AppWorld skills are functions in a library and its exact reward table was not read; weights 1 and 0.5 are
    this reconstruction's defaults, not the paper's.
    """
    adv, _, _ = sage_turns(forest, rewards_PxW, options, chain_link_PxWxD, chain_outcome_PxWxD, chain_skill_PxWxD)
    tokens = broadcast_segments(adv, forest.segment_index, forest.loss_mask)
    return Advantages(tokens=tokens, loss_mask=forest.loss_mask, segments=adv)


__all__ = ["SAGEOptions", "later_weights", "sage", "sage_turns", "skill_integrated_rewards"]
