"""TreePO's estimators (Li et al. 2025, arXiv 2508.17445, §2.3; official code
``verl/trainer/ppo/core_algos.py`` of multimodal-art-projection/TreePO)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from treejax.forest import Forest, subgroup_masks
from treejax.rl.advantages.common import (
    broadcast_leaves,
    broadcast_segments,
    centered_by_groups,
    check_rewards,
    masked_whiten,
    masked_product,
    pairwise_sum,
    whiten_stats,
)
from treejax.rl.advantages.nodes import (
    gather_path_values,
    leaf_mean_differences,
    node_values_child_mean,
    node_values_leaf_mean,
)
from treejax.rl.advantages.registry import Advantages, register_estimator


# ------------------------------------------------------------------------------------------------- treepo
@dataclasses.dataclass(frozen=True)
class TreePOOptions:
    """``weighting``: "average" (paper §4.2's choice, the released run script) or "group_size" (Eq. 6, the
    official function's default). ``reject_zero_std``: Eq. 7 subgroup rejection. ``whiten``: batch-global
    token-weighted whitening (official code: always)."""

    weighting: Literal["average", "group_size"] = "average"
    reject_zero_std: bool = False
    whiten: bool = True
    whiten_eps: float = 1e-8

    def __post_init__(self):
        if self.weighting not in ("average", "group_size"):
            raise ValueError(f"TreePOOptions.weighting must be 'average' or 'group_size', got {self.weighting!r}")


def treepo_core(leaf_path_WxD1: jax.Array, rewards_W: jax.Array, options: TreePOOptions) -> jax.Array:
    """One prompt: the per-leaf subgroup advantage before whitening, [W]."""
    group = subgroup_masks(leaf_path_WxD1)  # [D+1, W, W]
    a, size = centered_by_groups(rewards_W, group)  # [D+1, W]
    depth = jnp.arange(group.shape[0])[:, None]
    is_root = depth == 0
    above_end = depth < jnp.sum(leaf_path_WxD1[:, 1:] >= 0, axis=-1)[None, :]  # not the leaf's own end node
    include = is_root | ((size > 1) & above_end)
    if options.reject_zero_std:
        differs = rewards_W[:, None] != rewards_W[None, :]
        nonconstant = jnp.any(group & differs[None], axis=-1)
        include = include & (is_root | nonconstant)
    weight = jnp.where(include, size if options.weighting == "group_size" else 1.0, 0.0)
    # integer weights: their sum is exact in any order; the weighted terms go through the pairwise sum
    return pairwise_sum(masked_product(weight, a, include), axis=0) / jnp.sum(weight, axis=0)


@register_estimator("treepo", TreePOOptions, ragged=True)
def treepo(forest: Forest, rewards_PxW: jax.Array, options: TreePOOptions = TreePOOptions()) -> Advantages:
    r"""TreePO subgroup advantage: one scalar per leaf, broadcast over the leaf's tokens, whitened batch-globally.

    For leaf i with reward R_i, let G_d(i) be the leaves sharing leaf i's node at depth d (d = 0 is the root:
    all W leaves of the prompt). The included groups J(i) are: the root group always; a deeper group only if
    it holds more than one leaf (|G_d(i)| > 1) and is not the group of leaf i's own end node (that group
    holds only copies of leaf i itself -- a slot tree's duplicates, ``TreeConfig.allocation = "slots"`` -- whose
    a_d = 0 would otherwise dilute an early stop's advantage); with ``reject_zero_std`` a deeper group only if its
    rewards are not all equal (Eq. 7; the root is never rejected — if its rewards are all equal every term is 0).

        a_d(i) = R_i - mean_{j in G_d(i)} R_j
        average    (paper Eq. 5 without the std, "average" in the code):  A_i = (1/|J|) sum_{d in J} a_d(i)
        group_size (paper Eq. 6, the code's default):    A_i = sum_{d in J} |G_d| a_d(i) / sum_{d in J} |G_d|

    then ``tokens = masked_whiten(A broadcast over tokens)``: subtract the token-weighted mean over every
    valid token of the batch and divide by sqrt(unbiased variance + 1e-8), as the official code (and
    REINFORCE++-baseline) does. ``leaves`` holds the whitened per-leaf values.

    Paper vs official code: Eq. 5 divides each subgroup term by a std; the code never does (it centres only,
    the std appears only through the global whitening) — this implements the code. The code builds groups
    by path prefixes of depth 0..D-1; a depth-D group is a single leaf, so it is excluded either way.
    The paper reports plain averaging best and rejection harmful (§4.2), hence the defaults.

    Worked example (W = 4, b = 2, two segments of S = 1 token, every leaf 2 tokens long)::

        root 0 -> nodes 1, 2;  1 -> leaves' nodes 3, 4;  2 -> 5, 6
        leaf_path = [[0,1,3], [0,1,4], [0,2,5], [0,2,6]],  R = [1, 1, 0, 1]
        root group: mean 0.75 -> a_0 = [0.25, 0.25, -0.75, 0.25]
        depth-1 groups {0,1} mean 1, {2,3} mean 0.5 -> a_1 = [0, 0, -0.5, 0.5]
        depth-2 groups are single leaves -> excluded
        average:    A = [0.125, 0.125, -0.625, 0.375]
        group_size: A = [(4*0.25+2*0)/6, ..] = [1/6, 1/6, -2/3, 1/3]
        whitening (average): 8 tokens, mean 0, unbiased var = 2*(2*0.125^2+0.625^2+0.375^2)/7 = 0.16071428
            -> leaves = A / sqrt(0.16071428 + 1e-8) = [0.31180, 0.31180, -1.55902, 0.93541]

    >>> import numpy as np
    >>> from treejax.forest import forest_from_paths
    >>> f = forest_from_paths(np.array([[[0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 2, 6]]]), np.full((1, 4), 2), 1)
    >>> R = np.array([[1.0, 1.0, 0.0, 1.0]], np.float32)
    >>> print(np.round(np.asarray(treepo(f, R, TreePOOptions(whiten=False)).leaves), 5))
    [[ 0.125  0.125 -0.625  0.375]]
    >>> print(np.round(np.asarray(treepo(f, R, TreePOOptions(weighting="group_size", whiten=False)).leaves), 5))
    [[ 0.16667  0.16667 -0.66667  0.33333]]
    >>> print(np.round(np.asarray(treepo(f, R).leaves), 5))
    [[ 0.3118   0.3118  -1.55902  0.93541]]
    """
    r = check_rewards(forest, rewards_PxW)
    a = jax.vmap(lambda p, x: treepo_core(p, x, options))(forest.leaf_path, r)
    tokens = broadcast_leaves(a, forest.loss_mask)
    if not options.whiten:
        return Advantages(tokens=tokens, loss_mask=forest.loss_mask, leaves=a)
    mu, inv = whiten_stats(tokens, forest.loss_mask, eps=options.whiten_eps)
    leaves = (a - mu) * inv
    return Advantages(tokens=broadcast_leaves(leaves, forest.loss_mask), loss_mask=forest.loss_mask, leaves=leaves)


# ----------------------------------------------------------------------------------------- treepo_segment
@dataclasses.dataclass(frozen=True)
class TreePOSegmentOptions:
    """``eta``: parent discount (1.0 = plain V(node) - V(parent)); ``node_value``: "leaf_mean" (mean reward of
    the leaves under the node) or "child_mean" (bottom-up unweighted mean of the children, official code);
    ``root_value``: "mean" (V(root) = mean reward of the prompt) or "zero" (official code)."""

    eta: float = 1.0
    node_value: Literal["leaf_mean", "child_mean"] = "leaf_mean"
    root_value: Literal["mean", "zero"] = "mean"
    whiten: bool = True
    whiten_eps: float = 1e-8

    def __post_init__(self):
        if self.node_value not in ("leaf_mean", "child_mean"):
            raise ValueError(f"node_value must be 'leaf_mean' or 'child_mean', got {self.node_value!r}")
        if self.root_value not in ("mean", "zero"):
            raise ValueError(f"root_value must be 'mean' or 'zero', got {self.root_value!r}")
        if not self.eta > 0:
            raise ValueError(f"eta must be > 0, got {self.eta}")


def path_values(leaf_path_WxD1, rewards_W, num_nodes: int, node_value: str, root_value: str) -> jax.Array:
    """[W, D+1] V of the node at each depth of each leaf's path (0 past its end)."""
    if node_value == "leaf_mean":
        v_n = node_values_leaf_mean(leaf_path_WxD1, rewards_W, num_nodes)
    else:
        v_n = node_values_child_mean(leaf_path_WxD1, rewards_W, subgroup_masks(leaf_path_WxD1), num_nodes)
    v = gather_path_values(v_n, leaf_path_WxD1)
    if root_value == "zero":
        v = v.at[:, 0].set(0.0)
    return v


def treepo_segment_core(leaf_path_WxD1, rewards_W, num_nodes: int, options: TreePOSegmentOptions) -> jax.Array:
    """One prompt: per-segment advantages [W, D] before whitening (0 past each leaf's last segment)."""
    if options.node_value == "leaf_mean" and options.root_value == "mean" and options.eta == 1.0:
        return leaf_mean_differences(leaf_path_WxD1, rewards_W)  # same value, one rounding (see there)
    v = path_values(leaf_path_WxD1, rewards_W, num_nodes, options.node_value, options.root_value)
    d = leaf_path_WxD1.shape[1] - 1
    depth = jnp.sum(leaf_path_WxD1[:, 1:] >= 0, axis=-1)  # [W]
    k = jnp.arange(d)[None, :]  # 0-based segment index
    valid = k < depth[:, None]
    if options.eta != 1.0:
        exponent = jnp.clip(depth[:, None] - k, 0, d)  # 1 for the leaf's last segment
        powers = np.float32(options.eta) ** np.arange(d + 1, dtype=np.float32)  # static table: exact in jit
        seg = v[:, 1:] - masked_product(jnp.asarray(powers)[exponent], v[:, :-1], valid)
    else:
        seg = v[:, 1:] - v[:, :-1]
    return jnp.where(valid, seg, 0.0)


@register_estimator("treepo_segment", TreePOSegmentOptions, ragged=True)
def treepo_segment(
    forest: Forest, rewards_PxW: jax.Array, options: TreePOSegmentOptions = TreePOSegmentOptions()
) -> Advantages:
    r"""Segment-level TreePO ("progress" advantage): each segment is credited with the change of value it caused.

    Node value (``node_value="leaf_mean"``, default): V(n) = mean reward of the leaves whose path passes n
    (computed once per node; the leaf's last node has V = R_i, the root has the prompt's mean reward).
    For leaf i of depth D_i (segments k = 0..D_i-1, segment k is the node n_{k+1} at depth k+1 on its path):

        A_i[k] = V(n_{k+1}) - eta^(D_i - k) * V(n_k)

    i.e. **the exponent is the number of segments from the segment's own node down to the leaf, inclusive**:
    1 for the leaf's last segment, D_i for its first one (exactly the official code's ``adv_eta ** (len(nodes)
    - i)`` with ``len(nodes) = D_i + 1`` and node position ``i = k + 1``; the code applies it only for
    ``adv_eta > 0``). With eta = 1 the values telescope along a path: sum_k A_i[k] = R_i - V(root).
    Each token takes its segment's value (via ``segment_index``); then batch-global token-weighted whitening
    (``whiten=True``, unbiased variance, as the official code). ``segments`` holds A before whitening.

    Official code (``compute_tree_rfpp_progress_outcome_advantage``, present but unused in the released
    runs) differs in three ways, two of which are options: node values are the bottom-up *mean of the
    children* (``node_value="child_mean"``), the root's value is set to 0 (``root_value="zero"``), and the leaf
    rewards are first replaced by a size-weighted subgroup advantage (``tree_group_wise_reward``; not done
    here — compose with your own reward transform if wanted). It also fills segments by position
    (``k * S``) rather than by ``segment_index``, identical for fixed-length segments.
    """
    r = check_rewards(forest, rewards_PxW)
    num_nodes = int(forest.node_parent.shape[1])
    seg = jax.vmap(lambda p, x: treepo_segment_core(p, x, num_nodes, options))(forest.leaf_path, r)
    tokens = broadcast_segments(seg, forest.segment_index, forest.loss_mask)
    if options.whiten:
        tokens = masked_whiten(tokens, forest.loss_mask, eps=options.whiten_eps)
    return Advantages(tokens=tokens, loss_mask=forest.loss_mask, segments=seg)
