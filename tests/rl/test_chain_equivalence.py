"""The rollout chain accepts exactly the runs the old per-method checks accepted.

Every combination of the old rollout-source fields with at most three set (every run the old checks accepted sets
at most three: a planner, the shape search and replay), crossed with asynchronous rollouts, dynamic sampling, the
packed update, the reward source, the old-log-prob source and TIS cap, shapers, estimators with and without extra
inputs, and three tree shapes: the old checks (``tests/rl/legacy_source_checks.py``) and
:func:`~treejax.rl.sources.base.check_chain` on the deprecated fields' translation must agree on every one.
"""

import itertools
import types

from treejax.errors import ConfigError
from treejax.rl.advantages import estimator_spec
from treejax.rl.advantages.registry import list_estimators
from treejax.rl.sources import catalog as c
from treejax.rl.sources.base import check_chain
from treejax.rl.sources.requirements import RunFacts
from treejax.rl.allocation import DARS
from treejax.sampling.tree import TreeConfig

from legacy_source_checks import legacy_checks

FIELDS = {"nudge": [c.NudgeConfig(hints=("a", "b"))], "allocation": [c.AllocationConfig(allocator=DARS())],
          "selection": [c.DOTSConfig(), c.PromptGDROConfig()], "exemplars": [c.ExemplarConfig()],
          "multiturn": [c.MultiTurnConfig()], "partial": [c.PartialConfig()],
          "shape_search": [c.ShapeSearchConfig(candidates=(2,))], "replay": [c.ReplayConfig()],
          "spear": [c.SpearConfig()]}
ORDER = list(FIELDS)  # the old set-up's order of composition (treejax.rl.sources.legacy.LEGACY_FIELDS)
TREES = {"chains": TreeConfig(num_leaves=4, max_depth=2, segment_length=4, branch_factor=1, init_divergence=4,
                              fallback=False),
         "slots": TreeConfig(num_leaves=4, max_depth=2, segment_length=4, branch_factor=2, allocation="slots"),
         "one_chain": TreeConfig(num_leaves=1, max_depth=2, segment_length=4, branch_factor=1)}
ESTIMATORS = ("grpo", "gigpo", "remax", "decs", "igpo", "spo_chain", "nudge")  # none / ragged / each input kind
RAGGED = tuple(sorted(n for n in list_estimators() if estimator_spec(n).ragged))


def _subsets():
    for size in range(4):
        for names in itertools.combinations(ORDER, size):
            yield from (dict(zip(names, stages)) for stages in itertools.product(*(FIELDS[n] for n in names)))


def _accepts(fn) -> bool:
    try:
        fn()
    except ConfigError:
        return False
    return True


def test_the_chain_accepts_exactly_what_the_old_checks_accepted():
    from treejax.rl.shaping import EchoShaping

    settings = list(itertools.product((False, True), (False, True), (False, True), ("verifier", "majority"),
                                      (("trainer", 2.0), ("trainer", None), ("sampler", None)), ((), (EchoShaping(),)),
                                      ESTIMATORS, TREES))
    checked = accepted = 0
    disagree = []
    for fields in _subsets():
        chain = [fields[n] for n in ORDER if n in fields]
        for asy, dyn, packed, reward, (old_logp, tis), shapers, est, tree in settings:
            spec = estimator_spec(est)
            facts = RunFacts(estimator=est, estimator_inputs=tuple(spec.inputs), estimator_ragged=spec.ragged,
                             ragged_estimators=RAGGED, reward_source=reward, train_split="train", old_logp=old_logp,
                             tis_cap=tis, packed_update=packed, async_enabled=asy, dynamic_sampling=dyn,
                             shapers=tuple(s.name for s in shapers), tree=TREES[tree], prompts_per_step=4)
            old = types.SimpleNamespace(**{n: fields.get(n) for n in ORDER}, rollout=TREES[tree], estimator=est,
                                        dynamic_sampling=dyn, reward_source=reward, train_split="train",
                                        old_logp=old_logp, loss=types.SimpleNamespace(tis_cap=tis),
                                        packed_update=packed, async_rollouts=types.SimpleNamespace(enabled=asy),
                                        shapers=shapers, prompts_per_step=4,
                                        continuation_config=lambda est=est: ("cut_value_PxWxB" in
                                                                            estimator_spec(est).inputs) or None)
            new_ok = _accepts(lambda: check_chain(chain, facts))
            # the old estimator-input checks outside the source checks: TaskRollouts refused inputs it cannot supply,
            # and the NudgeRL source and estimator came together (both now rule 4 of check_chain)
            old_ok = _accepts(lambda: legacy_checks(old)) and _plain_inputs_ok(fields, spec.inputs)
            checked += 1
            accepted += new_ok
            if new_ok != old_ok:
                disagree.append((sorted(fields), asy, dyn, packed, reward, old_logp, tis, bool(shapers), est, tree,
                                 old_ok, new_ok))
    assert not disagree, f"{len(disagree)} of {checked} disagree, e.g. {disagree[:5]}"
    assert checked > 100_000 and 1_000 < accepted < checked  # both sides really accept and refuse


def _plain_inputs_ok(fields: dict, inputs: tuple) -> bool:
    """What the old set-up refused at build time for the task source's own rows: an estimator input that no source
    in the chain computes (``TaskRollouts`` raised ``ValueError`` at ``build_run``; the config accepted it)."""
    planner = next((n for n in ("nudge", "allocation", "selection", "exemplars", "multiturn", "partial")
                    if n in fields), None)
    if planner in ("nudge", "multiturn"):  # their own checks covered their inputs
        return True
    return all(i in ("greedy_reward_P", "answer_step_PxW", "cut_PxWxB", "cut_value_PxWxB") for i in inputs)


def test_old_fields_still_work_for_one_release_and_name_the_new_spelling():
    import dataclasses

    import pytest

    from treejax.rl.config import RunConfig
    from treejax.rl.losses import LossConfig
    from treejax.rl.sources.legacy import DeprecatedFieldWarning

    with pytest.warns(DeprecatedFieldWarning, match=r"RunConfig.rollouts = \[@DOTSConfig\(\), @ReplayConfig\(\)\]"):
        old = RunConfig(selection=c.DOTSConfig(), replay=c.ReplayConfig(), loss=LossConfig(tis_cap=2.0),
                        prompts_per_step=4)
    new = RunConfig(rollouts=[c.DOTSConfig(), c.ReplayConfig()], loss=LossConfig(tis_cap=2.0), prompts_per_step=4)
    assert old == new and old.replay is None and old.step_rows() == 4 + 4
    assert dataclasses.replace(old, num_steps=5).rollouts == new.rollouts  # no second translation, no warning
    with pytest.raises(ConfigError, match="both set"):
        RunConfig(rollouts=[c.ReplayConfig()], replay=c.ReplayConfig(), loss=LossConfig(tis_cap=2.0))
    with pytest.raises(ConfigError, match="takes DOTSConfig or PromptGDROConfig"):
        RunConfig(selection=c.ReplayConfig(), loss=LossConfig(tis_cap=2.0))
