"""MAPO's mixed advantages over multi-turn episodes (Zhang et al. 2026, *MAPO: Mixed Advantage Policy Optimization
for Long-Horizon Multi-Turn Dialogue*, arXiv 2603.06194; no official code found).

Input ``turn_judge_PxWxD [P, W, D]`` (:class:`treejax.rl.judges.mapo.MAPOConfig`): the judge's score in ``[0, 1]``
of leaf slot ``w``'s turn ``t`` (its depth-``t + 1`` turn node: the policy's turn and the observation after it,
read by a process reward model after the turns before it), NaN where it has none. Not to be confused with the
single-turn MAPO of Huang et al. 2025 (arXiv 2509.18849, advantage percent deviation), which needs no judge.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from treejax.forest import Forest
from treejax.rl.advantages.common import broadcast_segments, check_rewards
from treejax.rl.advantages.info_gain import discounted_to_go, group_normalize, turn_layout
from treejax.rl.advantages.registry import Advantages, register_estimator


TURN_REWARDS = ("score", "increment")


def turn_rewards(judge_PxWxD, valid_PxWxD, options) -> jax.Array:
    """The judged reward of every turn (:func:`mapo`): ``2 s_t - 1`` (``"score"``; NaN counts 0) or ``s_t -
    s_{t-1}`` (``"increment"``; ``s_{-1} = initial_score``; a NaN score repeats the last finite one, so its turn
    gets 0 and the next turn's increment is from that one)."""
    ok = valid_PxWxD & jnp.isfinite(judge_PxWxD)
    if options.reward == "score":
        return jnp.where(ok, 2.0 * judge_PxWxD - 1.0, 0.0)
    prev = jnp.full(judge_PxWxD.shape[:2], jnp.float32(options.initial_score))
    out = []
    for t in range(judge_PxWxD.shape[2]):  # D (turns) is small and static
        cur = jnp.where(ok[:, :, t], judge_PxWxD[:, :, t], prev)
        out.append(jnp.where(valid_PxWxD[:, :, t], cur - prev, 0.0))
        prev = cur
    return jnp.stack(out, axis=2)


@dataclasses.dataclass(frozen=True)
class MAPOOptions:
    """``mix`` (lambda): weight of the turn-level normalisation, ``1 - mix`` the batch-level one's; ``gamma``: the
    Monte-Carlo return's turn discount; ``outcome_coef``: weight of the episode's outcome reward on its final
    turn; ``reward``: a turn's judged reward, ``"score"`` (``2 s_t - 1``) or ``"increment"`` (``s_t - s_{t-1}``,
    the official code's incremental reward; ``s_{-1} = initial_score``); ``eps``: both normalisations divide by
    ``std + eps``."""

    mix: float = 0.5
    gamma: float = 1.0
    outcome_coef: float = 1.0
    reward: str = "score"
    initial_score: float = 0.5
    eps: float = 1e-6

    def __post_init__(self):
        for name, lo, hi in (("mix", 0.0, 1.0), ("gamma", 0.0, 1.0)):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and lo <= v <= hi):
                raise ValueError(f"MAPOOptions.{name} must be in [{lo:g}, {hi:g}], got {v!r}; fix: "
                                 f"MAPOOptions.{name} = {getattr(MAPOOptions, name)}")
        if not (isinstance(self.outcome_coef, (int, float)) and self.outcome_coef >= 0
                and math.isfinite(self.outcome_coef)):
            raise ValueError(f"MAPOOptions.outcome_coef must be a finite number >= 0, got {self.outcome_coef!r}; "
                             "fix: MAPOOptions.outcome_coef = 1.0")
        if self.reward not in TURN_REWARDS:
            raise ValueError(f"MAPOOptions.reward must be one of {TURN_REWARDS}, got {self.reward!r}; fix: "
                             "MAPOOptions.reward = 'score'")
        if not (isinstance(self.initial_score, (int, float)) and 0.0 <= self.initial_score <= 1.0):
            raise ValueError(f"MAPOOptions.initial_score must be in [0, 1] (a judge score), got "
                             f"{self.initial_score!r}; fix: MAPOOptions.initial_score = 0.5")
        if not (isinstance(self.eps, (int, float)) and self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"MAPOOptions.eps must be a finite number > 0, got {self.eps!r}; fix: "
                             "MAPOOptions.eps = 1e-6")


def mapo_returns(forest: Forest, rewards_PxW, options: MAPOOptions, turn_judge_PxWxD):
    """``(G [P, W, D], valid [P, W, D])``: every turn's Monte-Carlo return (:func:`mapo`) and whether it exists."""
    R = check_rewards(forest, rewards_PxW)
    _, valid, final = turn_layout(forest)
    judge = jnp.asarray(turn_judge_PxWxD, jnp.float32)
    if tuple(judge.shape) != tuple(valid.shape):
        raise ValueError(f"turn_judge_PxWxD has shape {tuple(judge.shape)}, the forest has [P, W, D] = "
                         f"{tuple(valid.shape)}")
    s = turn_rewards(judge, valid, options)
    r = s + jnp.where(final, jnp.float32(options.outcome_coef) * R[:, :, None], 0.0)
    return discounted_to_go(r, valid, options.gamma), valid


