"""MOSAIC's pairwise trajectory preferences as per-episode advantages (estimator ``"mosaic"``).

Input ``safety_verdict_PxWxC`` ([P, W, C], C = :data:`treejax.envs.guarded_user.VERDICT_COLUMNS`: ``decision``,
``success``, ``format``, each higher is better; NaN for a slot without guarded turns): each leaf slot's episode
verdict from the guarded simulated user (:func:`treejax.envs.guarded_user.safety_verdicts`). ``brevity`` is read
from the forest: minus the episode's policy tokens (``sum_t loss_mask``) when it made the right decision
(``decision = +1``), else 0, so that length only orders episodes that got the decision right. Statistics use
:func:`.info_gain.group_normalize` (weighted by ``Forest.leaf_weight``, population std, std 1 for a group of one,
exactly 0 for a group of equal values).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from treejax.errors import ConfigError
from treejax.forest import Forest
from treejax.rl.advantages.common import broadcast_leaves, check_rewards
from treejax.rl.advantages.info_gain import group_normalize
from treejax.rl.advantages.registry import Advantages, register_estimator

#: The judge's criteria, by name: the verdict's columns, then ``brevity`` (fewer policy tokens).
CRITERIA = ("decision", "success", "format", "brevity")
#: ``MOSAICOptions.objective`` values.
OBJECTIVES = ("win_rate", "bradley_terry")
#: Two criterion values closer than this are a tie (the format share is a fraction of at most a few turns).
TIE = 1e-6


@dataclasses.dataclass(frozen=True)
class MOSAICOptions:
    """``criteria``: the judge's lexicographic order (names of :data:`CRITERIA`, most important first; a gin list
    becomes a tuple); ``objective``: ``"win_rate"`` (each episode's share of won comparisons) or
    ``"bradley_terry"`` (the strengths of a Bradley-Terry model fitted to the group's comparisons, with a Gaussian
    prior of precision ``bt_prior`` and ``bt_steps`` Newton steps); ``scale_by_std`` / ``eps``: the group
    normalisation divides by ``std + eps``."""

    criteria: tuple[str, ...] = CRITERIA
    objective: str = "win_rate"
    bt_prior: float = 0.1
    bt_steps: int = 25
    scale_by_std: bool = True
    eps: float = 1e-6

    def __post_init__(self):
        object.__setattr__(self, "criteria", tuple(self.criteria))
        if not self.criteria or any(c not in CRITERIA for c in self.criteria) or len(set(self.criteria)) != len(
                self.criteria):
            raise ConfigError(f"MOSAICOptions.criteria must be distinct names of {CRITERIA}, got {self.criteria!r}; "
                              f"fix: MOSAICOptions.criteria = {CRITERIA}")
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"MOSAICOptions.objective must be one of {OBJECTIVES}, got {self.objective!r}; fix: "
                              "MOSAICOptions.objective = 'win_rate'")
        if not (isinstance(self.bt_prior, (int, float)) and math.isfinite(self.bt_prior) and self.bt_prior > 0):
            raise ConfigError(f"MOSAICOptions.bt_prior must be a finite number > 0 (it keeps an unbeaten episode's "
                              f"strength finite), got {self.bt_prior!r}; fix: MOSAICOptions.bt_prior = 0.1")
        if not (isinstance(self.bt_steps, int) and self.bt_steps >= 1):
            raise ConfigError(f"MOSAICOptions.bt_steps must be an int >= 1, got {self.bt_steps!r}; fix: "
                              "MOSAICOptions.bt_steps = 25")
        if not (isinstance(self.eps, (int, float)) and math.isfinite(self.eps) and self.eps > 0):
            raise ConfigError(f"MOSAICOptions.eps must be a finite number > 0, got {self.eps!r}; fix: "
                              "MOSAICOptions.eps = 1e-6")


def criteria_values(forest: Forest, safety_verdict_PxWxC, criteria: tuple[str, ...]):
    """``(values [P, W, K], member [P, W])``: each slot's criteria in the judge's order (``brevity``: minus its policy
    tokens after a right decision, else 0) and whether it takes part (a used slot with a finite verdict)."""
    P, W = forest.leaf_path.shape[:2]
    v = jnp.asarray(safety_verdict_PxWxC, jnp.float32)
    if v.ndim != 3 or tuple(v.shape[:2]) != (P, W) or v.shape[2] != len(CRITERIA) - 1:
        raise ValueError(f"safety_verdict_PxWxC has shape {tuple(v.shape)}, expected [P, W, C] = "
                         f"{(P, W, len(CRITERIA) - 1)}")
    tokens = jnp.sum(jnp.asarray(forest.loss_mask, jnp.float32), axis=-1)
    brevity = jnp.where(v[..., 0] > 0, -tokens, 0.0)  # only right decisions: a failure is not made shorter
    columns = {name: v[..., k] for k, name in enumerate(CRITERIA[:-1])} | {"brevity": brevity}
    member = (forest.leaf_path[:, :, 0] >= 0) & jnp.all(jnp.isfinite(v), axis=-1)
    values = jnp.stack([jnp.where(member, columns[c], 0.0) for c in criteria], axis=-1)
    return values, member


def pairwise_preferences(values_PxWxK, member_PxW):
    """``(pref [P, W, W], pair [P, W, W])``: ``pref[p, w, v]`` = +1 when episode ``w`` is preferred to ``v`` (the
    first criterion on which they differ by more than :data:`TIE` is higher for ``w``), -1 when ``v`` is, 0 for a
    tie; ``pair``: both take part and ``w != v``."""
    diff = values_PxWxK[:, :, None, :] - values_PxWxK[:, None, :, :]
    differs = jnp.abs(diff) > TIE
    first = differs & (jnp.cumsum(differs.astype(jnp.int32), axis=-1) == 1)
    pref = jnp.sum(jnp.where(first, jnp.sign(diff), 0.0), axis=-1)
    W = member_PxW.shape[1]
    pair = member_PxW[:, :, None] & member_PxW[:, None, :] & ~jnp.eye(W, dtype=bool)[None]
    return jnp.where(pair, pref, 0.0), pair


def win_rates(pref_PxWxW, pair_PxWxW, weight_PxW):
    """float32[P, W]: ``r_w = sum_v omega_v y_wv / sum_v omega_v`` over the episodes ``v`` compared with ``w``
    (``y = (pref + 1) / 2``: 1 a win, 1/2 a tie, 0 a loss; ``omega`` the slot weights); 1/2 with none."""
    w = jnp.where(pair_PxWxW, weight_PxW[:, None, :], 0.0)
    total = jnp.sum(w, axis=-1)
    won = jnp.sum(w * (pref_PxWxW + 1.0) * 0.5, axis=-1)
    return jnp.where(total > 0, won / jnp.maximum(total, 1e-30), 0.5)


def bradley_terry(pref_PxWxW, pair_PxWxW, prior: float, steps: int):
    """float32[P, W]: the maximiser of ``sum_{w != v} y_wv log sigmoid(theta_w - theta_v) - prior/2 sum theta^2`` per
    prompt (each compared pair once in each direction, ``y = (pref + 1) / 2``, a tie half a win each way), by
    ``steps`` Newton steps from 0 (the objective is strictly concave: the step is exact for its quadratic model);
    0 for slots without comparisons. At the optimum ``sum theta = 0`` and the gradient
    ``g_w = sum_v (y_wv - sigmoid(theta_w - theta_v)) - prior theta_w`` vanishes."""
    y = jnp.where(pair_PxWxW, (pref_PxWxW + 1.0) * 0.5, 0.0)
    on = pair_PxWxW.astype(jnp.float32)
    W = pref_PxWxW.shape[-1]
    eye = jnp.eye(W, dtype=jnp.float32)[None]

    def newton(_, theta):
        s = jax.nn.sigmoid(theta[:, :, None] - theta[:, None, :])
        g = jnp.sum(on * (y - s), axis=-1) - prior * theta
        c = on * s * (1.0 - s)
        hess = c - eye * (jnp.sum(c, axis=-1)[:, :, None] + prior)  # negative definite
        return theta - jnp.linalg.solve(hess, g[..., None])[..., 0]

    theta = jax.lax.fori_loop(0, steps, newton, jnp.zeros(pref_PxWxW.shape[:2], jnp.float32))
    return jnp.where(jnp.any(pair_PxWxW, axis=-1), theta, 0.0)


def mosaic_leaves(forest: Forest, rewards_PxW, options: MOSAICOptions, safety_verdict_PxWxC):
    """``(advantages [P, W], scores [P, W], pref [P, W, W])`` of :func:`mosaic`."""
    check_rewards(forest, rewards_PxW)
    values, member = criteria_values(forest, safety_verdict_PxWxC, options.criteria)
    pref, pair = pairwise_preferences(values, member)
    weight = forest.leaf_weights()
    if options.objective == "win_rate":
        score = win_rates(pref, pair, weight)
    else:
        score = bradley_terry(pref, pair, float(options.bt_prior), options.bt_steps)
    adv = group_normalize(score, member, weight, options.scale_by_std, options.eps)
    return adv, score, pref


@register_estimator("mosaic", MOSAICOptions, inputs=("safety_verdict_PxWxC",))
def mosaic(forest: Forest, rewards_PxW, options: MOSAICOptions = MOSAICOptions(), *,
           safety_verdict_PxWxC) -> Advantages:
    r"""MOSAIC (Agarwal et al. 2026, "Learning When to Act or Refuse: Guarding Agentic Reasoning Models for Safe
    Multi-Step Tool Use", arXiv 2603.03205): preference-based RL from *pairwise trajectory comparisons* for agents
    whose turns are plan -> check -> act-or-refuse (:mod:`treejax.envs.guarded_user`). Per prompt, every pair of
    its episodes is compared by a judge, and each episode's advantage comes from the comparisons it won::

        x_w      = (c_1(w), ..., c_K(w))        the criteria in MOSAICOptions.criteria's order; by default
                   decision (+1 right act/refuse, 0 none, -1 wrong), success (verified), format (well-formed
                   share of turns), brevity (minus policy tokens, after a right decision only)
        pref_wv  = sign(c_k(w) - c_k(v)) at the first k where |c_k(w) - c_k(v)| > 1e-6, else 0 (tie)
        y_wv     = (pref_wv + 1) / 2
        win_rate:       s_w = sum_{v != w} y_wv / (n - 1)
        bradley_terry:  s = argmax_theta sum_{w != v} y_wv log sigmoid(theta_w - theta_v) - (lambda/2) |theta|^2
        A_w      = (s_w - mean_p s) / (std_p s + eps)

    and every policy token of episode ``w`` gets ``A_w`` (``leaves``); ``rewards_PxW`` is checked for shape only.
    ``sum_w (y_wv + y_vw) = 1`` per pair, so the win rates average 1/2 and the advantages sum to 0 in each group.

    What is reconstructed, and why. Only the abstract and secondary summaries were available: the plan -> check
    -> act/refuse loop with explicit safety reasoning and refusal as actions, training "without trajectory-level
    labels" by preference-based RL over pairwise trajectory comparisons (by a judge), and length penalties.
    Chosen here: (1) the judge is a rule over the world's verifiers, lexicographic so that no weight trades safety
    against success or style (the paper's judge is a model; a scalar reward would give the same order only with
    weights chosen by hand); brevity is last, the paper's length penalty as a tie-break; (2) comparisons are
    within a prompt's group (the same request), as a group-relative policy gradient; (3) the preference enters
    as an advantage, not as a DPO loss: a DPO-style objective on pairs needs a frozen reference model's
    sequence log-probs and a pairwise sequence loss, which the PPO learner does not have, while the win rate
    (the share of the group an episode beats, the reward of pairwise-judge GRPO variants) and the Bradley-Terry
    strengths (the maximum-likelihood utilities behind a DPO/RLHF preference model, fitted to this group only)
    are per-episode scores the learner's clipped policy gradient trains on. ``lambda`` (``bt_prior`` 0.1) keeps
    an unbeaten episode's strength finite.
    """
    adv, _, _ = mosaic_leaves(forest, rewards_PxW, options, safety_verdict_PxWxC)
    return Advantages(tokens=broadcast_leaves(adv, forest.loss_mask), loss_mask=forest.loss_mask, leaves=adv)


__all__ = ["CRITERIA", "MOSAICOptions", "OBJECTIVES", "TIE", "bradley_terry", "criteria_values", "mosaic",
           "mosaic_leaves", "pairwise_preferences", "win_rates"]
