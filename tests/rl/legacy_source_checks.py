"""The rollout-source checks of ``RunConfig`` before the rollout chain (main at 1f9ea1e, ``rl/config.py``), kept
verbatim (the three calls to renamed methods excepted: ``check_budget``, ``check_tree``, a class-name test) as
functions of a config-like object ``self`` so that ``tests/rl/test_chain_equivalence.py`` can assert that
:func:`treejax.rl.sources.base.check_chain` accepts exactly the same set of runs. Not part of the package."""

from treejax.errors import ConfigError
from treejax.rl.advantages import estimator_spec
from treejax.rl.advantages.registry import list_estimators

MULTITURN_INPUTS = ("truth_logp_PxN", "tool_success_PxN", "state_cluster_PxN")

def _check_nudge(self) -> None:
    """NudgeRL: its source and its estimator come together, on one chain per prompt row, without what would
    drop or re-pack its rows."""
    if (self.nudge is None) != (self.estimator != "nudge"):
        raise ConfigError("RunConfig.nudge (NudgeRL's hinted rollouts) and RunConfig.estimator = 'nudge' go "
                          "together; fix: set both (RunConfig.nudge = @NudgeConfig()) or neither")
    if self.nudge is None:
        return
    tc = self.rollout
    if tc.num_leaves != 1 or tc.branch_factor != 1:
        raise ConfigError("NudgeRL rolls out each hinted or plain prompt as its own row (one chain each); fix: "
                          "TreeConfig.num_leaves = 1 and TreeConfig.branch_factor = 1 (rollouts per problem: "
                          "NudgeConfig.num_hints x rollouts_per_hint)")
    for bad, why in ((self.dynamic_sampling, "RunConfig.dynamic_sampling = False (a problem's rows are one group)"),
                     (self.packed_update, "RunConfig.packed_update = False (its rows share no prompt)"),
                     (self.reward_source != "verifier", "RunConfig.reward_source = 'verifier'"),
                     (self.train_split != "train", "RunConfig.train_split = 'train'")):
        if bad:
            raise ConfigError(f"NudgeRL: fix: {why}")


def _check_allocation(self) -> None:
    """Prompt-level allocation needs an estimator that honours unused slots, and nothing else that decides
    which rows a step keeps."""
    a = self.allocation
    if a is None:
        return
    a.check_budget(self.rollout.num_leaves)
    if not estimator_spec(self.estimator).ragged:
        ok = sorted(n for n in list_estimators() if estimator_spec(n).ragged)
        raise ConfigError(f"RunConfig.allocation gives prompts different numbers of rollouts, which estimator "
                          f"{self.estimator!r} does not support (its groups are the W leaves of one row); fix: "
                          f"RunConfig.estimator = one of {ok}")
    for bad, why in ((self.dynamic_sampling, "RunConfig.dynamic_sampling = False (the allocator decides the "
                      "rows; AllocationConfig.drop_equal_groups drops all-equal groups)"),
                     (self.reward_source != "verifier", "RunConfig.reward_source = 'verifier' (the allocator "
                      "reads the verifier's accuracy)"),
                     (self.nudge is not None, "RunConfig.nudge = None (NudgeRL has its own rows)"),
                     (self.continuation_config() is not None, "an estimator without continuations")):
        if bad:
            raise ConfigError(f"RunConfig.allocation: fix: {why}")


def _check_replay(self) -> None:
    """Replayed rows were sampled by older policies: the learner needs the trainer's proximal log-probs and
    the truncated importance weight pi_prox / q (decoupled PPO)."""
    if self.replay is None:
        return
    if self.old_logp == "sampler" or self.loss.tis_cap is None:
        raise ConfigError("RunConfig.replay trains rows sampled by older policies, which needs the importance "
                          "correction of decoupled PPO; fix: RunConfig.old_logp = 'trainer' (or 'ewma') and "
                          "LossConfig.tis_cap = 2.0 (or another cap)")
    for bad, why in ((self.allocation is not None, "RunConfig.allocation = None (its groups span rows that "
                      "replay does not keep together)"),
                     (self.nudge is not None, "RunConfig.nudge = None (NudgeRL's rows are one group per problem)"),
                     (self.reward_source != "verifier", "RunConfig.reward_source = 'verifier'"),
                     (bool(estimator_spec(self.estimator).inputs), f"an estimator without extra inputs "
                      f"(estimator {self.estimator!r} reads {estimator_spec(self.estimator).inputs})")):
        if bad:
            raise ConfigError(f"RunConfig.replay: fix: {why}")


