"""Set-up of a run: the task's data (checked before any weights load), the model, the mesh, the sampler, the
learner and the rollout source, the metrics writer and the checkpointer (restored when the log folder holds a
checkpoint): everything :mod:`treejax.rl.loop` needs, as one :class:`Run`.

Sharding: params are placed by their logical axes; the train state is created under jit with explicit out
shardings; the update is jitted with explicit in/out shardings and donates the state. The sampler keeps its KV
cache and per-row state sharded by the cache's logical axes on the same mesh, and reads a copy of the weights in
its own dtype (gathered over ``fsdp`` once per step on a mesh, ``SAMPLER_RULES``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import time
from typing import Any

import jax
import numpy as np

from treejax import checkpoint as ckpt_lib
from treejax import metrics as metrics_lib
from treejax.data import get_task, make_prompt_pipeline
from treejax.data.prompts import encode_examples, encode_prompts
from treejax.errors import DataError
from treejax.models import lora, transformer
from treejax.models.registry import load_model, load_tokenizer
from treejax.parallel import multihost
from treejax.parallel.axis_rules import SAMPLER_RULES
from treejax.parallel.mesh import (MeshConfig, batch_placer, logical_to_sharding, make_mesh, mesh_context,
                                   place_train_state, replicated, sharded_update)
from treejax.precision import warn_if_updates_round_away
from treejax.rl import collect
from treejax.rl.config import RunConfig, prompt_cap
from treejax.rl.layouts import make_layout
from treejax.rl.optimizer import learning_rate_schedule, make_optimizer
from treejax.rl.sources import catalog  # noqa: F401  (registers every rollout stage)
from treejax.rl.rollouts import TaskRollouts
from treejax.rl.sources.base import RolloutSource, SourceContext, build_chain, chain_process_local
from treejax.rl.shaping import init_states
from treejax.rl.shaping import probes as shaping_probes
from treejax.rl.step import Learner, initial_reference, make_learner
from treejax.rl.train_state import TrainState
from treejax.rl.update import make_update_fn
from treejax.sampling import path_scores
from treejax.sampling.decode import bucket_length, make_model_fns, resolve_stop_ids
from treejax.sampling.tree import make_tree_rollout

log = logging.getLogger("treejax.rl.loop")

#: Metrics the console line shows, in order (all of them go to TensorBoard).
CONSOLE_KEYS = ("reward/mean", "reward/accuracy", "rollout/decoded_tokens", "update/loss", "update/grad_norm",
                "mismatch/abs_max", "time/rollout_s", "time/update_s", "eval/accuracy", "eval/tool_accuracy",
                "eval/tool_calls_mean")


@dataclasses.dataclass
class Run:
    """What set-up builds and the step loop uses (host-side objects; no hidden globals)."""

    cfg: RunConfig
    precision: Any
    model_config: Any
    tokenizer: Any
    task: Any
    sampler_fns: Any
    source: RolloutSource
    learner: Learner
    state: Any
    ref_params: Any
    eval_examples: list
    prompt_width: int
    writer: Any
    checkpointer: Any
    start_step: int
    data_state: dict
    t_start: float
    mesh: Any = None  # the learner's mesh (all devices unless AsyncConfig splits them); programs trace under it
    sampler_mesh: Any = None  # the rollout sampler's mesh (the learner's unless AsyncConfig.sampler_devices > 0)
    stopped_by: str | None = None  # the signal that stopped the step loop early (SIGTERM, SIGINT)
    loop_s: float | None = None  # the step loop's wall-clock seconds (set when it ran through)
    memory_plan: Any = None  # what ``before_load`` returned (the loop's memory plan, for the summary)


def load_task_data(cfg: RunConfig) -> tuple[Any, list[dict[str, str]], list]:
    """``(task, train records, eval examples)`` of the run's task, checked before any model is loaded.

    Raises :class:`~treejax.errors.DataError` when the task has no training problems, or no held-out problems
    (the run evaluates ``EvalConfig.num_problems`` of them before and after training; the message names the task
    options that give it an eval split, e.g. ``eval_path`` / ``eval_fraction`` for a file task).

    ``RunConfig.train_split = "eval"`` (test-time RL): the training records are the evaluated problems themselves,
    the first ``EvalConfig.num_problems`` of the eval split (their answers only measure: the config requires
    pseudo-label rewards)."""
    task = get_task(cfg.task, **dict(cfg.task_options))
    if cfg.train_split == "eval":
        train_records = task.records("eval")[: cfg.eval.num_problems]
    else:
        train_records = task.records("train")
    if not train_records:
        raise DataError(f"task {cfg.task!r} ({task.name}) has no training problems in its {cfg.train_split!r} split")
    eval_examples = list(task.examples("eval"))[: cfg.eval.num_problems]
    if not eval_examples:
        raise DataError(f"task {cfg.task!r} ({task.name}) has no held-out (eval) problems, and the run evaluates "
                        f"EvalConfig.num_problems={cfg.eval.num_problems} of them before and after training: "
                        f"{task.eval_options}")
    return task, train_records, eval_examples


def filter_prompts(tokenizer, task, train_records, eval_examples, cfg):
    """Measures every train and eval prompt once (chat template included) and applies ``overlong_prompts``.

    Returns ``(train_records, eval_examples, prompt_width)``: the width is the power-of-two bucket of the longest
    kept prompt, so one over-long question can no longer blow up the batch (a 291-token question among ~57-token
    ones made the width 512 and step 1's update ask for 28.6 GB)."""
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


def build_run(cfg: RunConfig, operative_config: str | None = None, before_load=None) -> Run:
    """Everything the step loop needs (module docstring); restores the newest checkpoint of ``cfg.log_dir``.
    ``before_load(cfg, prompt_width, tokenizer, task, train_records)``: called once the task's prompts are
    measured, before the weights load."""
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
    planned = None
    if before_load is not None:  # e.g. the memory plan's verdict (treejax.rl.loop.run), before the weights load
        planned = before_load(cfg, prompt_width, tokenizer, task, train_records)
    log.info("loading %s (%s master weights, %s compute, %s sampler/cache, matmul precision %s)", cfg.model,
             prec.param_dtype, prec.compute_dtype, prec.cache_dtype, prec.matmul_precision)
    # LoRA: the frozen base loads in its storage float dtype (bf16, or fp32 for base_dtype='float32'), never as fp32
    # master weights it does not need; the adapters are fp32 (lora.prepare)
    load_dtype = prec.param_dtype if not cfg.lora.enabled else (
        "float32" if cfg.lora.base_dtype == "float32" else "bfloat16")
    model_config, params, tokenizer = load_model(cfg.model, param_dtype=load_dtype,
                                                 compute_dtype=prec.compute_dtype, tokenizer=tokenizer)
    if cfg.lora.enabled:
        params = lora.prepare(params, cfg.lora)
    else:
        warn_if_updates_round_away(params, prec.param_dtype, cfg.optimizer.learning_rate)
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    cfg = dataclasses.replace(cfg, rollout=dataclasses.replace(
        cfg.rollout, stop_ids=resolve_stop_ids(cfg.rollout.stop_ids, tokenizer=tokenizer)))
    local = chain_process_local(cfg.rollouts)  # each process its own policy (SAPO's nodes), or one global one
    sampler_devices, learner_devices = collect.split_devices(
        cfg.async_rollouts, jax.local_devices() if local else jax.devices(), 1 if local else jax.process_count())
    mesh = make_mesh(cfg.mesh, learner_devices)
    sampler_mesh = sampler_mesh_of(cfg, mesh, sampler_devices, learner_devices)
    if sampler_devices != learner_devices:
        log.info("asynchronous rollouts: %d device(s) sample, %d learn (max_staleness %d)", len(sampler_devices),
                 len(learner_devices), cfg.async_rollouts.max_staleness)
    elif sampler_mesh is not mesh:
        log.info("the sampler decodes on its own layout of the %d device(s): data x fsdp x tensor = %s (the "
                 "learner's: %s); its weights are re-laid out after each update", len(sampler_devices),
                 " x ".join(map(str, sampler_mesh.devices.shape)), " x ".join(map(str, mesh.devices.shape)))
    model_fns = lambda m: make_model_fns(model_config, attention=cfg.decode_attention,  # noqa: E731
                                         cache_dtype=prec.cache_dtype, mesh=m if m.size > 1 else None)
    sampler_fns = model_fns(mesh)  # held-out evaluation: on the learner's devices, in the loop's thread
    rollout_fns = sampler_fns if sampler_mesh is mesh else model_fns(sampler_mesh)
    learner, state, ref_params = _learner(cfg, prec, model_config, params, pad_id, mesh)
    del params
    pipeline = make_prompt_pipeline(train_records, batch_size=cfg.prompts_per_step,
                                    seed=cfg.seed + (jax.process_index() if local else 0))
    make_rollout = path_scored(cfg, tokenizer, lambda tc: make_tree_rollout(rollout_fns, tc,
                                                                         continuations=cfg.continuation_config()))
    source = build_chain(cfg.rollouts, SourceContext(
        cfg, tokenizer, task, pipeline, make_rollout(cfg.rollout), make_rollout, rollout_fns, model_config,
        prompt_width, pad_id, learner.estimator_inputs, task_rollouts, mesh))
    writer = (metrics_lib.MetricsWriter(cfg.log_dir, print_fn=log.info, total_steps=cfg.num_steps,
                                        console_keys=CONSOLE_KEYS)
              if multihost.is_primary() else metrics_lib.NullWriter())  # one process writes the event files
    checkpointer = ckpt_lib.Checkpointer(os.path.join(os.path.abspath(cfg.log_dir), "checkpoints"),
                                         max_to_keep=cfg.keep_checkpoints)
    data_state: dict = {"rl_step": 0}
    if checkpointer.latest_step() is not None:
        # LoRA: adapters only; a stateful shaper's state (a trainable scorer) the checkpoint lacks starts fresh
        restored, data_state = checkpointer.restore(lora.checkpoint_state(state), new_aux=state.aux)
        state = lora.restored_state(state, restored)
        pipeline.set_state(data_state["pipeline"])
        if hasattr(source, "restore_state"):  # the rollout chain's own state (its stages')
            source.restore_state(data_state)
        log.info("resumed from step %d", int(data_state["rl_step"]))
    else:
        log.info("new run in %s (no checkpoint there): starting at step 0", os.path.abspath(cfg.log_dir))
    return Run(cfg, prec, model_config, tokenizer, task, sampler_fns, source, learner, state, ref_params,
               eval_examples, prompt_width, writer, checkpointer, int(data_state["rl_step"]), data_state, t_start,
               mesh, sampler_mesh, memory_plan=planned)


def path_scored(cfg: RunConfig, tokenizer, make_rollout):
    """``make_rollout`` for a branching rule that reads a PRM's scores in the loop (ETS): the rule's ``scorer``
    (:class:`~treejax.scorers.ScorerConfig`; ``"policy"``: ``RunConfig.model`` again, frozen) loads once, the rule
    gets its in-loop scorer (:func:`treejax.sampling.path_scores.bind_rule`) and every call's params carry the
    scorer's weights (:func:`~treejax.sampling.path_scores.with_scorer`); other rules are left as they are."""
    loaded = {}

    def make(tc):
        rule = tc.rule
        if not rule.needs_path_scores or rule.path_scorer is not None:
            return make_rollout(tc)
        if "scorer" not in loaded:
            from treejax.scorers.model import load_scorer

            log.info("loading the PRM of branching rule %r: %s", rule.rule_name, rule.scorer.model)
            loaded["scorer"] = load_scorer(rule.scorer, cfg.model)
        bound, weights = path_scores.bind_rule(tc, loaded["scorer"], tokenizer)
        return path_scores.with_scorer(make_rollout(bound), weights)

    return make


def sampler_mesh_of(cfg: RunConfig, mesh, sampler_devices: list, learner_devices: list):
    """The rollout sampler's mesh: the learner's ``mesh`` itself unless ``RunConfig.sampler_mesh`` gives the same
    devices another shape, or ``AsyncConfig`` gives the sampler its own devices (then ``sampler_mesh``'s shape,
    default ``data=1, fsdp=-1`` with the learner's ``tensor``)."""
    if sampler_devices != learner_devices:
        return make_mesh(cfg.sampler_mesh or MeshConfig(data=1, fsdp=-1, tensor=cfg.mesh.tensor), sampler_devices)
    n = len(learner_devices)
    if cfg.sampler_mesh is None or cfg.sampler_mesh.shape(n) == cfg.mesh.shape(n):
        return mesh
    return make_mesh(cfg.sampler_mesh, sampler_devices)


def task_rollouts(ctx: SourceContext, estimator_inputs: tuple[str, ...]) -> TaskRollouts:
    """The task's rollout service of a chain's planner (:meth:`treejax.rl.sources.base.SourceContext.task_rollouts`)."""
    return TaskRollouts(ctx.cfg, ctx.rollout, ctx.sampler_fns, ctx.tokenizer, ctx.task, ctx.pipeline,
                        ctx.prompt_width, ctx.pad_id, estimator_inputs=estimator_inputs)


def sampler_weight_shardings(r: Run):
    """Where the sampler's weights live on its own mesh (``SAMPLER_RULES``: not split over ``fsdp``), for the tree
    :meth:`Learner.sampler_params` gives (LoRA's merged or unmerged view included)."""
    view = jax.eval_shape(r.learner.sampler_params, r.state.params)
    axes = transformer.param_logical_axes(r.model_config)
    if lora.has_adapters(view):
        axes = lora.logical_axes(axes, view)
    return logical_to_sharding(axes, r.sampler_mesh, SAMPLER_RULES, view)


def make_collector(r: Run, key: jax.Array):
    """The run's collector (:mod:`treejax.rl.collect`): synchronous, or the asynchronous sampler thread with its
    weight copies (cast, moved to the sampler's devices, never aliasing the donated state), the rollouts' move to
    the learner's devices and the queue a checkpoint saved."""
    cfg, learner = r.cfg, r.learner
    queued = collect.decode_queue(r.data_state.get("rollout_queue"))
    probes = None
    if shaping_probes(cfg.shapers, r.state.aux):  # copies on the sampler's devices (the update donates the state)
        where = replicated(r.sampler_mesh)
        probes = lambda s: jax.device_put(shaping_probes(cfg.shapers, s.aux), where, may_alias=False)  # noqa: E731
    own_layout = r.sampler_mesh is not r.mesh  # the sampler's own mesh (its devices, or its layout of them)
    if own_layout:  # the weights re-laid out for it after each update; its rollouts moved back
        target = sampler_weight_shardings(r)
        relayout = lambda p: jax.device_put(learner.sampler_params(p), target, may_alias=False)  # noqa: E731
    if not cfg.async_rollouts.enabled:
        if not own_layout:
            return collect.SyncCollector(r.source, learner.sampler_params, key, queued, probes=probes)
        on_learner = replicated(r.mesh)
        return collect.SyncCollector(r.source, relayout, jax.device_put(key, replicated(r.sampler_mesh)), queued,
                                     probes=probes, to_learner=lambda ro: collect.rollouts_to(ro, on_learner),
                                     context=lambda: mesh_context(r.sampler_mesh))
    a, split = cfg.async_rollouts, own_layout
    if split:
        sampler_weights = relayout
        on_learner = replicated(r.mesh)
        to_learner = lambda ro: collect.rollouts_to(ro, on_learner)  # noqa: E731
        key = jax.device_put(key, replicated(r.sampler_mesh))  # the same key, on the sampler's devices
    else:
        sampler_weights = lambda p: jax.device_put(learner.sampler_params(p), may_alias=False)  # noqa: E731
        to_learner = lambda ro: ro  # noqa: E731

    @contextlib.contextmanager
    def thread_context():  # JAX's mesh and matmul-precision contexts are per thread
        with r.precision.matmul_context(), mesh_context(r.sampler_mesh):
            yield

    keep = (lambda p: jax.device_put(p, may_alias=False)) if a.split_staleness else None  # noqa: E731
    return collect.AsyncCollector(r.source, sampler_weights, key, r.start_step, cfg.num_steps, a.max_staleness,
                                  thread_context, to_learner, queued, keep, probes=probes)


def _learner(cfg: RunConfig, prec, model_config, params, pad_id: int, mesh):
    """The sharded train state, the frozen reference (KL) and the :class:`~treejax.rl.step.Learner` whose update is
    jitted with the state's shardings and donates it."""
    optimizer = make_optimizer(cfg.optimizer)
    axes = transformer.param_logical_axes(model_config)
    plain_axes = axes
    if cfg.lora.enabled:  # adapters on a frozen base (bf16 or quantized); only they train and are checkpointed
        axes = lora.logical_axes(axes, params)
        trainable, frozen = lora.param_bytes(params)
        log.info("LoRA rank %d on %s (alpha %g): %.1f M trainable parameters (%.2f GB fp32), frozen %s base %.2f GB",
                 cfg.lora.rank, ",".join(cfg.lora.targets), cfg.lora.alpha, trainable / 4e6, trainable / 1e9,
                 cfg.lora.base_dtype, frozen / 1e9)
    aux = lambda: init_states(cfg.shapers, model_config.hidden_size)  # noqa: E731  the stateful shapers' state
    state, state_sh = place_train_state(params, axes, lambda p: TrainState.create(p, optimizer, aux()), optimizer,
                                        mesh, donate=True)  # the loaded weights become the state's: no copy
    step_cfg = cfg.step_config(pad_id, mesh.shape["data"] * mesh.shape["fsdp"])
    layout = make_layout(model_config, step_cfg.packing, pad_id=pad_id, attention_impl=cfg.attention_impl,
                         row_multiple=step_cfg.row_multiple, chunk_size=step_cfg.logprob_chunk_size)
    update_fn = make_update_fn(layout, cfg.loss, optimizer, num_micro_batches=cfg.micro_batches,
                               nonfinite=cfg.nonfinite, learning_rate_fn=learning_rate_schedule(cfg.optimizer),
                               remat=cfg.remat)
    update = sharded_update(update_fn, state_sh, mesh)  # jitted per mini-batch layout (packed shapes bucket)
    sampler_view = sampler_weights_fn(cfg.lora, prec.sampler_dtype)
    sampler_sh = None  # on a mesh the sampler's copy is gathered over fsdp once per step (SAMPLER_RULES)
    if mesh.size > 1:
        view = jax.eval_shape(sampler_view or (lambda p: p), state.params)
        view_axes = lora.logical_axes(plain_axes, view) if lora.has_adapters(view) else plain_axes
        sampler_sh = logical_to_sharding(view_axes, mesh, SAMPLER_RULES, view)
    learner = make_learner(model_config, step_cfg, prec, update, layout, batch_sharding=batch_placer(mesh),
                           sampler_shardings=sampler_sh, sampler_view=sampler_view,
                           share_sampler_leaves=cfg.lora.enabled)  # unmerged: the base is not copied
    return learner, state, initial_reference(state.params, cfg.loss, cfg.shapers)


def sampler_weights_fn(config: lora.LoRAConfig, dtype):
    """The params -> the weights the sampler decodes with, before its cast: the params themselves, or with LoRA
    (``LoRAConfig.sampler_weights``) the merged ``W + s A B`` (summed in fp32, stored in the sampler's ``dtype``)
    or the unmerged base + adapters (``None``: the params as they are)."""
    if config.enabled and config.sampler_weights == "merged":
        return lambda p: lora.merge(p, dtype)  # noqa: E731
    return None
