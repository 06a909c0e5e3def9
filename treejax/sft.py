"""Supervised fine-tuning on a task's demonstrations: plain cross-entropy, or OTR's one-token rollouts.

``treejax-sft [FILE.gin ...] [--gin_file FILE.gin] [--gin_param "SFTConfig.field = value"]`` (the gin options of
``treejax-train``): the model (an embedded name, an HF folder or a ``.gguf``) trains on the task's training
problems, each answered by its *demonstration* (``SFTConfig.demonstration``, a format string over the record:
``{answer}``, ``{question}`` and the task's metadata keys, e.g. a file task's solution column), and is evaluated
on the held-out problems (greedy accuracy, ``EvalConfig``) before, every ``eval_every`` steps and after. Writes
TensorBoard metrics and ``summary.json`` to ``log_dir`` and, with ``export_hf``, the weights as an HF folder
(``log_dir/hf_export``) that ``treejax-train`` can start from.

Objectives, over the demonstration's tokens ``y_t`` (``t`` in the loss mask: the demonstration and its EOS, never
the prompt), with ``pi = softmax(z_t)`` the model at temperature 1 given the gold prefix (teacher forcing):

* ``"nll"``: ``L = -(1/N) sum_t log pi(y_t)``.
* ``"otr"`` (One-Token Rollout, arXiv 2509.26313): every position is a one-step episode. ``K`` candidate tokens
  ``a_{t,1..K}`` are drawn from ``q_t = softmax(z_t / tau)`` (no gradient through the draw); a candidate earns
  ``R = 1`` when it is the gold token and ``R = beta`` otherwise; the policy-gradient loss is
  ``L = -(1/N) sum_t (1/K) sum_k R(a_{t,k}) log pi(a_{t,k})`` (no baseline). ``samples = 0`` takes the
  expectation over ``q_t`` exactly instead of drawing,
  ``L = -(1/N) sum_t [ q_t(y_t) log pi(y_t) + beta sum_{a != y_t} q_t(a) log pi(a) ]``, the same gradient in
  expectation without sampling noise. Constants (``K``, ``tau``, ``beta``) in :class:`OTRConfig`, with their source.

Batches: ``batch_size`` records per step from the grain pipeline (:func:`treejax.data.make_prompt_pipeline`, the
RL loop's, so the order depends only on ``seed``), prompt (chat template) + demonstration + EOS right-padded to a
power-of-two width; demonstrations longer than ``max_demo_tokens`` are an error naming the record.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import sys
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import optax

from treejax.errors import DataError, UserError
from treejax.gin_surface import add_gin_arguments, gin_files_of, parse
from treejax.rl.optimizer import learning_rate_schedule, make_optimizer
from treejax.sft_config import OBJECTIVES, OTRConfig, SFTConfig, demonstration_text

log = logging.getLogger("treejax.sft")


# ----------------------------------------------------------------------------------------------- the losses
def nll_loss(logits_BxLxV: jax.Array, targets_BxL: jax.Array, mask_BxL: jax.Array) -> jax.Array:
    """``-(1/N) sum_t mask_t log softmax(z_t)[y_t]``, ``N = sum mask``."""
    logp = jax.nn.log_softmax(logits_BxLxV.astype(jnp.float32), axis=-1)
    gold = jnp.take_along_axis(logp, targets_BxL[..., None], axis=-1)[..., 0]
    return -jnp.sum(gold * mask_BxL) / jnp.maximum(jnp.sum(mask_BxL), 1.0)


def otr_candidates(key: jax.Array, logits_BxLxV: jax.Array, samples: int, temperature: float) -> jax.Array:
    """int32 ``[B, L, K]``: ``K`` draws per position from ``softmax(z / tau)`` (inverse CDF on ``K`` uniforms; no
    gradient)."""
    q = jax.nn.softmax(jax.lax.stop_gradient(logits_BxLxV.astype(jnp.float32)) / temperature, axis=-1)
    cdf = jnp.cumsum(q, axis=-1)
    u = jax.random.uniform(key, logits_BxLxV.shape[:-1] + (samples,)) * cdf[..., -1:]
    flat_cdf = cdf.reshape(-1, cdf.shape[-1])
    flat_u = u.reshape(-1, samples)
    idx = jax.vmap(lambda c, x: jnp.searchsorted(c, x, side="right"))(flat_cdf, flat_u)
    return jnp.minimum(idx, cdf.shape[-1] - 1).reshape(u.shape).astype(jnp.int32)


def otr_loss(logits_BxLxV: jax.Array, targets_BxL: jax.Array, mask_BxL: jax.Array, key: jax.Array,
             otr: OTRConfig) -> jax.Array:
    """OTR's loss (module docstring): sampled with ``otr.samples = K > 0``, the exact expectation with 0."""
    z = logits_BxLxV.astype(jnp.float32)
    logp = jax.nn.log_softmax(z, axis=-1)
    n = jnp.maximum(jnp.sum(mask_BxL), 1.0)
    if otr.samples == 0:
        q = jax.lax.stop_gradient(jax.nn.softmax(z / otr.temperature, axis=-1))
        gold = jax.nn.one_hot(targets_BxL, z.shape[-1], dtype=jnp.float32)
        reward = gold + otr.beta * (1.0 - gold)
        per_pos = jnp.sum(jnp.where(q > 0, q * reward * logp, 0.0), axis=-1)
    else:
        a = otr_candidates(key, z, otr.samples, otr.temperature)
        reward = jnp.where(a == targets_BxL[..., None], 1.0, otr.beta)
        per_pos = jnp.mean(reward * jnp.take_along_axis(logp, a, axis=-1), axis=-1)
    return -jnp.sum(per_pos * mask_BxL) / n


