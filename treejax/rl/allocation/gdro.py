"""Rollout-GDRO (arXiv 2601.19280, §3.3 and Thm 4.2; code ``kishanpb/verl-gdro``): move rollouts across
pass-rate bins under a fixed mean budget, by the square-root rule.

Bins: each prompt's pass rate is the mean of its recent pass@k indicators (``c_t(x) = 1`` when any of the
step's ``k`` pre-rollouts is correct; a sliding window of the last ``history`` times it was drawn); bin ``b``
holds the rates in ``[edge_{b-1}, edge_b)`` (edges as the code's ``0.1, 0.2, 0.4, 0.6, 0.8, 0.9``; a prompt
drawn for the first time is binned by its pre-rollout accuracy).

Allocation: with ``v_b`` the gradient-variance proxy of bin ``b`` and ``q_b`` its share of the batch, the
variance of the batch's gradient estimate ``sum_b q_b v_b / n_b`` is smallest under the mean budget
``sum_b q_b n_b = n_bar`` at ``n_b = n_bar sqrt(v_b) / sum_j q_j sqrt(v_j)`` (the paper's Thm 4.2). With
the box ``n_min <= n_b <= n_max`` the solution is ``n_b(mu) = clip(sqrt(v_b / mu), n_min, n_max)`` with the
shadow price ``mu`` set so the budget holds (found here by bisection, exact up to rounding; the paper learns
the arms with a per-bin EXP3P bandit and a dual step on ``mu``, and its analysis gives this closed form).
``v_b``: an exponential moving average (``ema``, the code's 0.4) over steps of the mean Bernoulli variance
``a (1 - a)`` of the bin's prompts in the step (``a``: pre-rollout accuracy) — the size of a binary reward's
group-relative signal; a bin not seen yet starts at its current value.

Here ``n_min = W`` (the pre-rollout; the paper's ``n_min = 2`` can go below its mean ``n_bar = 4``, treejax's
pre-rollout is always decoded), ``n_max = AllocationConfig.max_rollouts``, ``n_bar P = W P +`` the step's extra
budget, and ``n_b - W`` rounds to whole chunks (:func:`treejax.rl.allocation.base.plan_chunks`).
"""

from __future__ import annotations

import dataclasses

import numpy as np

from treejax.errors import ConfigError
from treejax.rl.allocation.base import Allocator, Budget, PromptStats, register


def sqrt_rule(q_B, v_B, total: float, n_min: float, n_max: float, iters: int = 100) -> np.ndarray:
    """float[B]: ``n_b = clip(sqrt(v_b / mu), n_min, n_max)`` with ``sum_b q_b n_b = total`` (``q_b``: prompts
    in bin ``b``), by bisection on ``log mu``; the box's corner when the budget is outside its range."""
    q = np.asarray(q_B, np.float64)
    v = np.maximum(np.asarray(v_B, np.float64), 0.0)
    lo_total, hi_total = q.sum() * n_min, q.sum() * n_max

    def n_of(log_mu):
        return np.clip(np.sqrt(v / np.exp(log_mu)), n_min, n_max)

    if total <= lo_total or not np.any(v > 0):
        return np.full(len(q), float(n_min))
    if total >= hi_total:
        return np.where(v > 0, float(n_max), float(n_min))
    a, b = -80.0, 80.0  # sum q n(mu) decreases in mu
    for _ in range(iters):
        m = 0.5 * (a + b)
        if (q * n_of(m)).sum() > total:
            a = m
        else:
            b = m
    return n_of(b)


@register("rollout_gdro")
@dataclasses.dataclass(frozen=True)
class RolloutGDRO(Allocator):
    """Rollout-GDRO: rollouts to pass-rate bins by the square-root rule under the step's mean budget.

    Module docstring. ``edges``: the pass-rate bin edges; ``history``: the sliding window
    of pass@k indicators per prompt; ``ema``: the variance proxy's EMA weight of the new step."""

    edges: tuple[float, ...] = (0.1, 0.2, 0.4, 0.6, 0.8, 0.9)
    history: int = 50
    ema: float = 0.4

    def __post_init__(self):
        e = tuple(self.edges)
        if any(not 0.0 < x < 1.0 for x in e) or list(e) != sorted(set(e)):
            raise ConfigError(f"RolloutGDRO.edges must rise strictly inside (0, 1), got {e}")
        if self.history < 1 or not 0.0 < self.ema <= 1.0:
            raise ConfigError(f"RolloutGDRO: history >= 1 and 0 < ema <= 1 required, got {self}")

    @property
    def num_bins(self) -> int:
        return len(self.edges) + 1

    def init_state(self) -> dict:
        return {"passes": {}, "v": [None] * self.num_bins}

    def bins(self, stats: PromptStats, passes: dict) -> np.ndarray:
        """int[P]: each prompt's bin by its windowed pass rate (the current indicator included)."""
        rate = []
        for p in range(stats.num_prompts):
            hist = passes.get(stats.keys[p], []) if stats.keys else []
            now = [1.0 if stats.accuracy_P[p] > 0 else 0.0]
            seen = hist + now
            rate.append(float(np.mean(seen)) if hist else float(stats.accuracy_P[p]))
        return np.searchsorted(np.asarray(self.edges), np.asarray(rate), side="right")

    def extra_rollouts(self, stats: PromptStats, state: dict, budget: Budget):
        state = {"passes": {k: list(v) for k, v in state.get("passes", {}).items()},
                 "v": list(state.get("v", [None] * self.num_bins))}
        b = self.bins(stats, state["passes"])
        acc = np.asarray(stats.accuracy_P, np.float64)
        for j in range(self.num_bins):
            members = b == j
            if members.any():
                now = float(np.mean(acc[members] * (1.0 - acc[members])))
                old = state["v"][j]
                state["v"][j] = now if old is None else (1.0 - self.ema) * old + self.ema * now
        for p, key in enumerate(stats.keys):  # record this step's pass@k indicators
            state["passes"][key] = (state["passes"].get(key, []) + [1.0 if acc[p] > 0 else 0.0])[-self.history:]
        v = np.array([0.0 if x is None else x for x in state["v"]])
        q = np.bincount(b, minlength=self.num_bins).astype(np.float64)
        n_min = float(np.min(stats.rollouts_P))
        n_b = sqrt_rule(q, v, float(np.sum(stats.rollouts_P)) + budget.extra, n_min, float(budget.max_rollouts))
        # the extra rollouts rounded to the nearest whole chunk (the sampler's unit)
        chunks = np.floor((n_b[b] - np.asarray(stats.rollouts_P)) / budget.chunk + 0.5)
        return np.maximum(chunks, 0).astype(np.int64) * budget.chunk, state
