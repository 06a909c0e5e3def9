"""Tree-shaped estimators for multi-turn turn forests: Tree-GRPO, TreePS-RAG and PORTool.

Conventions as in :mod:`.agentic`: every leaf slot is one policy sample (weight 1; a path that ended early
while holding several slots counts once per slot), a node's value is a mean over the slots through it, per-step
values go to the node's tokens on each slot (observation tokens have ``loss_mask`` 0 and get exactly 0).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from treejax.forest import Forest, subgroup_masks
from treejax.rl.advantages.agentic import (
    _check_choice,
    _check_eps,
    _finish,
    group_relative,
    node_slot_mean,
)
from treejax.rl.advantages.common import broadcast_leaves, check_rewards, materialize, pairwise_sum
from treejax.rl.advantages.flat import GRPOOptions, grpo_core
from treejax.rl.advantages.nodes import first_occurrence, leaf_mean_differences
from treejax.rl.advantages.registry import Advantages, register_estimator


# ------------------------------------------------------------------------------------------ tree_grpo
@dataclasses.dataclass(frozen=True)
class TreeGRPOOptions:
    """``mode``: "sum" (intra-tree + inter-tree, the official ``adv_estimator=tree`` used by every released run
    script) or "two_stage" (normalise over the prompt, then those values again within the tree: the official
    ``tree_2norm``). ``scale_by_std``/``unbiased_std``/``eps``: each group's z-score (official: torch.std, 1e-6)."""

    mode: Literal["sum", "two_stage"] = "sum"
    scale_by_std: bool = True
    unbiased_std: bool = True
    eps: float = 1e-6

    def __post_init__(self):
        _check_choice("TreeGRPOOptions", "mode", self.mode, ("sum", "two_stage"))
        _check_eps("TreeGRPOOptions", self.eps)


def tree_grpo_core(leaf_path_WxD1: jax.Array, rewards_W: jax.Array, options: TreeGRPOOptions) -> jax.Array:
    """One prompt's per-slot Tree-GRPO advantages [W]."""
    used = leaf_path_WxD1[:, 0] >= 0
    tree = leaf_path_WxD1[:, 1]
    inter = used[:, None] & used[None, :]
    intra = (tree[:, None] == tree[None, :]) & (tree[:, None] >= 0) & (tree[None, :] >= 0)
    norm = (options.scale_by_std, options.unbiased_std, options.eps)
    a_inter, _ = group_relative(rewards_W, inter, *norm)
    if options.mode == "two_stage":
        a, _ = group_relative(a_inter, intra, *norm)
        return a
    a_intra, _ = group_relative(rewards_W, intra, *norm)
    return jnp.where(used, a_inter + a_intra, 0.0)


@register_estimator("tree_grpo", TreeGRPOOptions)
def tree_grpo(forest: Forest, rewards_PxW: jax.Array, options: TreeGRPOOptions = TreeGRPOOptions()) -> Advantages:
    r"""Tree-GRPO (Ji et al. 2025, "Tree Search for LLM Agent Reinforcement Learning", arXiv 2509.21240; official
    code ``verl/trainer/ppo/core_algos.py`` + ``ray_trainer_ts.py`` of AMAP-ML/Tree-GRPO).

    Trees: the subtrees under each depth-1 node (the distinct first turns); tree id = ``leaf_path[:, :, 1]``.
    With ``z_G(x)_i = (x_i - mean_{j in G} x_j) / (std_{j in G} x_j + eps)`` (unbiased std; 0 for a group of one):

        sum (default):  A_i = z_{tree(i)}(R)_i + z_{prompt}(R)_i          (intra-tree + inter-tree)
        two_stage:      A_i = z_{tree(i)}(z_{prompt}(R))_i

    one scalar per leaf slot, broadcast to the slot's policy tokens (``leaves`` holds it). Every slot is a
    sample (an early-ended path stored on two slots counts twice, as two samples of the policy).

    Variant vs the official code: there a group of one has mean 0 and std 1 (its advantage is the raw reward);
    here it gives 0 (a single sample has no group-relative signal), so a tree of one slot gets only the
    inter-tree term. ``scale_by_std=False`` drops both divisions (not in the official code).
    """
    r = check_rewards(forest, rewards_PxW)
    leaves = jax.vmap(lambda p, x: tree_grpo_core(p, x, options))(forest.leaf_path, r)
    return Advantages(tokens=broadcast_leaves(leaves, forest.loss_mask), loss_mask=forest.loss_mask, leaves=leaves)


# --------------------------------------------------------------------------------------------- treeps
@dataclasses.dataclass(frozen=True)
class TreePSOptions:
    """``normalize``: divide the process advantage by the prompt's reward std (unbiased) + eps;
    ``episode_weight``: weight of the added episode-level GRPO advantage (0 = process advantage only)."""

    normalize: bool = False
    episode_weight: float = 0.0
    eps: float = 1e-6

    def __post_init__(self):
        if not (isinstance(self.episode_weight, (int, float)) and self.episode_weight >= 0
                and math.isfinite(self.episode_weight)):
            raise ValueError(f"TreePSOptions.episode_weight must be a finite number >= 0, got {self.episode_weight!r}")
        _check_eps("TreePSOptions", self.eps)


