"""A³ (Action Advantage Assignment): turn advantages over a turn forest from the episode's relative outcome, the
residuals of AST action sub-chains and tree-level trajectory margins.

Input ``action_signature_PxWxD [P, W, D]`` (the multi-turn source's :func:`treejax.rl.multiturn.action_signatures`,
from the shell world's ``info["action_signature"]``, :mod:`treejax.envs.shell`): for leaf slot ``w`` and its turn
at depth ``t + 1``, an id (per prompt, ``>= 0``) of the command-name chain of the turn's parsed action
(``"find|wc"``, ``"grep"``, ``"cd && ls"``; one id for every action that does not parse), ``-1`` where the turn
ran no command (the answer turn) or does not exist. Every leaf slot is one trajectory (a node shared by ``k``
slots is a turn of each of their ``k`` trajectories, as in the official code's rows, one per trajectory and turn).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from treejax.forest import Forest
from treejax.rl.advantages.common import broadcast_segments, check_rewards, pairwise_sum
from treejax.rl.advantages.info_gain import discounted_to_go, turn_layout
from treejax.rl.advantages.registry import Advantages, register_estimator

_MAD_TO_STD = 1.4826  # a normal distribution's std per median absolute deviation
_TINY = 1e-9


def _finite(x, lo=0.0) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x >= lo


@dataclasses.dataclass(frozen=True)
class A3Options:
    """The three terms' weights (gin; defaults: the released config's ``w_trie = 0.65``, ``w_action_cluster =
    1.0``, the episode term 1); ``scopes`` / ``scope_weights``: the sub-chain windows (``s >= 1``: the last ``s``
    turns' command-name chains up to this turn; ``-1``: the whole trajectory's) and their weights (normalised to sum
    1); ``support_prior``: the margin's shrinkage count; ``decision_gamma``: the discount of later margins;
    ``term_bound`` / ``adv_bound``: the soft bounds ``b tanh(x / b)`` of the robust-scaled terms and of the sum (0:
    none); ``balance``: divide each term by its mean absolute value over the batch's turns; ``min_scale``: the
    floor of the robust scale; ``eps``."""

    episode_weight: float = 1.0
    residual_weight: float = 0.65
    margin_weight: float = 1.0
    scopes: tuple[int, ...] = (1, 2, 3, -1)
    scope_weights: tuple[float, ...] = (0.25, 0.25, 0.25, 0.25)
    support_prior: float = 0.1
    decision_gamma: float = 0.9
    term_bound: float = 1.0
    adv_bound: float = 1.1
    balance: bool = True
    min_scale: float = 0.5
    eps: float = 1e-6

    def __post_init__(self):
        for name in ("episode_weight", "residual_weight", "margin_weight", "support_prior", "term_bound", "adv_bound",
                     "min_scale"):
            if not _finite(getattr(self, name)):
                raise ValueError(f"A3Options.{name} must be a finite number >= 0, got {getattr(self, name)!r}")
        scopes, weights = tuple(self.scopes), tuple(self.scope_weights)
        object.__setattr__(self, "scopes", scopes)  # hashable (a static jit argument) even when gin gives lists
        object.__setattr__(self, "scope_weights", weights)
        if (not scopes or len(weights) != len(scopes) or any(not (isinstance(s, int) and (s >= 1 or s == -1))
                                                               for s in scopes)
                or not all(_finite(w) for w in weights) or sum(weights) <= 0):
            raise ValueError(f"A3Options: scopes must be integers >= 1 or -1 with one weight >= 0 each (not all 0), "
                             f"got scopes={self.scopes!r}, scope_weights={self.scope_weights!r}")
        if not (_finite(self.decision_gamma) and self.decision_gamma <= 1.0):
            raise ValueError(f"A3Options.decision_gamma must be in [0, 1], got {self.decision_gamma!r}")
        if not (_finite(self.eps) and self.eps > 0):
            raise ValueError(f"A3Options.eps must be a finite number > 0, got {self.eps!r}")


def soft_bound(x: jax.Array, bound: float) -> jax.Array:
    """``bound * tanh(x / bound)`` (``x`` for ``bound = 0``)."""
    return bound * jnp.tanh(x / bound) if bound > 0 else x


def robust_score(x: jax.Array, member: jax.Array, options: A3Options) -> jax.Array:
    """Over the ``member`` entries of the last axis: ``soft_bound((x - median) / (max(1.4826 MAD, min_scale) +
    eps), term_bound)``; 0 outside ``member``."""
    c = jnp.nanmedian(jnp.where(member, x, jnp.nan), axis=-1, keepdims=True)
    mad = jnp.nanmedian(jnp.where(member, jnp.abs(x - c), jnp.nan), axis=-1, keepdims=True)
    scale = jnp.maximum(_MAD_TO_STD * mad, options.min_scale) + options.eps
    z = soft_bound(jnp.where(member, (x - c) / scale, 0.0), options.term_bound)
    return jnp.where(member, z, 0.0)


def scope_agreement(sig_WxD: jax.Array, scope: int) -> jax.Array:
    """bool[W, W, D]: slots w and v have the same command-name chains on the window of ``scope`` at turn t (the
    turns ``t - scope + 1 .. t``; ``-1``: every turn of both trajectories)."""
    D = sig_WxD.shape[1]
    mism = (sig_WxD[:, None, :] != sig_WxD[None, :, :]).astype(jnp.int32)
    cs = jnp.concatenate([jnp.zeros(mism.shape[:2] + (1,), jnp.int32), jnp.cumsum(mism, axis=-1)], axis=-1)
    if scope == -1:
        return jnp.broadcast_to(cs[:, :, -1:] == 0, mism.shape)
    t = jnp.arange(D)
    return (cs[:, :, t + 1] - cs[:, :, jnp.maximum(t + 1 - scope, 0)]) == 0


def subchain_residuals(R_W, sig_WxD, member_WxD, options: A3Options) -> jax.Array:
    """[W, D]: ``sum_s w_s (R_w - mean_{v != w in g_s(w, t)} R_v)`` over the scopes (0 for a group of one and
    outside ``member``), ``g_s(w, t)``: the command turns at depth t + 1 whose chains agree on scope s's window."""
    weights = [float(w) / sum(options.scope_weights) for w in options.scope_weights]
    both = member_WxD[:, None, :] & member_WxD[None, :, :]
    out = jnp.zeros(sig_WxD.shape, jnp.float32)
    for scope, w in zip(options.scopes, weights):
        group = scope_agreement(sig_WxD, scope) & both  # [W, V, D]
        n = jnp.sum(group, axis=1).astype(jnp.float32)  # includes w itself
        dev = pairwise_sum(jnp.moveaxis(jnp.where(group, R_W[:, None, None] - R_W[None, :, None], 0.0), 1, -1),
                           axis=-1)
        out = out + jnp.float32(w) * jnp.where(n > 1.5, dev / jnp.maximum(n - 1.0, 1.0), 0.0)  # leave one out
    return jnp.where(member_WxD, out, 0.0)


