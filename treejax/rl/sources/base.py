"""Rollout sources as a declared chain of stages: one *planner* (it decides a step's prompt rows and rolls them
out), then *wrappers* (each transforms the rollouts of the chain before it), like optax's ``chain`` of
transformations.

gin: ``RunConfig.rollouts = [@DOTSConfig(), @ReplayConfig()]``; ``()`` (the default) is ``[@TaskSource()]``, and a
chain that starts with a wrapper gets the task source as its planner. Every stage is a frozen config dataclass
that subclasses :class:`Stage` and declares, as class attributes:

* ``role``: ``"planner"`` or ``"wrapper"``;
* ``requires``: the :class:`~treejax.rl.sources.requirements.Requirement` s it needs of the run (each message
  written once, in :mod:`treejax.rl.sources.requirements`);
* ``provides`` / ``needs``: row capabilities (``"replayable_rows"``: rows a replay buffer can store and re-train;
  ``"task_tree"``: the plain task source's tree rollout, which the shape search swaps; ``"turn_forest"``:
  multi-turn episodes). A wrapper needs its ``needs`` from the stages before it; ``keeps`` says which of those
  survive it (``None``: all);
* ``supplies``: the estimator inputs (``EstimatorSpec.inputs``) its rollouts carry (a planner computes them; a
  wrapper adds them to the rollouts it wraps, e.g. a judge's step scores); ``passes_inputs`` (wrappers): whether
  the inputs of the chain before it survive it;
* ``dynamic_sampling`` (planners): whether it honours ``RunConfig.dynamic_sampling``;
* ``process_local``: in a multi-process job, each process trains its own copy of the policy (its learner and
  sampler on its own devices, its own prompt stream, seeded ``RunConfig.seed + process index``) instead of one
  data-parallel model over every process's devices (SAPO's swarm nodes, :mod:`treejax.rl.sapo`);
* ``check(facts)``: its own checks; ``added_rows()`` / ``rows_per_problem()``: its share of a step's rows;
* ``build(inner, ctx)``: the runtime :class:`RolloutSource` (planners get ``inner = None``).

:func:`check_chain` is the one place that decides whether a chain is valid (rules 1-6 in its docstring); it
replaced 22 hand-written method-vs-method checks. :func:`build_chain` builds it. Neither names a method.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, ClassVar, Protocol

from treejax.errors import ConfigError
from treejax.registry import Registry
from treejax.rl.sources.requirements import Requirement, RunFacts

#: Every stage class by class name (filled as stage modules are imported: :mod:`treejax.rl.sources.catalog`;
#: gin registers them from here, so ``RunConfig.rollouts = [@MyStage()]`` works once the module is imported).
STAGES: Registry[type] = Registry("rollout stage")


class Stage:
    """Base of every rollout stage (module docstring). Subclasses are frozen dataclasses (the gin surface)."""

    role: ClassVar[str] = "planner"
    requires: ClassVar[tuple[Requirement, ...]] = ()
    provides: ClassVar[frozenset[str]] = frozenset()
    needs: ClassVar[frozenset[str]] = frozenset()
    keeps: ClassVar[frozenset[str] | None] = None
    supplies: ClassVar[frozenset[str]] = frozenset()
    passes_inputs: ClassVar[bool] = True
    dynamic_sampling: ClassVar[bool] = False
    process_local: ClassVar[bool] = False

    def __init_subclass__(cls, **kw):
        super().__init_subclass__(**kw)
        if cls.role not in ("planner", "wrapper"):
            raise TypeError(f"{cls.__name__}.role must be 'planner' or 'wrapper', got {cls.role!r}")
        STAGES.add(cls.__name__, cls, overwrite=True)  # a notebook cell that runs again redefines it

    @property
    def stage_name(self) -> str:
        return type(self).__name__

    def check(self, facts: RunFacts) -> None:
        """The stage's own checks of its settings against the run (raise :class:`~treejax.errors.ConfigError`)."""

    def added_rows(self) -> int:
        """Prompt rows this stage adds to a step's ``prompts_per_step`` (allocation's extra chunks, replayed rows)."""
        return 0

    def rows_per_problem(self) -> int:
        """Rows per drawn problem (NudgeRL's hinted and plain rows); 1 for every other stage."""
        return 1

    def build(self, inner: "RolloutSource | None", ctx: "SourceContext") -> "RolloutSource":
        raise NotImplementedError(f"{type(self).__name__}.build")


