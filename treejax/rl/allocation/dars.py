"""DARS: Difficulty-Adaptive Rollout Sampling (Yang et al. 2025; code ``yangzhch6/DARS``,
``verl/trainer/ppo/ray_dars_trainer.py``, ``schedule_ET`` / ``schedule_HW``).

GRPO's expected total advantage magnitude of a prompt with pass rate ``a`` over ``N`` binary rollouts is
``N S(a)`` with ``S(a) = 2 sqrt(a (1 - a))`` when advantages are divided by the group std (and ``2 a (1 - a)``
without): easy and hard prompts carry little signal. DARS rolls out ``N`` first, estimates ``a`` from them
(``a = 0`` is replaced by ``0.5 / N``, half a success, so a prompt with no success still gets extra
rollouts), and gives every prompt with ``a < 0.5`` ``dN`` more rollouts so its total advantage reaches a target:

    Equal-Treatment   (ET): dN = ceil((A_peak - N S(a)) / S(a))
    Hardness-Weighted (HW): dN = ceil((2 (1 - a) A_peak - N S(a)) / S(a))

``A_peak = N S(0.5)``: ``N`` with std normalisation, ``N / 2`` without; ``dN`` is clipped to ``[0, N_max -
N]`` (here ``AllocationConfig.max_rollouts``). ET lifts every hard prompt to the peak's magnitude; HW lifts
harder prompts above it (``2 (1 - a) > 1`` for ``a < 0.5``). Prompts with ``a >= 0.5`` keep their ``N``.

The official code: ``a`` is the mean score of the pre-rollout (``a <= 1e-6`` counts as 0), ``dN`` is
``min(ceil(dN), N_max - N)``, the extra rollouts are one more generation call whose samples join the same GRPO
group (same uid), and after the merge groups whose rewards are all equal are dropped
(``AllocationConfig.drop_equal_groups``). There is no per-batch cap on the extra rollouts; here the row budget
``AllocationConfig.extra_rows`` is one (set it to ``P * (N_max / W - 1)`` for none).

Here: ``a`` is the pre-rollout's leaf-weighted accuracy (``PromptStats.accuracy_P``), ``N`` its rollouts; the
extra rollouts come in whole chunks of ``W`` within the step's row budget
(:func:`treejax.rl.allocation.base.plan_chunks`). DARS-B's large-batch multi-epoch update is the loop's
``RunConfig.epochs`` / ``mini_batches``; it is not a separate allocator.
"""

from __future__ import annotations

import dataclasses
from typing import Literal

import numpy as np

from treejax.errors import ConfigError
from treejax.rl.allocation.base import Allocator, Budget, PromptStats, register


def dars_extra(accuracy_P, n_P, variant: str = "hw", std_normalized: bool = True) -> np.ndarray:
    """int64[P]: DARS's ``dN`` before the ``N_max`` cap (module docstring's formulas)."""
    n = np.asarray(n_P, np.float64)
    a = np.asarray(accuracy_P, np.float64)
    a = np.where(a <= 1e-6, 0.5 / np.maximum(n, 1.0), a)
    s = 2.0 * np.sqrt(a * (1.0 - a)) if std_normalized else 2.0 * a * (1.0 - a)
    peak = n if std_normalized else n / 2.0
    target = peak if variant == "et" else 2.0 * (1.0 - a) * peak
    dn = np.ceil((target - n * s) / np.maximum(s, 1e-12))
    return np.where(a < 0.5, np.maximum(dn, 0.0), 0.0).astype(np.int64)


@register("dars")
@dataclasses.dataclass(frozen=True)
class DARS(Allocator):
    """DARS: extra rollouts for prompts with pre-rollout accuracy below 0.5 (hardness-weighted or equal).

    Formulas in the module docstring. ``variant``: ``"hw"`` (Hardness-Weighted) or ``"et"`` (Equal-Treatment);
    ``std_normalized``: the estimator divides by the group std (GRPO; ``S(a) = 2 sqrt(a(1-a))``) or not
    (Dr.GRPO, the official scripts' ``grpo_use_std=False``, the default; ``2 a (1-a)``). The official scripts
    pair HW with ``N_max = 64`` and ET with ``N_max = 32`` at ``N = 8``."""

    variant: Literal["hw", "et"] = "hw"
    std_normalized: bool = False

    def __post_init__(self):
        if self.variant not in ("hw", "et"):
            raise ConfigError(f"DARS.variant must be 'hw' or 'et', got {self.variant!r}")

    def extra_rollouts(self, stats: PromptStats, state: dict, budget: Budget):
        return dars_extra(stats.accuracy_P, stats.rollouts_P, self.variant, self.std_normalized), state
