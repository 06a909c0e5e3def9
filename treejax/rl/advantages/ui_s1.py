"""UI-S1's weighted step-level and episode-level advantages over a turn forest, from the semi-online rollout's step
rewards (:mod:`treejax.envs.semi_online`).

Inputs ``step_reward_PxWxD [P, W, D]`` and ``step_match_PxWxD [P, W, D]``: for leaf slot ``w`` and its turn at depth
``t + 1``, the step reward ``r_{w,t}`` and whether the turn matched the expert's step (1 / 0), NaN where the turn
does not exist. Statistics use :func:`.info_gain.group_normalize` (weighted by ``Forest.leaf_weight``, population
std with a 1e-8 floor inside the root, std 1 for a group of one, exactly 0 for a group of equal values).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from treejax.errors import ConfigError
from treejax.forest import Forest
from treejax.rl.advantages.common import broadcast_segments, check_rewards
from treejax.rl.advantages.info_gain import discounted_to_go, group_normalize, turn_layout
from treejax.rl.advantages.registry import Advantages, register_estimator

#: ``UIS1Options.episode_level`` values.
EPISODE_LEVELS = ("return", "steps")


@dataclasses.dataclass(frozen=True)
class UIS1Options:
    """``gamma``: the discount of future step rewards (the official example script's 0.5); ``step_weight``
    (omega) / ``episode_weight``: the weights of the step- and episode-level advantages (both 1 in the official
    code); ``cut_at_mismatch``: a step's return stops at the first later mismatched step (the official code; False:
    the plain ``sum_k gamma^(k - t) r_k``); ``episode_level``: ``"return"`` (each episode's total step reward,
    normalised over the prompt's episodes) or ``"steps"`` (the official code: each step's own reward, normalised
    over every step of the prompt's episodes); ``scale_by_std`` / ``eps``: divide by ``std + eps`` (False: the
    official ``mean_norm`` mode, mean only)."""

    gamma: float = 0.5
    step_weight: float = 1.0
    episode_weight: float = 1.0
    cut_at_mismatch: bool = True
    episode_level: str = "return"
    scale_by_std: bool = True
    eps: float = 1e-6

    def __post_init__(self):
        if not (isinstance(self.gamma, (int, float)) and 0.0 <= self.gamma <= 1.0):
            raise ConfigError(f"UIS1Options.gamma must be in [0, 1], got {self.gamma!r}; fix: UIS1Options.gamma = 0.5")
        for name in ("step_weight", "episode_weight"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ConfigError(f"UIS1Options.{name} must be a finite number >= 0, got {v!r}; fix: "
                                  f"UIS1Options.{name} = 1.0")
        if self.episode_level not in EPISODE_LEVELS:
            raise ConfigError(f"UIS1Options.episode_level must be one of {EPISODE_LEVELS}, got "
                              f"{self.episode_level!r}; fix: UIS1Options.episode_level = 'return'")
        if not (isinstance(self.eps, (int, float)) and self.eps > 0 and math.isfinite(self.eps)):
            raise ConfigError(f"UIS1Options.eps must be a finite number > 0, got {self.eps!r}; fix: UIS1Options.eps "
                              "= 1e-6")


def step_returns(r_PxWxD, match_PxWxD, valid_PxWxD, gamma: float, cut_at_mismatch: bool):
    """float32[P, W, D]: ``R_t = sum_{k >= t} gamma^(k - t) r_k`` over the valid turns; with ``cut_at_mismatch``
    the sum runs over the matched steps from ``t`` on, stopping before the first mismatched one, and a mismatched
    step's return is its own reward (the official ``compute_step_discounted_returns``)::

        G_t = 1[m_t] (r_t + gamma G_{t+1}),   R_t = G_t if m_t else r_t"""
    if not cut_at_mismatch:
        return discounted_to_go(r_PxWxD, valid_PxWxD, gamma)
    D = r_PxWxD.shape[-1]
    run = jnp.zeros(r_PxWxD.shape[:-1], jnp.float32)
    out = []
    for t in range(D - 1, -1, -1):
        m, r = valid_PxWxD[..., t] & match_PxWxD[..., t], r_PxWxD[..., t]
        run = jnp.where(m, r + gamma * run, 0.0)
        out.append(jnp.where(valid_PxWxD[..., t], jnp.where(m, run, r), 0.0))
    return jnp.stack(out[::-1], axis=-1)


def ui_s1_turns(forest: Forest, rewards_PxW, options: UIS1Options, step_reward_PxWxD, step_match_PxWxD):
    """``(advantages [P, W, D], step-level term [P, W, D], episode-level term [P, W, D], returns [P, W, D])`` of
    :func:`ui_s1`."""
    check_rewards(forest, rewards_PxW)
    _, valid, _ = turn_layout(forest)
    P, W, D = valid.shape
    r_in, m_in = jnp.asarray(step_reward_PxWxD, jnp.float32), jnp.asarray(step_match_PxWxD, jnp.float32)
    for name, x in (("step_reward_PxWxD", r_in), ("step_match_PxWxD", m_in)):
        if tuple(x.shape) != (P, W, D):
            raise ValueError(f"{name} has shape {tuple(x.shape)}, the forest has [P, W, D] = {(P, W, D)}")
    valid = valid & jnp.isfinite(r_in)
    r = jnp.where(valid, r_in, 0.0)
    R = step_returns(r, jnp.where(valid, m_in, 0.0) > 0.5, valid, options.gamma, options.cut_at_mismatch)
    lw = forest.leaf_weights()
    w_PxWxD = jnp.broadcast_to(lw[:, :, None], (P, W, D))
    t_major = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  [P, D, W]: one group per (prompt, step index)
    step = t_major(group_normalize(t_major(R), t_major(valid), t_major(w_PxWxD), options.scale_by_std, options.eps))
    if options.episode_level == "return":
        used = forest.leaf_path[:, :, 0] >= 0
        ep = group_normalize(jnp.sum(r, axis=-1), used, lw, options.scale_by_std, options.eps)[:, :, None]
    else:
        flat = lambda x: x.reshape((P, W * D))  # noqa: E731  one group per prompt: all its slots' steps
        ep = group_normalize(flat(r), flat(valid), flat(w_PxWxD), options.scale_by_std, options.eps).reshape((P, W, D))
    ep = jnp.broadcast_to(ep, (P, W, D))
    adv = jnp.where(valid, jnp.float32(options.episode_weight) * ep + jnp.float32(options.step_weight) * step, 0.0)
    return adv, jnp.where(valid, step, 0.0), jnp.where(valid, ep, 0.0), R


@register_estimator("ui_s1", UIS1Options, inputs=("step_reward_PxWxD", "step_match_PxWxD"))
def ui_s1(forest: Forest, rewards_PxW, options: UIS1Options = UIS1Options(), *, step_reward_PxWxD,
          step_match_PxWxD) -> Advantages:
    r"""UI-S1 (Lu et al. 2025, "UI-S1: Advancing GUI Automation via Semi-online Reinforcement Learning", arXiv
    2509.11543): semi-online episodes on expert trajectories (:mod:`treejax.envs.semi_online`) with step rewards
    ``r_{w,t}`` and matches ``m_{w,t}``, discounted future returns, and a weighted sum of a step-level and an
    episode-level group-normalised advantage. Per prompt p, over its W slots::

        R_{w,t} = sum_{k >= t} gamma^(k - t) r_{w,k}      (cut_at_mismatch: only over the matched run from t on,
                                                            G_t = 1[m_t](r_t + gamma G_{t+1}), R_t = G_t or r_t)
        A^S_{w,t} = (R_{w,t} - mean_{w'} R_{w',t}) / (std_{w'} R_{w',t} + eps)   over p's slots that reach step t
        A^E_w     = (S_w - mean_p S) / (std_p S + eps),   S_w = sum_t r_{w,t}      (episode_level "return")
        A^E_{w,t} = (r_{w,t} - mean r) / (std r + eps)    over all of p's steps    (episode_level "steps")
        A_{w,t}   = episode_weight * A^E + step_weight * A^S_{w,t}

    broadcast to each turn's policy tokens (0 on observations); ``segments`` holds ``A`` per (slot, turn).
    ``rewards_PxW`` (the run's outcome reward) is checked for shape only: every term comes from the step rewards.

    From the paper (its abstract and summaries) and the released code (``uis1/core_uis1.py``, read, not copied):
    discounted future returns in the step reward, step-level advantages grouped by step index within a prompt's
    rollouts, episode-level advantages, their weighted sum (both weights 1 in the code), the mismatch cut of the
    returns, ``gamma = 0.5`` (the example script), mean-only (``mean_norm``) and mean/std normalisation.
    Reconstructed (the paper's method section was not available): the episode-level reward ``S_w`` of
    ``"return"`` (the released code normalises each step's own reward over all of the prompt's steps instead:
    ``"steps"``); statistics are the project's population std with the slot weights (the code: torch's
    Bessel-corrected std, unweighted), and a group of one gets 0 from both terms (the code: the raw reward from the
    episode term).
    """
    adv, _, _, _ = ui_s1_turns(forest, rewards_PxW, options, step_reward_PxWxD, step_match_PxWxD)
    tokens = broadcast_segments(adv, forest.segment_index, forest.loss_mask)
    return Advantages(tokens=tokens, loss_mask=forest.loss_mask, segments=adv)


__all__ = ["EPISODE_LEVELS", "UIS1Options", "step_returns", "ui_s1", "ui_s1_turns"]
