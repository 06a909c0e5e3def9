"""The run's configuration: :class:`RunConfig` (the gin-facing surface of ``treejax-train``) and the small configs it
hands down (:class:`StepConfig` to the learner; ``TreeConfig``, ``LossConfig``, ``OptimizerConfig``,
``PackingConfig``, ``EvalConfig``, ``MeshConfig`` and ``Precision`` are their modules' own).

Every check runs when the config is built (from gin or from Python), so a bad value is a one-line
:class:`~treejax.errors.ConfigError` before any model loads.
"""

from __future__ import annotations

import dataclasses
import warnings
from typing import Any, Callable

from treejax.choices import check_choice
from treejax.config_types import check_types
from treejax.data.defaults import DEFAULT_TASK_OPTIONS  # noqa: F401  (re-exported: its old home)
from treejax.errors import ConfigError
from treejax.models.transformer import REMAT_POLICIES, TRAIN_ATTENTION_IMPLS
from treejax.parallel.mesh import MeshConfig
from treejax.precision import Precision
from treejax.rl.advantages import estimator_spec
from treejax.rl.advantages.registry import list_estimators
from treejax.rl.allocation import AllocationConfig
from treejax.rl.evaluation import EvalConfig
from treejax.rl.losses import LossConfig
from treejax.rl.nudge import NudgeConfig
from treejax.rl.optimizer import OptimizerConfig
from treejax.rl.exemplars import ExemplarConfig
from treejax.rl.multiturn import MULTITURN_INPUTS, MultiTurnConfig
from treejax.rl.partial import PartialConfig
from treejax.rl.prompt_gdro import PromptGDROConfig
from treejax.rl.replay import ReplayConfig
from treejax.rl.shape_search import ShapeSearchConfig
from treejax.rl.spear import SpearConfig
from treejax.rl.selection import DOTSConfig
from treejax.rl.packing import PackingConfig
from treejax.rl.pseudo_labels import REWARD_SOURCES
from treejax.rl.shaping import Shaper, check_shapers
from treejax.run_dir import LOG_DIR_MODES
from treejax.sampling.strategies import Temperature
from treejax.sampling.tree import TreeConfig

#: ``RunConfig.old_logp``: where log pi_old comes from (:mod:`treejax.rl.step`): the trainer's forward with the
#: current weights, the sampler's log-probs, or (PPO-EWMA) the trainer's forward with the parameters' EMA
#: (``OptimizerConfig.proximal_ewma``).
OLD_LOGP_SOURCES = ("trainer", "sampler", "ewma")
#: Estimator inputs (``EstimatorSpec.inputs``) a rollout source can supply (:class:`treejax.rl.rollouts.Rollouts`).
KNOWN_INPUTS = ("greedy_reward_P", "answer_step_PxW", "cut_PxWxB", "cut_value_PxWxB", "nudge_problem_PxW",
                "nudge_context_PxW", "nudge_source_PxW", "truth_logp_PxN", "tool_success_PxN",
                "state_cluster_PxN")
#: ``RunConfig.train_split``: where the training prompts come from: the task's train split, or (test-time RL,
#: TTRL's setting) the evaluated problems themselves, with pseudo-label rewards only.
TRAIN_SPLITS = ("train", "eval")
#: ``RunConfig.nonfinite``: what an update with a non-finite loss or gradient does (:mod:`treejax.rl.update`).
NONFINITE_POLICIES = ("skip", "raise")