def branch_gains(leaf_path_WxD1: jax.Array, R_W: jax.Array, options: A3Options):
    """``(gain [W, D], support [W, D])``: at a fork (the turn's parent node, the root included, has >= 2 distinct
    children), ``gain = k (V(child) - V(parent))`` and ``support = k``, ``k = n / (n + support_prior + eps)`` with
    ``n`` the slots through the child and ``V`` a node's mean reward over its slots; 0 elsewhere."""
    node, parent = leaf_path_WxD1[:, 1:], leaf_path_WxD1[:, :-1]
    exists = (node >= 0) & (leaf_path_WxD1[:, :1] >= 0)
    pair = exists[:, None, :] & exists[None, :, :]
    same_child = (node[:, None, :] == node[None, :, :]) & pair  # [W, V, D]
    same_parent = (parent[:, None, :] == parent[None, :, :]) & pair
    n_child = jnp.sum(same_child, axis=1).astype(jnp.float32)
    n_parent = jnp.sum(same_parent, axis=1).astype(jnp.float32)
    children = jnp.sum(jnp.where(same_parent, 1.0 / jnp.maximum(n_child, 1.0)[None, :, :], 0.0), axis=1)
    d = R_W[None, :, None] - R_W[:, None, None]  # [W, V, 1]: R_v - R_w (exact 0 for equal rewards)
    def mean_dev(group, n):  # mean over the group of R_v - R_w
        return pairwise_sum(jnp.moveaxis(jnp.where(group, d, 0.0), 1, -1), axis=-1) / jnp.maximum(n, 1.0)

    margin = mean_dev(same_child, n_child) - mean_dev(same_parent, n_parent)  # V(child) - V(parent)
    fork = exists & (children > 1.5)
    shrink = n_child / (n_child + options.support_prior + options.eps)
    return jnp.where(fork, shrink * margin, 0.0), jnp.where(fork, shrink, 0.0)


def a3_prompt(leaf_path_WxD1, R_W, sig_WxD, options: A3Options):
    """One prompt's raw terms ``(episode [W], residual [W, D], margin [W, D])`` (module docstring, before the
    balance and the weights)."""
    used = leaf_path_WxD1[:, 0] >= 0
    valid = (leaf_path_WxD1[:, 1:] >= 0) & used[:, None]
    episode = robust_score(R_W, used, options)
    member = valid & (sig_WxD >= 0)
    raw = subchain_residuals(R_W, sig_WxD, member, options)
    residual = robust_score(raw.reshape(-1), member.reshape(-1), options).reshape(sig_WxD.shape)
    gain, support = branch_gains(leaf_path_WxD1, R_W, options)
    ret = discounted_to_go(gain, valid, options.decision_gamma)
    sup = discounted_to_go(support, valid, options.decision_gamma)
    margin = sup / (sup + options.support_prior + options.eps) * ret
    return episode, residual, jnp.where(valid, margin, 0.0)


