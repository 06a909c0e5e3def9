"""MatchTIR's dual-level advantages over a turn forest, from matched tool-call turn rewards.

Input ``tool_match_PxWxD [P, W, D]`` (:func:`treejax.rl.tool_match.tool_match_rewards`): for leaf slot ``w`` and its
turn at depth ``t + 1``, the score of that turn's tool call under the maximum-weight bipartite matching of the
slot's predicted calls against the task's reference calls (in [0, 1]; 0 for an unmatched call), NaN where the
turn made no call (the answer turn) or does not exist. Statistics use :func:`.info_gain.group_normalize`
(weighted by ``Forest.leaf_weight``, population std with a 1e-8 floor inside the root, std 1 for a group of one,
exactly 0 for a group of equal values).
"""

from __future__ import annotations

import dataclasses
import math

import jax.numpy as jnp

from treejax.forest import Forest
from treejax.rl.advantages.common import broadcast_segments, check_rewards
from treejax.rl.advantages.info_gain import discounted_to_go, group_normalize, turn_layout
from treejax.rl.advantages.registry import Advantages, register_estimator


@dataclasses.dataclass(frozen=True)
class MatchTIROptions:
    """``turn_weight`` (lambda): weight of the turn-level advantage next to the trajectory-level one; ``gamma``:
    turn discount of the matched rewards to go; ``scale_by_std`` / ``eps``: both normalisations divide by
    ``std + eps``."""

    turn_weight: float = 1.0
    gamma: float = 1.0
    scale_by_std: bool = True
    eps: float = 1e-6

    def __post_init__(self):
        if not (isinstance(self.turn_weight, (int, float)) and self.turn_weight >= 0 and math.isfinite(self.turn_weight)):
            raise ValueError(f"MatchTIROptions.turn_weight must be a finite number >= 0, got {self.turn_weight!r}")
        if not (isinstance(self.gamma, (int, float)) and 0.0 <= self.gamma <= 1.0):
            raise ValueError(f"MatchTIROptions.gamma must be in [0, 1], got {self.gamma!r}")
        if not (isinstance(self.eps, (int, float)) and self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"MatchTIROptions.eps must be a finite number > 0, got {self.eps!r}")


def tool_match_inputs(forest: Forest, rewards_PxW, tool_match_PxWxD):
    """``(rewards [P, W], valid turns [P, W, D], tool_match [P, W, D] float32)``, each checked against the
    forest (shared by the estimators that read ``tool_match_PxWxD``)."""
    R = check_rewards(forest, rewards_PxW)
    _, valid, _ = turn_layout(forest)
    P, W, D = valid.shape
    m = jnp.asarray(tool_match_PxWxD, jnp.float32)
    if tuple(m.shape) != (P, W, D):
        raise ValueError(f"tool_match_PxWxD has shape {tuple(m.shape)}, the forest has [P, W, D] = {(P, W, D)}")
    return R, valid, m


def matchtir_turns(forest: Forest, rewards_PxW, options: MatchTIROptions, tool_match_PxWxD):
    """``(advantages [P, W, D], turn-level term [P, W, D], trajectory term [P, W])`` of :func:`matchtir`."""
    R, valid, m = tool_match_inputs(forest, rewards_PxW, tool_match_PxWxD)
    P, W, D = valid.shape
    tool = valid & jnp.isfinite(m)
    r = jnp.where(tool, m, 0.0)
    G = discounted_to_go(r, valid, options.gamma)  # matched rewards to go from each turn
    lw = forest.leaf_weights()
    used = forest.leaf_path[:, :, 0] >= 0
    traj = group_normalize(R, used, lw, options.scale_by_std, options.eps)  # [P, W]
    flat = lambda x: x.reshape((P, W * D))  # noqa: E731  (one group per prompt: all its slots' tool turns)
    weight = flat(jnp.broadcast_to(lw[:, :, None], (P, W, D)))
    turn = group_normalize(flat(G), flat(tool), weight, options.scale_by_std, options.eps).reshape((P, W, D))
    adv = jnp.where(valid, traj[:, :, None] + jnp.float32(options.turn_weight) * turn, 0.0)
    return adv, turn, traj


@register_estimator("matchtir", MatchTIROptions, inputs=("tool_match_PxWxD",))
def matchtir(forest: Forest, rewards_PxW, options: MatchTIROptions = MatchTIROptions(), *,
             tool_match_PxWxD) -> Advantages:
    r"""MatchTIR (Qu et al. 2026, "MatchTIR: Fine-Grained Supervision for Tool-Integrated Reasoning via Bipartite
    Matching", arXiv 2601.10712): turn rewards from matching predicted against ground-truth tool calls, and a
    dual-level advantage that adds a turn-level term to the trajectory-level one.

    Turn rewards (host side, :mod:`treejax.rl.tool_match`): ``r_{w,t} = S[t, sigma(t)]``, the per-call score of
    slot w's tool call at turn t under the maximum-weight one-to-one matching ``sigma`` of its calls to the
    reference calls (Kuhn-Munkres, ``scipy.optimize.linear_sum_assignment``; the official ``compute_process_KM``
    "hard" assignment), 0 when unmatched, or with ``MultiTurnConfig.tool_match_assignment = "soft"`` the
    plan-weighted score under an entropic optimal-transport plan (the official ``compute_process_ot``); turns
    without a call have none. Then, per prompt p::

        G_{w,t}   = sum_{k >= t} gamma^(k - t) r_{w,k}                        (matched rewards to go)
        A^traj_w  = (R_w - mean_p R) / (std_p R + eps)                        (outcome, over p's slots)
        A^turn_{w,t} = (G_{w,t} - mean G) / (std G + eps)                     over p's tool turns (all slots)
        A_{w,t}   = A^traj_w + turn_weight * A^turn_{w,t}    on tool turns,  A^traj_w on the answer turn

    broadcast to each turn's policy tokens (0 on observations); ``segments`` holds ``A`` per (slot, turn).

    What is reconstructed: only the abstract and secondary summaries of the paper were available (the released
    repository's training code was not). From them: bipartite matching of predicted vs ground-truth calls gives
    dense turn rewards, with a hard (Kuhn-Munkres) and a soft (optimal-transport) assignment; the per-call score
    reads tool names, parameter names and parameter values; the dual-level advantage integrates turn- and
    trajectory-level signals. Reconstructed here (not checked against the paper): the per-call score formula
    (``s = 1[name] (lambda + (1 - lambda) mean token-F1 of the arguments)``, :func:`~treejax.rl.tool_match.call_score`),
    the discounted rewards to go, the z-scores over the prompt's tool turns and the additive combination with
    ``turn_weight``, and the soft assignment's cost ``1 - S``, uniform marginals, ``epsilon`` and reward
    ``m sum_j pi_ij S_ij`` (:mod:`treejax.rl.tool_match`).
    """
    adv, _, _ = matchtir_turns(forest, rewards_PxW, options, tool_match_PxWxD)
    tokens = broadcast_segments(adv, forest.segment_index, forest.loss_mask)
    return Advantages(tokens=tokens, loss_mask=forest.loss_mask, segments=adv)


__all__ = ["MatchTIROptions", "matchtir", "matchtir_turns"]
