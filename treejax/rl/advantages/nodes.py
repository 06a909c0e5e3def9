"""Node values of one prompt's tree, computed from ``leaf_path`` alone (node ids index a table of size N).

Values are kept *canonical per node* (one number per node id, gathered back to every leaf through it) and
computed as deviations from a per-prompt reference reward, so that equal rewards give exactly equal values
and value differences are exactly 0 where they should be.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from treejax.forest import subgroup_masks
from treejax.rl.advantages.common import pairwise_sum


def first_occurrence(group_DxWxW: jax.Array, leaf_path_WxD1: jax.Array) -> jax.Array:
    """[W, D+1] bool: leaf i is the lowest-index leaf through its depth-d node (so each node is counted once)."""
    w = leaf_path_WxD1.shape[0]
    earlier = jnp.arange(w)[None, :] < jnp.arange(w)[:, None]  # [i, j]: j < i
    seen = jnp.any(group_DxWxW & earlier[None], axis=-1)  # [D+1, W]
    return (~seen).T & (leaf_path_WxD1 >= 0)


def leaf_end_nodes(leaf_path_WxD1: jax.Array) -> jax.Array:
    """[W] node id of each leaf's last node (the root for a leaf with no segment)."""
    depth = jnp.sum(leaf_path_WxD1[:, 1:] >= 0, axis=-1)
    return jnp.take_along_axis(leaf_path_WxD1, depth[:, None], axis=-1)[:, 0]


def node_values_leaf_mean(leaf_path_WxD1: jax.Array, rewards_W: jax.Array, num_nodes: int) -> jax.Array:
    """[N] ``V(n) = mean of R over the leaves whose path contains n`` (0 for unused node ids)."""
    ref = rewards_W[0]
    idx = jnp.where(leaf_path_WxD1 >= 0, leaf_path_WxD1, num_nodes)
    dev = jnp.broadcast_to((rewards_W - ref)[:, None], leaf_path_WxD1.shape)
    total = jnp.zeros((num_nodes,), jnp.float32).at[idx].add(dev, mode="drop")
    count = jnp.zeros((num_nodes,), jnp.float32).at[idx].add(1.0, mode="drop")
    return jnp.where(count > 0, ref + total / jnp.maximum(count, 1.0), 0.0)


def node_values_child_mean(
    leaf_path_WxD1: jax.Array, rewards_W: jax.Array, group_DxWxW: jax.Array, num_nodes: int
) -> jax.Array:
    """[N] bottom-up values: a leaf's last node has ``V = R``; an inner node has the unweighted mean of its
    children's values (the official TreePO ``calculate_rewards_iterative``). Differs from the leaf mean when
    subtrees under one node hold different numbers of leaves."""
    w, d1 = leaf_path_WxD1.shape
    ref = rewards_W[0]
    first = first_occurrence(group_DxWxW, leaf_path_WxD1)
    ends = leaf_end_nodes(leaf_path_WxD1)
    value = jnp.zeros((num_nodes,), jnp.float32).at[ends].set(rewards_W - ref)
    is_end = jnp.zeros((num_nodes,), bool).at[ends].set(True)
    for d in range(d1 - 2, -1, -1):
        child, parent = leaf_path_WxD1[:, d + 1], leaf_path_WxD1[:, d]
        use = first[:, d + 1] & (child >= 0)
        pidx = jnp.where(use, parent, num_nodes)
        child_val = jnp.where(use, value[jnp.clip(child, 0, num_nodes - 1)], 0.0)
        total = jnp.zeros((num_nodes,), jnp.float32).at[pidx].add(child_val, mode="drop")
        count = jnp.zeros((num_nodes,), jnp.float32).at[pidx].add(use.astype(jnp.float32), mode="drop")
        value = jnp.where((count > 0) & ~is_end, total / jnp.maximum(count, 1.0), value)
    used = jnp.zeros((num_nodes,), bool).at[jnp.where(leaf_path_WxD1 >= 0, leaf_path_WxD1, num_nodes)].set(
        True, mode="drop"
    )
    return jnp.where(used, ref + value, 0.0)


def gather_path_values(node_value_N: jax.Array, leaf_path_WxD1: jax.Array) -> jax.Array:
    """[W, D+1] value of the node at each depth of each leaf's path (0 past the leaf's end)."""
    v = node_value_N[jnp.clip(leaf_path_WxD1, 0, node_value_N.shape[0] - 1)]
    return jnp.where(leaf_path_WxD1 >= 0, v, 0.0)


def leaf_mean_differences(leaf_path_WxD1: jax.Array, rewards_W: jax.Array) -> jax.Array:
    """[W, D] ``V(n_{k+1}) - V(n_k)`` along each leaf's path for leaf-mean values, rounded once (0 past its end).

    With c = the leaves under the depth-(k+1) node and p = those under its parent (c inside p):

        V(c) - V(p) = (1 / (|c| |p|)) sum_{j in c} sum_{l in p} (R_j - R_l)

    Every ``R_j - R_l`` is exact for rewards on a coarse grid (and accurate to the rewards' *spread*
    otherwise), the sums are pairwise and the only other rounding is the final division. Subtracting two
    separately rounded means instead loses ``2^-24 * max|R|`` absolutely, which is a large relative error
    when ``|V(c) - V(p)|`` is small (e.g. 5e-6 for a difference of 0.0125 next to rewards of 1), and SPO's
    normalization by the children's std would amplify exactly that. Equal rewards give exactly 0.
    """
    group = subgroup_masks(leaf_path_WxD1)  # [D+1, W, W]
    diff = rewards_W[:, None] - rewards_W[None, :]
    s = pairwise_sum(jnp.where(group, diff[None], 0.0), axis=-1)  # [D+1, W]: sum_{l in G_d(j)} (R_j - R_l)
    size = jnp.sum(group.astype(jnp.float32), axis=-1)  # [D+1, W], integer counts
    numerator = pairwise_sum(jnp.where(group[1:], s[:-1, None, :], 0.0), axis=-1)  # [D, W]: sum over j in c
    out = numerator / jnp.maximum(size[1:] * size[:-1], 1.0)  # |c| |p| <= W^2: exact
    return jnp.where(leaf_path_WxD1[:, 1:] >= 0, out.T, 0.0)
