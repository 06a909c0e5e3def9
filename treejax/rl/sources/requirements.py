"""What a rollout stage may require of the run, each written once.

A stage (:class:`treejax.rl.sources.base.Stage`) lists the :class:`Requirement` s it needs in ``requires``;
:func:`treejax.rl.sources.base.check_chain` tests each against the run's :class:`RunFacts` and refuses a chain
whose requirement fails with one line: ``RunConfig.rollouts: <Stage> needs <what>; fix: <fix>``.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable


@dataclasses.dataclass(frozen=True)
class RunFacts:
    """What a stage may check about the run, read from ``RunConfig`` once (no model, no jax arrays).

    ``estimator_inputs``: the estimator's declared inputs (``EstimatorSpec.inputs``); ``estimator_ragged``: it
    honours unused leaf slots; ``ragged_estimators``: every registered estimator that does (for messages);
    ``tis_cap``: ``LossConfig.tis_cap``; ``shapers``: the shapers' names; ``tree``: the ``TreeConfig``; ``task``:
    ``RunConfig.task`` (``""``: not known); ``saves_checkpoints``: the run saves orbax checkpoints
    (``RunConfig.checkpoint_every > 0`` or ``RunConfig.save_final``)."""

    estimator: str
    estimator_inputs: tuple[str, ...]
    estimator_ragged: bool
    ragged_estimators: tuple[str, ...]
    reward_source: str
    train_split: str
    old_logp: str
    tis_cap: float | None
    packed_update: bool
    async_enabled: bool
    dynamic_sampling: bool
    shapers: tuple[str, ...]
    tree: Any
    prompts_per_step: int
    task: str = ""
    saves_checkpoints: bool = False  # RunConfig.checkpoint_every > 0 or RunConfig.save_final


@dataclasses.dataclass(frozen=True)
class Requirement:
    """``holds(facts)`` must be true for a stage that lists this requirement; else the run is refused with
    ``<what>`` and ``<fix>`` (``fix`` may read the facts)."""

    what: str
    holds: Callable[[RunFacts], bool]
    fix: str | Callable[[RunFacts], str]

    def message(self, stage: str, facts: RunFacts) -> str:
        fix = self.fix(facts) if callable(self.fix) else self.fix
        return f"RunConfig.rollouts: {stage} needs {self.what}; fix: {fix}"


def _chains_problem(facts: RunFacts) -> str:
    """Why ``facts.tree`` is not independent chains (:func:`treejax.sampling.partial.check_chains`), or ``""``."""
    from treejax.sampling.partial import check_chains

    try:
        check_chains(facts.tree)
    except ValueError as e:
        return str(e)
    return ""


VERIFIER = Requirement("verifier rewards (it reads the verifier's scores of every leaf)",
                       lambda f: f.reward_source == "verifier", "RunConfig.reward_source = 'verifier'")
OFF_POLICY = Requirement(
    "decoupled PPO's importance correction (it trains tokens sampled by older policies)",
    lambda f: f.old_logp != "sampler" and f.tis_cap is not None,
    "RunConfig.old_logp = 'trainer' (or 'ewma') and LossConfig.tis_cap = 2.0 (or another cap)")
SYNCHRONOUS = Requirement("synchronous rollouts (its state is the sampler's own; a sampler thread would race it)",
                          lambda f: not f.async_enabled, "AsyncConfig.enabled = False")
EXPANDED = Requirement("the expanded update (its rows are not verified with the tree-packed one)",
                       lambda f: not f.packed_update, "RunConfig.packed_update = False")
NO_SHAPERS = Requirement("no shapers (they cut responses into fixed segments; turn forests hold spans)",
                         lambda f: not f.shapers, "RunConfig.shapers = []")
TRAIN_SPLIT = Requirement("the task's training split (it keeps state per training prompt)",
                          lambda f: f.train_split == "train", "RunConfig.train_split = 'train'")
RAGGED = Requirement("an estimator that supports prompts with different numbers of rollouts (unused leaf slots)",
                     lambda f: f.estimator_ragged,
                     lambda f: f"RunConfig.estimator = one of {list(f.ragged_estimators)} (not {f.estimator!r})")
SINGLE_CHAIN = Requirement(
    "one chain per prompt row",
    lambda f: f.tree.num_leaves == 1 and f.tree.branch_factor == 1,
    "TreeConfig.num_leaves = 1 and TreeConfig.branch_factor = 1 (its rollouts per problem are its own rows)")
CHAINS = Requirement("independent chains (it resumes or forks rows of its own)", lambda f: not _chains_problem(f),
                     _chains_problem)


def ESTIMATOR(name: str) -> Requirement:  # noqa: N802  (a requirement constant with a parameter)
    """The run's estimator is ``name`` (a source and the estimator written for it come together)."""
    return Requirement(f"estimator {name!r} (written for its rows)", lambda f: f.estimator == name,
                       f"RunConfig.estimator = {name!r}")