class RolloutSource(Protocol):
    """What the loop reads of a built chain: ``sample`` (one step's :class:`~treejax.rl.rollouts.Rollouts`),
    ``pipeline``, and optionally ``checkpoint_state`` / ``restore_state`` (the chain's state in a checkpoint) and
    ``evaluate`` (extra held-out metrics). A wrapper keeps the source it wraps as ``base``."""

    def sample(self, params: Any, key: Any, step: int) -> Any: ...


@dataclasses.dataclass(frozen=True)
class SourceContext:
    """What a stage's ``build`` may use, built once by :func:`treejax.rl.setup.build_run`.

    ``rollout``: the run's tree rollout (``make_tree_rollout`` of ``cfg.rollout``); ``make_rollout(tc)``: another
    rollout on the same sampler (the shape search's candidate trees); ``sampler_fns``: the sampler's model
    functions; ``estimator_inputs``: the learner's estimator inputs; ``seed``: ``RunConfig.seed``;
    ``rollout_service(ctx, estimator_inputs)``: builds the task's rollout service (set-up passes
    :class:`treejax.rl.rollouts.TaskRollouts`; tests may pass a fake); ``mesh``: the learner's device mesh (a
    judge's scorer with ``ScorerConfig.sharding = "mesh"`` is laid out on it; ``None`` in tests)."""

    cfg: Any
    tokenizer: Any
    task: Any
    pipeline: Any
    rollout: Callable
    make_rollout: Callable
    sampler_fns: Any
    model_config: Any
    prompt_width: int
    pad_id: int
    estimator_inputs: tuple[str, ...]
    rollout_service: Callable
    mesh: Any = None

    @property
    def seed(self) -> int:
        return self.cfg.seed

    def task_rollouts(self, estimator_inputs: tuple[str, ...] = ()):
        """The task's rollout service (:class:`treejax.rl.rollouts.TaskRollouts`: draw prompts, roll out, score)."""
        return self.rollout_service(self, tuple(estimator_inputs))


@dataclasses.dataclass(frozen=True)
class TaskSource(Stage):
    """The default planner: ``prompts_per_step`` prompts from the task's pipeline, each rolled out as one tree
    (:class:`treejax.rl.rollouts.TaskRollouts`), with dynamic sampling's refills when the run asks for them."""

    role: ClassVar[str] = "planner"
    provides: ClassVar[frozenset[str]] = frozenset({"replayable_rows", "task_tree"})
    supplies: ClassVar[frozenset[str]] = frozenset({"greedy_reward_P", "answer_step_PxW", "cut_PxWxB",
                                                    "cut_value_PxWxB"})
    dynamic_sampling: ClassVar[bool] = True

    def build(self, inner, ctx: SourceContext):
        return ctx.task_rollouts(tuple(i for i in ctx.estimator_inputs if i in self.supplies))


def normalize_chain(stages) -> tuple[Stage, ...]:
    """``stages`` as a tuple with its planner: ``()`` is ``(TaskSource(),)``; a chain that starts with a wrapper
    gets ``TaskSource()`` in front."""
    stages = tuple(stages)
    for s in stages:
        if not isinstance(s, Stage):
            raise ConfigError(f"RunConfig.rollouts holds {s!r}, which is not a rollout stage; stages: "
                              f"{STAGES.names()}")
    if not stages or stages[0].role == "wrapper":
        stages = (TaskSource(),) + stages
    return stages


