"""Estimators for multi-turn (agentic) turn forests that group *steps* by their state: GiGPO, HGPO and SALT.

Turn forest (:func:`treejax.forest.forest_from_spans`): a node at depth ``d >= 1`` is one turn, the policy's
action tokens (``policy_mask`` 1) followed by the environment's observation tokens (``policy_mask`` 0); its
children are different next turns from the same state. Every leaf *slot* is one policy sample (a path that
ended early while holding several slots is stored once per slot), so every statistic below counts slots:

* a *step* is a (slot ``w``, depth ``d``) pair on slot ``w``'s path; the step of slot ``w`` at depth ``d`` is the
  node ``n = leaf_path[w, d]``, and its *anchor state* is the state it acted from, its parent ``leaf_path[w, d-1]``
  (depth 0: the root = the prompt);
* a step's *return* (one reward at the episode end, discount ``gamma`` per turn): ``g_w(d) = gamma^(D_w - d) R_w``
  with ``D_w`` the depth of slot w's last node (``g = R_w`` for the last turn); a node shared by several slots
  has one return, the **mean over the slots through it** (each slot is a sample of that step):
  ``G(n) = mean_{w through n} g_w(d(n))``. Every copy of the node's tokens then carries the same step advantage,
  and group statistics weigh a node by its number of slots (the policy's expectation under slot sampling).

State identity: two anchor states are identical when both parents carry observation tokens and those token
sequences are equal (compared through two 32-bit polynomial hashes of the observation tokens and their count,
:func:`node_state_keys`), or when they are the same node. A node without observation tokens (the root = the
prompt, fixed segments, a final answer turn) is identified by its node id only: an empty observation says
nothing about the state. ``leaf_weight`` is not read: turn forests are slot trees (every slot weighs 1).

Per-step values go to tokens with :func:`~treejax.rl.advantages.common.broadcast_segments` (``segments[p, w,
d-1]`` is the step at depth d); tokens are exactly 0 where ``loss_mask`` is 0 (observation tokens included).
The tree-shaped estimators (Tree-GRPO, TreePS-RAG, PORTool) are in :mod:`.agentic_tree`.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Literal

import jax
import jax.numpy as jnp
import numpy as np

from treejax.forest import Forest, subgroup_masks
from treejax.rl.advantages.common import (
    broadcast_segments,
    centered_by_groups,
    check_rewards,
    materialize,
    pairwise_sum,
)
from treejax.rl.advantages.flat import GRPOOptions, grpo_core
from treejax.rl.advantages.nodes import first_occurrence
from treejax.rl.advantages.registry import Advantages, register_estimator

# --------------------------------------------------------------------------------------------- helpers
_BASES = (0x01000193, 0x5BD1E995)  # two odd multipliers: the polynomial bases of the two hashes
_MIX = (0x9E3779B1, 0x85EBCA6B)


@functools.lru_cache(maxsize=None)
def _power_table(base: int, length: int) -> np.ndarray:
    """uint32[length]: ``base^r mod 2^32`` (host-side, exact in Python integers)."""
    out, x = np.zeros(max(length, 1), np.uint32), 1
    for r in range(length):
        out[r] = x
        x = (x * base) % (1 << 32)
    return out


def _mix(tokens: jax.Array) -> jax.Array:
    """A uint32 scramble of ``token + 1`` (so token 0 contributes, and the polynomial's terms are not linear in
    the token ids)."""
    x = (tokens.astype(jnp.uint32) + jnp.uint32(1)) * jnp.uint32(_MIX[0])
    x = x ^ (x >> jnp.uint32(15))
    return x * jnp.uint32(_MIX[1])


def node_state_keys(forest: Forest, content: Literal["observation", "all"] = "observation"):
    """Content keys of every node on every leaf slot's path: ``(hash [P, W, D+1, 2] uint32, count [P, W, D+1])``.

    ``content="observation"``: the node's tokens with ``policy_mask`` 0 (what the environment wrote), in order;
    ``"all"``: all of the node's tokens (action and observation). ``hash[..., i] = sum_r mix(tok_r) B_i^r mod
    2^32`` over those tokens (``r`` = the token's rank among them), ``count`` their number; column ``d`` is the
    node at depth ``d`` of the slot's path (column 0, the root, has count 0). Slots through a node agree on its
    tokens, so each slot's row holds the node's key. Two different sequences of the same length collide with
    probability ~2^-64 for two random-like hashes (mod 2^32 polynomials are not adversarially robust; these are
    environment strings, not attacks). Jittable.
    """
    if content not in ("observation", "all"):
        raise ValueError(f"content must be 'observation' or 'all', got {content!r}")
    P, W, T = forest.tokens.shape
    D1 = forest.leaf_path.shape[2]
    seg = forest.segment_index
    valid = seg >= 0
    sel = valid & (forest.policy_tokens() == 0) if content == "observation" else valid
    col = jnp.where(valid, seg + 1, 0)
    node = jnp.maximum(forest.token_nodes(), 0)
    start = jax.vmap(lambda s, n: s[n])(forest.spans()[:, :, 0], node)  # [P, W, T]
    count_before = jnp.cumsum(sel.astype(jnp.int32), axis=-1) - sel.astype(jnp.int32)
    base = jnp.take_along_axis(count_before, jnp.clip(start, 0, T - 1), axis=-1)
    rank = jnp.clip(count_before - base, 0, T - 1)
    mixed = _mix(forest.tokens)
    p_idx = jnp.arange(P)[:, None, None]
    w_idx = jnp.arange(W)[None, :, None]
    hashes = []
    for b in _BASES:
        term = jnp.where(sel, mixed * jnp.asarray(_power_table(b, T))[rank], jnp.uint32(0))
        hashes.append(jnp.zeros((P, W, D1), jnp.uint32).at[p_idx, w_idx, col].add(term))
    count = jnp.zeros((P, W, D1), jnp.int32).at[p_idx, w_idx, col].add(sel.astype(jnp.int32))
    return jnp.stack(hashes, axis=-1), count


def pairwise_state_equal(hash_Mx2: jax.Array, count_M: jax.Array, node_M: jax.Array) -> jax.Array:
    """bool[M, M]: states i and j are identical: both have content and equal (hashes, count), or both have none
    and are the same node; never for a missing state (``node < 0``)."""
    has = count_M > 0
    same_content = jnp.all(hash_Mx2[:, None, :] == hash_Mx2[None, :, :], axis=-1) & (count_M[:, None] == count_M[None, :])
    same_node = node_M[:, None] == node_M[None, :]
    eq = jnp.where(has[:, None] & has[None, :], same_content, ~has[:, None] & ~has[None, :] & same_node)
    return eq & (node_M[:, None] >= 0) & (node_M[None, :] >= 0)


def shift_columns(x_WxD: jax.Array, s: int, fill) -> jax.Array:
    """``out[:, k] = x[:, k - s]`` (``fill`` for ``k < s``)."""
    if s == 0:
        return x_WxD
    pad = jnp.full((x_WxD.shape[0], s) + x_WxD.shape[2:], fill, x_WxD.dtype)
    return jnp.concatenate([pad, x_WxD[:, : x_WxD.shape[1] - s]], axis=1)


def group_relative(x_M: jax.Array, group_MxM: jax.Array, scale_by_std: bool, unbiased: bool, eps: float):
    """``(a, size)`` [M] each: ``a_i = x_i - mean_{j in G(i)} x_j`` (exactly 0 when the group's values are equal),
    divided by ``std_G + eps`` when ``scale_by_std`` (unbiased: n - 1). Groups must be equivalence classes
    (``G(j) = G(i)`` for ``j in G(i)``); rows in no group get ``a = 0``, size 0. A group of one gives 0."""
    a, size = centered_by_groups(x_M, group_MxM[None])
    a, size = a[0], size[0]
    if scale_by_std:
        sq = materialize(a * a)
        denom = jnp.maximum(size - 1.0 if unbiased else size, 1.0)
        var = pairwise_sum(jnp.where(group_MxM, sq[None, :], 0.0), axis=-1) / denom
        a = a * materialize(1.0 / (jnp.sqrt(var) + eps))
    return jnp.where(size > 0, a, 0.0), size


def node_slot_mean(leaf_path_WxD1: jax.Array, x_WxD: jax.Array) -> jax.Array:
    """[W, D]: ``mean_{v through n} x[v, k]`` for the node ``n = leaf_path[w, k + 1]`` (0 past the slot's end).

    Computed as ``x_ref + mean_v (x_v - x_ref)`` with ``x_ref`` the value of the node's lowest-index slot: one
    number per node (every slot through it gets the same bits), exactly ``x`` when the slots' values are equal."""
    full = subgroup_masks(leaf_path_WxD1)  # [D+1, W, W]
    group = full[1:]
    xt = x_WxD.T  # [D, W]
    first = first_occurrence(full, leaf_path_WxD1)[:, 1:].T  # [D, W]: v is its node's lowest-index slot
    ref = jnp.sum(jnp.where(group & first[:, None, :], xt[:, None, :], 0.0), axis=-1)  # one term: exact
    total = pairwise_sum(jnp.where(group, xt[:, None, :] - ref[:, :, None], 0.0), axis=-1)  # [D, W]
    count = jnp.sum(group, axis=-1, dtype=jnp.int32).astype(jnp.float32)
    return jnp.where(leaf_path_WxD1[:, 1:] >= 0, (ref + total / jnp.maximum(count, 1.0)).T, 0.0)


def step_returns(leaf_path_WxD1: jax.Array, rewards_W: jax.Array, gamma: float) -> jax.Array:
    """[W, D]: ``G(n)`` of each slot's step at depth k + 1: the mean over the slots through the node of
    ``gamma^(D_w - k - 1) R_w`` (0 past the slot's end)."""
    d = leaf_path_WxD1.shape[1] - 1
    valid = leaf_path_WxD1[:, 1:] >= 0
    if gamma == 1.0:
        g = jnp.where(valid, rewards_W[:, None], 0.0)
    else:
        depth = jnp.sum(valid, axis=-1)
        exponent = jnp.clip(depth[:, None] - 1 - jnp.arange(d)[None, :], 0, d)
        powers = jnp.asarray(np.float32(gamma) ** np.arange(d + 1, dtype=np.float32))  # static table
        g = jnp.where(valid, materialize(powers[exponent] * rewards_W[:, None]), 0.0)
    return node_slot_mean(leaf_path_WxD1, g)


def _check_choice(cls: str, name: str, value, choices) -> None:
    if value not in choices:
        raise ValueError(f"{cls}.{name} must be one of {choices}, got {value!r}")


def _check_eps(cls: str, eps: float) -> None:
    if not (isinstance(eps, (int, float)) and eps > 0 and math.isfinite(eps)):
        raise ValueError(f"{cls}.eps must be a finite number > 0, got {eps!r}")


def _check_gamma(cls: str, gamma: float) -> None:
    if not (isinstance(gamma, (int, float)) and 0.0 < gamma <= 1.0):
        raise ValueError(f"{cls}.gamma must be in (0, 1], got {gamma!r}")


def _finish(forest: Forest, seg_PxWxD: jax.Array, leaves=None) -> Advantages:
    seg = jnp.where(forest.leaf_path[:, :, 1:] >= 0, seg_PxWxD, 0.0).astype(jnp.float32)
    tokens = broadcast_segments(seg, forest.segment_index, forest.loss_mask)
    return Advantages(tokens=tokens, loss_mask=forest.loss_mask, leaves=leaves, segments=seg)


# ---------------------------------------------------------------------------------------------- gigpo
@dataclasses.dataclass(frozen=True)
class GiGPOOptions:
    """``mode``: "mean_norm" (F = 1, default) or "mean_std_norm" (F = the group's unbiased std + eps), for both
    levels as verl-agent's ``algorithm.gigpo.mode``; ``omega``: the step advantage's weight (verl-agent's
    ``step_advantage_w``); ``gamma``: the per-turn discount of the step return (0.95, verl-agent's example
    scripts); ``match_observations``: anchor groups also merge parents with identical observation content
    (else only the children of one parent node form a group)."""

    mode: Literal["mean_norm", "mean_std_norm"] = "mean_norm"
    omega: float = 1.0
    gamma: float = 0.95
    match_observations: bool = True
    eps: float = 1e-6

    def __post_init__(self):
        _check_choice("GiGPOOptions", "mode", self.mode, ("mean_norm", "mean_std_norm"))
        if not (isinstance(self.omega, (int, float)) and self.omega >= 0 and math.isfinite(self.omega)):
            raise ValueError(f"GiGPOOptions.omega must be a finite number >= 0, got {self.omega!r}")
        _check_gamma("GiGPOOptions", self.gamma)
        _check_eps("GiGPOOptions", self.eps)


def anchor_groups(leaf_path_WxD1, hash_WxD1x2, count_WxD1, match_observations: bool) -> jax.Array:
    """bool[W D, W D]: steps (w, k) and (v, l) (flattened ``w * D + k``; the step at depth k + 1) share their
    anchor state: the same parent node, or (``match_observations``) parents with identical observation content."""
    W, D1 = leaf_path_WxD1.shape
    D = D1 - 1
    valid = (leaf_path_WxD1[:, 1:] >= 0).reshape(W * D)
    parent = leaf_path_WxD1[:, :-1].reshape(W * D)
    if match_observations:
        eq = pairwise_state_equal(hash_WxD1x2[:, :-1].reshape(W * D, 2), count_WxD1[:, :-1].reshape(W * D), parent)
    else:
        eq = (parent[:, None] == parent[None, :]) & (parent[:, None] >= 0)
    return eq & valid[:, None] & valid[None, :]


def gigpo_core(leaf_path_WxD1, rewards_W, hash_WxD1x2, count_WxD1, options: GiGPOOptions):
    """One prompt: ``(segments [W, D], episode advantages [W])``."""
    W, D1 = leaf_path_WxD1.shape
    D = D1 - 1
    std = options.mode == "mean_std_norm"
    episode = grpo_core(rewards_W, GRPOOptions(scale_by_std=std, unbiased_std=True, eps=options.eps), leaf_path_WxD1)
    G = step_returns(leaf_path_WxD1, rewards_W, options.gamma).reshape(W * D)
    group = anchor_groups(leaf_path_WxD1, hash_WxD1x2, count_WxD1, options.match_observations)
    step, _ = group_relative(G, group, std, True, options.eps)
    seg = episode[:, None] + materialize(np.float32(options.omega) * step.reshape(W, D))
    return jnp.where(leaf_path_WxD1[:, 1:] >= 0, seg, 0.0), episode


@register_estimator("gigpo", GiGPOOptions)
def gigpo(forest: Forest, rewards_PxW: jax.Array, options: GiGPOOptions = GiGPOOptions()) -> Advantages:
    r"""GiGPO, group-in-group policy optimization (Feng et al. 2025, arXiv 2505.10978; official code
    ``gigpo/core_gigpo.py`` of langfengQ/verl-agent), on a turn forest.

    Episode level, over the prompt's W leaf slots: ``A^E_w = (R_w - mean_v R_v) / F`` with ``F = 1``
    ("mean_norm") or ``std_v R_v + eps`` (unbiased std, "mean_std_norm").

    Step level: the step of slot w at depth d is node ``n = leaf_path[w, d]``, acting from the anchor state of
    its parent. Its return ``G(n) = mean_{w through n} gamma^(D_w - d) R_w`` (the discounted episode reward,
    ``R_t = sum_k gamma^k r_{t+k}`` with the only reward at the end, averaged over the slots that sampled the
    step). Anchor group ``A(w, d)``: every step (v, e) whose parent is the same node, or, with
    ``match_observations``, whose parent has the identical observation token content (see the module docstring;
    parents without observation tokens -- the root = the prompt -- match only themselves); steps are counted
    per slot, so a node holding m slots appears m times.

        A^S(w, d) = (G(n) - mean_{(v,e) in A(w,d)} G(n_{v,e})) / F_A        (0 for a group of one)
        A(w, d)   = A^E_w + omega A^S(w, d)        -> every token of node n on slot w (0 on observation tokens)

    Variant vs the official code: its anchor groups match the *current* environment observation string of each
    step (optionally >= 0.95 similar); here a step's state is its parent node (exact) plus identical parent
    observations (exact, no similarity threshold). Its episode statistics default to counting every step row
    (``compute_mean_std_cross_all_data``); here every slot counts once. verl uses mean 0 / std 1 for a group
    of one; here a single sample gives 0. ``segments`` holds A per (slot, depth); ``leaves`` is None.
    """
    r = check_rewards(forest, rewards_PxW)
    h, c = node_state_keys(forest, "observation")
    seg, _ = jax.vmap(lambda p, x, hh, cc: gigpo_core(p, x, hh, cc, options))(forest.leaf_path, r, h, c)
    return _finish(forest, seg)


def cluster_state_keys(forest: Forest, state_cluster_PxN: jax.Array):
    """``(hash [P, W, D+1, 2], count [P, W, D+1])`` like :func:`node_state_keys`, from a host clustering of the
    nodes' observations: ``state_cluster_PxN[p, n]`` the cluster id of node n's observation (``-1``: none, the node
    is then identified by its id only). Two nodes are the same state iff they share a cluster id."""
    cluster = jnp.asarray(state_cluster_PxN, jnp.int32)
    col = jnp.take_along_axis(cluster[:, None, :], jnp.maximum(forest.leaf_path, 0), axis=-1)  # [P, W, D+1]
    col = jnp.where(forest.leaf_path >= 0, col, -1)
    has = col >= 0
    h = jnp.stack([jnp.where(has, col, 0).astype(jnp.uint32), jnp.zeros_like(col, jnp.uint32)], axis=-1)
    return h, has.astype(jnp.int32)


@register_estimator("gigpo_similar", GiGPOOptions, inputs=("state_cluster_PxN",))
def gigpo_similar(forest: Forest, rewards_PxW: jax.Array, options: GiGPOOptions = GiGPOOptions(), *,
                  state_cluster_PxN: jax.Array) -> Advantages:
    """GiGPO with the official code's *similar* anchor states: as :func:`gigpo`, but two parents are the same
    anchor state when their observations fall in one cluster of ``state_cluster_PxN`` (``[P, N]`` int, ``-1`` for
    a node without observation), which the multi-turn source builds on the host: observations whose
    ``difflib.SequenceMatcher`` ratio to a cluster's first member is at least ``MultiTurnConfig.state_similarity``
    (0.95, verl-agent's ``similarity_thresh``) join it (:func:`treejax.rl.multiturn.state_clusters`).
    ``match_observations`` must be on (it is what the clusters feed)."""
    if not options.match_observations:
        raise ValueError("gigpo_similar matches observations by their clusters: GiGPOOptions.match_observations must "
                         "be True")
    expected = tuple(forest.node_parent.shape)
    if tuple(state_cluster_PxN.shape) != expected:
        raise ValueError(f"state_cluster_PxN has shape {tuple(state_cluster_PxN.shape)}, the forest has [P, N] = "
                         f"{expected}")
    r = check_rewards(forest, rewards_PxW)
    h, c = cluster_state_keys(forest, state_cluster_PxN)
    seg, _ = jax.vmap(lambda p, x, hh, cc: gigpo_core(p, x, hh, cc, options))(forest.leaf_path, r, h, c)
    return _finish(forest, seg)


# ----------------------------------------------------------------------------------------------- hgpo
@dataclasses.dataclass(frozen=True)
class HGPOOptions:
    """``max_observations`` K: the deepest context level (the official ``history_length`` is K - 1, default 2);
    ``alpha``, ``weight_offset``: level weights ``w_k = (k + weight_offset)^alpha`` (official code: offset 0,
    alpha 1; the method summary's ``(k + 1)^alpha`` is offset 1); ``scale_by_std``: z-score (population std, as
    the code's ``np.std``) instead of mean-centring ("mean_norm", the code's default); ``skip_zero``: drop a
    level whose advantage is exactly 0 from the weighted mean (the code's ``advantage != 0`` filter);
    ``trajectory_weight``: weight of an extra episode-level term (the GRPO advantage of the slot, 0 = off)."""

    max_observations: int = 3
    alpha: float = 1.0
    weight_offset: int = 0
    gamma: float = 0.95
    scale_by_std: bool = False
    skip_zero: bool = True
    trajectory_weight: float = 0.0
    eps: float = 1e-6

    def __post_init__(self):
        if not (isinstance(self.max_observations, int) and self.max_observations >= 1):
            raise ValueError(f"HGPOOptions.max_observations must be an int >= 1, got {self.max_observations!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha)):
            raise ValueError(f"HGPOOptions.alpha must be a finite number, got {self.alpha!r}")
        if not (isinstance(self.weight_offset, int) and self.weight_offset >= 0):
            raise ValueError(f"HGPOOptions.weight_offset must be an int >= 0, got {self.weight_offset!r}")
        if not (isinstance(self.trajectory_weight, (int, float)) and self.trajectory_weight >= 0
                and math.isfinite(self.trajectory_weight)):
            raise ValueError(f"HGPOOptions.trajectory_weight must be a finite number >= 0, got {self.trajectory_weight!r}")
        _check_gamma("HGPOOptions", self.gamma)
        _check_eps("HGPOOptions", self.eps)

    def level_weight(self, k: int) -> float:
        return float((k + self.weight_offset) ** self.alpha)


def context_groups(leaf_path_WxD1, hash_WxD1x2, count_WxD1, levels: int) -> list[jax.Array]:
    """``levels`` bool[W D, W D] matrices: level k (1-based) groups the steps whose last k states -- the anchor
    (parent) and its k - 1 ancestors -- are pairwise identical (:func:`pairwise_state_equal`); a step at depth
    d < k has no level-k group."""
    W, D1 = leaf_path_WxD1.shape
    D = D1 - 1
    valid = (leaf_path_WxD1[:, 1:] >= 0).reshape(W * D)
    ids, hs, cs = leaf_path_WxD1[:, :-1], hash_WxD1x2[:, :-1], count_WxD1[:, :-1]  # the anchor column of each step
    out, eq = [], valid[:, None] & valid[None, :]
    for s in range(levels):
        node = shift_columns(ids, s, -1).reshape(W * D)
        eq = eq & pairwise_state_equal(shift_columns(hs, s, 0).reshape(W * D, 2),
                                       shift_columns(cs, s, 0).reshape(W * D), node)
        out.append(eq)
    return out


def hgpo_core(leaf_path_WxD1, rewards_W, hash_WxD1x2, count_WxD1, options: HGPOOptions):
    """One prompt's HGPO segments [W, D]."""
    W, D1 = leaf_path_WxD1.shape
    D = D1 - 1
    G = step_returns(leaf_path_WxD1, rewards_W, options.gamma).reshape(W * D)
    total = jnp.zeros((W * D,), jnp.float32)
    weight = jnp.zeros((W * D,), jnp.float32)
    for k, group in enumerate(context_groups(leaf_path_WxD1, hash_WxD1x2, count_WxD1, options.max_observations), 1):
        a, size = group_relative(G, group, options.scale_by_std, False, options.eps)
        include = size > 1
        if options.skip_zero:
            include = include & (a != 0)
        wk = np.float32(options.level_weight(k))
        total = total + jnp.where(include, materialize(wk * a), 0.0)
        weight = weight + jnp.where(include, wk, 0.0)
    total, weight = total.reshape(W, D), weight.reshape(W, D)
    if options.trajectory_weight > 0:
        episode = grpo_core(rewards_W, GRPOOptions(scale_by_std=options.scale_by_std, unbiased_std=True,
                                                   eps=options.eps), leaf_path_WxD1)
        wt = np.float32(options.trajectory_weight)
        total = total + materialize(wt * episode)[:, None]
        weight = weight + wt
    seg = jnp.where(weight > 0, total / jnp.maximum(weight, 1e-30), 0.0)
    return jnp.where(leaf_path_WxD1[:, 1:] >= 0, seg, 0.0)


@register_estimator("hgpo", HGPOOptions)
def hgpo(forest: Forest, rewards_PxW: jax.Array, options: HGPOOptions = HGPOOptions()) -> Advantages:
    r"""HGPO, hierarchy-of-groups policy optimization (He et al. 2026, arXiv 2602.22817; official code
    ``recipe/hgpo/core_hgpo.py`` of langfengQ/verl-agent, read from a public copy), on a turn forest.

    Step return ``G(n)`` as in :func:`gigpo` (discounted episode reward, mean over the slots through the node).
    For k = 1..K, the level-k group of the step of slot w at depth d holds the steps whose last k states are
    identical: the anchor (parent, depth d - 1) and the k - 1 states before it (depths d - 2, ..., d - k; the
    root = the prompt is one state), each compared by observation content (node id when it has none). Steps
    with fewer than k states in their history (d < k) have no level-k group.

        a_k(w, d) = G(n) - mean_{level-k group} G        (or / (population std + eps) with scale_by_std)
        A(w, d)   = sum_{k in J} w_k a_k / sum_{k in J} w_k,      w_k = (k + weight_offset)^alpha

    J = the levels whose group holds more than one step (and, with ``skip_zero``, whose a_k != 0, as the
    official code); no level -> A = 0. With ``trajectory_weight`` w_0 > 0 the slot's episode-level advantage
    ``(R_w - mean R) [/ (unbiased std + eps)]`` joins the weighted mean with weight w_0 (the optional k = 0 trajectory level).

    Variant vs the official code: there, level ``l = 0..history_length`` matches the current observation plus
    the l previous ones, weighted ``(l + 1)^alpha`` -- our level k = l + 1 with ``weight_offset = 0``; groups
    there are over trajectories' step rows, here over slots (a node counts once per slot through it).
    """
    r = check_rewards(forest, rewards_PxW)
    h, c = node_state_keys(forest, "observation")
    seg = jax.vmap(lambda p, x, hh, cc: hgpo_core(p, x, hh, cc, options))(forest.leaf_path, r, h, c)
    return _finish(forest, seg)


# ----------------------------------------------------------------------------------------------- salt
@dataclasses.dataclass(frozen=True)
class SALTOptions:
    """``merge``: which steps are one merged step: "node" (the tree's nodes), "observation" (also nodes at the
    same depth with identical observation content; nodes without one stay themselves) or "content" (nodes at
    the same depth with identical tokens, action and observation). ``scale_by_std``/``unbiased_std``/``eps``:
    the trajectory-level GRPO advantage."""

    merge: Literal["node", "observation", "content"] = "node"
    scale_by_std: bool = True
    unbiased_std: bool = True
    eps: float = 1e-6

    def __post_init__(self):
        _check_choice("SALTOptions", "merge", self.merge, ("node", "observation", "content"))
        _check_eps("SALTOptions", self.eps)


def merged_steps(leaf_path_WxD1, hash_WxD1x2, count_WxD1, merge: str) -> jax.Array:
    """bool[W D, W D]: steps (w, k) and (v, l) are the same merged step (same depth, and same node or same
    content key of the node itself)."""
    W, D1 = leaf_path_WxD1.shape
    D = D1 - 1
    node = leaf_path_WxD1[:, 1:].reshape(W * D)
    depth = jnp.broadcast_to(jnp.arange(D)[None, :], (W, D)).reshape(W * D)
    if merge == "node":
        eq = node[:, None] == node[None, :]
    else:
        eq = pairwise_state_equal(hash_WxD1x2[:, 1:].reshape(W * D, 2), count_WxD1[:, 1:].reshape(W * D), node)
    return eq & (depth[:, None] == depth[None, :]) & (node[:, None] >= 0) & (node[None, :] >= 0)


def salt_core(leaf_path_WxD1, rewards_W, hash_WxD1x2, count_WxD1, options: SALTOptions):
    W, D1 = leaf_path_WxD1.shape
    D = D1 - 1
    traj = grpo_core(rewards_W, GRPOOptions(scale_by_std=options.scale_by_std, unbiased_std=options.unbiased_std,
                                            eps=options.eps), leaf_path_WxD1)
    x = jnp.broadcast_to(traj[:, None], (W, D)).reshape(W * D)
    group = merged_steps(leaf_path_WxD1, hash_WxD1x2, count_WxD1, options.merge)
    total = pairwise_sum(jnp.where(group, x[None, :], 0.0), axis=-1)
    count = jnp.sum(group, axis=-1, dtype=jnp.int32).astype(jnp.float32)
    seg = jnp.where(count > 0, total / jnp.maximum(count, 1.0), 0.0).reshape(W, D)
    return jnp.where(leaf_path_WxD1[:, 1:] >= 0, seg, 0.0)


@register_estimator("salt", SALTOptions)
def salt(forest: Forest, rewards_PxW: jax.Array, options: SALTOptions = SALTOptions()) -> Advantages:
    r"""SALT (Li et al. 2025, arXiv 2510.20022): steps merged across a prompt's trajectories into a graph; a
    step's advantage is the mean of the trajectory advantages of the trajectories through it (implements the
    method summary T3-6 on the tree; no official code was available to check the paper's exact rule).

        A_w      = (R_w - mean_v R_v) / (std_v R_v + eps)            (GRPO over the prompt's slots)
        A(w, d)  = mean_{(v, d) merged with (w, d)} A_v              -> the tokens of slot w's depth-d node

    ``merge="node"``: a merged step is a tree node, so the mean runs over the slots through it (a node on one
    slot keeps A_w; a shared prefix gets the mean of its descendants'). "observation"/"content": nodes at the
    same depth whose observation (resp. whole token) content is identical are merged too (keys of
    :func:`node_state_keys`). ``segments`` holds A per (slot, depth).
    """
    r = check_rewards(forest, rewards_PxW)
    h, c = node_state_keys(forest, "all" if options.merge == "content" else "observation")
    seg = jax.vmap(lambda p, x, hh, cc: salt_core(p, x, hh, cc, options))(forest.leaf_path, r, h, c)
    return _finish(forest, seg)
