"""Flat (group-of-W) estimators: every leaf of a prompt is one sample of a group, the tree is ignored.

All of them broadcast one scalar per leaf over the leaf's tokens (``Advantages.leaves``). The per-prompt core
of each is written for one prompt ([W] rewards) and vmapped over prompts; batch-global steps come after.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from treejax.forest import Forest
from treejax.rl.advantages.common import (
    broadcast_leaves,
    check_baseline,
    count_scaled_sum,
    check_rewards,
    materialize,
    other_subtrees_deviation,
    scaled_sum,
    whiten_stats,
)
from treejax.rl.advantages.registry import Advantages, register_estimator


def _mean_deviation(r_W: jax.Array, used_W: jax.Array | None = None) -> jax.Array:
    """``R_i - mean(R) = mean_j (R_i - R_j)`` over the used slots ``j`` (all when ``used_W`` is None): exactly 0
    when all rewards are equal; 0 on unused slots."""
    if used_W is None:
        return scaled_sum(r_W[:, None] - r_W[None, :], r_W.shape[0], axis=-1)
    diff = jnp.where(used_W[None, :], r_W[:, None] - r_W[None, :], 0.0)
    return jnp.where(used_W, count_scaled_sum(diff, jnp.sum(used_W, dtype=jnp.int32), axis=-1), 0.0)


def used_leaves(leaf_path_PxWxD1: jax.Array) -> jax.Array:
    """bool[..., W]: the leaf slots that hold a rollout (``leaf_path[..., 0] >= 0``; allocation's groups mark the
    slots a prompt did not get with -1, :mod:`treejax.rl.allocation.groups`)."""
    return leaf_path_PxWxD1[..., 0] >= 0


# --------------------------------------------------------------------------------------------------- grpo
@dataclasses.dataclass(frozen=True)
class GRPOOptions:
    """``scale_by_std=False`` is Dr.GRPO (Liu et al. 2025, arXiv 2503.20783): no division by the group std."""

    scale_by_std: bool = True
    unbiased_std: bool = True  # torch.std default, as verl's compute_grpo_outcome_advantage
    eps: float = 1e-6
    baseline: str = "group"

    def __post_init__(self):
        check_baseline("GRPOOptions", self.baseline)


def grpo_core(r_W: jax.Array, options: GRPOOptions, leaf_path_WxD1: jax.Array | None = None) -> jax.Array:
    """One prompt's GRPO advantages [W] over its used leaf slots (all slots without ``leaf_path_WxD1``)."""
    used = None if leaf_path_WxD1 is None else used_leaves(leaf_path_WxD1)
    dev = _mean_deviation(r_W, used)
    centred = dev if options.baseline == "group" else other_subtrees_deviation(leaf_path_WxD1, r_W)
    if not options.scale_by_std:
        return centred
    sq = materialize(dev * dev)
    if used is None:
        w = r_W.shape[0]
        var = scaled_sum(sq, w - 1 if options.unbiased_std else w)
    else:
        n = jnp.sum(used, dtype=jnp.int32)
        var = count_scaled_sum(sq, n - 1 if options.unbiased_std else n)
    return centred * materialize(1.0 / (jnp.sqrt(var) + options.eps))  # see common.materialize


@register_estimator("grpo", GRPOOptions, ragged=True)
def grpo(forest: Forest, rewards_PxW: jax.Array, options: GRPOOptions = GRPOOptions()) -> Advantages:
    """GRPO (Shao et al. 2024, DeepSeekMath): ``A_i = (R_i - mean_G R) / (std_G R + eps)``, G = the W leaves of
    the prompt; Dr.GRPO option: ``A_i = R_i - mean_G R``.

    ``std`` is the unbiased (n - 1) std by default, as ``torch.std`` in verl. Differences to verl: for W = 1
    verl uses mean 0 and std 1 (so ``A = R``); here W = 1 gives ``A = 0`` (a single sample carries no
    group-relative signal), and the mean is taken as ``mean_j (R_i - R_j)`` so equal rewards give exactly 0.
    No batch whitening.

    ``baseline="other_subtrees"``: the centring is leave-one-subtree-out, ``R_i - mean_{j under another depth-1
    node} R_j`` (:func:`~treejax.rl.advantages.common.other_subtrees_deviation`; the std stays the group's),
    for trees whose siblings are correlated; on independent samples it is the leave-one-out (RLOO) mean.
    """
    r = check_rewards(forest, rewards_PxW)
    leaves = jax.vmap(lambda x, p: grpo_core(x, options, p))(r, forest.leaf_path)
    return Advantages(tokens=broadcast_leaves(leaves, forest.loss_mask), loss_mask=forest.loss_mask, leaves=leaves)


