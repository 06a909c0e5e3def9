"""SLATE's step-level advantages among siblings (Samarinas, Chang & Zamani 2026, *Truncated Step-Level Sampling
with Process Rewards for Retrieval-Augmented Reasoning*, arXiv 2602.23440; official code ``algoprog/SLATE``,
``slate/training/step_level_algos.py::compute_step_level_advantage`` and ``slate/rewards/llm_judge.py``).

SLATE samples ``k`` continuations of one prefix that differ only in the next step and scores each step with an
LLM judge; a step's advantage is its reward z-scored among the ``k`` siblings (the paper's Eq. 5). On a treejax
rollout tree the siblings are the children of one node: every node's segment is a step, and the children of a
node are continuations of the same prefix that differ from their first token on.

Input ``step_judge_PxWxD [P, W, D]`` (:class:`treejax.rl.judges.slate.SLATEConfig`): the judge's score in
``[0, 1]`` of leaf slot ``w``'s step ``d`` (its depth-``d + 1`` node's segment, read by a process reward model
after the steps before it), NaN where it has none.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from treejax.forest import Forest, subgroup_masks
from treejax.rl.advantages.common import broadcast_segments, check_rewards, pairwise_sum
from treejax.rl.advantages.nodes import first_occurrence
from treejax.rl.advantages.registry import Advantages, register_estimator


@dataclasses.dataclass(frozen=True)
class SLATEOptions:
    """``eps``: the z-score's ``std + eps`` (official 1e-6); ``bonus``: the early-answer bonus coefficient lambda
    (official ``lambda_bonus = 0.1``); ``outcome_coef``: weight of the leaf's outcome reward on its answer step
    (the official ``r_answer`` enters with weight 1)."""

    eps: float = 1e-6
    bonus: float = 0.1
    outcome_coef: float = 1.0

    def __post_init__(self):
        for name in ("bonus", "outcome_coef"):
            v = getattr(self, name)
            if not (isinstance(v, (int, float)) and v >= 0 and math.isfinite(v)):
                raise ValueError(f"SLATEOptions.{name} must be a finite number >= 0, got {v!r}; fix: "
                                 f"SLATEOptions.{name} = {getattr(SLATEOptions, name)}")
        if not (isinstance(self.eps, (int, float)) and self.eps > 0 and math.isfinite(self.eps)):
            raise ValueError(f"SLATEOptions.eps must be a finite number > 0, got {self.eps!r}; fix: "
                             "SLATEOptions.eps = 1e-6")


def slate_step_rewards(leaf_path_WxD1, judge_WxD, rewards_W, options: SLATEOptions):
    """One prompt: ``(r [W, D], valid [W, D])``, each leaf slot's step rewards (module docstring of
    :func:`slate`) and whether the step exists."""
    D = leaf_path_WxD1.shape[1] - 1
    valid = (leaf_path_WxD1[:, 1:] >= 0) & (leaf_path_WxD1[:, :1] >= 0)
    judge = jnp.asarray(judge_WxD, jnp.float32)
    s = jnp.where(jnp.isfinite(judge), 2.0 * judge - 1.0, 0.0)  # [0, 1] -> the ternary scale [-1, 1]; NaN -> 0
    depth = jnp.sum(valid, axis=-1)  # D_w
    last = valid & (jnp.arange(D)[None, :] == depth[:, None] - 1)
    bonus = jnp.float32(options.bonus) * (D - depth).astype(jnp.float32) * jnp.float32(1.0 / D)
    answer = jnp.float32(options.outcome_coef) * rewards_W + bonus  # [W]
    r = jnp.where(valid, s + jnp.where(last, answer[:, None], 0.0), 0.0)
    return r, valid


def slate_core(leaf_path_WxD1, judge_WxD, rewards_W, options: SLATEOptions) -> jax.Array:
    """One prompt: step advantages ``[W, D]`` (0 where the step does not exist or has no sibling)."""
    r, valid = slate_step_rewards(leaf_path_WxD1, judge_WxD, rewards_W, options)
    group = subgroup_masks(leaf_path_WxD1)  # [D+1, W, W]: share the depth-d node
    first = first_occurrence(group, leaf_path_WxD1)  # [W, D+1]: the first slot through its depth-d node
    # sib[d, i, j]: j's depth-(d+1) node is a child of i's depth-d node (the same parent), counted once per node
    sib = group[:-1] & (first[:, 1:] & valid).T[:, None, :] & valid.T[:, :, None]  # [D, W, W]
    rT = r.T  # [D, W]
    diff = rT[:, :, None] - rT[:, None, :]  # [D, W, W]: r_i - r_j
    k = jnp.sum(sib, axis=-1, dtype=jnp.int32).astype(jnp.float32)  # [D, W]: siblings, i's own node included
    a = pairwise_sum(jnp.where(sib, diff, 0.0), axis=-1) / jnp.maximum(k, 1.0)  # r_i - mean
    dev = jnp.where(sib, diff - a[:, :, None], 0.0)  # mean - r_j
    var = pairwise_sum(dev * dev, axis=-1) / jnp.maximum(k - 1.0, 1.0)  # unbiased (torch's std)
    adv = jnp.where(k >= 2, a / (jnp.sqrt(var) + jnp.float32(options.eps)), 0.0)
    return jnp.where(valid.T, adv, 0.0).T


@register_estimator("slate", SLATEOptions, inputs=("step_judge_PxWxD",), ragged=True)
def slate(forest: Forest, rewards_PxW, options: SLATEOptions = SLATEOptions(), *, step_judge_PxWxD) -> Advantages:
    r"""SLATE: each step's judged reward z-scored among its siblings (the other continuations of its prefix).

    For leaf slot ``w`` with ``D_w`` steps (its segments ``d = 0 .. D_w - 1``), judge score ``s_{w,d}`` in
    ``[0, 1]`` and outcome reward ``R_w``::

        r_{w,d} = (2 s_{w,d} - 1)                                              d < D_w - 1   (a reasoning step)
        r_{w,d} = (2 s_{w,d} - 1) + outcome_coef R_w + bonus (D - D_w) / D     d = D_w - 1   (the answer step)
        A_{w,d} = (r_{w,d} - mean_{c in C} r_c) / (std_{c in C} r_c + eps)

    where ``C`` holds the children of the parent of ``w``'s depth-``(d + 1)`` node (its siblings and itself; each
    distinct node once), ``std`` is the unbiased (Bessel) standard deviation, and ``A = 0`` for a node without
    siblings (``|C| = 1``: nothing to compare). Each policy token of step ``d`` gets ``A_{w,d}``; ``segments`` holds
    ``A``. No batch whitening (the official code has none: the group z-score is the advantage).

    Official (``compute_step_level_advantage``, ``llm_judge.py``, ``configs/slate.yaml``): ``A = (r - mean(r)) /
    (std(r) + 1e-6)`` over the ``k`` candidates of one step (``torch.std``: unbiased); a search step's reward is
    ``r_think + r_query``, an answer step's ``r_think + r_answer + lambda (B - t) / B`` with ternary judge scores in
    ``{-1, 0, +1}``, ``lambda = 0.1``, ``B = 4`` the step budget, ``k = 5``; an unparsable verdict scores 0.

    What is reconstructed or changed, and why:

    * the step judge: the official judge decodes a ternary verdict per quality dimension (reasoning, query,
      answer); here one score in ``[0, 1]`` per step from the scorer (a PRM's step-tag verdict probability, or a
      decoded, parsed verdict) is mapped onto the same range by ``2 s - 1``; a NaN score (a step past the PRM's
      ``max_length``, an unparsed verdict) counts 0, the official fallback;
    * the answer's correctness: the verifier's outcome reward ``R_w`` (``+-1`` with ``"pm1"``, the official
      ``r_answer`` scale) instead of a judge's comparison with the ground truth; the answer step is the leaf's
      last segment; ``B`` is the tree's ``max_depth`` ``D`` and ``t`` the answer step's 1-based depth ``D_w``, so
      answering at the last possible step earns no bonus (the official ``step`` index base is not documented);
    * the siblings: the official rollout keeps one of the ``k`` candidates (reward-weighted sampling) and samples
      ``k`` new ones from it, so every step has ``k`` siblings; here the tree rollout's children of a node are
      the siblings (``TreeConfig.init_divergence`` at the root, ``branch_factor`` below), and a node that the
      tree did not split gets 0 (``C`` is itself alone);
    * a node that ends one leaf slot and continues in another (the answer-step reward differs between them)
      enters its siblings' statistics once, with its first slot's reward.

    Worked example (one prompt, 4 slots, ``D = 2``)::

        root -> n1 -> {n3 (w0), n4 (w1)};  root -> n2 (w2, ends);  root -> n5 -> n6 (w3)
        s = [[.75, .5], [.75, 1], [.25, nan], [.5, .5]],  R = [1, -1, 1, -1]
        r = [[.5, 0 + 1], [.5, 1 - 1], [-.5 + 1 + .05, 0], [0, 0 - 1]]
        depth 1: C = {n1, n2, n5} with r = .5, .55, 0: mean .35, std .30414 -> A = .49319, .65759, -1.15079
        depth 2: C = {n3, n4} with r = 1, 0: mean .5, std .70711 -> A = .70711, -.70711;  n6 alone -> 0
    """
    R = check_rewards(forest, rewards_PxW)
    judge = jnp.asarray(step_judge_PxWxD, jnp.float32)
    if tuple(judge.shape) != tuple(forest.leaf_path.shape[:2]) + (forest.max_depth,):
        raise ValueError(f"step_judge_PxWxD has shape {tuple(judge.shape)}, the forest has [P, W, D] = "
                         f"{tuple(forest.leaf_path.shape[:2]) + (forest.max_depth,)}")
    adv = jax.vmap(lambda p, j, x: slate_core(p, j, x, options))(forest.leaf_path, judge, R)
    tokens = broadcast_segments(adv, forest.segment_index, forest.loss_mask)
    return Advantages(tokens=tokens, loss_mask=forest.loss_mask, segments=adv)


__all__ = ["SLATEOptions", "slate", "slate_core", "slate_step_rewards"]