def check_chain(stages, facts: RunFacts) -> tuple[Stage, ...]:
    """The normalized chain (:func:`normalize_chain`) if it is valid for the run, else one
    :class:`~treejax.errors.ConfigError` line. The rules, in order:

    1. exactly one planner, first; no stage twice;
    2. each wrapper's ``needs`` are provided by the stages before it (``provides``, filtered by each wrapper's
       ``keeps``);
    3. every stage's ``requires`` hold;
    4. the estimator's inputs are supplied by the chain (the planner's ``supplies``, cleared by a wrapper that
       does not pass inputs, plus each wrapper's own ``supplies``);
    5. ``RunConfig.dynamic_sampling`` only with a planner that honours it;
    6. every stage's own ``check``.
    """
    stages = normalize_chain(stages)
    names = [s.stage_name for s in stages]
    planners = [s.stage_name for s in stages if s.role == "planner"]
    if len(planners) > 1:
        raise ConfigError(f"RunConfig.rollouts: {' and '.join(planners)} each decide a step's rows; one planner per "
                          f"run (first), then wrappers (chain: {names})")
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ConfigError(f"RunConfig.rollouts: {dup} appear more than once (chain: {names})")
    caps, inputs = set(stages[0].provides), set(stages[0].supplies)
    for s in stages[1:]:
        missing = set(s.needs) - caps
        if missing:
            providers = sorted(n for n, c in STAGES.classes().items() if set(c.provides) & missing)
            raise ConfigError(f"RunConfig.rollouts: {s.stage_name} wraps rows with {sorted(missing)}, which the stages "
                              f"before it ({names[:names.index(s.stage_name)]}) do not give; fix: one of {providers} "
                              f"before it, e.g. RunConfig.rollouts = [@{providers[0] if providers else '?'}(), "
                              f"@{s.stage_name}()]")
        caps = (caps if s.keeps is None else caps & set(s.keeps)) | set(s.provides)
        inputs = (inputs if s.passes_inputs else set()) | set(s.supplies)
    for s in stages:
        for req in s.requires:
            if not req.holds(facts):
                raise ConfigError(req.message(s.stage_name, facts))
    unsupplied = [i for i in facts.estimator_inputs if i not in inputs]
    if unsupplied:
        suppliers = sorted(n for n, c in STAGES.classes().items() if c.role == "planner" and set(unsupplied) <= set(c.supplies))
        wrappers = sorted(n for n, c in STAGES.classes().items() if c.role == "wrapper" and set(unsupplied) <= set(c.supplies))
        if wrappers and not suppliers:
            raise ConfigError(f"RunConfig.rollouts: estimator {facts.estimator!r} reads {unsupplied}, which the chain "
                              f"{names} does not supply; fix: an estimator without them, or a chain with a wrapper "
                              f"that supplies them ({wrappers}), e.g. RunConfig.rollouts = [@{wrappers[0]}()]")
        raise ConfigError(f"RunConfig.rollouts: estimator {facts.estimator!r} reads {unsupplied}, which the chain "
                          f"{names} does not supply; fix: an estimator without them, or a chain whose planner "
                          f"supplies them ({suppliers}) and no wrapper that drops them")
    if facts.dynamic_sampling and not stages[0].dynamic_sampling:
        raise ConfigError(f"RunConfig.rollouts: {names[0]} decides a step's rows itself, so dynamic sampling cannot "
                          "refill them; fix: RunConfig.dynamic_sampling = False")
    for s in stages:
        s.check(facts)
    return stages


def build_chain(stages, ctx: SourceContext) -> RolloutSource:
    """The runtime source of a checked chain: the planner's, then each wrapper's around it, in order. The planner
    is built without the estimator inputs a wrapper supplies (they are that wrapper's to add)."""
    stages = normalize_chain(stages)
    added = set().union(*(s.supplies for s in stages[1:]))
    planner_ctx = ctx if not added & set(ctx.estimator_inputs) else dataclasses.replace(
        ctx, estimator_inputs=tuple(i for i in ctx.estimator_inputs if i not in added))
    source = stages[0].build(None, planner_ctx)
    for s in stages[1:]:
        source = s.build(source, ctx)
    return source


def chain_rows(stages, prompts_per_step: int, num_leaves: int) -> tuple[int, int]:
    """``(prompt rows, rollout rows)`` of one step: ``prompts_per_step`` plus every stage's ``added_rows``, and
    those times ``num_leaves`` times every stage's ``rows_per_problem``."""
    stages = normalize_chain(stages)
    rows = prompts_per_step + sum(s.added_rows() for s in stages)
    per_problem = 1
    for s in stages:
        per_problem *= s.rows_per_problem()
    return rows, rows * num_leaves * per_problem


def chain_process_local(stages) -> bool:
    """Whether a stage of the chain makes every process train its own policy (``Stage.process_local``)."""
    return any(s.process_local for s in normalize_chain(stages))


def chain_sources(source) -> list:
    """The built sources of a chain, outermost first (each wrapper keeps the one it wraps as ``base``)."""
    out = []
    while source is not None:
        out.append(source)
        source = getattr(source, "base", None)
    return out


def chain_evaluate(source, params, examples: list, eval_request: dict) -> dict:
    """Extra held-out metrics from every source of the chain that defines ``evaluate(params, examples,
    **eval_request)`` (multi-turn: greedy episodes with the environment); ``{}`` when none does."""
    out: dict = {}
    for s in chain_sources(source):
        fn = getattr(s, "evaluate", None)
        if fn is not None:
            out.update(fn(params, examples, **eval_request))
    return out
