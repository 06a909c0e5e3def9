"""ARRoL's pruning (arXiv 2603.24840, "Prune as You Generate"): prune partial rollouts so that the survivors are
correctness-balanced, by an online quality head's predicted success.

The head (:class:`treejax.rl.shaping.QualityHead`, a stateful shaper: ``RunConfig.shapers = [@QualityHead()]``)
is a linear probe on the policy's last hidden state, trained each step on the trainer's forward with BCE against
final correctness. Its weights travel with the sampler's copy of the policy (:mod:`treejax.sampling.probe`), and
the decode step evaluates it at every token (the ``"probe"`` statistic, :mod:`treejax.sampling.token_stats`).

At the boundary where a path has decoded ``prune_depth`` segments, every prompt's live paths at that depth
(``n`` of them, ``n >= min_live``) are ranked by the probe's predicted success at their last token,
``p_hat = sigmoid(w . h + b)``, and ``k = ceil(keep * n)`` survive: the ``ceil(rho * k)`` most likely to succeed
and the ``k - ceil(rho * k)`` least likely (``rho = 0.5``, the paper's target positive ratio: a balanced group
carries the most GRPO signal); the middle of the ranking is pruned. Nothing is pruned before the head has trained
once (``PathStats.probe_ready``). Survivors branch with the prompt's budget split evenly (the pruned paths' share
comes back through TreePO's budget transfer), so the prompt still ends with ``W`` leaves.

Choices where the paper could not be read (its code is not released), stated here: the prune point is a segment
boundary (``prune_depth``), not a token count; the kept fraction is ``keep = 0.5`` (the paper launches about
twice the rollouts it keeps); and, as for every treejax pruning rule, a pruned path stays in the forest as a
``PRUNED`` leaf with its partial response and the verifier's reward for it (ARRoL drops pruned rollouts from the
update). The head's third use, weighting held-out votes, is ``EvalConfig.vote_probe`` (``eval/wmaj@k``).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from treejax.sampling import kernels
from treejax.sampling.branching.base import BranchingRule, PathStats, register


@register("arrol")
@dataclasses.dataclass(frozen=True)
class QualityPrune(BranchingRule):
    """Correctness-balanced pruning by the quality head (module docstring); even split of the budget."""

    probe_name: str = "arrol_head"
    prune_depth: int = 2
    keep: float = 0.5
    rho: float = 0.5
    min_live: int = 2

    token_stats = ("probe",)
    prunes = True

    def __post_init__(self):
        if self.prune_depth < 1 or self.min_live < 1:
            raise ValueError(f"QualityPrune needs prune_depth >= 1 and min_live >= 1, got {self.prune_depth}, "
                             f"{self.min_live}")
        if not (0.0 < self.keep <= 1.0 and 0.0 <= self.rho <= 1.0):
            raise ValueError(f"QualityPrune needs 0 < keep <= 1 and 0 <= rho <= 1, got {self.keep}, {self.rho}")

    def score(self, stats: PathStats) -> jax.Array:
        """float[P, W]: the probe's logit at each path's last token (monotone in ``p_hat``)."""
        return stats.last_token(stats.token_stat("probe"))

    def prune(self, stats: PathStats) -> jax.Array:
        cand = stats.live_PxW & (stats.depth_PxW == self.prune_depth)
        n = jnp.sum(cand, axis=-1)  # [P]
        k = jnp.ceil(self.keep * n.astype(jnp.float32) - 1e-6).astype(jnp.int32)
        k = jnp.maximum(k, jnp.minimum(n, 1))
        hi = jnp.ceil(self.rho * k.astype(jnp.float32) - 1e-6).astype(jnp.int32)
        lo = k - hi
        score = jnp.where(cand, self.score(stats), -jnp.inf)
        W = cand.shape[-1]
        idx = jnp.arange(W)
        # rank[p, i]: candidates ahead of i in descending score (ties: lower index first)
        ahead = ((score[:, None, :] > score[:, :, None])
                 | ((score[:, None, :] == score[:, :, None]) & (idx[None, :] < idx[:, None])[None]))
        rank = jnp.sum(ahead & cand[:, None, :], axis=-1)
        survive = (rank < hi[:, None]) | (rank >= (n - lo)[:, None])
        act = (n >= self.min_live) & jnp.asarray(stats.probe_ready, bool)
        return cand & ~survive & act[:, None]

    def allocate(self, stats: PathStats, total_P: jax.Array) -> jax.Array:
        live = stats.live_PxW
        return kernels.allocate_budget(jnp.ones(live.shape, jnp.float32), live, total_P, minimum=1)