# ----------------------------------------------------------------------------------------------- data
def sft_batch(tokenizer, task, records: list[dict], cfg: SFTConfig, pad_id: int):
    """``(tokens [B, Lb], targets [B, Lb], mask [B, Lb])``: prompt + demonstration + EOS, right-padded to a power of
    two; ``targets[t] = tokens[t + 1]`` and ``mask`` is 1 where that target is a demonstration token or its EOS."""
    from treejax.data.prompts import encode_prompts
    from treejax.sampling.decode import bucket_length

    _, prompts = encode_prompts(tokenizer, task, records, cfg.system_prompt, cfg.instruction)
    eos = tokenizer.eos_ids[0] if tokenizer.eos_ids else None
    rows, starts = [], []
    for rec, p in zip(records, prompts):
        demo = tokenizer.encode(demonstration_text(cfg.demonstration, rec)) + ([eos] if eos is not None else [])
        if len(demo) > cfg.max_demo_tokens:
            raise DataError(f"the demonstration of record {rec['uid']!r} has {len(demo)} tokens > "
                            f"SFTConfig.max_demo_tokens={cfg.max_demo_tokens}")
        rows.append(p + demo)
        starts.append(len(p))
    width = bucket_length(max(len(r) for r in rows) + 1)
    tokens = np.full((len(rows), width), pad_id, np.int32)
    mask = np.zeros((len(rows), width), np.float32)
    for i, (r, s) in enumerate(zip(rows, starts)):
        tokens[i, :len(r)] = r
        mask[i, s - 1:len(r) - 1] = 1.0  # position t predicts token t + 1: the demonstration's tokens
    targets = np.concatenate([tokens[:, 1:], np.full((len(rows), 1), pad_id, np.int32)], axis=1)
    return tokens, targets, mask


# ----------------------------------------------------------------------------------------------- the step
def make_sft_step(model_config, cfg: SFTConfig, optimizer):
    """``step(params, opt_state, tokens, targets, mask, key) -> (params, opt_state, metrics)``, jitted."""
    from treejax.models import transformer

    def loss_fn(params, tokens, targets, mask, key):  # the layers cast the master weights to the compute dtype
        pos = jnp.broadcast_to(jnp.arange(tokens.shape[1], dtype=jnp.int32)[None, :], tokens.shape)
        h = transformer.forward(params, model_config, tokens, pos, jnp.ones_like(tokens))  # causal: padding is last
        z = transformer.logits(params, model_config, h)
        nll = nll_loss(z, targets, mask)
        loss = nll if cfg.objective == "nll" else otr_loss(z, targets, mask, key, cfg.otr)
        gold_p = jnp.exp(-nll)
        return loss, {"sft/nll": nll, "sft/gold_prob_geomean": gold_p}

    @jax.jit
    def step(params, opt_state, tokens, targets, mask, key):
        (loss, m), grads = jax.value_and_grad(loss_fn, has_aux=True)(params, tokens, targets, mask, key)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        params = optax.apply_updates(params, updates)
        return params, opt_state, dict(m, **{"sft/loss": loss, "sft/grad_norm": optax.tree.norm(grads),
                                             "sft/tokens": jnp.sum(mask)})

    return step


