"""The tree's shape chosen from the rollouts themselves: a calibration that measures each candidate slot tree and
keeps the one with the most information per decoded token (or per rollout second).

A slot tree (``TreeConfig.allocation = "slots"``) with ``k`` root paths and branch factor ``b`` decodes its first
segments for ``k`` paths instead of ``W``, so it costs fewer tokens than ``W`` independent samples; its leaves
under one depth-1 node share a prefix and their rewards correlate. Whether the saving outweighs the correlation
depends on the policy and the task (where answers end, how much siblings agree), so it is measured, not assumed.

Calibration (:meth:`ShapeSearchRollouts.calibrate`). ``calibration_batches`` batches of the task's prompts are
drawn once; every candidate ``k`` in ``candidates`` plus ``k = W`` (independent sampling: one chain per slot) rolls
out the *same* prompts with the *same* keys at the current weights; the leaves are scored with the run's reward.
Per candidate, pooled over its batches (:mod:`treejax.rl.tree_stats`):

* ``rho_k = 1 - gamma_sib / gamma_across``, the sibling correlation of the reward (pairs of leaves under one
  depth-1 node vs across);
* ``ESS_k = sum_prompts (sum_i w_i)^2 / (sum_i w_i^2 + rho_k sum_{i != j siblings} w_i w_j)``, the effective
  number of independent samples of each prompt's reward mean;
* ``tokens_k``: decoded tokens; ``seconds_k``: rollout seconds of the batches after the first (the first call of a
  shape compiles it).

The objective is ``ESS_k / tokens_k`` (``"ess_per_token"``) or ``ESS_k / seconds_k`` (``"ess_per_second"``); the
largest wins, ties to the larger ``k``. A tree arm whose ``rho`` is undefined (no reward spread across subtrees,
e.g. every leaf solved) is scored with ``rho = 1`` (no evidence that its siblings differ), which leaves independent
sampling the choice unless a tree measurably pays. With ``every = N > 0`` the calibration is repeated at steps
``N, 2N, ...`` at the then-current weights.

Reproducibility and resumption: the calibration's keys derive from the step's key (``fold_in``), its prompts come
from the run's pipeline (so the training prompts after it are fixed by the seed too), and the chosen ``k`` and
the step it was chosen at are part of the checkpoint: a resumed run rebuilds the chosen shape without
re-calibrating (until its next ``every`` step).
"""

from __future__ import annotations

import dataclasses
import logging
import math
import time
from typing import Any, ClassVar

import jax
import numpy as np

from treejax.errors import ConfigError
from treejax.rl.sources.base import Stage
from treejax.rl import tree_stats

log = logging.getLogger("treejax.rl.loop")

OBJECTIVES = ("ess_per_token", "ess_per_second")
SEARCH_STREAM = 0x5A9E


@dataclasses.dataclass(frozen=True)
class ShapeSearchConfig(Stage):
    """``candidates``: root-path counts ``k`` to try (``W``, independent sampling, is always tried too);
    ``objective``: ``"ess_per_token"`` or ``"ess_per_second"``; ``calibration_batches``: batches of
    ``prompts_per_step`` prompts each candidate samples (``>= 2`` for ``"ess_per_second"``: the first call of a
    shape compiles it; the first batch of every shape is left out of the timing); ``every``: re-calibrate every ``every`` steps (0: once, at the start)."""

    candidates: tuple[int, ...] | list[int] = (2, 4, 8)
    objective: str = "ess_per_token"
    calibration_batches: int = 2
    every: int = 0

    role: ClassVar[str] = "wrapper"  # swaps the task source's slot tree for the calibrated one
    needs: ClassVar[frozenset[str]] = frozenset({"task_tree"})

    def check(self, facts) -> None:
        if not facts.tree.slots:
            raise ConfigError("RunConfig.rollouts: ShapeSearchConfig chooses a slot tree's root paths k; fix: "
                              "TreeConfig.allocation = 'slots'")
        self.shapes(facts.tree.num_leaves)  # a candidate above W is an error now

    def build(self, inner, ctx):
        return ShapeSearchRollouts(inner, self, ctx.make_rollout)

    def __post_init__(self):
        object.__setattr__(self, "candidates", tuple(int(k) for k in self.candidates))
        if not self.candidates or min(self.candidates) < 1:
            raise ConfigError(f"ShapeSearchConfig.candidates: root-path counts >= 1 required, got {self.candidates}")
        if self.objective not in OBJECTIVES:
            raise ConfigError(f"ShapeSearchConfig.objective must be one of {OBJECTIVES}, got {self.objective!r}")
        if self.calibration_batches < 1 or self.every < 0:
            raise ConfigError("ShapeSearchConfig: calibration_batches >= 1 and every >= 0 required, got "
                              f"{self.calibration_batches} and {self.every}")
        if self.objective == "ess_per_second" and self.calibration_batches < 2:
            raise ConfigError("ShapeSearchConfig.objective='ess_per_second' times the batches after each shape's "
                              "first (compiling) call: set calibration_batches >= 2")

    def shapes(self, W: int) -> tuple[int, ...]:
        """The root-path counts tried, ascending, ``W`` included; a candidate above ``W`` is a config error."""
        bad = [k for k in self.candidates if k > W]
        if bad:
            raise ConfigError(f"ShapeSearchConfig.candidates {bad} exceed TreeConfig.num_leaves={W}")
        return tuple(sorted(set(self.candidates) | {W}))