# --------------------------------------------------------------------------------------------------- rloo
@dataclasses.dataclass(frozen=True)
class RLOOOptions:
    """``baseline="other_subtrees"``: leave one depth-1 subtree out instead of one leaf (see :func:`rloo`)."""

    baseline: str = "group"

    def __post_init__(self):
        check_baseline("RLOOOptions", self.baseline)


def rloo_core(r_W: jax.Array, used_W: jax.Array | None = None) -> jax.Array:
    """One prompt's leave-one-out advantages [W] over its used leaf slots (all without ``used_W``)."""
    if used_W is None:
        w = r_W.shape[0]
        return scaled_sum(r_W[:, None] - r_W[None, :], w - 1, axis=-1)
    diff = jnp.where(used_W[None, :], r_W[:, None] - r_W[None, :], 0.0)
    return jnp.where(used_W, count_scaled_sum(diff, jnp.sum(used_W, dtype=jnp.int32) - 1, axis=-1), 0.0)


@register_estimator("rloo", RLOOOptions, ragged=True)
def rloo(forest: Forest, rewards_PxW: jax.Array, options: RLOOOptions = RLOOOptions()) -> Advantages:
    """RLOO (Ahmadian et al. 2024, arXiv 2402.14740): ``A_i = R_i - (1/(W-1)) sum_{j != i} R_j``
    ``= W/(W-1) (R_i - mean R)``. W = 1 gives 0 (verl gives ``A = R`` there). No whitening.
    ``baseline="other_subtrees"``: ``A_i = R_i - mean_{j under another depth-1 node} R_j`` (a tree's siblings
    are correlated with R_i; identical to the default on independent samples)."""
    r = check_rewards(forest, rewards_PxW)
    if options.baseline == "other_subtrees":
        leaves = jax.vmap(other_subtrees_deviation)(forest.leaf_path, r)
    else:
        leaves = jax.vmap(rloo_core)(r, used_leaves(forest.leaf_path))
    return Advantages(tokens=broadcast_leaves(leaves, forest.loss_mask), loss_mask=forest.loss_mask, leaves=leaves)


# ---------------------------------------------------------------------------------- reinforce_pp_baseline
@dataclasses.dataclass(frozen=True)
class ReinforcePPBaselineOptions:
    whiten: bool = True
    whiten_eps: float = 1e-8  # verl masked_whiten's rsqrt(var + 1e-8)
    baseline: str = "group"

    def __post_init__(self):
        check_baseline("ReinforcePPBaselineOptions", self.baseline)


@register_estimator("reinforce_pp_baseline", ReinforcePPBaselineOptions, ragged=True)
def reinforce_pp_baseline(
    forest: Forest, rewards_PxW: jax.Array, options: ReinforcePPBaselineOptions = ReinforcePPBaselineOptions()
) -> Advantages:
    """REINFORCE++-baseline (Hu 2025, arXiv 2501.03262; verl ``compute_reinforce_plus_plus_baseline_outcome_
    advantage``): ``a_i = R_i - mean_G R`` per prompt, broadcast over the leaf's tokens, then batch-global
    token-weighted whitening over all valid tokens of all prompts (:func:`masked_whiten`, unbiased variance).
    ``leaves`` holds the whitened per-leaf value ``(a_i - mu) / sqrt(var + eps)``. verl uses mean 0 for W = 1
    (``a = R``); here W = 1 gives ``a = 0``. ``baseline="other_subtrees"``: ``a_i = R_i - mean_{j under another
    depth-1 node} R_j`` (leave one subtree out, for trees).
    """
    r = check_rewards(forest, rewards_PxW)
    if options.baseline == "other_subtrees":
        a = jax.vmap(other_subtrees_deviation)(forest.leaf_path, r)
    else:
        a = jax.vmap(_mean_deviation)(r, used_leaves(forest.leaf_path))
    return _whitened_leaf_advantages(a, forest, options.whiten, options.whiten_eps)


def _whitened_leaf_advantages(a_PxW, forest: Forest, whiten: bool, eps: float) -> Advantages:
    """Broadcast per-leaf ``a`` over tokens and (optionally) whiten batch-globally; ``leaves`` = final values."""
    tokens = broadcast_leaves(a_PxW, forest.loss_mask)
    if not whiten:
        return Advantages(tokens=tokens, loss_mask=forest.loss_mask, leaves=a_PxW)
    mu, inv = whiten_stats(tokens, forest.loss_mask, eps=eps)
    leaves = (a_PxW - mu) * inv
    return Advantages(tokens=broadcast_leaves(leaves, forest.loss_mask), loss_mask=forest.loss_mask, leaves=leaves)


