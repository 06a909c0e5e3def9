"""The RL loop: set-up -> for each step: collect -> learn -> log -> finish. Read it top to bottom.

One step (TreePO's recipe, DAPO details; every stage is a pure function of explicit inputs):

1. collect (:class:`treejax.rl.rollouts.TaskRollouts`): ``P`` prompts from the grain pipeline through the chat
   template; the sampler reads a copy of the weights in the policy's sampler dtype (bf16 on GPU/TPU), cast once
   per step, and decodes the segment tree (or ``W`` independent samples) as one jitted program -> a ``Forest``;
   each leaf's text is scored by the task's verifier -> reward (±1 or {0, 1}) plus DAPO's overlong penalty;
   dynamic sampling refills degenerate prompts; the estimator's declared inputs (ReMax's greedy rewards);
2. learn (:func:`treejax.rl.step.learn`): advantages, the layout's mini-batches (expanded rows or tree-packed,
   :mod:`treejax.rl.layouts`), old / reference log-probs, ``epochs`` x ``mini_batches`` optax steps;
3. log: the step's host metrics at once, its device metrics one step late (:class:`treejax.metrics.DeferredMetrics`,
   so the device runs the update while the host draws the tree and writes the previous step); ``time/update_s``
   is the time from the learning's dispatch until its new state is ready (read before the next rollout, which
   needs those weights anyway); checkpoints and held-out evaluation on their schedules;
4. finish: final evaluation, checkpoint, HF export, ``summary.json``.

Collect and learn meet in a collector (:mod:`treejax.rl.collect`): synchronous (sample when the step asks, with
the newest weights) or asynchronous (``RunConfig.async_rollouts``: a sampler thread samples ``max_staleness``
policy versions ahead, on its own devices when the mesh is split; the learner publishes each new version).

Held-out evaluation (greedy accuracy, and pass@k / maj@k from k samples when ``EvalConfig.k > 0``) runs before
training, every ``eval_every`` steps and at the end; TensorBoard gets it against the step (``eval/...``) and
against wall-clock seconds since the start (``eval_wallclock/...``).

Precision: :class:`treejax.precision.Precision` (``RunConfig.precision``) — fp32 master weights and optimizer
state; bf16 compute, sampler weights and KV cache on GPU/TPU; fp32 with full-precision matmuls on CPU.

Several processes (``jax.distributed``, :mod:`treejax.parallel.multihost`): every process runs this loop over one
global mesh and draws the same global batch of prompts, so host values derived from them are identical everywhere
and enter the jitted sampler and update as replicated inputs. Host code reads the forest only through explicit
all-gathers (``multihost.host_tree``). Process 0 alone holds the log folder's lock and writes the event files,
pictures, ``summary.json`` and the export; all processes save and restore the orbax checkpoints together.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import signal
import threading
import time
from typing import Any

import jax
import optax

from treejax import checkpoint as ckpt_lib
from treejax import metrics as metrics_lib
from treejax.compile_cache import compile_clock, enable_compilation_cache
from treejax.errors import DivergenceError, record_failure
from treejax.log import show_progress
from treejax.memory_plan import log_run_plan
from treejax.models import lora
from treejax.models.export import export_hf
from treejax.parallel import multihost
from treejax.parallel.mesh import mesh_context
from treejax.rl.config import RunConfig
from treejax.rl.evaluation import evaluate
from treejax.rl.shaping import probes as shaping_probes
from treejax.rl.health import divergence, nonfinite_update_error, out_of_memory_error
from treejax.rl.report import step_line, write_tree_picture
from treejax.rl.setup import Run, build_run, make_collector
from treejax.rl.sources.base import chain_evaluate
from treejax.rl.step import learn, stop_ladder
from treejax.run_dir import claim_log_dir

log = logging.getLogger(__name__)


def run(cfg: RunConfig, operative_config: str | None = None) -> dict[str, Any]:
    """Runs training as configured and returns the summary (also written to ``log_dir/summary.json``).

    In a multi-process run every process calls this with the same config; process 0 holds the log folder's lock
    and writes the files, every process returns the summary."""
    if multihost.is_primary():
        show_progress()
    cache_dir = enable_compilation_cache(cfg.compilation_cache)
    if cache_dir:
        log.info("compilation cache: %s (RunConfig.compilation_cache = 'off' or TREEJAX_COMPILATION_CACHE=off "
                 "turns it off)", cache_dir)
    with claim_log_dir(cfg.log_dir, cfg.log_dir_mode):
        r = build_run(cfg, operative_config, before_load=plan_before_load)
        try:
            with r.precision.matmul_context(), mesh_context(r.mesh):
                preempted_at = train(r)
                return finish_preempted(r, preempted_at) if preempted_at is not None else finish(r)
        except BaseException as e:  # record where the run stopped, then let the error surface unchanged
            try:
                record_failure(cfg.log_dir, int(r.data_state.get("rl_step", r.start_step)), e,
                               process=multihost.process_index() if multihost.process_count() > 1 else None)
            except OSError:  # the disk that made the run fail (full, read-only) cannot take the record either
                pass
            raise


def plan_before_load(cfg: RunConfig, prompt_width: int, tokenizer, task, train_records):
    """The run's first memory line, before the weights load (:func:`treejax.memory_plan.log_run_plan`: the
    analytic plan on this run's devices, a WARNING naming the fix when it predicts the run will not fit); process
    0 only. Returns the plan (``None`` elsewhere or when none could be made): the summary sets its peak beside
    the measured one."""
    if multihost.is_primary():
        return log_run_plan(cfg, prompt_width, log, tokenizer, task, train_records)
    return None


def device_memory_summary(plan) -> dict:
    """``{"memory": {"measured_peak_bytes", "planned_peak_bytes"}}``: the largest ``peak_bytes_in_use`` over this
    process's devices (accelerators report it; the CPU does not) and the memory plan's per-device peak; ``{}``
    when neither is known."""
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.local_devices()]
    peaks = [p for p in peaks if p is not None]
    out = {"measured_peak_bytes": max(peaks) if peaks else None,
           "planned_peak_bytes": plan.peak if plan is not None else None}
    return {"memory": out} if any(v is not None for v in out.values()) else {}


def train(r: Run) -> int | None:
    """The step loop; returns the step at which a preemption signal stopped it (``None`` if it ran through)."""
    cfg, key = r.cfg, jax.random.key(r.cfg.seed)
    evals = r.data_state.setdefault("evals", [])
    if not evals:
        log.info("evaluating %d held-out problems before training (the first call compiles the decoder)",
                 len(r.eval_examples))
        evals.append(evaluate_now(r, 0))
    preemption = ckpt_lib.PreemptionHandler()
    if threading.current_thread() is threading.main_thread():
        preemption.install()
    logger = StepLogger(r)
    clock = compile_clock()  # running totals of compile seconds / programs, logged with every step
    collector = make_collector(r, key)
    collector.publish(r.start_step, r.state)  # the weights the first rollouts are sampled with
    t_loop = time.perf_counter()
    try:
        for step in range(r.start_step, cfg.num_steps):
            if step == r.start_step:
                log.info("step %d: rollout, scoring and update (the first step compiles the tree sampler and the "
                         "update; later steps are faster)", step + 1)
            t_step = time.perf_counter()
            logger.wait_for_update(r.state)  # the previous step's update (synchronous: the sampler needs it)
            item = collector.collect(step, r.state)
            t_learn = time.perf_counter()
            r.state, device_metrics, layout_info = learn(r.learner, r.state, item.rollouts,
                                                         jax.random.fold_in(key, step), r.ref_params,
                                                         behaviour_params=item.behaviour_params)
            done = step + 1
            collector.publish(done, r.state)
            host = dict(item.host_metrics(), **layout_info, **{"time/learn_dispatch_s": time.perf_counter() - t_learn},
                        **clock.totals())
            log.info("%s", step_line(done, cfg.num_steps, host, time.perf_counter() - t_step))
            logger.push(done, dict(host, **{"time/step_s": time.perf_counter() - r.t_start}), device_metrics,
                        t_learn)
            r.data_state["rl_step"] = done
            if cfg.tree_picture_every and done % cfg.tree_picture_every == 0:
                r.data_state["tree_picture"] = write_tree_picture(cfg, r.tokenizer, r.writer, item.rollouts, done)
            if cfg.eval_every and done % cfg.eval_every == 0 and done < cfg.num_steps:
                logger.flush(r.state)
                evals.append(evaluate_now(r, done))
            if cfg.checkpoint_every and done % cfg.checkpoint_every == 0:
                logger.flush(r.state)
                save(r, collector, done)
            if preemption.should_stop(done, r.checkpointer):
                logger.flush(r.state)
                if r.checkpointer.latest_step() != done:
                    save(r, collector, done, force=True)
                r.stopped_by = signal.Signals(preemption.signal_received).name if preemption.signal_received else \
                    "a preemption notice"
                log.warning("%s: saved step %d and stopping; rerun the same command to resume", r.stopped_by, done)
                return done
        logger.flush(r.state)
        record_collector(r, collector)  # what finish() saves
        r.loop_s = time.perf_counter() - t_loop
    except RuntimeError as e:
        error = nonfinite_update_error(e) or memory_error(r, e)
        if error is None:
            raise
        raise error from e
    finally:
        collector.close()
        stop_ladder(r.learner)  # the packed layout's ahead-of-time compiles, if any are still running
        preemption.uninstall()
    return None


def memory_error(r: Run, e: BaseException):
    """:func:`~treejax.rl.health.out_of_memory_error` with this run's update settings (``None``: not an
    out-of-memory error)."""
    layout = r.learner.layout
    floor = getattr(layout, "floor", None)
    return out_of_memory_error(e, remat=r.cfg.remat, micro_batches=r.cfg.micro_batches,
                               packed=r.cfg.packed_update,
                               row_length=floor.shape[1] if floor is not None and floor.shape else None)


def save(r: Run, collector, step: int, force: bool = False) -> None:
    """A checkpoint of the state and the data state, with the collector's pipeline state and queued rollouts."""
    record_collector(r, collector)
    r.checkpointer.save(step, lora.checkpoint_state(r.state), r.data_state, force=force)