@dataclasses.dataclass(frozen=True)
class ArmMeasurement:
    """One candidate's calibration: ``k`` root paths; ``rho`` (NaN when undefined), ``ess`` (summed over prompts),
    ``tokens`` decoded, ``seconds`` (timed batches only) and ``timed`` (their count), ``prompts``."""

    k: int
    rho: float
    ess: float
    tokens: int
    seconds: float
    timed: int
    prompts: int

    def score(self, objective: str) -> float:
        if objective == "ess_per_token":
            return self.ess / max(self.tokens, 1)
        return self.ess / self.seconds if self.timed and self.seconds > 0 else float("nan")

    def row(self) -> dict:
        """JSON-safe (an undefined ``rho`` is ``None``): checkpoints keep the calibration table."""
        return {"k": self.k, "rho": self.rho if math.isfinite(self.rho) else None,
                "ess_per_prompt": self.ess / max(self.prompts, 1), "tokens": self.tokens, "seconds": self.seconds,
                "ess_per_1k_tokens": 1000 * self.ess / max(self.tokens, 1)}


def measure_arm(k: int, W: int, batches: list[dict]) -> ArmMeasurement:
    """Pools one candidate's batches (each: ``path`` [P, W, D+1], ``weight`` [P, W], ``reward`` [P, W],
    ``decoded``, ``seconds``, ``timed``) into an :class:`ArmMeasurement` (module docstring; an undefined ``rho``
    of a tree arm counts as 1 in its ESS)."""
    sums = None
    for b in batches:
        sums = tree_stats.add_sums(sums, tree_stats.sibling_sums(b["path"], b["weight"], b["reward"]))
    rho = tree_stats.sibling_correlation(sums)
    rho_for_ess = rho if math.isfinite(rho) or k == W else 1.0
    ess = sum(float(tree_stats.effective_samples(b["path"], b["weight"], rho_for_ess).sum()) for b in batches)
    timed = [b for b in batches if b["timed"]]
    return ArmMeasurement(k=k, rho=rho, ess=ess, tokens=int(sum(b["decoded"] for b in batches)),
                          seconds=float(sum(b["seconds"] for b in timed)), timed=len(timed),
                          prompts=int(sum(b["path"].shape[0] for b in batches)))


def choose_shape(arms: dict[int, ArmMeasurement], objective: str) -> int:
    """The ``k`` of the best arm under ``objective`` (ties: the larger ``k``; NaN scores never win)."""
    scored = [(a.score(objective), k) for k, a in arms.items() if math.isfinite(a.score(objective))]
    if not scored:
        raise ValueError(f"no candidate has a finite {objective} score: {[a.row() for a in arms.values()]}")
    return max(scored)[1]


def format_table(arms: dict[int, ArmMeasurement], objective: str, chosen: int, W: int) -> str:
    """The calibration as a few log lines (one per candidate)."""
    best = arms[W].score(objective)
    lines = [f"shape search ({objective}): chose k={chosen}" + (" (independent sampling)" if chosen == W else "")]
    for k, a in sorted(arms.items()):
        s = a.score(objective)
        lines.append(f"  k={k:<3} rho {a.rho:5.2f}  ESS/prompt {a.ess / max(a.prompts, 1):5.2f}  tokens {a.tokens:>8,}"
                     f"  rollout {a.seconds:6.2f} s ({a.timed} timed)  {objective} vs independent "
                     f"{s / best if best > 0 else float('nan'):5.2f}{'  <-' if k == chosen else ''}")
    return "\n".join(lines)