def a3_turns(forest: Forest, rewards_PxW, options: A3Options, action_signature_PxWxD):
    """``(advantages [P, W, D], episode [P, W], residual [P, W, D], margin [P, W, D])`` of :func:`a3` (the terms
    before the balance and the weights)."""
    R = check_rewards(forest, rewards_PxW)
    _, valid, _ = turn_layout(forest)
    sig = jnp.asarray(action_signature_PxWxD)
    if tuple(sig.shape) != tuple(valid.shape) or not jnp.issubdtype(sig.dtype, jnp.integer):
        raise ValueError(f"action_signature_PxWxD must be integers of shape [P, W, D] = {tuple(valid.shape)}, got "
                         f"{sig.dtype} {tuple(sig.shape)}")
    episode, residual, margin = jax.vmap(lambda p, r, s: a3_prompt(p, r, s, options))(
        forest.leaf_path, R, sig.astype(jnp.int32))
    terms = [jnp.where(valid, episode[:, :, None], 0.0), residual, margin]
    if options.balance:  # each term over its mean |value| on the batch's turns
        count = jnp.maximum(jnp.sum(valid).astype(jnp.float32), 1.0)
        terms = [x / (pairwise_sum(jnp.abs(x).reshape(-1)) / count + _TINY) for x in terms]
    weights = (options.episode_weight, options.residual_weight, options.margin_weight)
    total = sum(jnp.float32(w) * x for w, x in zip(weights, terms))
    return jnp.where(valid, soft_bound(total, options.adv_bound), 0.0), episode, residual, margin


@register_estimator("a3", A3Options, inputs=("action_signature_PxWxD",))
def a3(forest: Forest, rewards_PxW, options: A3Options = A3Options(), *, action_signature_PxWxD) -> Advantages:
    r"""A³, Action Advantage Assignment (Su and Wen 2026, "Learning CLI Agents with Structured Action Credit under
    Selective Observation", arXiv 2605.08013; official code ``algo/A3_algo.py`` of Hoyant-Su/Agentic-RL-A3).

    Per prompt p, slot (trajectory) w with outcome ``R_w``, turn t at node ``n_{w,t}`` with parent ``u``; with
    ``rob(x) = bt((x - median x) / (max(1.4826 MAD x, min_scale) + eps))`` over the group and ``bt(x) = b tanh(x /
    b)``, ``b = term_bound``::

        E_w      = rob_p(R)_w                                                   episode feedback
        rho_{w,t} = sum_s w_s (R_w - mean_{v in g_s(w,t), v != w} R_v)           sub-chain residual (leave one out)
        Rho_{w,t} = rob(rho)_{w,t}   over p's command turns
        gain_{w,t} = k (V(n_{w,t}) - V(u)),  k = n / (n + support_prior + eps)   at forks (u has >= 2 children)
        M_{w,t}  = S / (S + support_prior + eps) * sum_{j >= t} gamma_d^(j - t) gain_{w,j}   tree-level margin
        A_{w,t}  = bt_{adv_bound}(episode_weight E/|E| + residual_weight Rho/|Rho| + margin_weight M/|M|)

    ``g_s(w, t)``: the command turns at the same depth whose command-name chains (the AST signatures) agree on the
    scope's window (the last ``s`` turns, or the whole trajectory for ``-1``); a group of one gives 0. ``V(n)``:
    the mean reward of the slots through node n; ``n``: the slots through the child; ``S``: the same discounted sum
    of ``k``; ``|X|``: the mean absolute value of the term over the batch's turns (``balance``). ``A`` goes to each
    turn's policy tokens (0 on observations); ``segments`` holds it per (slot, turn). Turns without a command
    (answers) have no residual; every turn has ``E`` and ``M``.

    Read from the paper's abstract and the released code (followed, not copied): the episode backbone's median/MAD
    scale with a 0.5 floor and the tanh bounds, the leave-one-out residuals over multi-scale windows (1, 2, 3 and
    the whole trajectory, equal weights), the shrunk child-minus-parent margins, discounted with a support gate,
    and the mean-absolute-value balance before the weighted sum (0.65 and 1.0 in its config). Where this differs:
    (1) the official code clusters bash texts by an "intent" distance (its ``BashIntentActionSpace``) with single
    linkage; here a sub-chain is the exact command-name chain of the parsed AST; (2) it finds shared states by the
    similarity of earlier turns' intents; here the tree's nodes are the states (exact shared prefixes) and a branch
    is a child node; (3) it keeps one residual per trajectory (its first row's) for all of the trajectory's turns;
    here each turn keeps its own, scaled over the prompt's command turns; (4) it trains with GSPO's sequence-level
    ratio; here the advantage goes to the learner's loss like every estimator's. The paper's own equations were not
    read (only its abstract), so its exact form may differ from both.
    """
    adv, _, _, _ = a3_turns(forest, rewards_PxW, options, action_signature_PxWxD)
    tokens = broadcast_segments(adv, forest.segment_index, forest.loss_mask)
    return Advantages(tokens=tokens, loss_mask=forest.loss_mask, segments=adv)


__all__ = ["A3Options", "a3", "a3_prompt", "a3_turns", "branch_gains", "robust_score", "scope_agreement",
           "soft_bound", "subchain_residuals"]