def record_collector(r: Run, collector) -> None:
    """The collector's prompt-pipeline state and queued rollouts into the data state a checkpoint saves."""
    r.data_state.pop("rollout_queue", None)
    r.data_state.update(collector.checkpoint_state())


class StepLogger:
    """Writes each step's metrics once its device values are read (one step late), with the update's time, and
    applies the divergence rules (:func:`treejax.rl.health.divergence`) to each written row."""

    def __init__(self, r: Run):
        self.r, self.deferred, self.pending = r, metrics_lib.DeferredMetrics(), {}
        self.history = r.data_state.setdefault("history", [])
        self.diverged = r.data_state.setdefault("divergence", [])
        # the norm of the parameters the first step starts from (initial or restored): a jump in step 1 is seen too
        self.prev_norm = (self.history[-1].get("update/param_norm") if self.history
                          else float(optax.tree.norm(lora.split(r.state.params)[0])))  # trainable, as the update's
        self.dispatched: tuple[int, float] | None = None  # (step, when its learning was dispatched)

    def push(self, step: int, host: dict, device_metrics: dict, learn_start: float) -> None:
        """Step ``step``'s host values now, its device metrics one step late; ``learn_start``: when its learning
        was dispatched (``perf_counter``), the start of its ``time/update_s``."""
        self.pending[step] = host
        self.dispatched = (step, learn_start)
        self._write(self.deferred.push(step, device_metrics))

    def wait_for_update(self, state) -> None:
        """Blocks until the last dispatched update is done and records its ``time/update_s``."""
        if self.dispatched is not None:
            step, t = self.dispatched
            jax.block_until_ready(state.step)
            self.pending[step]["time/update_s"] = time.perf_counter() - t
            self.dispatched = None

    def flush(self, state) -> None:
        self.wait_for_update(state)
        self._write(self.deferred.flush())

    def _write(self, ready) -> None:
        r = self.r
        for s, values in ready:
            row = dict(self.pending.pop(s), **values)
            r.writer.write_scalars(s, row)
            self.history.append(dict(row, step=s))
            why = divergence(row, self.prev_norm, r.sampler_fns.sampling_vocab_size,
                             initial_entropy=self.history[0].get("update/entropy"))
            self.prev_norm = row.get("update/param_norm", self.prev_norm)
            if why and r.cfg.nonfinite == "raise":
                raise DivergenceError(f"step {s}: {why}; stopped before export (nonfinite='raise'); "
                                      "lower OptimizerConfig.learning_rate")
            if why:
                self.diverged.append({"step": s, "why": why})
                log.warning("step %d: %s: training looks diverged (RunConfig.nonfinite='raise' stops the run "
                            "here)", s, why)