def episode_world(cfg: SFTConfig, task, tokenizer, model_config, prec):
    """``(make_batch(records), tool_eval(params, examples, width) -> dict)`` of a run: the expert episodes'
    (:mod:`treejax.sft_episodes`) with ``SFTConfig.multiturn``, else plain demonstrations and no tool evaluation
    (``{}``)."""
    pad_id = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    if cfg.multiturn is None:
        return (lambda records: sft_batch(tokenizer, task, records, cfg, pad_id)), (lambda *a: {})
    from treejax.envs import get_env
    from treejax.sampling.decode import make_model_fns
    from treejax.sft_episodes import episode_batch, tool_evaluate

    mt, stop_ids = cfg.multiturn, tuple(tokenizer.eos_ids or ())
    make_env = lambda: get_env(mt.environment).from_config(mt, task, None)  # noqa: E731  (no sandbox: no code runs)
    model_fns = make_model_fns(model_config, cache_dtype=prec.cache_dtype)

    def tool_eval(params, examples, width):
        return tool_evaluate(params, model_fns, tokenizer, examples, cfg, make_env, stop_ids, width,
                             cfg.eval.max_new_tokens, cfg.eval.batch_size)

    return (lambda records: episode_batch(tokenizer, task, records, cfg, pad_id, make_env, stop_ids)), tool_eval