class ShapeSearchRollouts:
    """A :class:`~treejax.rl.rollouts.TaskRollouts` whose slot tree's ``k`` is chosen by calibration (module
    docstring). ``make_rollout(tree_config)`` builds a compiled rollout for a shape (cached per ``k``)."""

    def __init__(self, base, search: ShapeSearchConfig, make_rollout):
        self.base, self.search, self.make_rollout = base, search, make_rollout  # RunConfig checked the slot tree
        self.W = base.cfg.rollout.num_leaves
        self.shapes = search.shapes(self.W)
        self._rollouts: dict[int, Any] = {}
        self.k: int | None = None
        self.chosen_at: int | None = None
        self.table: list[dict] = []

    # ---------------------------------------------------------------------------------------------- shapes
    def tree_config(self, k: int):
        return dataclasses.replace(self.base.cfg.rollout, init_divergence=k, init_divergence_range=None)

    def rollout_for(self, k: int):
        if k not in self._rollouts:
            self._rollouts[k] = self.make_rollout(self.tree_config(k))
        return self._rollouts[k]

    def use(self, k: int, step: int) -> None:
        self.k, self.chosen_at = k, step
        self.base.rollout = self.rollout_for(k)

    # ---------------------------------------------------------------------------------------------- calibration
    def calibrate(self, params, key, step) -> dict[int, ArmMeasurement]:
        """Every shape on the same ``calibration_batches`` batches (module docstring); returns the measurements.
        Each batch is rolled out and scored by the task source's own :meth:`roll_and_score` (its sampled-id check,
        leaf gather across processes and reward), with the shape's rollout in place of the current one."""
        draws = [self.base.draw() for _ in range(self.search.calibration_batches)]
        current = self.base.rollout
        batches: dict[int, list[dict]] = {k: [] for k in self.shapes}
        try:
            for k in self.shapes:
                self.base.rollout = self.rollout_for(k)
                for b, draw in enumerate(draws):
                    bkey = jax.random.fold_in(jax.random.fold_in(key, SEARCH_STREAM), b)
                    t0 = time.perf_counter()
                    out = self.base.roll_and_score(params, *draw, bkey, step)
                    forest, rewards, counters = out.forest, out.rewards, out.counters
                    seconds = time.perf_counter() - t0 - counters.scoring_s
                    batches[k].append({"path": np.asarray(forest.leaf_path), "reward": np.asarray(rewards),
                                       "weight": np.asarray(forest.leaf_weights(), np.float64),
                                       "decoded": counters.decoded_tokens, "seconds": seconds, "timed": b > 0})
        finally:
            self.base.rollout = current
        return {k: measure_arm(k, self.W, bs) for k, bs in batches.items()}

    def due(self, step: int) -> bool:
        if self.k is None:
            return True
        every = self.search.every
        return every > 0 and step >= self.chosen_at + every

    def sample(self, params, key, step):
        """The step's rollouts with the current shape, after a calibration when one is due. A calibration's decoded
        tokens count in the step's ``rollout/decoded_tokens`` (they are rollout compute; ``shape/calibration_tokens``
        says how many), and its time in the step's rollout time."""
        calibration_tokens = 0
        if self.due(step):
            arms = self.calibrate(params, key, step)
            k = choose_shape(arms, self.search.objective)
            self.use(k, step)
            self.table = [a.row() for a in arms.values()]
            calibration_tokens = sum(a.tokens for a in arms.values())
            log.info("%s", format_table(arms, self.search.objective, k, self.W))
        ro = self.base.sample(params, key, step)
        counters = dataclasses.replace(ro.counters, decoded_tokens=ro.counters.decoded_tokens + calibration_tokens)
        return dataclasses.replace(ro, counters=counters, extra_metrics={
            **(ro.extra_metrics or {}), "shape/k": float(self.k), "shape/chosen_at": float(self.chosen_at),
            "shape/calibration_tokens": float(calibration_tokens)})

    # ---------------------------------------------------------------------------------------------- checkpoint
    def checkpoint_state(self) -> dict:
        out = dict(self.base.checkpoint_state()) if hasattr(self.base, "checkpoint_state") else {}
        out["shape_search"] = {"k": self.k, "chosen_at": self.chosen_at, "table": self.table}
        return out

    def restore_state(self, data_state: dict) -> None:
        if hasattr(self.base, "restore_state"):
            self.base.restore_state(data_state)
        saved = data_state.get("shape_search")
        if saved and saved.get("k") is not None:
            self.table = list(saved.get("table", []))
            self.use(int(saved["k"]), int(saved["chosen_at"]))
            log.info("shape search: resumed with k=%d (chosen at step %d)", self.k, self.chosen_at)

    def __getattr__(self, name):  # everything else (greedy rewards, the pipeline, ...) is the base source's
        return getattr(self.base, name)