def evaluate_now(r: Run, step: int) -> dict:
    """Held-out evaluation with the sampler's weights; logged against the step and the wall clock."""
    t = time.perf_counter()
    vote = r.cfg.eval.vote_probe
    probe = shaping_probes(r.cfg.shapers, r.state.aux)[vote] if vote is not None else None
    out = evaluate(r.learner.sampler_params(r.state.params), r.sampler_fns, r.tokenizer, r.task, r.eval_examples,
                   r.prompt_width, r.cfg.eval, system_prompt=r.cfg.system_prompt, instruction=r.cfg.instruction,
                   probe=probe)
    out.update(chain_evaluate(r.source, r.learner.sampler_params(r.state.params), r.eval_examples[
        :r.cfg.eval.num_problems], dict(prompt_width=r.prompt_width, system_prompt=r.cfg.system_prompt,
                                        instruction=r.cfg.instruction, batch_size=r.cfg.eval.batch_size)))
    out = dict(out, step=step, wall_s=time.perf_counter() - r.t_start, eval_s=time.perf_counter() - t)
    scalars = {f"eval/{k}": v for k, v in out.items() if k not in ("n", "k", "step", "wall_s")}
    r.writer.write_scalars(step, scalars)
    r.writer.write_scalars(int(out["wall_s"]), {f"eval_wallclock/{k.split('/', 1)[1]}": v
                                                for k, v in scalars.items()}, console=False)
    return out


