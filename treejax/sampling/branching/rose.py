"""ROSE's semantic-entropy branching (``ZiqiZhao1/ROSE-rl`` at 2142dc7, ``verl/workers/rollout/vllm_rollout/
vllm_rollout_spmd.py::generate_sequences_loop_entropy``): branch where the next-token distribution is uncertain
*and* its likely tokens differ in meaning.

Per token ``t`` the code scores ``score_t = -F_t * H_t`` with ``H_t`` the next-token entropy and ``F_t = ||sum_i p_i
e_i||^2 - sum_i p_i^2 = sum_{i != j} p_i p_j cos(e_i, e_j)`` over the 20 most likely tokens (``e_i``: unit input
embeddings; the ``"semantic_similarity"`` statistic, :mod:`treejax.sampling.token_stats`), and forks one new
rollout per iteration at the argmax over all rollouts' tokens. Our adaptation to segment trees: at a boundary each
live path is scored by the largest ``score_t`` over its last segment, and the extra budget goes to the highest
scores, ``branches - 1`` extra children each (:func:`capped_allocation`, as the entropy rule). ``metric``:
``"cosine_entropy"`` (the product above), ``"cosine"`` (``-F_t``) or ``"entropy"`` (``H_t``) — the code's three
``branch_metric`` values.

**Epsilon-root** (``epsilon``; the code's ``entropy_branching_epsilon``, 0.5 in its ``example.sh``, 0 = off
here by default): in the code each iteration's new rollout starts from the bare prompt with probability
``epsilon``; here each new child of a boundary does, independently, with probability ``epsilon`` (it takes its
row as a fork would and restarts at the root: :meth:`BranchingRule.root_restarts`; counted in
``root_restarts``).

Deviations, stated: ``H_t`` is the full-vocabulary entropy (the code's is truncated to vLLM's 20 returned
log-probs); forks happen at segment boundaries, not at the scored token itself. ROSE's length-aware advantage
shaping is the shaper :class:`treejax.rl.shaping.RoseLengthPenalty`.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from treejax.choices import check_choice
from treejax.sampling.branching.base import BranchingRule, PathStats, capped_allocation, register


@register("rose")
@dataclasses.dataclass(frozen=True)
class RoseBranching(BranchingRule):
    """ROSE's cosine-entropy scoring at segment boundaries (module docstring)."""

    metric: str = "cosine_entropy"
    branches: int | None = None
    spill: bool = True
    epsilon: float = 0.0

    token_stats = ("semantic_similarity",)

    def __post_init__(self):
        check_choice("RoseBranching.metric", self.metric, ("cosine_entropy", "cosine", "entropy"))
        if self.branches is not None and self.branches < 1:
            raise ValueError(f"RoseBranching.branches must be >= 1, got {self.branches}")
        if not 0.0 <= self.epsilon <= 1.0:
            raise ValueError(f"RoseBranching.epsilon must be in [0, 1], got {self.epsilon}")

    @property
    def restarts(self) -> bool:  # type: ignore[override]
        return self.epsilon > 0

    def root_restarts(self, stats: PathStats, counts_PxW: jax.Array) -> jax.Array:
        """int32[P]: each of the prompt's ``E = sum(counts - 1)`` new children restarts at the root with
        probability ``epsilon`` (independent draws from the boundary's key)."""
        extra = jnp.sum(jnp.maximum(counts_PxW - 1, 0), axis=-1)
        draws = jax.random.uniform(jax.random.fold_in(stats.key, 0x0E5), counts_PxW.shape) < self.epsilon
        first = jnp.arange(counts_PxW.shape[-1])[None, :] < extra[:, None]
        return jnp.sum(draws & first, axis=-1).astype(jnp.int32)

    @property
    def needs_entropy(self) -> bool:  # type: ignore[override]
        return self.metric != "cosine"

    def token_score(self, stats: PathStats) -> jax.Array:
        """float[P, W, T]: ``score_t`` of every token."""
        f = stats.token_stat("semantic_similarity")
        if self.metric == "cosine":
            return -f
        if self.metric == "entropy":
            return stats.entropy_PxWxT
        return -f * stats.entropy_PxWxT

    def score(self, stats: PathStats) -> jax.Array:
        """float[P, W]: the largest ``score_t`` over each path's last segment."""
        return jnp.max(jnp.where(stats.segment_mask(), self.token_score(stats), -jnp.inf), axis=-1)

    def allocate(self, stats: PathStats, total_P: jax.Array) -> jax.Array:
        branches = stats.branch_factor if self.branches is None else self.branches
        cap = jnp.full(stats.live_PxW.shape, branches - 1, jnp.int32)
        return capped_allocation(self.score(stats), cap, stats.live_PxW, total_P, spill=self.spill)
