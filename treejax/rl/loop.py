"""The RL loop: setup -> step loop -> finish, around :func:`treejax.rl.step.rl_step`.

One step (TreePO's recipe, DAPO details; every stage is a pure function of explicit inputs):

1. ``P`` prompts from the grain pipeline, rendered with the tokenizer's chat template and tokenized;
2. the sampler reads a copy of the weights in the policy's sampler dtype (bf16 on GPU/TPU), cast once per step,
   and decodes the segment tree (or ``W`` independent samples) as one jitted program -> a ``Forest``;
3. each leaf's text is scored by the task's verifier -> reward (±1 or {0, 1}) plus DAPO's overlong penalty;
   rollout accuracy is the share of leaves whose verifier score is 1 (not the shaped reward's sign);
4. dynamic sampling (optional): prompts whose ``W`` rewards are all equal are dropped and up to ``max_refills``
   extra rollout batches refill the ``P`` slots (unfilled slots train on nothing);
5. the estimator's declared inputs (ReMax: one greedy rollout per prompt, scored by the verifier), then its
   per-token advantages;
6. old log-probs from the trainer's forward under the pre-update weights (``old_logp='trainer'``), reference
   log-probs from the frozen initial weights when ``LossConfig.kl_coef > 0``; the sampler's log-probs feed TIS;
7. ``epochs`` passes over ``mini_batches`` shuffled mini-batches, each one optax step (gradient accumulation over
   ``micro_batches``).

Held-out evaluation (greedy accuracy, and pass@k / maj@k from k samples when ``EvalConfig.k > 0``) runs before
training, every ``eval_every`` steps and at the end; TensorBoard gets it against the step (``eval/...``) and
against wall-clock seconds since the start (``eval_wallclock/...``). Metrics of step N are read after step N+1
was dispatched (:class:`treejax.metrics.DeferredMetrics`).

Precision: :class:`treejax.precision.Precision` (``RunConfig.precision``) — fp32 master weights and optimizer
state; bf16 compute, sampler weights and KV cache on GPU/TPU; fp32 with full-precision matmuls on CPU.

Several processes (``jax.distributed``, :mod:`treejax.parallel.multihost`): every process runs this loop over one
global mesh. Every process draws the same global batch of ``P`` prompts from the grain pipeline (same seed, same
iterator state; the prompt records are a few hundred bytes each), so host values derived from them are identical
everywhere and enter the jitted sampler and update as replicated inputs; the sampler, the estimator and the update
run on global arrays sharded over all processes' devices. Host code reads the forest only through explicit
all-gathers (``multihost.host_tree``): the leaves' tokens and lengths once per rollout for the verifier (every
process scores every leaf, so the rewards are the same everywhere without a second exchange), prompt 0's tree for
the picture, the evaluation's outputs, the parameters for the HF export. Process 0 alone holds the log folder's
lock and writes the event files, pictures, ``summary.json`` and the export; all processes save and restore the
orbax checkpoints together.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import os
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from treejax.errors import ConfigError, record_failure
from treejax.forest import Forest
from treejax.parallel import multihost
from treejax.parallel.axis_rules import SAMPLER_RULES
from treejax.parallel.mesh import (MeshConfig, batch_placer, logical_to_sharding, make_mesh, mesh_context,
                                   place_train_state, sharded_update)
from treejax.precision import Precision, warn_if_updates_round_away
from treejax.rl import rewards as rewards_lib
from treejax.rl.evaluation import EvalConfig
from treejax.rl.losses import LossConfig
from treejax.rl.optimizer import OptimizerConfig, learning_rate_schedule, make_optimizer
from treejax.rl.packing import PackingConfig
from treejax.rl.step import Rollouts, StepConfig, initial_reference, make_step_fns, rl_step
from treejax.rl.train_state import TrainState
from treejax.rl.update import make_update_fn
from treejax.sampling.strategies import Temperature
from treejax.sampling.tree import TreeConfig

log = logging.getLogger(__name__)


class ScheduleWarning(UserWarning):
    """The learning-rate schedule and the run's length disagree (``RunConfig._check_schedule``)."""


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything one training run needs (the gin-facing surface; see ``configs/*.gin``).

    The defaults are the quickstart (``configs/quickstart.gin``): a few TreePO steps of the embedded SmolLM2 on
    ``chain_sum_2x1``. ``old_logp``: ``"trainer"`` (recompute log pi_old with the trainer's forward, one extra
    forward per step) or ``"sampler"`` (use the sampler's log-probs; cheaper, the first ratio is then not 1).
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
    ``leaf_weighting``: ``"count"`` (every leaf slot weighs 1: TreePO's official weighting) or ``"mass"`` (each
    leaf's advantages times ``Forest.leaf_weight``, ``W`` x its path mass for ``"transfer"`` trees: see
    :data:`treejax.rl.step.LEAF_WEIGHTINGS`; refused with the fallback).
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
    task_options: dict = dataclasses.field(default_factory=lambda: {
        "size": 128, "eval_size": 32, "seed": 0, "system_prompt": None,
        "instruction": "Answer with just the number.", "extraction": "last_number"})
    system_prompt: str | None = None  # None: the task's own
    instruction: str | None = None  # None: the task's own
    prompts_per_step: int = 2
    num_steps: int = 3
    rollout: TreeConfig = TreeConfig(num_leaves=8, max_depth=3, segment_length=16, branch_factor=2,
                                     strategy=Temperature(1.0), repetition_ngram=4, repetition_count=4)
    estimator: str = "treepo"
    estimator_options: Any = None  # None: the estimator's defaults
    leaf_weighting: str = "count"  # "mass": each leaf's advantages x Forest.leaf_weight (step.LEAF_WEIGHTINGS)
    reward_style: str = "pm1"
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
    tree_picture_every: int = 1
    tree_picture_text: bool = True  # the picture shows the prompt and each leaf's answer text
    export_hf: bool = True
    seed: int = 0
    mesh: MeshConfig = MeshConfig()
    compilation_cache: str = "auto"  # persistent JAX compilation cache: 'auto' (~/.cache/treejax/jax), 'off', a folder

    def __post_init__(self):
        from treejax.config_types import check_types

        check_types(self)  # from Python too: RunConfig(num_steps=2.5) names the field before anything runs
        if self.prompts_per_step < 1 or self.num_steps < 0:
            raise ValueError("RunConfig: prompts_per_step >= 1 and num_steps >= 0 required")
        rows = self.prompts_per_step * self.rollout.num_leaves
        if rows % self.mini_batches or (rows // self.mini_batches) % self.micro_batches:
            raise ValueError(f"RunConfig: {rows} rollout rows (prompts_per_step x num_leaves) must split into "
                             f"mini_batches={self.mini_batches} x micro_batches={self.micro_batches}")
        self._check_choices()
        if self.max_prompt_length < 1:
            raise ValueError(f"RunConfig.max_prompt_length must be >= 1, got {self.max_prompt_length}")
        if self.eval_every < 0:
            raise ValueError(f"RunConfig.eval_every must be >= 0, got {self.eval_every}")
        if self.packed_update and self.prompts_per_step % self.mini_batches:
            raise ValueError(f"RunConfig: the packed update splits prompts into mini-batches; prompts_per_step="
                             f"{self.prompts_per_step} does not split into mini_batches={self.mini_batches}")
        if self.leaf_weighting == "mass" and not self.rollout.slots and self.rollout.fallback:
            raise ConfigError("RunConfig.leaf_weighting='mass' with TreeConfig.fallback=True: the depth-first fallback "
                              "gives ended subtrees new children, so no path mass makes the leaves an unbiased sample; "
                              "set TreeConfig.fallback=False (or use TreeConfig.allocation='slots')")
        self.step_config()  # validates old_logp, TIS, leaf weighting and the estimator's inputs
        self._check_schedule()

    def _check_choices(self) -> None:
        """Every enumerated field, one line each naming the valid choices (:func:`treejax.choices.check_choice`)."""
        from treejax.choices import check_choice
        from treejax.models.transformer import REMAT_POLICIES, TRAIN_ATTENTION_IMPLS
        from treejax.rl.advantages.registry import list_estimators
        from treejax.rl.step import LEAF_WEIGHTINGS, OLD_LOGP_SOURCES
        from treejax.rl.update import NONFINITE_POLICIES
        from treejax.run_dir import LOG_DIR_MODES

        check_choice("RunConfig.estimator", self.estimator, list_estimators())
        check_choice("RunConfig.nonfinite", self.nonfinite, NONFINITE_POLICIES)
        check_choice("RunConfig.remat", self.remat, (False, True, *REMAT_POLICIES))
        check_choice("RunConfig.attention_impl", self.attention_impl, TRAIN_ATTENTION_IMPLS)
        check_choice("RunConfig.old_logp", self.old_logp, OLD_LOGP_SOURCES)
        check_choice("RunConfig.reward_style", self.reward_style, ("pm1", "01"))
        check_choice("RunConfig.overlong_prompts", self.overlong_prompts, ("filter", "error"))
        check_choice("RunConfig.log_dir_mode", self.log_dir_mode, LOG_DIR_MODES)
        check_choice("RunConfig.leaf_weighting", self.leaf_weighting, LEAF_WEIGHTINGS)

    def _check_schedule(self) -> None:
        """A decaying learning-rate schedule that ends before the run does trains its last steps at the final
        rate (0 with the default ``end_lr_factor``): warned, once per config, not changed (the schedule is
        ``OptimizerConfig.total_steps``, never silently rescaled to ``num_steps``)."""
        opt = self.optimizer
        if opt.decay != "constant" and opt.total_steps < self.num_steps:
            import warnings

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
                          row_multiple=self.micro_batches * batch_devices, leaf_weighting=self.leaf_weighting)


# ----------------------------------------------------------------------------------------------- prompts
def encode_examples(tokenizer, examples, system_prompt=None, instruction=None) -> list[list[int]]:
    """Examples -> token lists through the chat template (``None`` keeps the task's system prompt/instruction)."""
    from treejax.data.prompts import format_prompt

    texts = [format_prompt(tokenizer, ex.prompt_messages, system_prompt=system_prompt, instruction=instruction)
             for ex in examples]
    return [tokenizer.encode(t) for t in texts]


def encode_prompts(tokenizer, task, records, system_prompt=None, instruction=None):
    """Records -> (examples, token lists) through the task and the chat template."""
    examples = [task.make_example(r) for r in records]
    return examples, encode_examples(tokenizer, examples, system_prompt, instruction)


def pad_token_lists(token_lists, width: int | None = None, pad_id: int = 0):
    """Right-pads token lists into ``([N, width] int32, lengths [N])``."""
    lens = np.array([len(t) for t in token_lists], np.int32)
    width = int(lens.max()) if width is None else width
    if lens.max() > width:
        raise ValueError(f"a prompt of {lens.max()} tokens exceeds the prompt width {width}")
    out = np.full((len(token_lists), width), pad_id, np.int32)
    for i, t in enumerate(token_lists):
        out[i, : len(t)] = t
    return out, lens


# ----------------------------------------------------------------------------------------------- rewards
def decode_leaves(tokenizer, tokens_PxWxT: np.ndarray, lengths_PxW: np.ndarray) -> list[list[str]]:
    """Every leaf's response text from host arrays of its tokens and lengths."""
    return [[tokenizer.decode(tokens_PxWxT[p, w, : lengths_PxW[p, w]].tolist(), skip_special_tokens=True)
             for w in range(tokens_PxWxT.shape[1])] for p in range(tokens_PxWxT.shape[0])]


def leaf_texts(tokenizer, forest: Forest) -> list[list[str]]:
    """Every leaf's response text (the forest's tokens are all-gathered in a multi-process run: call it on every
    process)."""
    return decode_leaves(tokenizer, *multihost.host_tree((forest.tokens, forest.leaf_length)))


def score_texts(task, examples, texts_PxW: list[list[str]]) -> np.ndarray:
    """[P, W] verifier scores in [0, 1] of response texts (row ``p`` answers ``examples[p]``)."""
    return np.array([[task.score(t, ex) for t in row] for row, ex in zip(texts_PxW, examples)], np.float32)


def score_forest(tokenizer, task, examples, forest: Forest) -> np.ndarray:
    """[P, W] verifier scores in [0, 1] of every leaf's decoded text."""
    return score_texts(task, examples, leaf_texts(tokenizer, forest))


def shaped_rewards(scores: np.ndarray, lengths: np.ndarray, cfg: RunConfig) -> np.ndarray:
    """Verifier reward (``cfg.reward_style``) of scores in [0, 1] plus DAPO's overlong penalty on the response
    lengths when ``cfg.overlong_buffer > 0`` (any matching shapes: ``[P, W]`` leaves, ``[P]`` greedy answers)."""
    r = rewards_lib.verifier_reward(jnp.asarray(scores >= 1.0), cfg.reward_style)
    if cfg.overlong_buffer > 0:
        r = r + rewards_lib.overlong_penalty(jnp.asarray(lengths), cfg.rollout.max_length, cfg.overlong_buffer,
                                             cfg.overlong_factor)
    return np.asarray(r)


# ----------------------------------------------------------------------------------------------- rollout source
class TaskRollouts:
    """The loop's :class:`~treejax.rl.step.RolloutSource`: prompts from the grain pipeline, the tree sampler,
    the task's verifier, DAPO's dynamic sampling with refills, and ReMax's greedy baseline."""

    def __init__(self, cfg: RunConfig, rollout, sampler_fns, tokenizer, task, pipeline, prompt_width: int,
                 pad_id: int):
        self.cfg, self.rollout, self.sampler_fns = cfg, rollout, sampler_fns
        self.tokenizer, self.task, self.pipeline = tokenizer, task, pipeline
        self.prompt_width, self.pad_id = prompt_width, pad_id

    def sample(self, params, key, step) -> Rollouts:
        cfg, P = self.cfg, self.cfg.prompts_per_step
        kept: list[tuple] = []
        info: dict[str, Any] = {"time/scoring_s": 0.0}
        have = 0
        for attempt in range(1 + (cfg.max_refills if cfg.dynamic_sampling else 0)):
            records = next(self.pipeline)
            records = [dict(zip(records, vals)) for vals in zip(*records.values())]
            examples, toks = encode_prompts(self.tokenizer, self.task, records, cfg.system_prompt, cfg.instruction)
            prompts, lens = pad_token_lists(toks, self.prompt_width, self.pad_id)
            forest, rinfo = self.rollout(params, prompts, lens, jax.random.fold_in(key, attempt), step)
            for k, v in dict(rinfo, **{f"stops/{k}": v for k, v in rinfo.get("stops", {}).items()}).items():
                if not isinstance(v, dict) and np.ndim(v) == 0:
                    info[k] = info.get(k, 0) + int(v)
            check_sampled_ids(forest, self.sampler_fns.sampling_vocab_size, step)
            t = time.perf_counter()
            # one explicit all-gather of the leaves (a no-op copy with one process); every process then scores
            # every leaf, so rewards, dynamic sampling and the refills agree on all processes
            tokens, leaf_lengths = multihost.host_tree((forest.tokens, forest.leaf_length))
            scores = score_texts(self.task, examples, decode_leaves(self.tokenizer, tokens, leaf_lengths))
            info["time/scoring_s"] += time.perf_counter() - t
            rewards = shaped_rewards(scores, leaf_lengths, cfg)
            keep = (np.asarray(rewards_lib.dynamic_sampling_keep(jnp.asarray(rewards))) if cfg.dynamic_sampling
                    else np.ones(P, bool))
            idx = np.nonzero(keep)[0][: P - have]
            kept.append((_take_prompts(forest, idx), rewards[idx], scores[idx], [examples[i] for i in idx],
                         prompts[idx], lens[idx]))
            have += len(idx)
            if have >= P:
                break
        info["rollout_calls"] = attempt + 1
        if have < P:
            # Not enough informative prompts after the refills: fill the remaining slots with the last rollout's
            # first prompts, masked out of the loss (they carry no gradient and no whitening weight).
            idx = np.arange(P - have)
            filler = _take_prompts(forest, idx)
            kept.append((filler.replace(loss_mask=jnp.zeros_like(filler.loss_mask)), rewards[idx], scores[idx],
                         [examples[i] for i in idx], prompts[idx], lens[idx]))
            info["filler_prompts"] = int(P - have)
        forests, rewards, scores, examples, prompts, lens = zip(*kept)
        # rewards, prompts and lengths are host values equal on every process: jit takes them as replicated inputs
        return Rollouts(forest=_concat_forests(list(forests)), rewards_PxW=jnp.asarray(np.concatenate(rewards)),
                        scores_PxW=np.concatenate(scores), prompts_PxLp=np.concatenate(prompts),
                        lengths_P=np.concatenate(lens), info=info, examples=[e for ex in examples for e in ex])

    def greedy_rewards(self, params, ro: Rollouts) -> np.ndarray:
        """ReMax's baseline: the shaped reward of one greedy completion per prompt (same length budget)."""
        from treejax.sampling.decode import generate
        from treejax.sampling.strategies import Greedy

        out = generate(params, self.sampler_fns, ro.prompts_PxLp, ro.lengths_P, jax.random.key(0),
                       self.cfg.rollout.max_length, Greedy(), stop_ids=self.cfg.rollout.stop_ids)
        tokens, lengths = multihost.host_tree((out.tokens, out.lengths))
        scores = np.array([self.task.score(self.tokenizer.decode(tokens[p, : lengths[p]].tolist(),
                                                                 skip_special_tokens=True), ex)
                           for p, ex in enumerate(ro.examples)], np.float32)
        return shaped_rewards(scores, lengths, self.cfg)


def check_sampled_ids(forest: Forest, vocab_size: int, step: int) -> None:
    """Raises :class:`~treejax.errors.DivergenceError` if the sampler produced ids outside the vocabulary or
    non-finite log-probs (what a model with non-finite logits does; decoding such ids would crash the tokenizer)."""
    from treejax.errors import DivergenceError

    # counted on the device: two replicated scalars come back, not the forest (which may span other processes)
    bad_ids, bad_logp = (int(v) for v in _bad_samples(forest.tokens, forest.logprobs, forest.segment_index,
                                                      vocab_size))
    if bad_ids or bad_logp:
        raise DivergenceError(f"step {step + 1}: the sampler produced {bad_ids} token ids outside the vocabulary "
                              f"and {bad_logp} non-finite log-probs: the policy has diverged (non-finite logits); "
                              "lower OptimizerConfig.learning_rate")


@functools.partial(jax.jit, static_argnums=3)
def _bad_samples(tokens, logprobs, segment_index, vocab_size: int):
    """(ids outside ``[0, vocab_size)``, non-finite log-probs) among the forest's valid tokens."""
    valid = segment_index >= 0
    bad_ids = jnp.sum(valid & ((tokens < 0) | (tokens >= vocab_size)))
    return bad_ids, jnp.sum(valid & ~jnp.isfinite(logprobs))


#: Divergence rules on a step's host metrics: entropy within 2% of the uniform distribution's ln(V), or the
#: parameter norm moving by more than half of its value in one step (typical AdamW steps move it by < 1%).
ENTROPY_UNIFORM_FRACTION = 0.98
PARAM_NORM_JUMP = 0.5


def divergence(row: dict, prev_param_norm: float | None, vocab_size: int,
               initial_entropy: float | None = None) -> str | None:
    """Why step ``row`` looks diverged (``None`` if it does not). The rules, first match wins:

    * the parameter norm after the update is not finite;
    * the policy entropy ``H >= 0.98 ln V`` (uniform over the vocabulary) — only when the run's first measured
      entropy ``initial_entropy`` was below that (a randomly initialised model starts uniform: that is no
      divergence); ``None``: unknown, the rule applies;
    * ``|norm - prev_param_norm| > 0.5 prev_param_norm``, where ``prev_param_norm`` is the norm after the previous
      step (before the first step: the initial, or restored, parameters' norm).

    ``update/entropy`` is measured in the update's forward, i.e. under the parameters before that step's update,
    and ``update/param_norm`` after it: a learning rate that wrecks the model in step ``s`` shows as a norm jump
    in step ``s`` and as entropy at ln V in step ``s + 1``.
    """
    ent, norm = row.get("update/entropy"), row.get("update/param_norm")
    if norm is not None and not np.isfinite(norm):
        return f"the parameter norm is {norm}"
    uniform = ENTROPY_UNIFORM_FRACTION * np.log(vocab_size)
    if ent is not None and ent >= uniform and (initial_entropy is None or initial_entropy < uniform):
        return f"the policy entropy {ent:.2f} is at the uniform distribution's ln(V) = {np.log(vocab_size):.2f}"
    if norm is not None and prev_param_norm and abs(norm - prev_param_norm) > PARAM_NORM_JUMP * prev_param_norm:
        return f"the parameter norm jumped from {prev_param_norm:.4g} to {norm:.4g} in one step"
    return None


def reward_range(cfg: RunConfig) -> tuple[float, float]:
    """The run's possible reward range (verifier reward plus the overlong penalty): a fixed colour scale."""
    lo, hi = (-1.0, 1.0) if cfg.reward_style == "pm1" else (0.0, 1.0)
    return (lo - (cfg.overlong_factor if cfg.overlong_buffer > 0 else 0.0), hi)


def sample_completions(tokenizer, ro: Rollouts, leaves: int = 3) -> str:
    """A few leaves of the first prompt as Markdown (reward, verifier score, text) for TensorBoard's text tab
    (gathers prompt 0's leaves in a multi-process run: call it on every process)."""
    texts = leaf_texts(tokenizer, first_prompt(ro.forest))[0]
    rewards = np.asarray(ro.rewards_PxW)[0]
    lines = []
    for w in range(min(leaves, len(texts))):
        score = "" if ro.scores_PxW is None else f", score {ro.scores_PxW[0, w]:.2f}"
        lines.append(f"**leaf {w}** (reward {rewards[w]:+.2f}{score}):\n\n    " + texts[w].replace("\n", "\n    "))
    return "\n\n".join(lines)


def _concat_forests(forests: list[Forest]) -> Forest:
    return forests[0] if len(forests) == 1 else jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *forests)


def _take_prompts(forest: Forest, idx: np.ndarray) -> Forest:
    if len(idx) == forest.num_prompts and np.array_equal(idx, np.arange(len(idx))):
        return forest  # every prompt kept in order (no dynamic sampling): no gather
    return jax.tree.map(lambda x: x[jnp.asarray(idx)], forest)


def first_prompt(forest: Forest) -> Forest:
    """Prompt 0's tree as host (NumPy) arrays, all-gathered where it spans other processes (a collective)."""
    return multihost.host_tree(jax.tree.map(lambda x: x[:1], forest))


# ----------------------------------------------------------------------------------------------- the run
@dataclasses.dataclass
class _Run:
    """What setup builds and the step loop uses (host-side objects; no hidden globals)."""

    cfg: RunConfig
    precision: Any
    model_config: Any
    tokenizer: Any
    task: Any
    sampler_fns: Any
    source: TaskRollouts
    step_fns: Any
    state: Any
    ref_params: Any
    eval_examples: list
    prompt_width: int
    writer: Any
    checkpointer: Any
    start_step: int
    data_state: dict
    t_start: float
    mesh: Any = None  # the run's mesh; its programs are traced under mesh_context(mesh)
    stopped_by: str | None = None  # the signal that stopped the step loop early (SIGTERM, SIGINT)


def run(cfg: RunConfig, operative_config: str | None = None) -> dict[str, Any]:
    """Runs training as configured and returns the summary (also written to ``log_dir/summary.json``).

    In a multi-process run every process calls this with the same config; process 0 holds the log folder's lock
    and writes the files, every process returns the summary."""
    from treejax.compile_cache import enable_compilation_cache
    from treejax.log import show_progress
    from treejax.run_dir import claim_log_dir

    if multihost.is_primary():
        show_progress()
    cache_dir = enable_compilation_cache(cfg.compilation_cache)
    if cache_dir:
        log.info("compilation cache: %s (RunConfig.compilation_cache = 'off' or TREEJAX_COMPILATION_CACHE=off "
                 "turns it off)", cache_dir)
    with claim_log_dir(cfg.log_dir, cfg.log_dir_mode):
        r = _setup(cfg, operative_config)
        try:
            with r.precision.matmul_context(), mesh_context(r.mesh):
                preempted_at = _train(r)
            if preempted_at is not None:
                return _finish_preempted(r, preempted_at)
            with r.precision.matmul_context(), mesh_context(r.mesh):
                return _finish(r)
        except BaseException as e:  # record where the run stopped, then let the error surface unchanged
            try:
                record_failure(cfg.log_dir, int(r.data_state.get("rl_step", r.start_step)), e,
                               process=multihost.process_index() if multihost.process_count() > 1 else None)
            except OSError:  # the disk that made the run fail (full, read-only) cannot take the record either
                pass
            raise


def _setup(cfg: RunConfig, operative_config: str | None) -> _Run:
    from treejax import checkpoint as ckpt_lib
    from treejax import metrics as metrics_lib
    from treejax.data import make_prompt_pipeline
    from treejax.models import transformer
    from treejax.models.registry import load_model, load_tokenizer
    from treejax.sampling.decode import make_model_fns
    from treejax.sampling.tree import make_tree_rollout

    t_start = time.perf_counter()
    prec = cfg.precision.resolve()
    os.makedirs(cfg.log_dir, exist_ok=True)
    if operative_config is not None and multihost.is_primary():
        with open(os.path.join(cfg.log_dir, "operative_config.gin"), "w") as f:
            f.write(operative_config)

    # The task's data is read, validated and measured before the weights load: a data problem is reported in
    # seconds, not after minutes of loading and compiling.
    task, train_records, eval_examples = load_task_data(cfg)
    tokenizer = load_tokenizer(cfg.model)
    train_records, eval_examples, prompt_width = filter_prompts(tokenizer, task, train_records, eval_examples, cfg)
    log.info("loading %s (%s master weights, %s compute, %s sampler/cache, matmul precision %s)", cfg.model,
             prec.param_dtype, prec.compute_dtype, prec.cache_dtype, prec.matmul_precision)
    model_config, params, tokenizer = load_model(cfg.model, param_dtype=prec.param_dtype,
                                                 compute_dtype=prec.compute_dtype, tokenizer=tokenizer)
    warn_if_updates_round_away(params, prec.param_dtype, cfg.optimizer.learning_rate)
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    tree_cfg = dataclasses.replace(cfg.rollout, stop_ids=cfg.rollout.stop_ids or tuple(tokenizer.eos_ids))
    cfg = dataclasses.replace(cfg, rollout=tree_cfg)
    # Sharding: params placed by their logical axes; the state is created under jit with explicit out
    # shardings; the update is jitted with explicit in/out shardings and donates the state. The sampler keeps
    # its KV cache and per-row state sharded by the cache's logical axes on the same mesh.
    mesh = make_mesh(cfg.mesh)
    sampler_fns = make_model_fns(model_config, cache_dtype=prec.cache_dtype, mesh=mesh if mesh.size > 1 else None)
    rollout = make_tree_rollout(sampler_fns, tree_cfg)
    optimizer = make_optimizer(cfg.optimizer)
    key = jax.random.key(cfg.seed)
    create = lambda p: TrainState.create(p, optimizer, jax.random.fold_in(key, 1))  # noqa: E731
    state, state_sh = place_train_state(params, transformer.param_logical_axes(model_config), create, optimizer,
                                        mesh)
    ref_params = initial_reference(state.params, cfg.loss)
    del params
    update_fn = make_update_fn(model_config, cfg.loss, optimizer, num_micro_batches=cfg.micro_batches,
                               nonfinite=cfg.nonfinite, learning_rate_fn=learning_rate_schedule(cfg.optimizer),
                               attention_impl=cfg.attention_impl, remat=cfg.remat,
                               tree_attention_impl=cfg.packing.attention_impl)
    update = sharded_update(update_fn, state_sh, mesh)  # jitted per mini-batch layout (packed shapes bucket)

    sampler_sh = None  # on a mesh the sampler's copy is gathered over fsdp once per step (SAMPLER_RULES)
    if mesh.size > 1:
        sampler_sh = logical_to_sharding(transformer.param_logical_axes(model_config), mesh, SAMPLER_RULES,
                                         state.params)
    step_fns = make_step_fns(model_config, cfg.step_config(pad_id, mesh.shape["data"] * mesh.shape["fsdp"]), prec,
                             update, batch_sharding=batch_placer(mesh),
                             sampler_shardings=sampler_sh)
    pipeline = make_prompt_pipeline(train_records, batch_size=cfg.prompts_per_step, seed=cfg.seed)
    source = TaskRollouts(cfg, rollout, sampler_fns, tokenizer, task, pipeline, prompt_width, pad_id)

    writer = (metrics_lib.MetricsWriter(cfg.log_dir, print_fn=log.info, total_steps=cfg.num_steps,
                                        console_keys=_CONSOLE_KEYS)
              if multihost.is_primary() else metrics_lib.NullWriter())  # one process writes the event files
    checkpointer = ckpt_lib.Checkpointer(os.path.join(os.path.abspath(cfg.log_dir), "checkpoints"),
                                         max_to_keep=cfg.keep_checkpoints)
    data_state: dict = {"rl_step": 0}
    if checkpointer.latest_step() is not None:
        state, data_state = checkpointer.restore(state)
        pipeline.set_state(data_state["pipeline"])
        log.info("resumed from step %d", int(data_state["rl_step"]))
    else:
        log.info("new run in %s (no checkpoint there): starting at step 0", os.path.abspath(cfg.log_dir))
    return _Run(cfg, prec, model_config, tokenizer, task, sampler_fns, source, step_fns, state, ref_params,
                eval_examples, prompt_width, writer, checkpointer, int(data_state["rl_step"]), data_state, t_start,
                mesh)


_CONSOLE_KEYS = ("reward/mean", "reward/accuracy", "rollout/decoded_tokens", "update/loss", "update/grad_norm",
                 "mismatch/abs_max", "time/rollout_s", "time/update_s", "eval/accuracy")


def _evaluate(r: _Run, step: int) -> dict:
    """Held-out evaluation with the sampler's weights; logged against the step and the wall clock."""
    from treejax.rl.evaluation import evaluate

    t = time.perf_counter()
    out = evaluate(r.step_fns.sampler_params(r.state.params), r.sampler_fns, r.tokenizer, r.task,
                   r.eval_examples, r.prompt_width, r.cfg.eval, system_prompt=r.cfg.system_prompt,
                   instruction=r.cfg.instruction)
    out = dict(out, step=step, wall_s=time.perf_counter() - r.t_start, eval_s=time.perf_counter() - t)
    scalars = {f"eval/{k}": v for k, v in out.items() if k not in ("n", "k", "step", "wall_s")}
    r.writer.write_scalars(step, scalars)
    r.writer.write_scalars(int(out["wall_s"]), {f"eval_wallclock/{k.split('/', 1)[1]}": v
                                                for k, v in scalars.items()}, console=False)
    return out


def _train(r: _Run) -> int | None:
    """The step loop; returns the step at which a preemption signal stopped it (``None`` if it ran through)."""
    from treejax import checkpoint as ckpt_lib
    from treejax import metrics as metrics_lib
    from treejax import viz

    cfg = r.cfg
    key = jax.random.key(cfg.seed)
    evals = r.data_state.setdefault("evals", [])
    if not evals:
        log.info("evaluating %d held-out problems before training (the first call compiles the decoder)",
                 len(r.eval_examples))
        evals.append(_evaluate(r, 0))
    preemption = ckpt_lib.PreemptionHandler()
    if threading.current_thread() is threading.main_thread():
        preemption.install()
    deferred = metrics_lib.DeferredMetrics()
    pending_host: dict[int, dict] = {}
    history = r.data_state.setdefault("history", [])

    # the norm of the parameters the first step starts from (initial or restored): a jump in step 1 is seen too
    norms = {"prev": history[-1].get("update/param_norm") if history else float(optax.global_norm(r.state.params))}
    diverged = r.data_state.setdefault("divergence", [])

    def write(ready):
        from treejax.errors import DivergenceError

        for s, values in ready:
            row = dict(pending_host.pop(s), **values)
            r.writer.write_scalars(s, row)
            history.append(dict(row, step=s))
            why = divergence(row, norms["prev"], r.sampler_fns.sampling_vocab_size,
                             initial_entropy=history[0].get("update/entropy"))
            norms["prev"] = row.get("update/param_norm", norms["prev"])
            if why:
                if cfg.nonfinite == "raise":
                    raise DivergenceError(f"step {s}: {why}; stopped before export (nonfinite='raise'); "
                                          "lower OptimizerConfig.learning_rate")
                diverged.append({"step": s, "why": why})
                log.warning("step %d: %s: training looks diverged (RunConfig.nonfinite='raise' stops the run "
                            "here)", s, why)

    preempted_at = None
    try:
        for step in range(r.start_step, cfg.num_steps):
            if step == r.start_step:
                log.info("step %d: rollout, scoring and update (the first step compiles the tree sampler and the "
                         "update; later steps are faster)", step + 1)
            t_step = time.perf_counter()
            r.state, ro, device_metrics, host = rl_step(r.step_fns, r.state, r.source, jax.random.fold_in(key, step),
                                                        step, r.ref_params)
            log.info("%s", step_line(step + 1, cfg.num_steps, host, time.perf_counter() - t_step))
            pending_host[step + 1] = dict(host, **{"time/step_s": time.perf_counter() - r.t_start})
            write(deferred.push(step + 1, device_metrics))
            done = step + 1
            r.data_state.update(rl_step=done, pipeline=r.source.pipeline.get_state())
            if cfg.tree_picture_every and done % cfg.tree_picture_every == 0:
                picture = os.path.join(cfg.log_dir, f"tree_step{done}.png")
                first = dataclasses.replace(ro, forest=first_prompt(ro.forest))  # gathered on every process
                if multihost.is_primary():
                    texts = {}
                    if cfg.tree_picture_text:  # first.forest is on the host already: no collective here
                        texts = dict(prompt_text=ro.examples[0].prompt_messages[-1]["content"],
                                     leaf_texts=leaf_texts(r.tokenizer, first.forest)[0])
                    viz.draw_tree(first.forest, np.asarray(ro.rewards_PxW)[:1], picture, prompt=0,
                                  title=f"step {done}: prompt 0, {cfg.rollout.num_leaves} leaves",
                                  reward_range=reward_range(cfg), correct=ro.scores_PxW[:1] >= 1.0, **texts)
                    r.writer.write_image(done, "rollout/tree", picture)
                    r.writer.write_text(done, "rollout/samples", sample_completions(r.tokenizer, first))
                r.data_state["tree_picture"] = os.path.abspath(picture)
            if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.num_steps:
                write(deferred.flush())
                evals.append(_evaluate(r, done))
            if cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
                write(deferred.flush())
                r.checkpointer.save(done, r.state, r.data_state)
            if preemption.should_stop(done, r.checkpointer):
                preempted_at = done
                write(deferred.flush())
                if r.checkpointer.latest_step() != done:
                    r.checkpointer.save(done, r.state, r.data_state, force=True)
                import signal

                r.stopped_by = signal.Signals(preemption.signal_received).name if preemption.signal_received else \
                    "a preemption notice"
                log.warning("%s: saved step %d and stopping; rerun the same command to resume", r.stopped_by, done)
                break
        write(deferred.flush())
    except RuntimeError as e:
        diverged_error = nonfinite_update_error(e)
        if diverged_error is None:
            raise
        raise diverged_error from e
    finally:
        preemption.uninstall()
    return preempted_at


def step_line(done: int, total: int, host: dict, step_s: float) -> str:
    """The line printed as soon as step ``done`` ends: its host-side results, its time and an ETA (the remaining
    steps at this step's time; the first step also compiles, so its ETA is an upper bound). The update's metrics
    (loss, gradient norm, ...) are read one step later and follow in the step's full line."""
    from tqdm import tqdm

    parts = [f"reward {host['reward/mean']:+.3f}"]
    if "reward/accuracy" in host:
        parts.append(f"accuracy {100 * host['reward/accuracy']:.1f}%")
    parts.append(f"{host.get('rollout/decoded_tokens', 0)} decoded tokens")
    eta = f"ETA {tqdm.format_interval((total - done) * step_s)}" if done < total else "last step"
    return f"step {done}/{total} done in {step_s:.1f} s: {', '.join(parts)} | {eta}"


def nonfinite_update_error(e: BaseException):
    """The :class:`~treejax.errors.DivergenceError` for a jax runtime error that carries the update's
    ``nonfinite='raise'`` check (:func:`treejax.rl.update._raise_nonfinite`, raised in a host callback, so it
    reaches the loop wrapped in jax's error with a traceback as text); ``None`` for any other error."""
    import re

    from treejax.errors import DivergenceError

    found = re.search(r"FloatingPointError: (non-finite update at step \d+[^\n]*)", str(e))
    if not isinstance(e, RuntimeError) or found is None:
        return None
    what = found.group(1).split("; params and optimizer state")[0]
    return DivergenceError(f"{what}; stopped before export (nonfinite='raise'); lower OptimizerConfig.learning_rate")


def _finish_preempted(r: _Run, preempted_at: int) -> dict:
    r.checkpointer.wait()
    r.checkpointer.close()
    r.writer.close()
    return {"preempted_at": preempted_at, "stopped_by": r.stopped_by, "log_dir": os.path.abspath(r.cfg.log_dir),
            "checkpoint_dir": os.path.abspath(r.checkpointer.directory), "history": r.data_state["history"]}


def _finish(r: _Run) -> dict:
    from treejax.models.export import export_hf

    cfg, evals = r.cfg, r.data_state["evals"]
    if evals[-1]["step"] != cfg.num_steps:
        evals.append(_evaluate(r, cfg.num_steps))
    if r.checkpointer.latest_step() != cfg.num_steps:
        r.checkpointer.save(cfg.num_steps, r.state, r.data_state, force=True)
    r.checkpointer.wait()
    diverged = r.data_state.get("divergence", [])
    if diverged:
        log.warning("training looked diverged at step(s) %s (%s); the checkpoint%s that model",
                    ", ".join(str(d["step"]) for d in diverged), diverged[0]["why"],
                    " and the HF export hold" if cfg.export_hf else " holds")
    export_dir = None
    if cfg.export_hf:
        export_dir = os.path.join(cfg.log_dir, "hf_export")
        params = multihost.host_tree(r.state.params)  # all-gathered: every process takes part
        if multihost.is_primary():
            export_hf(params, r.model_config, export_dir, r.tokenizer)
        del params
    r.writer.close()
    r.checkpointer.close()
    history = r.data_state["history"]
    summary = {
        "model": cfg.model, "task": cfg.task, "estimator": cfg.estimator, "steps": cfg.num_steps,
        "device": jax.devices()[0].device_kind, "num_devices": jax.device_count(),
        "num_processes": jax.process_count(),
        "precision": dataclasses.asdict(r.precision),
        "eval_before": evals[0], "eval_after": evals[-1], "evals": evals, "history": history,
        "decoded_tokens": int(sum(h.get("rollout/decoded_tokens", 0) for h in history)),
        "total_s": time.perf_counter() - r.t_start,
        "log_dir": os.path.abspath(cfg.log_dir), "checkpoint_dir": os.path.abspath(r.checkpointer.directory),
        "hf_export": export_dir and os.path.abspath(export_dir), "tree_picture": r.data_state.get("tree_picture"),
        "divergence": diverged,
    }
    if multihost.is_primary():
        with open(os.path.join(cfg.log_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2, default=float)
    multihost.sync("treejax_run_finished")  # no process leaves before the summary marks the run finished
    return summary


def load_task_data(cfg: RunConfig) -> tuple[Any, list[dict[str, str]], list]:
    """``(task, train records, eval examples)`` of the run's task, checked before any model is loaded.

    Raises :class:`~treejax.errors.DataError` when the task has no training problems, or no held-out problems
    (the run evaluates ``EvalConfig.num_problems`` of them before and after training; the message names the task
    options that give it an eval split, e.g. ``eval_path`` / ``eval_fraction`` for a file task)."""
    from treejax.data import get_task
    from treejax.errors import DataError

    task = get_task(cfg.task, **dict(cfg.task_options))
    train_records = task.records("train")
    if not train_records:
        raise DataError(f"task {cfg.task!r} ({task.name}) has no training problems")
    eval_examples = list(task.examples("eval"))[: cfg.eval.num_problems]
    if not eval_examples:
        raise DataError(f"task {cfg.task!r} ({task.name}) has no held-out (eval) problems, and the run evaluates "
                        f"EvalConfig.num_problems={cfg.eval.num_problems} of them before and after training: "
                        f"{task.eval_options}")
    return task, train_records, eval_examples


def prompt_cap(cfg: RunConfig) -> int:
    """The longest prompt a run accepts: ``RunConfig.max_prompt_length``, and ``TreeConfig.max_prompt_length``
    when that is set and smaller."""
    limit = cfg.rollout.max_prompt_length
    return cfg.max_prompt_length if limit is None else min(limit, cfg.max_prompt_length)


def filter_prompts(tokenizer, task, train_records, eval_examples, cfg):
    """Measures every train and eval prompt once (chat template included) and applies ``overlong_prompts``.

    Returns ``(train_records, eval_examples, prompt_width)``: the width is the power-of-two bucket of the longest
    kept prompt, so one over-long question can no longer blow up the batch (a 291-token question among ~57-token
    ones made the width 512 and step 1's update ask for 28.6 GB)."""
    from treejax.errors import DataError
    from treejax.sampling.decode import bucket_length

    cap = prompt_cap(cfg)
    _, toks = encode_prompts(tokenizer, task, list(train_records), cfg.system_prompt, cfg.instruction)
    etoks = encode_examples(tokenizer, eval_examples, cfg.system_prompt, cfg.instruction)
    lens, elens = np.array([len(t) for t in toks]), np.array([len(t) for t in etoks], int)
    over, eover = int(np.sum(lens > cap)), int(np.sum(elens > cap))
    if over or eover:
        msg = (f"{over} of {len(lens)} training and {eover} of {len(elens)} evaluation prompts of task "
               f"{cfg.task!r} are longer than max_prompt_length={cap} tokens (longest: {max(lens.max(), elens.max(initial=0))})")
        if cfg.overlong_prompts == "error":
            raise DataError(msg + "; raise RunConfig.max_prompt_length or set RunConfig.overlong_prompts='filter'")
        log.warning("%s: filtered out", msg)
        train_records = [r for r, n in zip(train_records, lens) if n <= cap]
        eval_examples = [e for e, n in zip(eval_examples, elens) if n <= cap]
    if len(train_records) < cfg.prompts_per_step:
        raise DataError(f"task {cfg.task!r} has {len(train_records)} usable training prompts, fewer than "
                        f"prompts_per_step={cfg.prompts_per_step}")
    if eover and eover == len(elens):
        raise DataError(f"every evaluation prompt of task {cfg.task!r} is longer than max_prompt_length={cap} "
                        "tokens; raise RunConfig.max_prompt_length")
    kept = [n for n in lens if n <= cap] + [n for n in elens if n <= cap]
    return train_records, eval_examples, bucket_length(max(kept))
