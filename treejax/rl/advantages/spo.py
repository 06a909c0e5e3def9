"""SPO-tree (Guo et al. 2025, "Segment Policy Optimization", arXiv 2505.23564, tree-based estimation)."""

from __future__ import annotations

import dataclasses
from typing import Literal

import jax
import jax.numpy as jnp

from treejax.forest import Forest, subgroup_masks
from treejax.rl.advantages.common import broadcast_segments, check_rewards, masked_whiten, materialize
from treejax.rl.advantages.nodes import first_occurrence, leaf_mean_differences
from treejax.rl.advantages.registry import Advantages, register_estimator
from treejax.rl.advantages.tree import path_values


@dataclasses.dataclass(frozen=True)
class SPOTreeOptions:
    """``normalize``: divide by the parent's std over its children; ``prob_threshold``: SPO's probability mask
    (train only tokens with pi(token) < threshold; None = off); ``whiten``: batch whitening (off in SPO)."""

    normalize: bool = False
    eps: float = 1e-6
    node_value: Literal["leaf_mean", "child_mean"] = "leaf_mean"
    prob_threshold: float | None = None
    whiten: bool = False
    whiten_eps: float = 1e-8

    def __post_init__(self):
        if self.node_value not in ("leaf_mean", "child_mean"):
            raise ValueError(f"node_value must be 'leaf_mean' or 'child_mean', got {self.node_value!r}")
        if self.prob_threshold is not None and not 0.0 < self.prob_threshold <= 1.0:
            raise ValueError(f"prob_threshold must be in (0, 1], got {self.prob_threshold}")


def spo_probability_mask(logprobs_PxWxT: jax.Array, loss_mask_PxWxT: jax.Array, threshold: float) -> jax.Array:
    """SPO's probability mask as a loss mask: keep a token only where ``pi(token) = exp(logprob) < threshold``.

    SPO argues that high-probability tokens carry little of a segment's credit, so the segment advantage is
    applied only to the low-probability ones; the other tokens leave the loss. Returns ``loss_mask`` x that test.
    """
    keep = jnp.exp(logprobs_PxWxT) < threshold
    return jnp.where(keep, loss_mask_PxWxT, 0.0)


def children_std(leaf_path_WxD1: jax.Array, value_WxD1: jax.Array, num_nodes: int) -> jax.Array:
    """[W, D] population std of the values of the children of leaf i's depth-k node (each child counted once),
    for k = 0..D-1; exactly 0 where all children share one value (and for a single child)."""
    group = subgroup_masks(leaf_path_WxD1)
    first = first_occurrence(group, leaf_path_WxD1)  # [W, D+1]
    d = leaf_path_WxD1.shape[1] - 1
    out = []
    for k in range(d):
        child, parent = leaf_path_WxD1[:, k + 1], leaf_path_WxD1[:, k]
        use = first[:, k + 1] & (child >= 0)
        pidx = jnp.where(use, parent, num_nodes)
        val = value_WxD1[:, k + 1]
        shift = jnp.full((num_nodes,), -jnp.inf).at[pidx].max(jnp.where(use, val, -jnp.inf), mode="drop")
        shift = jnp.where(jnp.isfinite(shift), shift, 0.0)
        dev = jnp.where(use, val - shift[jnp.clip(parent, 0, num_nodes - 1)], 0.0)
        cnt = jnp.zeros((num_nodes,), jnp.float32).at[pidx].add(use.astype(jnp.float32), mode="drop")
        s1 = jnp.zeros((num_nodes,), jnp.float32).at[pidx].add(dev, mode="drop")
        mean_dev = s1 / jnp.maximum(cnt, 1.0)
        centered = dev - mean_dev[jnp.clip(parent, 0, num_nodes - 1)]
        sq = jnp.where(use, materialize(centered * centered), 0.0)
        var = jnp.zeros((num_nodes,), jnp.float32).at[pidx].add(sq, mode="drop") / jnp.maximum(cnt, 1.0)
        out.append(jnp.where(parent >= 0, jnp.sqrt(var)[jnp.clip(parent, 0, num_nodes - 1)], 0.0))
    return jnp.stack(out, axis=1)


def spo_tree_core(leaf_path_WxD1, rewards_W, num_nodes: int, options: SPOTreeOptions) -> jax.Array:
    """One prompt: per-segment advantages [W, D] (0 past each leaf's last segment)."""
    d = leaf_path_WxD1.shape[1] - 1
    depth = jnp.sum(leaf_path_WxD1[:, 1:] >= 0, axis=-1)
    valid = jnp.arange(d)[None, :] < depth[:, None]
    if options.node_value == "leaf_mean":
        seg = leaf_mean_differences(leaf_path_WxD1, rewards_W)  # V(child) - V(parent), rounded once
        # The std over the children of one parent is shift-invariant: std_c V(c) = std_c (V(c) - V(parent)),
        # so the accurate differences serve as the children's values.
        v = jnp.concatenate([jnp.zeros_like(seg[:, :1]), seg], axis=1)
    else:
        v = path_values(leaf_path_WxD1, rewards_W, num_nodes, options.node_value, "mean")
        seg = v[:, 1:] - v[:, :-1]
    if options.normalize:
        std = children_std(leaf_path_WxD1, v, num_nodes)
        seg = jnp.where(std > 0, seg / (std + options.eps), 0.0)
    return jnp.where(valid, seg, 0.0)


@register_estimator("spo_tree", SPOTreeOptions, ragged=True)
def spo_tree(forest: Forest, rewards_PxW: jax.Array, options: SPOTreeOptions = SPOTreeOptions()) -> Advantages:
    r"""SPO-tree segment advantage: ``A(child) = V(child) - V(parent)``, broadcast over the child's segment.

    V(n) = mean reward of the leaves under n (``node_value="leaf_mean"``, SPO-tree's Monte-Carlo estimate from
    the tree itself; "child_mean" = unweighted mean of the children, as TreePO's port). For segment k of leaf i
    (node n_{k+1} at depth k+1, parent n_k; V(root) = the prompt's mean reward):

        A_i[k] = V(n_{k+1}) - V(n_k)                                  (normalize=False)
        A_i[k] = (V(n_{k+1}) - V(n_k)) / (std_{c in children(n_k)} V(c) + eps)   (normalize=True)

    with the population std over the distinct children of n_k; where that std is 0 (a single child, or all
    children of equal value) the normalized advantage is defined as 0. The SPO probability mask
    (``prob_threshold``) narrows ``Advantages.loss_mask`` to low-probability tokens (see
    :func:`spo_probability_mask`). No whitening by default (SPO, and TreePO's port ``compute_spo_advantage``).

    Differences to TreePO's port of SPO: the port normalizes each node by its siblings as
    ``(V - mean_siblings) / std_siblings`` before differencing and sets V(root) = 0; here the parent's own
    value is the baseline as in the SPO paper, and the std only rescales.
    """
    r = check_rewards(forest, rewards_PxW)
    num_nodes = int(forest.node_parent.shape[1])
    seg = jax.vmap(lambda p, x: spo_tree_core(p, x, num_nodes, options))(forest.leaf_path, r)
    mask = forest.loss_mask
    if options.prob_threshold is not None:
        mask = spo_probability_mask(forest.logprobs, mask, options.prob_threshold)
    tokens = broadcast_segments(seg, forest.segment_index, mask)
    if options.whiten:
        tokens = masked_whiten(tokens, mask, eps=options.whiten_eps)
    return Advantages(tokens=tokens, loss_mask=mask, segments=seg)