def mapo_turns(forest: Forest, rewards_PxW, options: MAPOOptions, turn_judge_PxWxD):
    """``(A [P, W, D], turn-level term [P, W, D], batch-level term [P, W, D])`` of :func:`mapo`."""
    G, valid = mapo_returns(forest, rewards_PxW, options, turn_judge_PxWxD)
    P, W, D = valid.shape
    lw = jnp.broadcast_to(forest.leaf_weights()[:, :, None], (P, W, D))
    swap = lambda x: jnp.swapaxes(x, 1, 2)  # noqa: E731  ([P, D, W]: one group per prompt and turn index)
    turn = swap(group_normalize(swap(G), swap(valid), swap(lw), True, options.eps))
    flat = lambda x: x.reshape((1, P * W * D))  # noqa: E731  (one group: every turn of the batch)
    batch = group_normalize(flat(G), flat(valid), flat(lw), True, options.eps).reshape((P, W, D))
    mix = jnp.float32(options.mix)
    adv = jnp.where(valid, mix * turn + (1.0 - mix) * batch, 0.0)
    return adv, turn, batch


@register_estimator("mapo", MAPOOptions, inputs=("turn_judge_PxWxD",))
def mapo(forest: Forest, rewards_PxW, options: MAPOOptions = MAPOOptions(), *, turn_judge_PxWxD) -> Advantages:
    r"""MAPO: per-turn judge rewards, Monte-Carlo returns over turns, and an advantage that mixes a turn-level
    and a batch-level normalisation of the returns.

    For leaf slot ``w`` of prompt ``p`` with turns ``t = 0 .. K_w - 1``, judge scores ``s_{w,t}`` in ``[0, 1]`` and
    outcome reward ``R_w``::

        r_{w,t}   = (2 s_{w,t} - 1) + [t = K_w - 1] outcome_coef R_w              (dense judge reward per turn)
                    reward = "increment": (s_{w,t} - s_{w,t-1}) + [t = K_w - 1] outcome_coef R_w,  s_{w,-1} =
                    initial_score (the official code's reward: the turn's progress, a potential difference)
        G_{w,t}   = sum_{k >= t} gamma^(k - t) r_{w,k}                             (Monte-Carlo return)
        A^turn    = (G_{w,t} - mean G_{., t}) / (std G_{., t} + eps)   over prompt p's slots that reach turn t
        A^batch   = (G_{w,t} - mean G) / (std G + eps)                 over every turn of every slot in the batch
        A_{w,t}   = mix A^turn + (1 - mix) A^batch

    Statistics are :func:`~treejax.rl.advantages.info_gain.group_normalize`'s (weighted by ``leaf_weight``,
    population std, a group of one gets 0 from its own normalisation, a group of equal values exactly 0). Each
    policy token of turn ``t`` gets ``A_{w,t}`` (0 on observations: the loss mask); ``segments`` holds ``A``.

    What is reconstructed (only the abstract was available; no code): the paper names dense process feedback
    from a judge model, Monte-Carlo returns to propagate long-horizon effects, and a mixed estimator that
    "combines turn-level normalization with batch-level normalization". Chosen here, not checked against the
    paper: the turn-level group is the prompt's episodes at the same turn index (the turn-specific return
    statistics one rollout group gives without re-sampling any state: MAPO's point against turn-level group
    sampling), the batch-level group every turn of the step, a convex mix with ``mix = 0.5`` (equal weight),
    ``gamma = 1`` (undiscounted returns, verl's default), the outcome reward added to the final turn's judge
    reward, and the judge score mapped by ``2 s - 1`` with NaN (an unparsed verdict, a turn past the PRM's
    ``max_length``) counting 0. With ``mix = 0`` this is a batch-whitened return (REINFORCE++'s form); with
    ``mix = 1`` a GRPO-style z-score per turn index.

    Worked example (one prompt, 2 independent episodes of 2 turns, ``gamma = 1``, ``outcome_coef = 1``)::

        s = [[1, .5], [.5, .25]], R = [1, -1]  ->  r = [[1, 0 + 1], [0, -.5 - 1]]
        G = [[2, 1], [-1.5, -1.5]]
        turn level: t = 0: (2, -1.5) -> (1, -1); t = 1: (1, -1.5) -> (1, -1)      (population std, eps 1e-6)
        batch level: mean 0, std sqrt(9.5 / 4) = 1.54110 -> [[1.29777, .64889], [-.97333, -.97333]]
        mix .5: A = [[1.14889, .82444], [-.98667, -.98667]]
    """
    adv, _, _ = mapo_turns(forest, rewards_PxW, options, turn_judge_PxWxD)
    tokens = broadcast_segments(adv, forest.segment_index, forest.loss_mask)
    return Advantages(tokens=tokens, loss_mask=forest.loss_mask, segments=adv)


__all__ = ["MAPOOptions", "TURN_REWARDS", "mapo", "mapo_returns", "mapo_turns", "turn_rewards"]