def loop_throughput(cfg: RunConfig, history: list[dict], start_step: int, loop_s: float) -> dict:
    """``loop_s`` (the step loop's wall-clock seconds in this process, periodic evaluations and checkpoints
    included), ``steps_per_s``, and with asynchronous rollouts ``"async"``: the config, the mean staleness and
    the busy fraction of each side (the sampler thread's rollout + scoring seconds and the learner's update
    seconds over ``loop_s``; with a device split, each group's share of the wall clock)."""
    rows = [h for h in history if h["step"] > start_step]
    out = {"loop_s": loop_s, "steps_per_s": len(rows) / loop_s if loop_s > 0 else 0.0}
    if cfg.async_rollouts.enabled and rows:
        total = lambda k: sum(h.get(k, 0.0) for h in rows)  # noqa: E731
        out["async"] = {**dataclasses.asdict(cfg.async_rollouts),
                        "mean_staleness": total("async/staleness") / len(rows),
                        "sampler_busy": (total("time/rollout_s") + total("time/scoring_s")) / loop_s,
                        "learner_busy": total("time/update_s") / loop_s,
                        "learner_wait_s": total("time/wait_rollout_s"), "sampler_wait_s": total("time/sampler_wait_s")}
    return out


def compile_summary(history: list[dict]) -> dict:
    """The process's program-making totals (:func:`treejax.compile_cache.compile_clock`): ``compile_s`` and
    ``compile_programs``; from the step history, ``compile_after_first_step_s`` (what later steps spent on
    programs: recompiles of new shapes, e.g. a packed layout that grows) and ``packing_layouts`` (the packed
    update's distinct layouts)."""
    out = compile_clock().totals()
    out = {"compile_s": out["time/compile_s"], "compile_programs": out["time/compile_programs"]}
    timed = [h for h in history if "time/compile_s" in h]
    if timed:
        out["compile_after_first_step_s"] = timed[-1]["time/compile_s"] - timed[0]["time/compile_s"]
    if history and "packing/layouts" in history[-1]:
        out["packing_layouts"] = history[-1]["packing/layouts"]
    return out


