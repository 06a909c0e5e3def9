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
from treejax.models.lora import LoRAConfig
from treejax.models.transformer import REMAT_POLICIES, TRAIN_ATTENTION_IMPLS
from treejax.parallel.mesh import MeshConfig
from treejax.precision import Precision
from treejax.rl.advantages import estimator_spec
from treejax.rl.advantages.registry import list_estimators
from treejax.rl.evaluation import EvalConfig
from treejax.rl.losses import LossConfig
from treejax.rl.optimizer import OptimizerConfig
from treejax.rl.packing import PackingConfig
from treejax.rl.pseudo_labels import REWARD_SOURCES
from treejax.rl.shaping import Shaper
from treejax.sampling.attention import ATTENTION_IMPLS
from treejax.rl.sources.base import Stage, chain_rows, check_chain, normalize_chain
from treejax.rl.sources.legacy import LegacySourceFields, apply_legacy_fields
from treejax.rl.sources.requirements import RunFacts
from treejax.rl.async_config import AsyncConfig, OffPolicyWarning  # noqa: F401  (re-exported)
from treejax.rl.step_config import (KNOWN_INPUTS, LEAF_WEIGHTINGS, OLD_LOGP_SOURCES,  # noqa: F401  (re-exported)
                                    StepConfig)
from treejax.run_dir import LOG_DIR_MODES
from treejax.sampling.strategies import Temperature
from treejax.sampling.tree import TreeConfig

#: ``RunConfig.train_split``: where the training prompts come from: the task's train split, or (test-time RL,
#: TTRL's setting) the evaluated problems themselves, with pseudo-label rewards only.
TRAIN_SPLITS = ("train", "eval")
#: ``RunConfig.nonfinite``: what an update with a non-finite loss or gradient does (:mod:`treejax.rl.update`).
NONFINITE_POLICIES = ("skip", "raise")

class ScheduleWarning(UserWarning):
    """The learning-rate schedule and the run's length disagree (``RunConfig._check_schedule``)."""


