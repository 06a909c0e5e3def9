"""A³ (Action Advantage Assignment): turn advantages over a turn forest from the episode's relative outcome, the
residuals of AST action sub-chains and tree-level trajectory margins.

Input ``action_signature_PxWxD [P, W, D]`` (the multi-turn source's :func:`treejax.rl.multiturn.action_signatures`,
from the shell world's ``info["action_signature"]``, :mod:`treejax.envs.shell`): for leaf slot ``w`` and its turn
at depth ``t + 1``, an id (per prompt, ``>= 0``) of the command-name chain of the turn's parsed action
(``"find|wc"``, ``"grep"``, ``"cd && ls"``; one id for every action that does not parse), ``-1`` where the turn
ran no command (the answer turn) or does not exist. Every leaf slot is one sample (weight 1; a node shared by
``k`` slots counts once per slot, as its turn does in each of their trajectories).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from treejax.forest import Forest
from treejax.rl.advantages.agentic import group_relative, node_slot_mean
from treejax.rl.advantages.common import broadcast_segments, check_rewards, pairwise_sum
from treejax.rl.advantages.info_gain import _VAR_FLOOR, group_normalize, turn_layout
from treejax.rl.advantages.registry import Advantages, register_estimator

#: ``A3Options.residual_group`` values.
RESIDUAL_GROUPS = ("action", "prefix")


@dataclasses.dataclass(frozen=True)
class A3Options:
    """``episode_weight`` / ``residual_weight`` / ``margin_weight``: the weights of the three terms (gin);
    ``residual_group``: ``"action"`` (turns whose actions have the same command-name chain) or ``"prefix"`` (turns
    at the same depth whose trajectories' chains agree on every turn so far); ``gamma``: a turn's return is
    ``gamma^(K - 1 - t) R``; ``scale_by_std`` / ``eps``: every term is divided by the prompt's reward std + eps."""

    episode_weight: float = 1.0
    residual_weight: float = 1.0
    margin_weight: float = 1.0
    residual_group: str = "action"
    gamma: float = 1.0
    scale_by_std: bool = True
    eps: float = 1e-6

    def __post_init__(self):
        for name in ("episode_weight", "residual_weight", "margin_weight"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"A3Options.{name} must be a finite number >= 0, got {v!r}")
        if self.residual_group not in RESIDUAL_GROUPS:
            raise ValueError(f"A3Options.residual_group must be one of {RESIDUAL_GROUPS}, got {self.residual_group!r}")
        if not (isinstance(self.gamma, (int, float)) and 0.0 <= self.gamma <= 1.0):
            raise ValueError(f"A3Options.gamma must be in [0, 1], got {self.gamma!r}")
        if not (isinstance(self.eps, (int, float)) and self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"A3Options.eps must be a finite number > 0, got {self.eps!r}")


def _reward_scale(R_W: jax.Array, used_W: jax.Array, options: A3Options) -> jax.Array:
    """``std_p(R) + eps`` over the used slots (population std, ``sqrt(var + 1e-8)``; 1 for one slot), or 1."""
    if not options.scale_by_std:
        return jnp.float32(1.0)
    n = jnp.sum(used_W).astype(jnp.float32)
    mean = pairwise_sum(jnp.where(used_W, R_W, 0.0)) / jnp.maximum(n, 1.0)
    var = pairwise_sum(jnp.where(used_W, (R_W - mean) ** 2, 0.0)) / jnp.maximum(n, 1.0)
    return jnp.where(n <= 1, 1.0, jnp.sqrt(var + _VAR_FLOOR)) + jnp.float32(options.eps)


def residual_groups(sig_WxD: jax.Array, valid_WxD: jax.Array, mode: str) -> jax.Array:
    """bool[W D, W D] (flattened ``w * D + t``): turns (w, t) and (v, u) are one sub-chain group: both ran a
    command, and ``"action"``: the same signature; ``"prefix"``: ``t = u`` and the signatures agree at every depth
    ``<= t``."""
    W, D = sig_WxD.shape
    member = (valid_WxD & (sig_WxD >= 0)).reshape(-1)
    if mode == "action":
        flat = sig_WxD.reshape(-1)
        same = flat[:, None] == flat[None, :]
    else:
        eq = sig_WxD[:, None, :] == sig_WxD[None, :, :]  # [W, W, D]
        agree = jnp.cumprod(eq.astype(jnp.int32), axis=-1) > 0  # all depths <= t agree
        t = jnp.arange(D)
        same = (agree[:, :, :, None] & (t[:, None] == t[None, :])[None, None])  # [W, W, D, D]
        same = same.transpose(0, 2, 1, 3).reshape(W * D, W * D)
    return same & member[:, None] & member[None, :]


def sibling_margins(leaf_path_WxD1: jax.Array, R_W: jax.Array) -> jax.Array:
    """[W, D]: ``V(n) - mean_{c in C(u)} V(c)`` for slot w's turn node ``n`` at depth ``t + 1 >= 2`` with parent
    ``u`` (a turn node) having ``|C(u)| >= 2`` children (each child once), ``V`` the mean reward over the slots
    through a node; 0 elsewhere (depth-1 turns, nodes without siblings, missing turns)."""
    D = leaf_path_WxD1.shape[1] - 1
    node, parent = leaf_path_WxD1[:, 1:], leaf_path_WxD1[:, :-1]  # [W, D]: turn node and its parent
    V = node_slot_mean(leaf_path_WxD1, jnp.broadcast_to(R_W[:, None], node.shape))
    exists = (node >= 0) & (jnp.arange(D)[None, :] >= 1)
    same_parent = (parent[:, None, :] == parent[None, :, :]) & exists[:, None, :] & exists[None, :, :]  # [W, W, D]
    same_child = (node[:, None, :] == node[None, :, :]) & exists[:, None, :] & exists[None, :, :]
    per_child = 1.0 / jnp.maximum(jnp.sum(same_child, axis=0).astype(jnp.float32), 1.0)  # [W, D]: 1 / slots of v's node
    weight = jnp.where(same_parent, per_child[None, :, :], 0.0)  # [W, V, D]
    children = pairwise_sum(jnp.moveaxis(weight, 1, -1), axis=-1)  # [W, D]: |C(u)|
    diff = pairwise_sum(jnp.moveaxis(weight * (V[None, :, :] - V[:, None, :]), 1, -1), axis=-1)
    return jnp.where(exists & (children > 1.5), -diff / jnp.maximum(children, 1.0), 0.0)


def a3_prompt(leaf_path_WxD1, R_W, sig_WxD, options: A3Options):
    """One prompt's ``(advantages [W, D], episode term [W], residual term [W, D], margin term [W, D])``, each
    term divided by the reward scale (not yet weighted)."""
    W, D = sig_WxD.shape
    used = leaf_path_WxD1[:, 0] >= 0
    valid = (leaf_path_WxD1[:, 1:] >= 0) & used[:, None]
    scale = _reward_scale(R_W, used, options)
    episode = group_normalize(R_W, used, jnp.ones_like(R_W), False, options.eps) / scale
    depth = jnp.sum(valid, axis=-1)
    powers = jnp.float32(options.gamma) ** jnp.maximum(depth[:, None] - 1 - jnp.arange(D)[None, :], 0)
    G = jnp.where(valid, powers * R_W[:, None], 0.0)
    group = residual_groups(sig_WxD, valid, options.residual_group)
    residual, _ = group_relative(G.reshape(-1), group, False, False, options.eps)
    residual = residual.reshape(W, D) / scale
    margin = sibling_margins(leaf_path_WxD1, R_W) / scale
    adv = (jnp.float32(options.episode_weight) * episode[:, None] + jnp.float32(options.residual_weight) * residual
           + jnp.float32(options.margin_weight) * margin)
    return jnp.where(valid, adv, 0.0), episode, residual, margin


def a3_turns(forest: Forest, rewards_PxW, options: A3Options, action_signature_PxWxD):
    """``(advantages, episode, residual, margin)`` of :func:`a3` for the whole forest (``[P, W, D]``, ``[P, W]``,
    ``[P, W, D]``, ``[P, W, D]``)."""
    R = check_rewards(forest, rewards_PxW)
    _, valid, _ = turn_layout(forest)
    sig = jnp.asarray(action_signature_PxWxD)
    if tuple(sig.shape) != tuple(valid.shape) or not jnp.issubdtype(sig.dtype, jnp.integer):
        raise ValueError(f"action_signature_PxWxD must be integers of shape [P, W, D] = {tuple(valid.shape)}, got "
                         f"{sig.dtype} {tuple(sig.shape)}")
    return jax.vmap(lambda p, r, s: a3_prompt(p, r, s, options))(forest.leaf_path, R, sig.astype(jnp.int32))


@register_estimator("a3", A3Options, inputs=("action_signature_PxWxD",))
def a3(forest: Forest, rewards_PxW, options: A3Options = A3Options(), *, action_signature_PxWxD) -> Advantages:
    r"""A³, Action Advantage Assignment (Su and Wen 2026, "Learning CLI Agents with Structured Action Credit under
    Selective Observation", arXiv 2605.08013): turn-level advantages for command-line agents built from
    episode-level relative feedback, residuals of AST-based action sub-chains and tree-level trajectory margins.

    Per prompt p, leaf slot w with outcome ``R_w`` and turns ``t = 0 .. K_w - 1`` (node ``n_{w,t}``), and
    ``s_p = std_p(R) + eps`` (population std over p's slots; 1 with ``scale_by_std=False``)::

        A^ep_w      = (R_w - mean_p R) / s_p                                          (episode feedback)
        G_{w,t}     = gamma^(K_w - 1 - t) R_w                                         (the turn's return)
        rho_{w,t}   = (G_{w,t} - mean_{(v,u) in S(w,t)} G_{v,u}) / s_p               (sub-chain residual)
        M_{w,t}     = (V(n_{w,t}) - mean_{c in C(parent)} V(c)) / s_p                 (trajectory margin)
        A_{w,t}     = episode_weight A^ep_w + residual_weight rho_{w,t} + margin_weight M_{w,t}

    ``S(w, t)``: the command turns of p's slots in the same sub-chain group as (w, t) (``residual_group``:
    ``"action"``, the same command-name chain of the parsed action, e.g. every ``find|wc``; ``"prefix"``: the
    same depth and the same chains on every turn so far); turns without a command (answers) and groups of one
    get ``rho = 0``. ``V(n)``: the mean reward of the slots through node n; ``C(parent)``: the distinct children
    of ``n_{w,t}``'s parent turn node, each counted once (the sibling branches of a fork); ``M = 0`` at depth 1
    (the siblings there are the prompt's independent episodes, which ``A^ep`` already compares) and for a node
    without siblings (so with independent episodes only ``A^ep`` and ``rho`` act). ``A`` goes to each turn's policy
    tokens (0 on observations); ``segments`` holds it per (slot, turn).

    What is reconstructed: only the paper's abstract and a secondary summary were read (the official repository,
    Hoyant-Su/Agentic-RL-A3, was not). They give the three sources (episode-level relative feedback, AST-based
    action sub-chain residuals comparing similar actions, a tree-level margin of a chosen branch against the
    other paths from the same state) and that A³ keeps standard agentic RL's complexity. Everything above beyond
    that is this module's choice, not checked against the paper: the sub-chain key (the command-name chain, or
    its trajectory prefix), residuals of the outcome return (not of a learned value), the sibling mean with each
    child once and no margin at depth 1, the shared scale ``s_p``, and the weighted sum.
    """
    adv, _, _, _ = a3_turns(forest, rewards_PxW, options, action_signature_PxWxD)
    tokens = broadcast_segments(adv, forest.segment_index, forest.loss_mask)
    return Advantages(tokens=tokens, loss_mask=forest.loss_mask, segments=adv)


__all__ = ["A3Options", "RESIDUAL_GROUPS", "a3", "a3_prompt", "a3_turns", "residual_groups", "sibling_margins"]