def _reward_scale(leaf_path_WxD1: jax.Array, rewards_W: jax.Array, eps: float) -> jax.Array:
    """``1 / (std + eps)`` of the rewards over the used slots (unbiased std)."""
    used = leaf_path_WxD1[:, 0] >= 0
    dev = grpo_core(rewards_W, GRPOOptions(scale_by_std=False), leaf_path_WxD1)
    n = jnp.sum(used, dtype=jnp.int32).astype(jnp.float32)
    var = pairwise_sum(jnp.where(used, materialize(dev * dev), 0.0)) / jnp.maximum(n - 1.0, 1.0)
    return materialize(1.0 / (jnp.sqrt(var) + eps))


def treeps_core(leaf_path_WxD1: jax.Array, rewards_W: jax.Array, options: TreePSOptions) -> jax.Array:
    seg = leaf_mean_differences(leaf_path_WxD1, rewards_W)  # V(n) - V(parent(n)), [W, D]
    if options.normalize:
        seg = seg * _reward_scale(leaf_path_WxD1, rewards_W, options.eps)
    if options.episode_weight > 0:
        episode = grpo_core(rewards_W, GRPOOptions(eps=options.eps), leaf_path_WxD1)
        seg = seg + materialize(np.float32(options.episode_weight) * episode)[:, None]
    return jnp.where(leaf_path_WxD1[:, 1:] >= 0, seg, 0.0)


@register_estimator("treeps", TreePSOptions)
def treeps(forest: Forest, rewards_PxW: jax.Array, options: TreePSOptions = TreePSOptions()) -> Advantages:
    r"""TreePS-RAG process advantages from Monte-Carlo node values (Zhang et al. 2026, arXiv 2601.06922; method
    summary T3-3: node = one (reasoning, search | answer, observation) turn, V(n) = Monte-Carlo mean of the
    outcomes below n; no official code was available to check the exact advantage, so this is the
    value-difference reading of it, with the paper's optional extras as options).

        V(n)     = mean of R_w over the leaf slots w through n      (V(root) = the prompt's mean reward)
        A(n)     = V(n) - V(parent(n))              [/ (std_w R_w + eps) with normalize]
        A(w, d)  = A(n_{w,d}) + episode_weight * (R_w - mean R) / (std R + eps)

    Along a slot's path the process terms telescope to ``R_w - mean R``. The differences are computed in one
    rounding (:func:`~treejax.rl.advantages.nodes.leaf_mean_differences`; equal rewards give exactly 0). Same
    values as ``treepo_segment`` (leaf-mean, eta = 1) without whitening, on turn nodes. ``segments`` holds A.
    """
    r = check_rewards(forest, rewards_PxW)
    seg = jax.vmap(lambda p, x: treeps_core(p, x, options))(forest.leaf_path, r)
    return _finish(forest, seg)


# -------------------------------------------------------------------------------------------- portool
@dataclasses.dataclass(frozen=True)
class PORToolOptions:
    """``beta``: weight of the fork-relative advantage in ``A = (1 - beta) A_traj + beta A_fork``; default 0.5,
    an even blend of two unit-scale z-scores (the paper's weights were not retrievable). ``unbiased_std``/``eps``:
    both z-scores."""

    beta: float = 0.5
    unbiased_std: bool = True
    eps: float = 1e-6

    def __post_init__(self):
        if not (isinstance(self.beta, (int, float)) and 0.0 <= self.beta <= 1.0):
            raise ValueError(f"{type(self).__name__}.beta must be in [0, 1], got {self.beta!r}")
        _check_eps(type(self).__name__, self.eps)


@dataclasses.dataclass(frozen=True)
class PORToolToolOptions(PORToolOptions):
    """PORTool with the tool-success step reward: ``tool_weight`` lambda (small next to the outcome reward:
    PORTool's step reward is correctness-dominant)."""

    tool_weight: float = 0.1

    def __post_init__(self):
        super().__post_init__()
        if not (isinstance(self.tool_weight, (int, float)) and math.isfinite(self.tool_weight)):
            raise ValueError(f"PORToolToolOptions.tool_weight must be a finite number, got {self.tool_weight!r}")


