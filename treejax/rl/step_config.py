"""The learner's static settings (:class:`StepConfig`, a subset of ``RunConfig``: :func:`treejax.rl.step.learn`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

from treejax.rl.advantages import estimator_spec
from treejax.rl.losses import LossConfig
from treejax.rl.packing import PackingConfig
from treejax.rl.shaping import check_shapers

#: ``RunConfig.old_logp``: where log pi_old comes from (:mod:`treejax.rl.step`): the trainer's forward with the
#: current weights, the sampler's log-probs, or (PPO-EWMA) the trainer's forward with the parameters' EMA
#: (``OptimizerConfig.proximal_ewma``).
OLD_LOGP_SOURCES = ("trainer", "sampler", "ewma")
#: Estimator inputs (``EstimatorSpec.inputs``) a rollout source can supply (:class:`treejax.rl.rollouts.Rollouts`).
KNOWN_INPUTS = ("greedy_reward_P", "answer_step_PxW", "cut_PxWxB", "cut_value_PxWxB", "nudge_problem_PxW",
                "nudge_context_PxW", "nudge_source_PxW", "truth_logp_PxN", "tool_success_PxN",
                "state_cluster_PxN", "tool_match_PxWxD", "action_signature_PxWxD", "step_judge_PxWxD",
                "turn_judge_PxWxD", "chain_link_PxWxD", "chain_outcome_PxWxD", "chain_skill_PxWxD",
                "feedback_gain_PxN", "step_reward_PxWxD", "step_match_PxWxD",
                "safety_verdict_PxWxC")
#: ``StepConfig.leaf_weighting``: ``"count"`` trains every leaf slot with weight 1 (TreePO's official weighting;
#: slot trees and independent samples are unbiased this way); ``"mass"`` multiplies each leaf's per-token
#: advantages by ``Forest.leaf_weight`` (``W`` x path mass for ``"transfer"`` trees), so the policy-gradient sum
#: ``sum_l w_l A_l grad log pi(l)`` weighs every leaf by the share of the policy's sample it stands for (the PPO
#: clip of a leaf with ``w > 0`` is unchanged by the scale); the estimators' baselines are left as they are.
LEAF_WEIGHTINGS = ("count", "mass")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static settings of the learner (:func:`treejax.rl.step.learn`; a subset of ``RunConfig``): the estimator,
    the loss, where log pi_old comes from, epochs / mini-batches / micro-batches and the layout's settings (``packing``
    None: expanded rows, :class:`treejax.rl.layouts.Expanded`; else :class:`treejax.rl.layouts.Packed`)."""

    estimator: str = "treepo"
    estimator_options: Any = None
    loss: LossConfig = LossConfig()
    old_logp: str = "trainer"
    epochs: int = 1
    mini_batches: int = 1
    micro_batches: int = 1
    pad_id: int = 0
    logprob_chunk_size: int = 8192
    attention_impl: str = "auto"
    clip_scale_fn: Callable | None = None  # (forest, rewards_PxW) -> [P, W] per-sample clip-range multiplier
    packing: PackingConfig | None = None  # None: expanded rows; else the tree-packed update
    row_multiple: int = 1  # packed row count multiple (micro-batches x batch-sharded devices)
    leaf_weighting: str = "count"  # "count" | "mass": scale each leaf's advantages by forest.leaf_weight
    shapers: tuple = ()  # treejax.rl.shaping.Shaper instances, applied in order after the old-log-prob pass

    def __post_init__(self):
        object.__setattr__(self, "shapers", check_shapers(self.shapers))
        if self.leaf_weighting not in LEAF_WEIGHTINGS:
            raise ValueError(f"leaf_weighting must be one of {LEAF_WEIGHTINGS}, got {self.leaf_weighting!r}")
        if self.old_logp not in OLD_LOGP_SOURCES:
            raise ValueError(f"old_logp must be one of {OLD_LOGP_SOURCES}, got {self.old_logp!r}")
        if self.old_logp == "sampler" and self.loss.tis_cap is not None:
            raise ValueError("LossConfig.tis_cap needs old_logp='trainer': with old_logp='sampler' the sampler's "
                             "log-probs are both the PPO denominator and the TIS reference, so TIS is a no-op")
        for name in ("epochs", "mini_batches", "micro_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        missing = [i for i in estimator_spec(self.estimator).inputs if i not in KNOWN_INPUTS]
        if missing:
            raise ValueError(f"estimator {self.estimator!r} needs inputs {missing} that the RL step cannot supply "
                             f"(supplied: {KNOWN_INPUTS})")
