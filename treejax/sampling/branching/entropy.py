"""Entropy-guided branching (TreeRL's EPTree idea, THUDM/TreeRL): the budget goes to the most uncertain paths.

EPTree forks from the ``N`` tokens of existing paths with the highest ``-log p`` (an entropy proxy), ``T`` branches
per fork point. At a segment boundary (our adaptation: branches fork at boundaries, not at the token) each live
path is scored by the uncertainty of its last segment,

    ``u = reduce_{t in segment} h_t``,  ``h_t = H(pi(. | prefix_t))`` (``statistic="entropy"``) or
    ``h_t = -log pi(y_t | prefix_t)`` (``"nll"``, EPTree's proxy, needs no extra per-token statistic),
    ``reduce`` = mean or max over the segment's tokens,

and the extra budget ``E = total - A`` goes down the ranking, ``branches - 1`` extra children per path (``T =
branches`` children in all), highest ``u`` first (:func:`capped_allocation`); with ``spill`` whatever the caps
leave (budget transfer from stopped paths) is spread evenly. No pruning.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from treejax.choices import check_choice
from treejax.sampling.branching.base import BranchingRule, PathStats, capped_allocation, register


@register("entropy")
@dataclasses.dataclass(frozen=True)
class EntropyGuided(BranchingRule):
    """EPTree-style branching at segment boundaries (module docstring). ``branches``: children of a chosen path
    (``None``: the tree's branch factor ``b``)."""

    statistic: str = "entropy"
    reduce: str = "mean"
    branches: int | None = None
    spill: bool = True

    def __post_init__(self):
        if self.statistic not in ("entropy", "nll"):
            check_choice("EntropyGuided.statistic", self.statistic, ("entropy", "nll"))
        if self.reduce not in ("mean", "max"):
            check_choice("EntropyGuided.reduce", self.reduce, ("mean", "max"))
        if self.branches is not None and self.branches < 1:
            raise ValueError(f"EntropyGuided.branches must be >= 1, got {self.branches}")

    @property
    def needs_entropy(self) -> bool:  # type: ignore[override]
        return self.statistic == "entropy"

    def score(self, stats: PathStats) -> jax.Array:
        """float[P, W]: the uncertainty ``u`` of each path's last segment."""
        h = stats.entropy_PxWxT if self.statistic == "entropy" else -stats.logp_PxWxT
        mask = stats.segment_mask()
        if self.reduce == "mean":
            return stats.masked_mean(h, mask)
        return jnp.max(jnp.where(mask, h, -jnp.inf), axis=-1)

    def allocate(self, stats: PathStats, total_P: jax.Array) -> jax.Array:
        branches = stats.branch_factor if self.branches is None else self.branches
        cap = jnp.full(stats.live_PxW.shape, branches - 1, jnp.int32)
        return capped_allocation(self.score(stats), cap, stats.live_PxW, total_P, spill=self.spill)