def portool_core(leaf_path_WxD1, rewards_W, success_N, tool_weight: float, options: PORToolOptions) -> jax.Array:
    """One prompt's PORTool segments [W, D] (``success_N`` None: no tool term)."""
    W, D1 = leaf_path_WxD1.shape
    valid = leaf_path_WxD1[:, 1:] >= 0  # [W, D]
    if success_N is None:
        g = jnp.where(valid, rewards_W[:, None], 0.0)
    else:
        s = jnp.where(jnp.isfinite(success_N) & (success_N >= 0), success_N, 0.0)
        s_wd = jnp.where(valid, s[jnp.clip(leaf_path_WxD1[:, 1:], 0, s.shape[0] - 1)], 0.0)
        to_go = jnp.cumsum(s_wd[:, ::-1], axis=1)[:, ::-1]  # tool successes at depth >= d on the path
        g = jnp.where(valid, rewards_W[:, None] + materialize(np.float32(tool_weight) * to_go), 0.0)
    V = node_slot_mean(leaf_path_WxD1, g)  # [W, D]
    group = subgroup_masks(leaf_path_WxD1)  # [D+1, W, W]
    first = first_occurrence(group, leaf_path_WxD1)[:, 1:] & valid  # slot v represents its depth-k+1 node
    sib = group[:-1] & first.T[:, None, :]  # [D, W, W]: v's node is a child of w's parent (one slot per child)
    c = jnp.sum(sib, axis=-1, dtype=jnp.int32).astype(jnp.float32)  # [D, W] number of children of the parent
    Vt = V.T  # [D, W]
    dev = pairwise_sum(jnp.where(sib, Vt[:, :, None] - Vt[:, None, :], 0.0), axis=-1) / jnp.maximum(c, 1.0)
    sq = materialize(dev * dev)
    var = pairwise_sum(jnp.where(sib, sq[:, None, :], 0.0), axis=-1) / jnp.maximum(
        c - 1.0 if options.unbiased_std else c, 1.0)
    fork = jnp.where(c >= 2, dev * materialize(1.0 / (jnp.sqrt(var) + options.eps)), 0.0).T  # [W, D]
    traj = grpo_core(g[:, 0], GRPOOptions(unbiased_std=options.unbiased_std, eps=options.eps), leaf_path_WxD1)
    beta = np.float32(options.beta)
    seg = materialize(np.float32(1.0) - beta) * traj[:, None] + materialize(beta * fork)
    return jnp.where(valid, seg, 0.0)


_PORTOOL_DOC = r"""PORTool fork-relative advantages (Wu et al. 2025, "PORTool: Tool-Use LLM Training with Rewarded Tree",
    arXiv 2510.26020; implements the method summary T3-2, the paper's blend weights were not retrievable).

    Step reward r(n) = lambda s(n) for a node whose tool call succeeded (``portool_tool``: ``tool_success_PxN``
    [P, N] float, 1 = succeeded, 0 = failed, NaN or negative = no call, both of the latter giving no term;
    ``portool``: no tool term), the outcome R_w at the end. Return of slot w from its depth-d node on:
    ``G_w(d) = R_w + sum_{e >= d} r(n_{w,e})`` (undiscounted); value ``V(n) = mean_{w through n} G_w(d(n))``
    (correctness-dominant: the mean outcome of the step's descendants, shared steps share it).

        A_traj(w)    = (G_w(1) - mean_v G_v(1)) / (std + eps)                 (GRPO over the prompt's slots)
        A_fork(n)    = (V(n) - mean_{c in C(p)} V(c)) / (std_{c in C(p)} V(c) + eps)   if |C(p)| >= 2, else 0
        A(w, d)      = (1 - beta) A_traj(w) + beta A_fork(n_{w,d})

    with p = parent(n), C(p) its children (each child node once, unweighted: every fork is one sample of the
    next step); std unbiased by default. A node that is its parent's only child gets ``(1 - beta) A_traj``.
    ``segments`` holds A per (slot, depth)."""


@register_estimator("portool", PORToolOptions)
def portool(forest: Forest, rewards_PxW: jax.Array, options: PORToolOptions = PORToolOptions()) -> Advantages:
    r = check_rewards(forest, rewards_PxW)
    seg = jax.vmap(lambda p, x: portool_core(p, x, None, 0.0, options))(forest.leaf_path, r)
    return _finish(forest, seg)


@register_estimator("portool_tool", PORToolToolOptions, inputs=("tool_success_PxN",))
def portool_tool(forest: Forest, rewards_PxW: jax.Array, options: PORToolToolOptions = PORToolToolOptions(), *,
                 tool_success_PxN: jax.Array) -> Advantages:
    r = check_rewards(forest, rewards_PxW)
    expected = tuple(forest.node_parent.shape)
    if tuple(tool_success_PxN.shape) != expected:
        raise ValueError(f"tool_success_PxN has shape {tuple(tool_success_PxN.shape)}, the forest has [P, N] = {expected}")
    s = jnp.asarray(tool_success_PxN, jnp.float32)
    seg = jax.vmap(lambda p, x, t: portool_core(p, x, t, options.tool_weight, options))(forest.leaf_path, r, s)
    return _finish(forest, seg)


portool.__doc__ = _PORTOOL_DOC
portool_tool.__doc__ = _PORTOOL_DOC