def _check_selection(self) -> None:
    """A selector (DOTS, Prompt-GDRO) draws and rolls out its own prompts: nothing else may decide which
    prompt rows a step has."""
    d = self.selection
    if d is None:
        return
    name = type(d).__name__
    if type(d).__name__ == 'DOTSConfig' and d.reference >= self.prompts_per_step:
        raise ConfigError(f"DOTSConfig.reference = {d.reference} leaves no selected row of prompts_per_step = "
                          f"{self.prompts_per_step}; fix: DOTSConfig.reference < RunConfig.prompts_per_step")
    for bad, why in ((self.dynamic_sampling, "RunConfig.dynamic_sampling = False (the selector picks the rows)"),
                     (self.allocation is not None, "RunConfig.allocation = None"),
                     (self.nudge is not None, "RunConfig.nudge = None"),
                     (self.reward_source != "verifier", "RunConfig.reward_source = 'verifier'"),
                     (self.train_split != "train", "RunConfig.train_split = 'train'"),
                     ("greedy_reward_P" in estimator_spec(self.estimator).inputs,
                      f"an estimator without a greedy baseline (not {self.estimator!r})")):
        if bad:
            raise ConfigError(f"RunConfig.selection ({name}): fix: {why}")


def _check_partial(self) -> None:
    """Partial rollouts resume independent chains and train tokens of older policies: chains only, the
    decoupled-PPO correction, and nothing else that decides a step's rows."""
    if self.partial is None:
        return
    from treejax.sampling.partial import check_chains

    try:
        check_chains(self.rollout)
    except ValueError as e:
        raise ConfigError(f"RunConfig.partial: {e}") from None
    if self.old_logp == "sampler" or self.loss.tis_cap is None:
        raise ConfigError("RunConfig.partial trains tokens sampled by older policies (the resumed part of a carried "
                          "response), which needs the importance correction of decoupled PPO; fix: "
                          "RunConfig.old_logp = 'trainer' (or 'ewma') and LossConfig.tis_cap = 2.0 (or another cap)")
    for bad, why in ((self.allocation is not None, "RunConfig.allocation = None"),
                     (self.replay is not None, "RunConfig.replay = None"),
                     (self.selection is not None, "RunConfig.selection = None"),
                     (self.nudge is not None, "RunConfig.nudge = None"),
                     (self.async_rollouts.enabled, "AsyncConfig.enabled = False (the carry is the sampler's "
                      "own state; asynchronous rollouts would sample it from another thread)"),
                     (self.reward_source != "verifier", "RunConfig.reward_source = 'verifier'"),
                     (bool(estimator_spec(self.estimator).inputs), f"an estimator without extra inputs "
                      f"(estimator {self.estimator!r} reads {estimator_spec(self.estimator).inputs})")):
        if bad:
            raise ConfigError(f"RunConfig.partial: fix: {why}")


def _check_exemplars(self) -> None:
    """XRPO's exemplars re-roll a step's failed prompts: nothing else may decide the step's rows."""
    if self.exemplars is None:
        return
    for bad, why in ((self.dynamic_sampling, "RunConfig.dynamic_sampling = False (the exemplars rescue the "
                      "all-fail groups dynamic sampling would drop)"),
                     (self.allocation is not None, "RunConfig.allocation = None"),
                     (self.selection is not None, "RunConfig.selection = None"),
                     (self.replay is not None, "RunConfig.replay = None"),
                     (self.partial is not None, "RunConfig.partial = None"),
                     (self.nudge is not None, "RunConfig.nudge = None"),
                     (self.reward_source != "verifier", "RunConfig.reward_source = 'verifier'"),
                     (bool(estimator_spec(self.estimator).inputs), f"an estimator without extra inputs "
                      f"(estimator {self.estimator!r} reads {estimator_spec(self.estimator).inputs})")):
        if bad:
            raise ConfigError(f"RunConfig.exemplars: fix: {why}")