#: ``StepConfig.leaf_weighting``: ``"count"`` trains every leaf slot with weight 1 (TreePO's official weighting;
#: slot trees and independent samples are unbiased this way); ``"mass"`` multiplies each leaf's per-token
#: advantages by ``Forest.leaf_weight`` (``W`` x path mass for ``"transfer"`` trees), so the policy-gradient sum
#: ``sum_l w_l A_l grad log pi(l)`` weighs every leaf by the share of the policy's sample it stands for (the PPO
#: clip of a leaf with ``w > 0`` is unchanged by the scale); the estimators' baselines are left as they are.
LEAF_WEIGHTINGS = ("count", "mass")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static settings of the learner (:func:`treejax.rl.step.learn`; a subset of ``RunConfig``): the estimator,
    the loss, where log pi_old comes from, epochs / mini-batches / micro-batches and the layout's settings (``packing``
    None: expanded rows, :class:`treejax.rl.layouts.Expanded`; else :class:`treejax.rl.layouts.Packed`)."""

    estimator: str = "treepo"
    estimator_options: Any = None
    loss: LossConfig = LossConfig()
    old_logp: str = "trainer"
    epochs: int = 1
    mini_batches: int = 1
    micro_batches: int = 1
    pad_id: int = 0
    logprob_chunk_size: int = 8192
    attention_impl: str = "auto"
    clip_scale_fn: Callable | None = None  # (forest, rewards_PxW) -> [P, W] per-sample clip-range multiplier
    packing: PackingConfig | None = None  # None: expanded rows; else the tree-packed update
    row_multiple: int = 1  # packed row count multiple (micro-batches x batch-sharded devices)
    leaf_weighting: str = "count"  # "count" | "mass": scale each leaf's advantages by forest.leaf_weight
    shapers: tuple = ()  # treejax.rl.shaping.Shaper instances, applied in order after the old-log-prob pass

    def __post_init__(self):
        object.__setattr__(self, "shapers", check_shapers(self.shapers))
        if self.leaf_weighting not in LEAF_WEIGHTINGS:
            raise ValueError(f"leaf_weighting must be one of {LEAF_WEIGHTINGS}, got {self.leaf_weighting!r}")
        if self.old_logp not in OLD_LOGP_SOURCES:
            raise ValueError(f"old_logp must be one of {OLD_LOGP_SOURCES}, got {self.old_logp!r}")
        if self.old_logp == "sampler" and self.loss.tis_cap is not None:
            raise ValueError("LossConfig.tis_cap needs old_logp='trainer': with old_logp='sampler' the sampler's "
                             "log-probs are both the PPO denominator and the TIS reference, so TIS is a no-op")
        for name in ("epochs", "mini_batches", "micro_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        missing = [i for i in estimator_spec(self.estimator).inputs if i not in KNOWN_INPUTS]
        if missing:
            raise ValueError(f"estimator {self.estimator!r} needs inputs {missing} that the RL step cannot supply "
                             f"(supplied: {KNOWN_INPUTS})")



@dataclasses.dataclass(frozen=True)
class AsyncConfig:
    """Asynchronous rollouts (:mod:`treejax.rl.collect`): a sampler thread fills a queue of rollouts while the
    learner trains on earlier ones.

    ``enabled``: off (default) runs today's synchronous loop. ``max_staleness`` ``k``: the rollouts learned at
    step ``i`` were sampled by policy version ``max(0, i - k)`` (the version after that many updates), so the
    sampler runs up to ``k`` steps ahead; the bound is used as the lag (the schedule is fixed, hence a run is
    reproducible and resumes exactly; it is also the fastest one the bound allows). ``k = 0`` samples every step
    with the newest weights: the synchronous loop's numbers, bit for bit. ``sampler_devices``: the first ``n``
    devices sample and the rest learn (``RunConfig.mesh`` then describes the learner's devices; the sampler's mesh
    keeps ``MeshConfig.tensor`` and puts the rest on ``fsdp``), weights cast to the sampler dtype and copied
    learner -> sampler after every update; ``0``: both share every device (one device only: programs of two
    threads on a multi-device mesh could interleave their collectives differently on different devices).
    ``split_staleness``: also compute the trainer's log-probs under the parameters that sampled each rollout
    (one more forward per step; the learner keeps up to ``k + 1`` parameter versions), splitting the importance
    weight into a staleness and a numerics part (``offpolicy/stale_iw_...``, ``mismatch/numerics_...``).
    The correction is decoupled PPO (AReaL): the PPO ratio is taken against the trainer's recomputed log-probs
    (``old_logp = "trainer"``, the proximal policy) and ``LossConfig.tis_cap`` weights each token by
    ``min(pi_prox / q, C)``, ``q`` the sampler's recorded log-probs of the stale policy."""

    enabled: bool = False
    max_staleness: int = 1
    sampler_devices: int = 0
    split_staleness: bool = False

    def __post_init__(self):
        for name in ("max_staleness", "sampler_devices"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ConfigError(f"AsyncConfig.{name} must be an int >= 0, got {v!r}")


class OffPolicyWarning(UserWarning):
    """Stale rollouts are trained without the behaviour importance weight (``RunConfig._check_async``)."""


class ScheduleWarning(UserWarning):
    """The learning-rate schedule and the run's length disagree (``RunConfig._check_schedule``)."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything one training run needs (the gin-facing surface; see ``configs/*.gin``).

    The defaults are the quickstart (``configs/quickstart.gin``): a few TreePO steps of the embedded SmolLM2 on
    ``chain_sum_2x1``. ``old_logp``: ``"trainer"`` (recompute log pi_old with the trainer's forward, one extra
    forward per step), ``"sampler"`` (use the sampler's log-probs; cheaper, the first ratio is then not 1) or
    ``"ewma"`` (PPO-EWMA: the trainer's forward with the parameters' exponential moving average,
    ``OptimizerConfig.proximal_ewma``; :func:`treejax.rl.optimizer.proximal_ewma`).
    ``allocation`` / ``selection`` / ``replay`` / ``partial`` / ``exemplars``: where the rollout budget goes
    (:mod:`treejax.rl.allocation`, :mod:`treejax.rl.selection` and :mod:`treejax.rl.prompt_gdro`,
    :mod:`treejax.rl.replay`, :mod:`treejax.rl.partial`, :mod:`treejax.rl.exemplars`).
    ``clip_scale_fn``: optional ``fn(forest, rewards_PxW) -> [P, W]`` multiplier of the clip range per sample
    (gin: ``RunConfig.clip_scale_fn = @my_fn`` after ``gin.external_configurable(my_fn)``).
    ``eval_every``: held-out evaluation every N steps (0: only before and after training).
    ``nonfinite``: ``"skip"`` (an update with a non-finite loss or gradient is not applied; a step that looks
    diverged, see :func:`divergence`, is logged and listed in the summary's ``"divergence"``) or ``"raise"`` (either
    stops the run with a :class:`~treejax.errors.DivergenceError` before anything is exported).
    ``max_prompt_length`` / ``overlong_prompts``: prompts are measured when the run starts (train and eval
    splits); longer ones are filtered with a count in the log (``"filter"``, verl's ``filter_overlong_prompts``)
    or refused (``"error"``), so the static prompt width never exceeds the cap. ``log_dir_mode``: what to do with
    a log folder that holds a run (:mod:`treejax.run_dir`; CLI ``--resume`` / ``--overwrite``).
    ``train_split``: ``"train"`` or ``"eval"``: test-time RL (TTRL) trains on the first ``EvalConfig.num_problems``
    held-out problems, the ones it is evaluated on, which needs ``reward_source = "majority"`` (their answers then
    only measure).
    ``reward_source``: ``"verifier"`` (the task's verifier scores each leaf against the true answer) or
    ``"majority"`` (test-time RL, TTRL / ETTRL: a leaf scores 1 when its answer is its prompt's majority answer
    over the leaves, votes weighted by ``Forest.leaf_weight``; :mod:`treejax.rl.pseudo_labels`; the verifier then
    only measures ``reward/accuracy`` and ``reward/label_accuracy``).
    ``leaf_weighting``: ``"count"`` (every leaf slot weighs 1: TreePO's official weighting) or ``"mass"`` (each
    leaf's advantages times ``Forest.leaf_weight``, ``W`` x its path mass for ``"transfer"`` trees: see
    :data:`LEAF_WEIGHTINGS`; refused with the fallback).
    ``shapers``: advantage / clip-range shapers (:mod:`treejax.rl.shaping`: ECHO, ETTRL's EAR, ROSE's length
    penalty, PRL), applied in order after the trainer's old-log-prob pass, whose forward also gives the
    entropies and top-k log-probs they read (gin: ``RunConfig.shapers = [@EchoShaping()]``).
    ``tree_picture_text``: the tree picture (every ``tree_picture_every`` steps) shows prompt 0's question and
    each leaf's answer text. ``compilation_cache``: the persistent JAX compilation cache
    (:mod:`treejax.compile_cache`): ``"auto"`` (``~/.cache/treejax/jax``), ``"off"``, or a folder;
    ``TREEJAX_COMPILATION_CACHE`` overrides it.
    ``packed_update``: train on tree-packed batches (:mod:`treejax.rl.packing`: every shared prompt and segment
    token computed once, same loss and gradient; mini-batches are then groups of prompts, so
    ``prompts_per_step`` must split into ``mini_batches``), with ``packing``'s row bucketing and tree attention.
    """

    model: str = "smollm2-135m-instruct"
    precision: Precision = Precision()
    task: str = "chain_sum_2x1"
    task_options: dict = dataclasses.field(default_factory=lambda: dict(DEFAULT_TASK_OPTIONS))
    system_prompt: str | None = None  # None: the task's own
    instruction: str | None = None  # None: the task's own
    prompts_per_step: int = 2
    num_steps: int = 3
    rollout: TreeConfig = TreeConfig(num_leaves=8, max_depth=3, segment_length=16, branch_factor=2,
                                     strategy=Temperature(1.0), repetition_ngram=4, repetition_count=4)
    estimator: str = "treepo"
    estimator_options: Any = None  # None: the estimator's defaults
    leaf_weighting: str = "count"  # "mass": each leaf's advantages x Forest.leaf_weight (LEAF_WEIGHTINGS)
    reward_style: str = "pm1"
    reward_source: str = "verifier"  # "majority": pseudo-labels, each prompt's majority answer (test-time RL)
    train_split: str = "train"  # "eval": test-time RL on the evaluated problems themselves (needs "majority")
    overlong_buffer: int = 0  # DAPO soft overlong penalty buffer (0 = off)
    overlong_factor: float = 1.0
    dynamic_sampling: bool = False
    max_refills: int = 0
    loss: LossConfig = LossConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=10.0, aggregation="token-mean")
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-5, warmup_steps=0, total_steps=3,
                                                 weight_decay=0.1, max_grad_norm=1.0)
    old_logp: str = "trainer"
    clip_scale_fn: Callable | None = None
    epochs: int = 1
    mini_batches: int = 1
    micro_batches: int = 1
    nonfinite: str = "skip"
    attention_impl: str = "auto"  # training attention: cudnn flash on GPU (bf16), XLA elsewhere
    packed_update: bool = False  # tree-packed update: each shared prompt/segment token computed once
    packing: PackingConfig = PackingConfig()  # the packed batch's settings (used when packed_update is True)
    remat: bool | str = False  # per-layer rematerialisation in the update's forward: False/True or 'none'/'full'/'dots'
    eval: EvalConfig = EvalConfig(num_problems=32, max_new_tokens=48)
    eval_every: int = 0
    max_prompt_length: int = 1024  # prompts longer than this (tokens, chat template included) are filtered
    overlong_prompts: str = "filter"  # or "error": refuse the task's data before training
    log_dir: str = "runs/quickstart"
    log_dir_mode: str = "new"  # "new" | "resume" | "overwrite" (treejax.run_dir)
    checkpoint_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 2
    save_final: bool = True  # False: no checkpoint at the end (sweeps that keep only summary.json; a 1.5B state is 18 GB)
    tree_picture_every: int = 1
    tree_picture_text: bool = True  # the picture shows the prompt and each leaf's answer text
    export_hf: bool = True
    seed: int = 0
    mesh: MeshConfig = MeshConfig()
    compilation_cache: str = "auto"  # persistent JAX compilation cache: 'auto' (~/.cache/treejax/jax), 'off', a folder
    async_rollouts: AsyncConfig = AsyncConfig()  # sampler / learner overlap with bounded staleness (AsyncConfig)
    shapers: tuple[Shaper, ...] | list[Shaper] = ()  # advantage / clip shapers (treejax.rl.shaping), in order
    nudge: NudgeConfig | None = None  # NudgeRL's hinted rollouts (treejax.rl.nudge; estimator "nudge")
    allocation: AllocationConfig | None = None  # prompt-level rollout allocation (treejax.rl.allocation)
    replay: ReplayConfig | None = None  # rollout replay: recent rows trained again, IS-corrected (treejax.rl.replay)
    selection: DOTSConfig | PromptGDROConfig | None = None  # prompt selection: DOTS (treejax.rl.selection), Prompt-GDRO
    partial: PartialConfig | None = None  # APRIL's partial rollouts: stop early, resume next step (treejax.rl.partial)
    exemplars: ExemplarConfig | None = None  # XRPO: all-fail prompts re-rolled with solved exemplars (treejax.rl.exemplars)
    multiturn: MultiTurnConfig | None = None  # code-tool episodes: multi-turn rollouts (treejax.rl.multiturn)
    spear: SpearConfig | None = None  # SPEAR: tool-call bonus + self-imitation rows on multiturn (treejax.rl.spear)
    shape_search: ShapeSearchConfig | None = None  # the slot tree's k chosen by calibration (treejax.rl.shape_search)

    def __post_init__(self):
        object.__setattr__(self, "shapers", tuple(self.shapers))
        check_types(self)  # from Python too: RunConfig(num_steps=2.5) names the field before anything runs
        if self.prompts_per_step < 1 or self.num_steps < 0:
            raise ValueError("RunConfig: prompts_per_step >= 1 and num_steps >= 0 required")
        rows = self.step_rows() * self.rollout.num_leaves
        if self.nudge is not None:  # each problem: M K hinted/plain rollouts (and as many distillation rows)
            rows *= self.nudge.rows_per_problem()
        if rows % self.mini_batches or (rows // self.mini_batches) % self.micro_batches:
            raise ValueError(f"RunConfig: {rows} rollout rows ((prompts_per_step"
                             f"{' + AllocationConfig.extra_rows' if self.allocation else ''}"
                             f"{' + ReplayConfig.rows' if self.replay else ''}"
                             f"{' + SpearConfig.sil_rows' if self.spear else ''}) x num_leaves"
                             f"{' x NudgeConfig rows per problem' if self.nudge else ''}) must split into "
                             f"mini_batches={self.mini_batches} x micro_batches={self.micro_batches}")
        self._check_choices()
        if self.max_prompt_length < 1:
            raise ValueError(f"RunConfig.max_prompt_length must be >= 1, got {self.max_prompt_length}")
        if self.eval_every < 0:
            raise ValueError(f"RunConfig.eval_every must be >= 0, got {self.eval_every}")
        if self.packed_update and self.step_rows() % self.mini_batches:
            raise ValueError(f"RunConfig: the packed update splits prompts into mini-batches; prompts_per_step="
                             f"{self.prompts_per_step}"
                             f"{f' + AllocationConfig.extra_rows={self.allocation.extra_rows}' if self.allocation else ''}"
                             f"{f' + ReplayConfig.rows={self.replay.rows}' if self.replay else ''}"
                             f"{f' + SpearConfig.sil_rows={self.spear.sil_rows}' if self.spear else ''}"
                             f" does not split into mini_batches={self.mini_batches}")
        if self.leaf_weighting == "mass" and not self.rollout.slots and self.rollout.fallback:
            raise ConfigError("RunConfig.leaf_weighting='mass' with TreeConfig.fallback=True: the depth-first fallback "
                              "gives ended subtrees new children, so no path mass makes the leaves an unbiased sample; "
                              "set TreeConfig.fallback=False (or use TreeConfig.allocation='slots')")
        self.step_config()  # validates old_logp, TIS, leaf weighting and the estimator's inputs
        self._check_probe()
        self._check_continuations()
        self._check_nudge()
        self._check_allocation()
        self._check_replay()
        self._check_selection()
        self._check_partial()
        self._check_exemplars()
        self._check_multiturn()
        self._check_spear()
        self._check_shape_search()
        self._check_proximal()
        self._check_async()
        self._check_schedule()

    def step_rows(self) -> int:
        """Prompt rows of one step's rollouts: ``prompts_per_step``, plus ``AllocationConfig.extra_rows``."""
        return (self.prompts_per_step + (self.allocation.extra_rows if self.allocation is not None else 0)
                + (self.replay.rows if self.replay is not None else 0)
                + (self.spear.sil_rows if self.spear is not None else 0))

    def _check_allocation(self) -> None:
        """Prompt-level allocation needs an estimator that honours unused slots, and nothing else that decides
        which rows a step keeps."""
        a = self.allocation
        if a is None:
            return
        a.check(self.rollout.num_leaves, self.prompts_per_step)
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

    def _check_selection(self) -> None:
        """A selector (DOTS, Prompt-GDRO) draws and rolls out its own prompts: nothing else may decide which
        prompt rows a step has."""
        d = self.selection
        if d is None:
            return
        name = type(d).__name__
        if isinstance(d, DOTSConfig) and d.reference >= self.prompts_per_step:
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
        self.multiturn.check(self.rollout)
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

    def _check_proximal(self) -> None:
        """PPO-EWMA: the EMA of the parameters and the ratio that reads it come together."""
        if (self.old_logp == "ewma") != (self.optimizer.proximal_ewma is not None):
            raise ConfigError("RunConfig.old_logp = 'ewma' (PPO-EWMA's proximal policy) and "
                              "OptimizerConfig.proximal_ewma (the parameters' EMA it reads) go together; fix: set "
                              "both (e.g. OptimizerConfig.proximal_ewma = 0.9) or neither")
        if self.old_logp == "ewma" and self.shapers:
            raise ConfigError("RunConfig.old_logp = 'ewma' with shapers: the shapers read the trainer pass of the "
                              "current weights, which then is not the PPO ratio's denominator; fix: "
                              "RunConfig.old_logp = 'trainer', or no shapers")

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

    def continuation_config(self):
        """The rollout's Monte-Carlo continuations (:mod:`treejax.sampling.continuation`) when the estimator reads
        values at cut points (SPO-chain: ``cut_value_PxWxB``), from its options; else ``None``."""
        spec = estimator_spec(self.estimator)
        if "cut_value_PxWxB" not in spec.inputs:
            return None
        options = spec.default_options() if self.estimator_options is None else self.estimator_options
        return options.continuation_config()

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

    def _check_continuations(self) -> None:
        """SPO-chain forks its continuations from each leaf's KV, which is still resident at the end only for
        independent chains, and scores them with the verifier."""
        if self.continuation_config() is None:
            return
        tc = self.rollout
        chains = (tc.branch_factor == 1 and tc.init_divergence_range is None
                  and (tc.init_divergence or tc.branch_factor) == tc.num_leaves)
        if not chains:
            raise ConfigError(f"estimator {self.estimator!r} samples its Monte-Carlo continuations from inside each "
                              "leaf, forked from the leaf's KV, which only independent chains keep to the end; fix: "
                              f"TreeConfig.branch_factor = 1 and TreeConfig.init_divergence = {tc.num_leaves} "
                              "(= num_leaves)")
        if self.reward_source != "verifier":
            raise ConfigError(f"estimator {self.estimator!r} scores its Monte-Carlo continuations with the verifier, "
                              "which pseudo-label rewards do not use; fix: RunConfig.reward_source = 'verifier'")

    def _check_probe(self) -> None:
        """A branching rule that reads a shaper's probe (ARRoL's pruning reads the quality head), or a held-out
        vote weighted by one (``EvalConfig.vote_probe``), needs that shaper among ``shapers``."""
        stateful = [s.name for s in self.shapers if s.stateful and type(s).probe is not Shaper.probe]  # has a probe
        vote = self.eval.vote_probe if self.eval is not None else None
        if vote is not None and vote not in stateful:
            raise ConfigError(f"EvalConfig.vote_probe = {vote!r} weights held-out votes by that shaper's probe, "
                              f"which RunConfig.shapers does not train; fix: RunConfig.shapers = [@QualityHead()] "
                              f"(shapers with a probe now: {stateful})")
        rule = self.rollout.rule
        if "probe" not in rule.token_stats:
            return
        name = getattr(rule, "probe_name", None)
        if name not in [s.name for s in self.shapers if s.stateful]:
            raise ConfigError(f"branching rule {rule.rule_name!r} prunes by the probe of shaper {name!r}, which "
                              f"RunConfig.shapers does not train; fix: RunConfig.shapers = [@QualityHead()] "
                              f"(shapers now: {[s.name for s in self.shapers]})")

    def _check_async(self) -> None:
        a = self.async_rollouts
        if not a.enabled:
            if a != AsyncConfig():
                raise ConfigError(f"{a} is set but AsyncConfig.enabled = False; fix: AsyncConfig.enabled = True")
            return
        if a.split_staleness and self.old_logp != "trainer":
            raise ConfigError("AsyncConfig.split_staleness needs RunConfig.old_logp = 'trainer' (it splits the "
                              "trainer's importance weight pi_prox / q)")
        if a.max_staleness > 0 and self.loss.tis_cap is None:
            warnings.warn(f"AsyncConfig.max_staleness = {a.max_staleness} without LossConfig.tis_cap: stale "
                          "rollouts are trained with the PPO ratio against the recomputed (proximal) policy only, "
                          "without the behaviour weight pi_prox / q; set LossConfig.tis_cap (e.g. 2.0) for "
                          "decoupled PPO's correction", OffPolicyWarning, stacklevel=2)

    def _check_choices(self) -> None:
        """Every enumerated field, one line each naming the valid choices (:func:`treejax.choices.check_choice`)."""
        check_choice("RunConfig.estimator", self.estimator, list_estimators())
        options_cls = estimator_spec(self.estimator).options_cls
        if self.estimator_options is not None and not isinstance(self.estimator_options, options_cls):
            raise ConfigError(f"RunConfig.estimator_options = {self.estimator_options!r} is not an options object of "
                              f"estimator {self.estimator!r}; fix: RunConfig.estimator_options = "
                              f"@{options_cls.__name__}()")
        check_choice("RunConfig.nonfinite", self.nonfinite, NONFINITE_POLICIES)
        check_choice("RunConfig.remat", self.remat, (False, True, *REMAT_POLICIES))
        check_choice("RunConfig.attention_impl", self.attention_impl, TRAIN_ATTENTION_IMPLS)
        check_choice("RunConfig.old_logp", self.old_logp, OLD_LOGP_SOURCES)
        check_choice("RunConfig.reward_style", self.reward_style, ("pm1", "01"))
        check_choice("RunConfig.reward_source", self.reward_source, REWARD_SOURCES)
        check_choice("RunConfig.train_split", self.train_split, TRAIN_SPLITS)
        if self.train_split == "eval" and self.reward_source != "majority":
            raise ConfigError("RunConfig.train_split = 'eval' trains on the problems the run evaluates, so its "
                              "rewards must not read their answers; fix: RunConfig.reward_source = 'majority' "
                              "(test-time RL), or RunConfig.train_split = 'train'")
        if self.reward_source == "majority" and "answer_step_PxW" in estimator_spec(self.estimator).inputs:
            raise ConfigError(f"RunConfig.reward_source = 'majority' with estimator {self.estimator!r}: its "
                              "necessary-reasoning prefix is found by the verifier against the true answer, which "
                              "pseudo-label rewards do not use; fix: RunConfig.reward_source = 'verifier'")
        if self.reward_source == "majority" and "greedy_reward_P" in estimator_spec(self.estimator).inputs:
            raise ConfigError(f"RunConfig.reward_source = 'majority' with estimator {self.estimator!r}: its greedy "
                              "baseline is scored by the verifier, which pseudo-label rewards do not use; fix: "
                              "another estimator, or RunConfig.reward_source = 'verifier'")
        check_choice("RunConfig.overlong_prompts", self.overlong_prompts, ("filter", "error"))
        check_choice("RunConfig.log_dir_mode", self.log_dir_mode, LOG_DIR_MODES)
        check_choice("RunConfig.leaf_weighting", self.leaf_weighting, LEAF_WEIGHTINGS)

    def _check_schedule(self) -> None:
        """A decaying learning-rate schedule that ends before the run does trains its last steps at the final
        rate (0 with the default ``end_lr_factor``): warned, once per config, not changed (the schedule is
        ``OptimizerConfig.total_steps``, never silently rescaled to ``num_steps``)."""
        opt = self.optimizer
        if opt.decay != "constant" and opt.total_steps < self.num_steps:
            warnings.warn(f"OptimizerConfig.total_steps={opt.total_steps} < RunConfig.num_steps={self.num_steps} "
                          f"with decay={opt.decay!r}: steps {opt.total_steps + 1}..{self.num_steps} train at "
                          f"learning rate {opt.learning_rate * opt.end_lr_factor:g} (end_lr_factor="
                          f"{opt.end_lr_factor:g}); set OptimizerConfig.total_steps = {self.num_steps}",
                          ScheduleWarning, stacklevel=2)

    def step_config(self, pad_id: int = 0, batch_devices: int = 1) -> StepConfig:
        """The step's settings; ``batch_devices``: devices the batch is sharded over (packed row multiple)."""
        return StepConfig(estimator=self.estimator, estimator_options=self.estimator_options, loss=self.loss,
                          old_logp=self.old_logp, epochs=self.epochs, mini_batches=self.mini_batches,
                          micro_batches=self.micro_batches, pad_id=pad_id, attention_impl=self.attention_impl,
                          clip_scale_fn=self.clip_scale_fn, packing=self.packing if self.packed_update else None,
                          row_multiple=self.micro_batches * batch_devices, leaf_weighting=self.leaf_weighting,
                          shapers=self.shapers)


def prompt_cap(cfg: RunConfig) -> int:
    """The longest prompt a run accepts: ``RunConfig.max_prompt_length``, and ``TreeConfig.max_prompt_length``
    when that is set and smaller."""
    limit = cfg.rollout.max_prompt_length
    return cfg.max_prompt_length if limit is None else min(limit, cfg.max_prompt_length)