def run(cfg: SFTConfig) -> dict:
    """Trains and evaluates (module docstring); returns the summary also written to ``log_dir/summary.json``."""
    from treejax import metrics as metrics_lib
    from treejax.data import get_task, make_prompt_pipeline
    from treejax.models.export import export_hf
    from treejax.models.registry import load_model, load_tokenizer
    from treejax.rl.evaluation import evaluate, prompt_width_for

    t0 = time.perf_counter()
    prec = cfg.precision.resolve()
    os.makedirs(cfg.log_dir, exist_ok=True)
    task = get_task(cfg.task, **dict(cfg.task_options))
    train = task.records("train")
    if len(train) < cfg.batch_size:
        raise DataError(f"task {cfg.task!r} has {len(train)} training problems, fewer than batch_size={cfg.batch_size}")
    eval_examples = list(task.examples("eval"))[: cfg.eval.num_problems]
    if not eval_examples:
        raise DataError(f"task {cfg.task!r} has no held-out problems: {task.eval_options}")
    for rec in train[:1]:
        demonstration_text(cfg.demonstration, rec)  # a bad template fails before the weights load
    tokenizer = load_tokenizer(cfg.model)
    model_config, params, tokenizer = load_model(cfg.model, param_dtype=prec.param_dtype,
                                                 compute_dtype=prec.compute_dtype, tokenizer=tokenizer)
    make_batch, tool_eval = episode_world(cfg, task, tokenizer, model_config, prec)
    optimizer = make_optimizer(cfg.optimizer)
    opt_state = optimizer.init(params)
    step_fn = make_sft_step(model_config, cfg, optimizer)
    lr = learning_rate_schedule(cfg.optimizer)
    width = prompt_width_for(tokenizer, eval_examples, cfg.system_prompt, cfg.instruction)
    pipeline = make_prompt_pipeline(train, batch_size=cfg.batch_size, seed=cfg.seed)
    writer = metrics_lib.MetricsWriter(cfg.log_dir, print_fn=log.info, total_steps=cfg.num_steps,
                                       console_keys=("sft/loss", "sft/nll", "sft/grad_norm", "eval/accuracy",
                                                     "eval/tool_accuracy"))
    key = jax.random.key(cfg.seed)

    def evaluate_now(step):
        with prec.matmul_context():
            e = evaluate(params, model_config, tokenizer, task, eval_examples, width, cfg.eval, cfg.system_prompt,
                         cfg.instruction)
            e.update(tool_eval(params, eval_examples, width))
        e["step"] = step
        log.info("step %d: held-out greedy accuracy %.1f%% (n = %d)%s", step, 100 * e["accuracy"], e["n"],
                 f", with the tools {100 * e['tool_accuracy']:.1f}%" if "tool_accuracy" in e else "")
        return e

    evals, history = [evaluate_now(0)], []
    for step in range(1, cfg.num_steps + 1):
        records = next(pipeline)
        records = [dict(zip(records, vals)) for vals in zip(*records.values())]
        tokens, targets, mask = make_batch(records)
        with prec.matmul_context():
            params, opt_state, m = step_fn(params, opt_state, jnp.asarray(tokens), jnp.asarray(targets),
                                           jnp.asarray(mask), jax.random.fold_in(key, step))
        m = {k: float(v) for k, v in jax.device_get(m).items()}
        m["sft/learning_rate"] = float(lr(step - 1))
        if cfg.eval_every and step % cfg.eval_every == 0 and step < cfg.num_steps:
            e = evaluate_now(step)
            evals.append(e)
            m["eval/accuracy"] = e["accuracy"]
            if "tool_accuracy" in e:
                m["eval/tool_accuracy"] = e["tool_accuracy"]
        history.append(dict(m, step=step))
        writer.write_scalars(step, m)
    if evals[-1]["step"] != cfg.num_steps:
        evals.append(evaluate_now(cfg.num_steps))
    writer.close()
    if cfg.export_hf:
        export_hf(jax.device_get(params), model_config, os.path.join(cfg.log_dir, "hf_export"), tokenizer)
    summary = {"model": cfg.model, "task": cfg.task, "objective": cfg.objective, "steps": cfg.num_steps,
               "device": jax.devices()[0].device_kind, "otr": dataclasses.asdict(cfg.otr),
               "eval_before": evals[0], "eval_after": evals[-1], "evals": evals, "history": history,
               "total_s": time.perf_counter() - t0}
    with open(os.path.join(cfg.log_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    return summary


# ----------------------------------------------------------------------------------------------- the CLI
def main(argv: list[str] | None = None) -> dict:
    import gin

    from treejax.log import configure_logging

    parser = argparse.ArgumentParser(prog="treejax-sft", description=__doc__.split("\n\n")[0])
    add_gin_arguments(parser, example="SFTConfig.num_steps = 5")
    parser.add_argument("--quiet", action="store_true", help="only warnings and errors")
    args = parser.parse_args(argv)
    gin_files = gin_files_of(parser, args) or []
    configure_logging(args.quiet)
    cfg = parse(gin_files, args.gin_param, check_mesh=False, root="SFTConfig")
    summary = run(cfg)
    with open(os.path.join(cfg.log_dir, "operative_config.gin"), "w") as f:
        f.write(gin.config_str())
    b, a = summary["eval_before"], summary["eval_after"]
    print(f"treejax sft: {cfg.model} on {cfg.task} with {cfg.objective}, {cfg.num_steps} steps in "
          f"{summary['total_s']:.0f} s\n  held-out greedy accuracy: {b['accuracy']:.1%} before -> "
          f"{a['accuracy']:.1%} after (n = {a['n']})\n"
          + (f"  with the tools ({cfg.multiturn.environment}): {b['tool_accuracy']:.1%} before -> "
             f"{a['tool_accuracy']:.1%} after, {a['tool_calls_mean']:.2f} calls an episode\n" if cfg.multiturn else "")
          + f"  logs: {cfg.log_dir}")
    return summary


def console_main(argv: list[str] | None = None) -> None:
    """The ``treejax-sft`` entry point: a user error is one line and exit status 2."""
    try:
        main(argv)
    except UserError as e:
        print(f"treejax-sft: error: {e}", file=sys.stderr)
        sys.exit(2)


__all__ = ["OBJECTIVES", "OTRConfig", "SFTConfig", "demonstration_text", "make_sft_step", "nll_loss", "otr_candidates",
           "otr_loss", "run", "sft_batch"]

if __name__ == "__main__":
    console_main()
