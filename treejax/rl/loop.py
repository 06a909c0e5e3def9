"""The RL loop: prompts -> tree rollout -> rewards -> (dynamic sampling) -> advantages -> PPO updates.

One iteration (TreePO's recipe, DAPO details; every stage is a pure function of explicit inputs):

1. ``P`` prompts from the grain pipeline, rendered with the tokenizer's chat template and tokenized;
2. ``rollout(params, prompts, lengths, fold_in(key, step))`` decodes the segment tree (or ``W`` independent
   samples) as one jitted program and returns the :class:`~treejax.forest.Forest`;
3. each leaf's text is scored by the task's verifier -> reward (±1 or {0, 1}), plus DAPO's overlong penalty;
4. dynamic sampling (optional): prompts whose ``W`` rewards are all equal are dropped and up to
   ``max_refills`` extra rollout batches refill the ``P`` slots (unfilled slots train on nothing);
5. the registered advantage estimator maps (forest, rewards) to per-token advantages;
6. ``epochs`` passes over ``mini_batches`` shuffled mini-batches, each one optax step (gradient accumulation over
   ``micro_batches``), with ``old_logp`` = the sampler's log-probs under the policy at temperature 1.

The loop is host-side Python around jitted pieces; nothing recompiles between steps (fixed ``P``, ``W``, ``T``
and bucketed prompt lengths).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import threading
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from treejax.forest import Forest
from treejax.parallel.mesh import (MeshConfig, batch_sharding, jit_update, logical_to_sharding, make_mesh,
                                   train_state_shardings)
from treejax.rl import rewards as rewards_lib
from treejax.rl.advantages import estimator_spec
from treejax.rl.batch import forest_to_batch
from treejax.rl.losses import LossConfig
from treejax.rl.optimizer import OptimizerConfig, learning_rate_schedule, make_optimizer
from treejax.rl.train_state import TrainState
from treejax.rl.update import make_update_fn
from treejax.sampling.tree import TreeConfig

log = logging.getLogger(__name__)


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """Everything one training run needs (the gin-facing surface; see ``configs/*.gin``)."""

    model: str = "smollm2-135m-instruct"
    param_dtype: str = "float32"
    task: str = "chain_sum_2x1"
    task_options: dict = dataclasses.field(default_factory=dict)
    system_prompt: str | None = None  # None: the task's own
    instruction: str | None = None  # None: the task's own
    prompts_per_step: int = 4
    num_steps: int = 3
    rollout: TreeConfig = TreeConfig(num_leaves=8, max_depth=4, segment_length=32, branch_factor=2)
    estimator: str = "treepo"
    estimator_options: Any = None  # None: the estimator's defaults
    reward_style: str = "pm1"
    overlong_buffer: int = 0  # DAPO soft overlong penalty buffer (0 = off)
    overlong_factor: float = 1.0
    dynamic_sampling: bool = False
    max_refills: int = 0
    loss: LossConfig = LossConfig(eps_low=0.2, eps_high=0.28, dual_clip_c=10.0, aggregation="token-mean")
    optimizer: OptimizerConfig = OptimizerConfig(learning_rate=1e-6, warmup_steps=0, total_steps=1000)
    epochs: int = 1
    mini_batches: int = 1
    micro_batches: int = 1
    nonfinite: str = "skip"
    attention_impl: str = "auto"  # training attention: cudnn flash on GPU (bf16), XLA elsewhere
    remat: bool | str = False  # per-layer rematerialisation in the update's forward: False/True or 'none'/'full'/'dots'
    eval_size: int = 32
    eval_max_new_tokens: int = 128
    compare_independent: bool = True
    log_dir: str = "runs/quickstart"
    checkpoint_every: int = 0  # 0: only at the end
    keep_checkpoints: int = 2
    tree_picture_every: int = 1
    export_hf: bool = True
    seed: int = 0
    mesh: MeshConfig = MeshConfig()

    def __post_init__(self):
        if self.prompts_per_step < 1 or self.num_steps < 0:
            raise ValueError("RunConfig: prompts_per_step >= 1 and num_steps >= 0 required")
        rows = self.prompts_per_step * self.rollout.num_leaves
        if rows % self.mini_batches or (rows // self.mini_batches) % self.micro_batches:
            raise ValueError(f"RunConfig: {rows} rollout rows (prompts_per_step x num_leaves) must split into "
                             f"mini_batches={self.mini_batches} x micro_batches={self.micro_batches}")
        if self.reward_style not in ("pm1", "01"):
            raise ValueError(f"RunConfig.reward_style must be 'pm1' or '01', got {self.reward_style!r}")


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
def leaf_texts(tokenizer, forest: Forest) -> list[list[str]]:
    tokens = np.asarray(forest.tokens)
    lengths = np.asarray(forest.leaf_length)
    return [[tokenizer.decode(tokens[p, w, : lengths[p, w]].tolist(), skip_special_tokens=True)
             for w in range(tokens.shape[1])] for p in range(tokens.shape[0])]


def score_forest(tokenizer, task, examples, forest: Forest) -> np.ndarray:
    """[P, W] verifier scores in [0, 1] of every leaf's decoded text."""
    texts = leaf_texts(tokenizer, forest)
    return np.array([[task.score(t, ex) for t in row] for row, ex in zip(texts, examples)], np.float32)


def shaped_rewards(scores_PxW: np.ndarray, forest: Forest, cfg: RunConfig) -> jax.Array:
    """Verifier reward (``cfg.reward_style``) plus DAPO's overlong penalty when ``cfg.overlong_buffer > 0``."""
    r = rewards_lib.verifier_reward(scores_PxW >= 1.0, cfg.reward_style)
    if cfg.overlong_buffer > 0:
        r = r + rewards_lib.overlong_penalty(forest.leaf_length, cfg.rollout.max_length, cfg.overlong_buffer,
                                             cfg.overlong_factor)
    return r


def _concat_forests(forests: list[Forest]) -> Forest:
    return jax.tree.map(lambda *xs: jnp.concatenate(xs, axis=0), *forests)


def _take_prompts(forest: Forest, idx: np.ndarray) -> Forest:
    return jax.tree.map(lambda x: x[jnp.asarray(idx)], forest)


# ----------------------------------------------------------------------------------------------- evaluation
def evaluate(params, model_config, tokenizer, task, examples, prompt_width: int, max_new_tokens: int,
             batch_size: int = 32, system_prompt=None, instruction=None) -> dict[str, float]:
    """Greedy accuracy on held-out examples (fixed batch size: the last batch is padded, one compile)."""
    from treejax.sampling.decode import generate
    from treejax.sampling.strategies import Greedy

    correct, lengths = [], []
    for start in range(0, len(examples), batch_size):
        chunk = examples[start: start + batch_size]
        toks = encode_examples(tokenizer, chunk, system_prompt, instruction)
        toks = toks + [toks[0]] * (batch_size - len(toks))
        prompts, lens = pad_token_lists(toks, prompt_width, tokenizer.pad_id or 0)
        out = generate(params, model_config, prompts, lens, jax.random.key(0), max_new_tokens, Greedy(),
                       stop_ids=tokenizer.eos_ids)
        out_tokens, out_lens = np.asarray(out.tokens), np.asarray(out.lengths)
        for i, ex in enumerate(chunk):
            text = tokenizer.decode(out_tokens[i, : out_lens[i]].tolist(), skip_special_tokens=True)
            correct.append(task.score(text, ex) >= 1.0)
            lengths.append(out_lens[i])
    return {"accuracy": float(np.mean(correct)), "mean_length": float(np.mean(lengths)), "n": len(correct)}


# ----------------------------------------------------------------------------------------------- the run
def run(cfg: RunConfig, operative_config: str | None = None) -> dict[str, Any]:
    """Runs training as configured and returns the summary (also written to ``log_dir/summary.json``)."""
    from treejax import checkpoint as ckpt_lib
    from treejax import metrics as metrics_lib
    from treejax import viz
    from treejax.data import get_task, make_prompt_pipeline
    from treejax.models import transformer
    from treejax.models.export import export_hf
    from treejax.models.registry import load_model
    from treejax.sampling.tree import make_tree_rollout

    t_start = time.perf_counter()
    os.makedirs(cfg.log_dir, exist_ok=True)
    if operative_config is not None:
        with open(os.path.join(cfg.log_dir, "operative_config.gin"), "w") as f:
            f.write(operative_config)

    model_config, params, tokenizer = load_model(cfg.model, param_dtype=cfg.param_dtype)
    task = get_task(cfg.task, **dict(cfg.task_options))
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    stop_ids = tuple(tokenizer.eos_ids)
    tree_cfg = dataclasses.replace(cfg.rollout, stop_ids=cfg.rollout.stop_ids or stop_ids)
    rollout = make_tree_rollout(model_config, tree_cfg)
    independent = None
    if cfg.compare_independent:
        from treejax.sampling.tree import independent_config
        independent = make_tree_rollout(model_config, independent_config(
            tree_cfg.num_leaves, tree_cfg.max_length, tree_cfg.segment_length, strategy=tree_cfg.strategy,
            stop_ids=tree_cfg.stop_ids))

    spec = estimator_spec(cfg.estimator)
    est_options = cfg.estimator_options if cfg.estimator_options is not None else spec.default_options()
    estimator = jax.jit(lambda f, r: spec.fn(f, r, est_options))

    # Sharding: params placed by their logical axes; the state is created under jit with explicit out
    # shardings; the update is jitted with explicit in/out shardings and donates the state. The sampler reads
    # the same (sharded) params: no host copies between rollout and update.
    mesh = make_mesh(cfg.mesh)
    param_sh = logical_to_sharding(transformer.param_logical_axes(model_config), mesh, shapes=params)
    params = jax.device_put(params, param_sh)
    optimizer = make_optimizer(cfg.optimizer)
    key = jax.random.key(cfg.seed)
    create = lambda p: TrainState.create(p, optimizer, jax.random.fold_in(key, 1))  # noqa: E731
    state_sh = train_state_shardings(jax.eval_shape(create, params), param_sh, optimizer, mesh)
    state = jax.jit(create, out_shardings=state_sh)(params)
    del params
    update_fn = make_update_fn(model_config, cfg.loss, optimizer, num_micro_batches=cfg.micro_batches,
                               nonfinite=cfg.nonfinite, learning_rate_fn=learning_rate_schedule(cfg.optimizer),
                               attention_impl=cfg.attention_impl, remat=cfg.remat)
    update = None  # jitted with the batch shardings once the first batch's shapes are known

    # Data: the train split streams through grain; the eval split is held out by content hash.
    train_records = task.records("train")
    pipeline = make_prompt_pipeline(train_records, batch_size=cfg.prompts_per_step, seed=cfg.seed)
    eval_examples = list(task.examples("eval"))[: cfg.eval_size]
    prompt_width = _prompt_width(tokenizer, task, train_records, eval_examples, cfg)

    writer = metrics_lib.MetricsWriter(cfg.log_dir, print_fn=log.info, total_steps=cfg.num_steps)
    checkpointer = ckpt_lib.Checkpointer(os.path.join(os.path.abspath(cfg.log_dir), "checkpoints"),
                                         max_to_keep=cfg.keep_checkpoints)
    start_step = 0
    if checkpointer.latest_step() is not None:
        state, data_state = checkpointer.restore(state)
        pipeline.set_state(data_state["pipeline"])
        start_step = int(data_state["rl_step"])
        log.info("resumed from step %d", start_step)

    timings: dict[str, float] = {}
    eval_before = _timed(timings, "eval_before", lambda: evaluate(
        state.params, model_config, tokenizer, task, eval_examples, prompt_width, cfg.eval_max_new_tokens,
        system_prompt=cfg.system_prompt, instruction=cfg.instruction))
    writer.write_scalars(0, {"eval/accuracy": eval_before["accuracy"]})

    # SIGTERM (preemptible VMs): finish the current step, save, skip the rest, exit cleanly; rerunning the same
    # command resumes from that checkpoint and reproduces the uninterrupted run.
    preemption = ckpt_lib.PreemptionHandler()
    if threading.current_thread() is threading.main_thread():
        preemption.install()
    preempted_at = None
    totals = {"tree_decoded": 0, "independent_decoded": 0, "tree_time": 0.0, "independent_time": 0.0}
    picture = None
    history = []
    for step in range(start_step, cfg.num_steps):
        step_key = jax.random.fold_in(key, step)
        t0 = time.perf_counter()
        forest, info, rewards, examples, prompts, lens, n_rollouts = _collect(
            cfg, rollout, state.params, tokenizer, task, pipeline, prompt_width, pad_id, step_key, step)
        jax.block_until_ready(forest.tokens)
        t_rollout = time.perf_counter() - t0
        if independent is not None:
            t1 = time.perf_counter()
            f_ind, info_ind = independent(state.params, prompts, lens, jax.random.fold_in(step_key, 7))
            jax.block_until_ready(f_ind.tokens)
            totals["independent_time"] += time.perf_counter() - t1
            totals["independent_decoded"] += int(info_ind["decoded_tokens"])
        totals["tree_time"] += t_rollout
        # per rollout call (dynamic-sampling refills make several), to compare with one independent call
        totals["tree_decoded"] += int(info["decoded_tokens"]) // n_rollouts

        t2 = time.perf_counter()
        adv = estimator(forest, rewards)
        batch = forest_to_batch(jnp.asarray(prompts), jnp.asarray(lens), forest, adv.tokens, adv.loss_mask, pad_id)
        rows = batch["tokens"].shape[0]
        per_mini = rows // cfg.mini_batches
        update_metrics = []
        for epoch in range(cfg.epochs):
            perm = np.asarray(jax.random.permutation(jax.random.fold_in(step_key, 100 + epoch), rows))
            for m in range(cfg.mini_batches):
                idx = jnp.asarray(perm[m * per_mini: (m + 1) * per_mini])
                mini = {k: v[idx] for k, v in batch.items()}
                if update is None:
                    mini_sh = batch_sharding(mesh, mini)
                    update = jit_update(update_fn, state_sh, mini_sh, mesh)
                state, metrics = update(state, jax.device_put(mini, mini_sh))
                update_metrics.append(metrics)
        update_metrics = jax.device_get(update_metrics)
        t_update = time.perf_counter() - t2

        r = np.asarray(rewards)
        scores_correct = r > (0.0 if cfg.reward_style == "pm1" else 0.5)
        row = {
            "reward/mean": float(r.mean()), "reward/accuracy": float(scores_correct.mean()),
            "rollout/decoded_tokens": int(info["decoded_tokens"]), "rollout/forks": int(info.get("forks", 0)),
            "rollout/fallbacks": int(info.get("fallbacks", 0)),
            **{f"rollout/{k}": v for k, v in info.items() if k.startswith("stops/")},
            "rollout/mean_leaf_length":
                float(np.asarray(forest.leaf_length).mean()), "time/rollout_s": t_rollout, "time/update_s": t_update,
            "rollout/tokens_per_s": int(info["decoded_tokens"]) / max(t_rollout, 1e-9),
        }
        for k in ("loss", "grad_norm", "clip_frac_low", "clip_frac_high", "approx_kl", "entropy", "skipped"):
            vals = [float(np.asarray(mm[k])) for mm in update_metrics if k in mm]
            if vals:
                row[f"update/{k}"] = float(np.mean(vals))
        writer.write_scalars(step + 1, row)
        history.append(row)
        if cfg.tree_picture_every and (step + 1) % cfg.tree_picture_every == 0:
            picture = os.path.join(cfg.log_dir, f"tree_step{step + 1}.png")
            viz.draw_tree(forest, np.asarray(rewards), picture, prompt=0,
                          title=f"step {step + 1}: prompt 0, {cfg.rollout.num_leaves} leaves")
            writer.write_image(step + 1, "rollout/tree", picture)
        if cfg.checkpoint_every and (step + 1) % cfg.checkpoint_every == 0:
            checkpointer.save(step + 1, state, {"pipeline": pipeline.get_state(), "rl_step": step + 1})
        if preemption.should_stop(step + 1, checkpointer):
            preempted_at = step + 1
            if checkpointer.latest_step() != step + 1:
                checkpointer.save(step + 1, state, {"pipeline": pipeline.get_state(), "rl_step": step + 1},
                                  force=True)
            log.warning("preemption signal: saved step %d and stopping; rerun the same command to resume",
                        step + 1)
            break
    preemption.uninstall()
    if preempted_at is not None:
        checkpointer.wait()
        checkpointer.close()
        writer.close()
        return {"preempted_at": preempted_at, "log_dir": os.path.abspath(cfg.log_dir),
                "checkpoint_dir": os.path.abspath(checkpointer.directory), "history": history}

    if checkpointer.latest_step() != cfg.num_steps:
        checkpointer.save(cfg.num_steps, state, {"pipeline": pipeline.get_state(), "rl_step": cfg.num_steps},
                          force=True)
    checkpointer.wait()
    eval_after = _timed(timings, "eval_after", lambda: evaluate(
        state.params, model_config, tokenizer, task, eval_examples, prompt_width, cfg.eval_max_new_tokens,
        system_prompt=cfg.system_prompt, instruction=cfg.instruction))
    writer.write_scalars(cfg.num_steps, {"eval/accuracy": eval_after["accuracy"]})
    export_dir = None
    if cfg.export_hf:
        export_dir = os.path.join(cfg.log_dir, "hf_export")
        export_hf(jax.device_get(state.params), model_config, export_dir, tokenizer)
    writer.close()
    checkpointer.close()

    summary = {
        "model": cfg.model, "task": cfg.task, "estimator": cfg.estimator, "steps": cfg.num_steps,
        "eval_before": eval_before, "eval_after": eval_after, "history": history,
        "tree_decoded_tokens": totals["tree_decoded"], "independent_decoded_tokens": totals["independent_decoded"],
        "tree_rollout_s": totals["tree_time"], "independent_rollout_s": totals["independent_time"],
        "timings": timings, "total_s": time.perf_counter() - t_start,
        "log_dir": os.path.abspath(cfg.log_dir), "checkpoint_dir": os.path.abspath(checkpointer.directory),
        "hf_export": export_dir and os.path.abspath(export_dir), "tree_picture": picture and os.path.abspath(picture),
    }
    with open(os.path.join(cfg.log_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2, default=float)
    return summary


def _timed(timings, name, fn):
    t = time.perf_counter()
    out = fn()
    timings[name] = time.perf_counter() - t
    return out


def _prompt_width(tokenizer, task, train_records, eval_examples, cfg) -> int:
    """One static prompt width for the run (a power of two covering the longest prompt seen in a scan)."""
    from treejax.sampling.decode import bucket_length

    sample = list(train_records[: min(len(train_records), 256)])
    _, toks = encode_prompts(tokenizer, task, sample, cfg.system_prompt, cfg.instruction)
    etoks = encode_examples(tokenizer, eval_examples, cfg.system_prompt, cfg.instruction)
    longest = max(len(t) for t in toks + etoks)
    return bucket_length(longest + 8)


def _collect(cfg, rollout, params, tokenizer, task, pipeline, prompt_width, pad_id, key, step):
    """Rollout(s) for one step, with DAPO dynamic sampling when enabled; returns exactly ``P`` prompts."""
    P = cfg.prompts_per_step
    kept_forests, kept_rewards, kept_examples, kept_prompts, kept_lens = [], [], [], [], []
    info_total: dict[str, int] = {}
    n = 0
    for attempt in range(1 + (cfg.max_refills if cfg.dynamic_sampling else 0)):
        records = next(pipeline)
        records = [dict(zip(records, vals)) for vals in zip(*records.values())]
        examples, toks = encode_prompts(tokenizer, task, records, cfg.system_prompt, cfg.instruction)
        prompts, lens = pad_token_lists(toks, prompt_width, pad_id)
        forest, info = rollout(params, prompts, lens, jax.random.fold_in(key, attempt), step)
        n += 1
        counters = dict(info, **{f"stops/{k}": v for k, v in info.get("stops", {}).items()})
        for k, v in counters.items():
            if not isinstance(v, dict) and np.ndim(v) == 0:
                info_total[k] = info_total.get(k, 0) + int(v)
        rewards = shaped_rewards(score_forest(tokenizer, task, examples, forest), forest, cfg)
        keep = np.asarray(rewards_lib.dynamic_sampling_keep(rewards)) if cfg.dynamic_sampling else np.ones(P, bool)
        idx = np.nonzero(keep)[0]
        kept_forests.append(_take_prompts(forest, idx))
        kept_rewards.append(np.asarray(rewards)[idx])
        kept_examples += [examples[i] for i in idx]
        kept_prompts.append(prompts[idx])
        kept_lens.append(lens[idx])
        if sum(len(x) for x in kept_lens) >= P:
            break
    have = sum(len(x) for x in kept_lens)
    if have < P:
        # Not enough informative prompts after the refills: fill the remaining slots with the last rollout's
        # first prompts, masked out of the loss (they carry no gradient and no whitening weight).
        idx = np.arange(P - have)
        filler = _take_prompts(forest, idx)
        kept_forests.append(filler.replace(loss_mask=jnp.zeros_like(filler.loss_mask)))
        kept_rewards.append(np.asarray(rewards)[idx])
        kept_examples += [examples[i] for i in idx]
        kept_prompts.append(prompts[idx])
        kept_lens.append(lens[idx])
    forest = _take_prompts(_concat_forests(kept_forests), np.arange(P))
    rewards = np.concatenate(kept_rewards)[:P]
    prompts, lens = np.concatenate(kept_prompts)[:P], np.concatenate(kept_lens)[:P]
    return forest, info_total, jnp.asarray(rewards), kept_examples[:P], prompts, lens, n
