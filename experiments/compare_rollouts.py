"""Tree vs independent sampling under the same policy, on a run's own config (moved out of the training loop,
where it doubled every step's rollout cost).

For ``--batches`` batches of the config's prompts: the config's tree rollout (``RunConfig.rollout``) and ``W``
independent samples of the same maximum length (segment length kept, ``b = 1``), both from the same weights
(the config's model, or ``--checkpoint`` of a run). Reports decoded tokens, rollout time (after a warm-up call),
verifier accuracy, and the distributions of leaf length and of the length of correct answers, per method::

    python experiments/compare_rollouts.py --gin_file=configs/treepo_smollm2.gin --batches 4 --json out.json
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import numpy as np


def _percentiles(x) -> dict:
    x = np.asarray(x, np.float64)
    if x.size == 0:
        return {"n": 0}
    q = np.percentile(x, [10, 50, 90])
    return {"n": int(x.size), "mean": float(x.mean()), "p10": float(q[0]), "p50": float(q[1]), "p90": float(q[2]),
            "max": float(x.max())}


def compare(cfg, batches: int, seed: int = 0, checkpoint: str | None = None) -> dict:
    from treejax.data import get_task, make_prompt_pipeline
    from treejax.forest import NodeStatus
    from treejax.models.registry import load_model
    from treejax.rl import loop
    from treejax.sampling.decode import make_model_fns
    from treejax.sampling.tree import make_independent_rollout, make_tree_rollout

    prec = cfg.precision.resolve()
    task = get_task(cfg.task, **dict(cfg.task_options))
    model_config, params, tokenizer = load_model(cfg.model, param_dtype=prec.param_dtype,
                                                 compute_dtype=prec.compute_dtype)
    if checkpoint:
        from treejax.checkpoint import restore_params

        params, _ = restore_params(checkpoint, params)
    params = prec.sampler_params(params)
    fns = make_model_fns(model_config, cache_dtype=prec.cache_dtype)
    tc = dataclasses.replace(cfg.rollout, stop_ids=cfg.rollout.stop_ids or tuple(tokenizer.eos_ids))
    rollouts = {"tree": make_tree_rollout(fns, tc),
                "independent": make_independent_rollout(fns, tc.num_leaves, tc.max_length, tc.segment_length,
                                                        strategy=tc.strategy, stop_ids=tc.stop_ids)}
    records, _, width = loop.filter_prompts(tokenizer, task, task.records("train"), [], cfg)
    pipeline = make_prompt_pipeline(records, batch_size=cfg.prompts_per_step, seed=seed)
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    stats = {name: {"decoded": 0, "time_s": 0.0, "correct": [], "lengths": [], "correct_lengths": [],
                    "truncated": 0} for name in rollouts}
    with prec.matmul_context():
        for b in range(batches + 1):  # batch 0 warms up (compiles) and is not counted
            recs = next(pipeline)
            recs = [dict(zip(recs, v)) for v in zip(*recs.values())]
            examples, toks = loop.encode_prompts(tokenizer, task, recs, cfg.system_prompt, cfg.instruction)
            prompts, lens = loop.pad_token_lists(toks, width, pad)
            for name, rollout in rollouts.items():
                t0 = time.perf_counter()
                forest, info = rollout(params, prompts, lens, jax.random.key(seed * 1000 + b))
                jax.block_until_ready(forest.tokens)
                dt = time.perf_counter() - t0
                if b == 0:
                    continue
                scores = loop.score_forest(tokenizer, task, examples, forest)
                length = np.asarray(forest.leaf_length)
                s = stats[name]
                s["decoded"] += int(info["decoded_tokens"])
                s["time_s"] += dt
                s["correct"] += (scores >= 1).ravel().tolist()
                s["lengths"] += length.ravel().tolist()
                s["correct_lengths"] += length[scores >= 1].tolist()
                s["truncated"] += int(np.sum(np.asarray(forest.leaf_status) == int(NodeStatus.TRUNCATED)))
    out = {}
    for name, s in stats.items():
        out[name] = {"decoded_tokens": s["decoded"], "rollout_s": s["time_s"],
                     "accuracy": float(np.mean(s["correct"])), "truncated_leaves": s["truncated"],
                     "leaves": len(s["lengths"]), "leaf_length": _percentiles(s["lengths"]),
                     "correct_answer_length": _percentiles(s["correct_lengths"])}
    return out


def main(argv=None):
    from treejax import train

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gin_file", action="append", default=[])
    ap.add_argument("--gin_param", action="append", default=[])
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--checkpoint", default=None, help="an orbax checkpoint folder of a run (default: the model)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = train.parse(args.gin_file, args.gin_param)
    out = compare(cfg, args.batches, args.seed, args.checkpoint)
    print(f"device: {jax.devices()[0].device_kind}; {args.batches} batches x {cfg.prompts_per_step} prompts x "
          f"{cfg.rollout.num_leaves} leaves")
    print(f"{'method':<13}{'decoded':>10}{'time s':>9}{'accuracy':>10}{'truncated':>11}{'leaf p50':>10}"
          f"{'leaf mean':>11}{'correct-len p50':>17}")
    for name, r in out.items():
        print(f"{name:<13}{r['decoded_tokens']:>10}{r['rollout_s']:>9.2f}{r['accuracy']:>10.1%}"
              f"{r['truncated_leaves']:>11}{r['leaf_length'].get('p50', 0):>10.0f}"
              f"{r['leaf_length'].get('mean', 0):>11.1f}{r['correct_answer_length'].get('p50', 0):>17.0f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.gin_file, "gin_params": args.gin_param, "batches": args.batches,
                       "seed": args.seed, "checkpoint": args.checkpoint, "device": jax.devices()[0].device_kind,
                       "methods": out}, f, indent=2)
    return out


if __name__ == "__main__":
    main()
