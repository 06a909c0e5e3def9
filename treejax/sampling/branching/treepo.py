"""TreePO's branching rules (arXiv 2508.17445 §2.2; official ``vllm_rollout_spmd.py``): no pruning, the budget
``total`` (see :mod:`treejax.sampling.branching.base`) split over the live paths, each ``>= 1``."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from treejax.choices import check_choice
from treejax.sampling import kernels
from treejax.sampling.branching.base import BranchingRule, PathStats, register


@register("fixed_average")
@dataclasses.dataclass(frozen=True)
class FixedAverage(BranchingRule):
    """Equal split: ``total // A`` children per live path, and the remainder ``total mod A``

    * ``remainder="first"``: one each to the first live paths (largest remainder with equal weights,
      :func:`kernels.allocate_budget`; treejax's default);
    * ``remainder="last"``: all of it to the last live path (the official code's split).

    In a slot tree (``TreeConfig.allocation = "slots"``) every live path with ``n`` slots takes ``min(b, n)``
    children (:meth:`BranchingRule.slot_children`); ``remainder`` is not read there.
    """

    remainder: str = "first"
    splits_slots = True  # slot trees: min(b, n) children per path, n = its own slots (BranchingRule.slot_children)

    def __post_init__(self):
        if self.remainder not in ("first", "last"):
            check_choice("FixedAverage.remainder", self.remainder, ("first", "last"))

    def allocate(self, stats: PathStats, total_P: jax.Array) -> jax.Array:
        live = stats.live_PxW
        if self.remainder == "first":
            return kernels.allocate_budget(jnp.ones(live.shape, jnp.float32), live, total_P, minimum=1)
        n = jnp.sum(live, axis=-1)
        base = jnp.where(n > 0, total_P // jnp.maximum(n, 1), 0)
        rem = jnp.where(n > 0, total_P - base * n, 0)
        last = live & (kernels.rank_within(live) == (n - 1)[:, None])
        return jnp.where(live, base[:, None] + jnp.where(last, rem[:, None], 0), 0).astype(jnp.int32)


@register("logprob")
@dataclasses.dataclass(frozen=True)
class LogProbWeighted(BranchingRule):
    """Log-prob weighted split: weights ``softmax(sign * (x - min x) / T)`` over the live paths, with ``x`` the
    mean policy log-prob of the path's last segment (``scope="segment"``) or whole response (``"path"``);
    ``sign=+1`` favours confident paths, ``-1`` uncertain ones. ``T = temperature``, or with
    ``schedule=(start, end, num_steps)`` annealed over the training step (:func:`kernels.temperature_schedule`,
    linear; TreePO: 5.0 -> 1.0). Integer split by largest remainder, each path ``>= 1``
    (:func:`kernels.allocate_budget`). TreePO §4.4 finds it no better than the fixed split.
    """

    scope: str = "segment"
    sign: float = 1.0
    temperature: float = 2.0
    schedule: tuple[float, float, int] | None = None

    def __post_init__(self):
        if self.scope not in ("segment", "path"):
            check_choice("LogProbWeighted.scope", self.scope, ("segment", "path"))
        if not self.temperature > 0:
            raise ValueError(f"LogProbWeighted.temperature must be > 0, got {self.temperature}")
        if self.schedule is not None and (len(self.schedule) != 3 or self.schedule[2] <= 0):
            raise ValueError(f"LogProbWeighted.schedule must be (start, end, num_steps > 0), got {self.schedule}")

    def temperature_at(self, step) -> jax.Array:
        if self.schedule is None:
            return jnp.float32(self.temperature)
        start, end, num_steps = self.schedule
        return kernels.temperature_schedule(step, int(num_steps), float(start), float(end))

    def allocate(self, stats: PathStats, total_P: jax.Array) -> jax.Array:
        mask = stats.segment_mask() if self.scope == "segment" else stats.response_mask()
        x = stats.masked_mean(stats.logp_PxWxT, mask)
        weights = kernels.divergence_weights(x, stats.live_PxW, self.temperature_at(stats.step), self.sign)
        return kernels.allocate_budget(weights, stats.live_PxW, total_P, minimum=1)