def _check_multiturn(self) -> None:
    """Code-tool episodes are their own source of rows: nothing else may decide them; only they supply the
    turn inputs (IGPO's ``truth_logp_PxN``, PORTool's ``tool_success_PxN``)."""
    turn_inputs = [i for i in estimator_spec(self.estimator).inputs if i in MULTITURN_INPUTS]
    if self.multiturn is None:
        if turn_inputs:
            raise ConfigError(f"estimator {self.estimator!r} reads {turn_inputs}, which only multi-turn rollouts "
                              "supply: set RunConfig.multiturn = @MultiTurnConfig()")
        return
    self.multiturn.check_tree(self.rollout)
    other = [i for i in estimator_spec(self.estimator).inputs if i not in MULTITURN_INPUTS]
    for bad, why in ((self.dynamic_sampling, "RunConfig.dynamic_sampling = False"),
                     (self.allocation is not None, "RunConfig.allocation = None"),
                     (self.selection is not None, "RunConfig.selection = None"),
                     (self.replay is not None, "RunConfig.replay = None"),
                     (self.partial is not None, "RunConfig.partial = None"),
                     (self.exemplars is not None, "RunConfig.exemplars = None"),
                     (self.nudge is not None, "RunConfig.nudge = None"),
                     (self.async_rollouts.enabled, "AsyncConfig.enabled = False"),
                     (self.reward_source != "verifier", "RunConfig.reward_source = 'verifier'"),
                     (bool(other), f"an estimator without single-turn inputs (estimator {self.estimator!r} "
                      f"reads {other})"),
                     (bool(self.shapers), "RunConfig.shapers = [] (the shapers cut responses into fixed "
                      "segments; turn forests hold spans)")):
        if bad:
            raise ConfigError(f"RunConfig.multiturn: fix: {why}")


def _check_spear(self) -> None:
    """SPEAR wraps the multi-turn source (its tool calls, its turn forests); its self-imitation rows were
    sampled by older policies (decoupled PPO's correction) and carry their own advantage."""
    if self.spear is None:
        return
    if self.multiturn is None:
        raise ConfigError("RunConfig.spear wraps the multi-turn source (its tool-call bonus counts tool calls); "
                          "fix: RunConfig.multiturn = @MultiTurnConfig()")
    if self.old_logp == "sampler" or self.loss.tis_cap is None:
        raise ConfigError("RunConfig.spear trains self-imitation rows sampled by older policies, which needs the "
                          "importance correction of decoupled PPO; fix: RunConfig.old_logp = 'trainer' (or "
                          "'ewma') and LossConfig.tis_cap = 2.0 (or another cap)")
    if self.packed_update:
        raise ConfigError("RunConfig.spear with the packed update is not verified (its self-imitation rows are "
                          "W copies of one chain with one slot trained); fix: RunConfig.packed_update = False")


def _check_shape_search(self) -> None:
    """The shape search swaps the slot tree of the plain task source and calibrates in its ``sample``; sources
    that sample through other rollouts or the task source's internals (allocation's chunks, NudgeRL's hinted
    rows, multi-turn episodes, APRIL's carry, DOTS / Prompt-GDRO, XRPO's exemplars) are not wired."""
    if self.shape_search is None:
        return
    if not self.rollout.slots:
        raise ConfigError("RunConfig.shape_search chooses a slot tree's root paths k; fix: "
                          "TreeConfig.allocation = 'slots'")
    self.shape_search.shapes(self.rollout.num_leaves)  # a candidate above W is an error now
    for bad, why in ((self.allocation is not None, "RunConfig.allocation = None"),
                     (self.nudge is not None, "RunConfig.nudge = None"),
                     (self.multiturn is not None, "RunConfig.multiturn = None"),
                     (self.partial is not None, "RunConfig.partial = None"),
                     (self.selection is not None, "RunConfig.selection = None"),
                     (self.exemplars is not None, "RunConfig.exemplars = None")):
        if bad:
            raise ConfigError(f"RunConfig.shape_search: fix: {why} (the search swaps the task source's tree; "
                              "this source samples through it without the search's calibration)")



def legacy_checks(self) -> None:
    """The old ``RunConfig.__post_init__``'s source checks, in its order."""
    for check in (_check_nudge, _check_allocation, _check_replay, _check_selection, _check_partial, _check_exemplars,
                  _check_multiturn, _check_spear, _check_shape_search):
        check(self)