def finish_preempted(r: Run, preempted_at: int) -> dict:
    r.checkpointer.wait()
    r.checkpointer.close()
    r.writer.close()
    return {"preempted_at": preempted_at, "stopped_by": r.stopped_by, "log_dir": os.path.abspath(r.cfg.log_dir),
            "checkpoint_dir": os.path.abspath(r.checkpointer.directory), "history": r.data_state["history"]}


def finish(r: Run) -> dict:
    """Final evaluation and checkpoint, the HF export, ``summary.json``; returns the summary."""
    cfg, evals = r.cfg, r.data_state["evals"]
    if evals[-1]["step"] != cfg.num_steps:
        evals.append(evaluate_now(r, cfg.num_steps))
    if cfg.save_final and r.checkpointer.latest_step() != cfg.num_steps:
        r.checkpointer.save(cfg.num_steps, lora.checkpoint_state(r.state), r.data_state, force=True)
    r.checkpointer.wait()
    diverged = r.data_state.get("divergence", [])
    if diverged:
        log.warning("training looked diverged at step(s) %s (%s); the checkpoint%s that model",
                    ", ".join(str(d["step"]) for d in diverged), diverged[0]["why"],
                    " and the HF export hold" if cfg.export_hf else " holds")
    export_dir = None
    if cfg.export_hf:
        export_dir = os.path.join(cfg.log_dir, "hf_export")
        params = r.state.params
        if lora.has_adapters(params):  # LoRA: the merged W + s A B (the base dequantized); no copy otherwise
            params = jax.jit(lora.merge)(params)
        params = multihost.host_tree(params)  # all-gathered: every process takes part
        if multihost.is_primary():
            export_hf(params, r.model_config, export_dir, r.tokenizer)
        del params
    r.writer.close()
    saved_dir = os.path.abspath(r.checkpointer.directory) if r.checkpointer.latest_step() is not None else None
    r.checkpointer.close()
    history = r.data_state["history"]
    summary = {
        "model": cfg.model, "task": cfg.task, "estimator": cfg.estimator, "steps": cfg.num_steps,
        "device": jax.devices()[0].device_kind, "num_devices": jax.device_count(),
        "num_processes": jax.process_count(), "precision": dataclasses.asdict(r.precision),
        "eval_before": evals[0], "eval_after": evals[-1], "evals": evals, "history": history,
        "decoded_tokens": int(sum(h.get("rollout/decoded_tokens", 0) for h in history)),
        "total_s": time.perf_counter() - r.t_start,
        "log_dir": os.path.abspath(cfg.log_dir), "checkpoint_dir": saved_dir,
        "hf_export": export_dir and os.path.abspath(export_dir), "tree_picture": r.data_state.get("tree_picture"),
        "divergence": diverged,
    }
    summary.update(compile_summary(history))
    summary.update(device_memory_summary(r.memory_plan))
    if r.loop_s is not None:
        summary.update(loop_throughput(cfg, history, r.start_step, r.loop_s))
    if multihost.is_primary():
        with open(os.path.join(cfg.log_dir, "summary.json"), "w") as f:
            json.dump(summary, f, indent=2, default=float)
    multihost.sync("treejax_run_finished")  # no process leaves before the summary marks the run finished
    return summary


__all__ = ["RunConfig", "run", "train", "finish"]