@dataclasses.dataclass(frozen=True)
class RunConfig(LegacySourceFields):
    """Everything one training run needs (the gin-facing surface; see ``configs/*.gin``).

    The defaults are the quickstart (``configs/quickstart.gin``): a few TreePO steps of the embedded SmolLM2 on
    ``chain_sum_2x1``. ``old_logp``: ``"trainer"`` (recompute log pi_old with the trainer's forward, one extra
    forward per step), ``"sampler"`` (use the sampler's log-probs; cheaper, the first ratio is then not 1) or
    ``"ewma"`` (PPO-EWMA: the trainer's forward with the parameters' exponential moving average,
    ``OptimizerConfig.proximal_ewma``; :func:`treejax.rl.optimizer.proximal_ewma`).
    ``rollouts``: the rollout source as a chain of stages, one planner then wrappers
    (:mod:`treejax.rl.sources.base`; gin: ``RunConfig.rollouts = [@<planner>(), @<wrapper>()]``; ``()``: the
    task source). The stages check themselves against the run (:func:`~treejax.rl.sources.base.check_chain`); the
    old per-method fields (:mod:`treejax.rl.sources.legacy`) still work for one release and translate into the chain.
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
    ``decode_attention``: the sampler's per-row decode attention (rollouts and held-out evaluation;
    :mod:`treejax.sampling.attention`): ``"auto"`` (the Pallas kernel on GPU, the Pallas TPU kernel on TPU where
    their constraints hold, the XLA ragged loop otherwise), ``"ragged"``, ``"pallas"`` (Triton), ``"pallas_mgpu"``
    (the Mosaic GPU kernel; Hopper, not yet run on a GPU, so asked for by name), ``"pallas_tpu"`` or ``"dense"``; a
    kernel forced where it cannot run is a ``ValueError`` when the sampler is built.
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
    decode_attention: str = "auto"  # the sampler's decode attention (treejax.sampling.attention.ATTENTION_IMPLS)
    packed_update: bool = False  # tree-packed update: each shared prompt/segment token computed once
    packing: PackingConfig = PackingConfig()  # the packed batch's settings (used when packed_update is True)
    remat: bool | str = False  # per-layer rematerialisation in the update's forward: False/True or 'none'/'full'/'dots'
    lora: LoRAConfig = LoRAConfig()  # rank > 0: train low-rank adapters on a frozen (optionally quantized) base
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
    # the rollout sampler's own layout over the same devices (gin: @sampler/MeshConfig()), e.g. tensor-parallel
    # decode (MeshConfig(data=1, fsdp=1, tensor=-1)) under an FSDP learner; None: the learner's mesh, weights
    # gathered over fsdp once per step. With AsyncConfig's split: the layout of the sampler's devices.
    sampler_mesh: MeshConfig | None = None
    compilation_cache: str = "auto"  # persistent JAX compilation cache: 'auto' (~/.cache/treejax/jax), 'off', a folder
    async_rollouts: AsyncConfig = AsyncConfig()  # sampler / learner overlap with bounded staleness (AsyncConfig)
    shapers: tuple[Shaper, ...] | list[Shaper] = ()  # advantage / clip shapers (treejax.rl.shaping), in order
    rollouts: tuple[Stage, ...] | list[Stage] = ()  # one planner, then wrappers (treejax.rl.sources.base)

    def __post_init__(self):
        object.__setattr__(self, "shapers", tuple(self.shapers))
        check_types(self)  # from Python too: RunConfig(num_steps=2.5) names the field before anything runs
        if self.prompts_per_step < 1 or self.num_steps < 0:
            raise ValueError("RunConfig: prompts_per_step >= 1 and num_steps >= 0 required")
        apply_legacy_fields(self)  # the deprecated per-method fields translate into the chain, with a warning
        object.__setattr__(self, "rollouts", tuple(self.rollouts))
        stages = normalize_chain(self.rollouts)
        prompt_rows, rows = chain_rows(stages, self.prompts_per_step, self.rollout.num_leaves)
        if rows % self.mini_batches or (rows // self.mini_batches) % self.micro_batches:
            parts = "".join(f" + {s.stage_name} {s.added_rows()}" for s in stages if s.added_rows())
            per = "".join(f" x {s.stage_name} {s.rows_per_problem()}" for s in stages if s.rows_per_problem() != 1)
            raise ValueError(f"RunConfig: {rows} rollout rows ((prompts_per_step{parts}) x num_leaves{per}) must "
                             f"split into mini_batches={self.mini_batches} x micro_batches={self.micro_batches}")
        self._check_choices()
        if self.max_prompt_length < 1:
            raise ValueError(f"RunConfig.max_prompt_length must be >= 1, got {self.max_prompt_length}")
        if self.eval_every < 0:
            raise ValueError(f"RunConfig.eval_every must be >= 0, got {self.eval_every}")
        if self.packed_update and prompt_rows % self.mini_batches:
            raise ValueError(f"RunConfig: the packed update splits prompts into mini-batches; {prompt_rows} prompt rows "
                             f"(prompts_per_step={self.prompts_per_step} and the rollout stages' extra rows) do not "
                             f"split into mini_batches={self.mini_batches}")
        if self.leaf_weighting == "mass" and not self.rollout.slots and self.rollout.fallback:
            raise ConfigError("RunConfig.leaf_weighting='mass' with TreeConfig.fallback=True: the depth-first fallback "
                              "gives ended subtrees new children, so no path mass makes the leaves an unbiased sample; "
                              "set TreeConfig.fallback=False (or use TreeConfig.allocation='slots')")
        self.step_config()  # validates old_logp, TIS, leaf weighting and the estimator's inputs
        self._check_estimator_options()
        for s in self.shapers:  # each shaper's own checks against the run (Shaper.check_run)
            s.check_run(self)
        self._check_probe()
        self._check_path_scorer()
        self._check_continuations()
        check_chain(stages, self.facts())
        self._check_proximal()
        self._check_async()
        self._check_schedule()

    def step_rows(self) -> int:
        """Prompt rows of one step's rollouts: ``prompts_per_step`` plus the rollout stages' extra rows."""
        return chain_rows(self.rollouts, self.prompts_per_step, self.rollout.num_leaves)[0]

    def chain(self) -> tuple:
        """The rollout stages, planner first (``()`` is ``(TaskSource(),)``)."""
        return normalize_chain(self.rollouts)

    def facts(self) -> RunFacts:
        """What the rollout stages check about the run (:class:`~treejax.rl.sources.requirements.RunFacts`)."""
        spec = estimator_spec(self.estimator)
        return RunFacts(estimator=self.estimator, estimator_inputs=tuple(spec.inputs), estimator_ragged=spec.ragged,
                        ragged_estimators=tuple(sorted(n for n in list_estimators() if estimator_spec(n).ragged)),
                        reward_source=self.reward_source, train_split=self.train_split, old_logp=self.old_logp,
                        tis_cap=self.loss.tis_cap, packed_update=self.packed_update,
                        async_enabled=self.async_rollouts.enabled, dynamic_sampling=self.dynamic_sampling,
                        shapers=tuple(s.name for s in self.shapers), tree=self.rollout,
                        prompts_per_step=self.prompts_per_step, task=self.task,
                        saves_checkpoints=bool(self.checkpoint_every) or bool(self.save_final))

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

    def _check_estimator_options(self) -> None:
        """An estimator's options may check themselves against the run (``check_run(cfg)``, as a shaper's)."""
        spec = estimator_spec(self.estimator)
        options = spec.default_options() if self.estimator_options is None else self.estimator_options
        check = getattr(options, "check_run", None)
        if check is not None:
            check(self)

    def continuation_config(self):
        """The rollout's Monte-Carlo continuations (:mod:`treejax.sampling.continuation`) when the estimator reads
        values at cut points (SPO-chain: ``cut_value_PxWxB``), from its options; else ``None``."""
        spec = estimator_spec(self.estimator)
        if "cut_value_PxWxB" not in spec.inputs:
            return None
        options = spec.default_options() if self.estimator_options is None else self.estimator_options
        return options.continuation_config()

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

    def _check_path_scorer(self) -> None:
        """A branching rule that reads PRM scores in the loop (ETS) needs the scorer the run loads for it."""
        from treejax.scorers import ScorerConfig

        rule = self.rollout.rule
        if rule.needs_path_scores and rule.path_scorer is None and not isinstance(getattr(rule, "scorer", None),
                                                                                  ScorerConfig):
            raise ConfigError(f"branching rule {rule.rule_name!r} reads a PRM's step scores at every boundary, but "
                              f"{type(rule).__name__}.scorer is {getattr(rule, 'scorer', None)!r}; fix: "
                              f"{type(rule).__name__}.scorer = @ScorerConfig() (e.g. ScorerConfig.model = 'policy')")

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
        check_choice("RunConfig.decode_attention", self.decode_attention, ATTENTION_IMPLS)
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