# ------------------------------------------------------------------------------------------------ mc_grpo
@dataclasses.dataclass(frozen=True)
class MCGRPOOptions:
    """``normalize``: divide by ``MAD + eps``; ``std_fallback``: where MAD = 0 but rewards differ (common with
    binary rewards, e.g. [0, 0, 0, 1, 1]) divide by the population std + eps instead of by eps alone."""

    normalize: bool = True
    std_fallback: bool = True
    eps: float = 1e-6


def mc_grpo_core(r_W: jax.Array, options: MCGRPOOptions) -> tuple[jax.Array, jax.Array]:
    """One prompt -> (advantages [W], pivot one-hot [W] bool)."""
    w = r_W.shape[0]
    k = (w - 1) // 2
    order = jnp.argsort(r_W, stable=True)  # ascending reward, ties by index
    pivot = order[k]
    is_pivot = jnp.arange(w) == pivot
    dev = r_W - r_W[pivot]  # exactly 0 on the pivot and on equal rewards
    if not options.normalize:
        return jnp.where(is_pivot, 0.0, dev), is_pivot
    mad = jnp.sort(jnp.abs(dev))[k]
    scale = mad
    if options.std_fallback:
        centered = r_W[:, None] - r_W[None, :]
        dev_mean = scaled_sum(centered, w, axis=-1)
        std = jnp.sqrt(scaled_sum(materialize(dev_mean * dev_mean), w))
        scale = jnp.where(mad > 0, mad, std)
    adv = dev * materialize(1.0 / (scale + options.eps))
    return jnp.where(is_pivot, 0.0, adv), is_pivot


@register_estimator("mc_grpo", MCGRPOOptions)
def mc_grpo(forest: Forest, rewards_PxW: jax.Array, options: MCGRPOOptions = MCGRPOOptions()) -> Advantages:
    """MC-GRPO (Kim 2026, arXiv 2601.22582, median-centered GRPO for small rollout budgets).

    ``A_i = (R_i - med) / (MAD + eps)``, ``MAD = med_j |R_j - med|`` (over all W leaves, pivot included),
    ``eps = options.eps`` (1e-6) — or ``(R_i - med) / (std + eps)`` (population std) where MAD is 0 but the
    rewards are not all equal (``std_fallback``), and ``A_i = R_i - med`` with ``normalize=False``.

    The pivot: sort the W rewards ascending with ties broken by leaf index (stable sort); the pivot is the leaf
    at sorted position ``(W - 1) // 2`` and ``med`` is its reward. With W = G + 1 odd (the paper samples one
    extra rollout) this is the exact median; with W even it is the lower median, so the baseline is always a
    real rollout's reward (``med`` and ``MAD`` use the same lower-median rule). The pivot's advantage is 0 and
    it is excluded from the loss: its row of ``Advantages.loss_mask`` is all 0, leaving W - 1 = G
    gradient-contributing rollouts as in the paper. W = 1: the only leaf is the pivot, so nothing is trained.
    """
    r = check_rewards(forest, rewards_PxW)
    leaves, is_pivot = jax.vmap(lambda x: mc_grpo_core(x, options))(r)
    mask = jnp.where(is_pivot[:, :, None], 0.0, forest.loss_mask)
    return Advantages(tokens=broadcast_leaves(leaves, mask), loss_mask=mask, leaves=leaves)


# -------------------------------------------------------------------------------------------------- remax
@dataclasses.dataclass(frozen=True)
class ReMaxOptions:
    pass


@register_estimator("remax", ReMaxOptions, inputs=("greedy_reward_P",), ragged=True)
def remax(
    forest: Forest, rewards_PxW: jax.Array, options: ReMaxOptions = ReMaxOptions(), *, greedy_reward_P: jax.Array
) -> Advantages:
    """ReMax (Li et al. 2023, arXiv 2310.10505): ``A_i = R_i - R(greedy)``, the baseline being the reward of
    one greedy (argmax) response per prompt that the sampler decodes alongside the W sampled leaves and that
    is not itself trained on. ``greedy_reward_P`` [P] is a required keyword input. Outcome reward only, so the
    return-to-go of verl's ``compute_remax_outcome_advantage`` is the same scalar at every token. No whitening.
    """
    r = check_rewards(forest, rewards_PxW)
    g = jnp.asarray(greedy_reward_P, jnp.float32)
    if g.shape != (r.shape[0],):
        raise ValueError(f"greedy_reward_P must have shape [P] = ({r.shape[0]},), got {tuple(g.shape)}")
    leaves = r - g[:, None]
    return Advantages(tokens=broadcast_leaves(leaves, forest.loss_mask), loss_mask=forest.loss_mask, leaves=leaves)
