"""Does a tree pay on this task? Tree vs independent sampling under the same policy, on a run's own config.

For ``--batches`` batches of the config's prompts (one warm-up batch first, not counted), every *arm* samples
``W`` leaves per prompt from the same weights (the config's model, or ``--checkpoint`` of a run):

* ``config``       the config's own rollout (``RunConfig.rollout``; e.g. TreePO's official ``"transfer"`` tree);
* ``slots k=K``    for each ``--slots K``: the config's tree as a slot tree (``allocation="slots"``,
                   ``init_divergence=K``; unbiased by construction, :mod:`treejax.sampling.tree_config`);
* ``independent``  ``W`` independent samples of the same maximum length (segment length kept, ``b = 1``).

Per arm it reports, over all leaf slots with their weights (``Forest.leaf_weight``: what the leaves stand for
under the policy) and over the distinct leaves (what the tree decoded): length, truncation and verifier
accuracy; decoded tokens, rounds (segment iterations) and rollout seconds per call (after the warm-up); distinct
leaves per prompt; the sibling correlation of reward and of length (leaves under one depth-1 node vs across, see
:mod:`treejax.rl.tree_stats`) and the effective sample size of the reward mean per prompt, per 1,000 decoded tokens
and relative to independent sampling. How to read it (docs/long-regime.md): an unbiased arm has weighted
length / truncation / accuracy within noise of ``independent``; the tree pays when its ESS per decoded token is
above independent's (ratio > 1), i.e. when the tokens it saves outweigh the correlation of its siblings::

    python experiments/compare_rollouts.py --gin_file=configs/efficacy_treepo.gin --batches 16 --slots 2 4 8 \
        --json out.json
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


def rollout_arms(tc, slots: list[int], include_config: bool = True) -> dict:
    """``{arm name: TreeConfig}`` (module docstring)."""
    from treejax.sampling.tree import independent_config

    arms = {"config": tc} if include_config else {}
    for k in slots:
        arms[f"slots k={k}"] = dataclasses.replace(tc, allocation="slots", init_divergence=k,
                                                   init_divergence_range=None)
    arms["independent"] = independent_config(tc.num_leaves, tc.max_length, tc.segment_length, strategy=tc.strategy,
                                             stop_ids=tc.stop_ids, fallback=False)
    return arms


def arm_report(batches: list[dict], seconds: float) -> dict:
    """One arm's numbers from its batches (each: forest arrays on the host, scores, info counters)."""
    from treejax.forest import NodeStatus
    from treejax.rl import tree_stats

    cat = {k: np.concatenate([b[k] for b in batches]) for k in ("path", "weight", "length", "status", "correct",
                                                                  "first")}
    calls = len(batches)
    w, first = cat["weight"], cat["first"].astype(np.float64)
    trunc = (cat["status"] == int(NodeStatus.TRUNCATED)).astype(np.float64)
    length, correct = cat["length"].astype(np.float64), cat["correct"].astype(np.float64)
    reward_sums = length_sums = None
    for b in batches:
        reward_sums = tree_stats.add_sums(reward_sums, tree_stats.sibling_sums(b["path"], b["weight"], b["correct"]))
        length_sums = tree_stats.add_sums(length_sums, tree_stats.sibling_sums(b["path"], b["weight"], b["length"]))
    rho = tree_stats.sibling_correlation(reward_sums)
    ess = tree_stats.effective_samples(cat["path"], w, rho)
    decoded = sum(b["decoded"] for b in batches)
    prompts = cat["path"].shape[0]
    return {
        "calls": calls, "prompts": prompts, "decoded_tokens": decoded, "decoded_per_call": decoded / calls,
        "rollout_s_per_call": seconds / calls, "rounds_per_call": float(np.mean([b["rounds"] for b in batches])),
        "distinct_leaves_per_prompt": float(first.sum() / prompts),
        "weighted": {"length_mean": tree_stats.weighted_mean(length, w),
                     "truncated": tree_stats.weighted_mean(trunc, w),
                     "accuracy": tree_stats.weighted_mean(correct, w),
                     "correct_length_mean": tree_stats.weighted_mean(length, w * correct)},
        "distinct": {"length_mean": tree_stats.weighted_mean(length, first),
                     "truncated": tree_stats.weighted_mean(trunc, first),
                     "accuracy": tree_stats.weighted_mean(correct, first),
                     "length": _percentiles(length[first > 0])},
        "sibling_corr_reward": rho, "sibling_corr_length": tree_stats.sibling_correlation(length_sums),
        "ess_per_prompt": float(ess.mean()), "ess_per_1k_tokens": float(1000 * ess.sum() / max(decoded, 1)),
    }


def compare(cfg, batches: int, seed: int = 0, checkpoint: str | None = None, slots: list[int] = (),
            include_config: bool = True) -> dict:
    from treejax.data import get_task, make_prompt_pipeline
    from treejax.models.registry import load_model
    from treejax.data.prompts import encode_prompts, pad_token_lists
    from treejax.rl.scoring import score_forest
    from treejax.rl.setup import filter_prompts
    from treejax.sampling.decode import resolve_stop_ids
    from treejax.sampling.decode import make_model_fns
    from treejax.sampling.tree import make_tree_rollout

    prec = cfg.precision.resolve()
    task = get_task(cfg.task, **dict(cfg.task_options))
    model_config, params, tokenizer = load_model(cfg.model, param_dtype=prec.param_dtype,
                                                 compute_dtype=prec.compute_dtype)
    if checkpoint:
        from treejax.checkpoint import restore_params

        params, _ = restore_params(checkpoint, params)
    params = prec.sampler_params(params)
    fns = make_model_fns(model_config, cache_dtype=prec.cache_dtype)
    tc = dataclasses.replace(cfg.rollout, stop_ids=resolve_stop_ids(cfg.rollout.stop_ids, tokenizer=tokenizer))
    arms = rollout_arms(tc, list(slots), include_config)
    rollouts = {name: make_tree_rollout(fns, arm) for name, arm in arms.items()}
    records, _, width = filter_prompts(tokenizer, task, task.records("train"), [], cfg)
    pipeline = make_prompt_pipeline(records, batch_size=cfg.prompts_per_step, seed=seed)
    pad = tokenizer.pad_id if tokenizer.pad_id is not None else 0
    got = {name: [] for name in rollouts}
    seconds = {name: 0.0 for name in rollouts}
    with prec.matmul_context():
        for b in range(batches + 1):  # batch 0 warms up (compiles) and is not counted
            recs = next(pipeline)
            recs = [dict(zip(recs, v)) for v in zip(*recs.values())]
            examples, toks = encode_prompts(tokenizer, task, recs, cfg.system_prompt, cfg.instruction)
            prompts, lens = pad_token_lists(toks, width, pad)
            for name, rollout in rollouts.items():
                t0 = time.perf_counter()
                forest, info = rollout(params, prompts, lens, jax.random.key(seed * 1000 + b))
                jax.block_until_ready(forest.tokens)
                dt = time.perf_counter() - t0
                if b == 0:
                    continue
                seconds[name] += dt
                got[name].append({
                    "path": np.asarray(forest.leaf_path), "weight": np.asarray(forest.leaf_weights(), np.float64),
                    "length": np.asarray(forest.leaf_length), "status": np.asarray(forest.leaf_status),
                    "correct": (score_forest(tokenizer, task, examples, forest) >= 1).astype(np.float64),
                    "first": np.asarray(forest.distinct_leaves()), "decoded": int(info.decoded_tokens),
                    "rounds": int(info.segments)})
    out = {name: arm_report(got[name], seconds[name]) for name in rollouts}
    base = out["independent"]["ess_per_1k_tokens"]
    for r in out.values():
        r["ess_per_token_vs_independent"] = r["ess_per_1k_tokens"] / base if base > 0 else float("nan")
    return out


def print_table(out: dict, header: str) -> None:
    print(header)
    cols = ("arm", "tok/call", "s/call", "rounds", "distinct", "w.len", "w.trunc", "w.acc", "d.len", "d.trunc",
            "d.acc", "rho(R)", "rho(len)", "ESS/prompt", "ESS/1k tok", "vs indep")
    print("| " + " | ".join(cols) + " |")
    print("|" + "---|" * len(cols))
    for name, r in out.items():
        wt, d = r["weighted"], r["distinct"]
        print(f"| {name} | {r['decoded_per_call']:,.0f} | {r['rollout_s_per_call']:.3f} | {r['rounds_per_call']:.1f} | "
              f"{r['distinct_leaves_per_prompt']:.1f} | {wt['length_mean']:.1f} | {wt['truncated']:.1%} | "
              f"{wt['accuracy']:.1%} | {d['length_mean']:.1f} | {d['truncated']:.1%} | {d['accuracy']:.1%} | "
              f"{r['sibling_corr_reward']:.2f} | {r['sibling_corr_length']:.2f} | {r['ess_per_prompt']:.2f} | "
              f"{r['ess_per_1k_tokens']:.2f} | {r['ess_per_token_vs_independent']:.2f} |")


def main(argv=None):
    from treejax import train

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--gin_file", action="append", default=[])
    ap.add_argument("--gin_param", action="append", default=[])
    ap.add_argument("--batches", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--slots", type=int, nargs="*", default=[], help="slot-tree arms: init divergence k of each")
    ap.add_argument("--no-config-arm", action="store_true", help="leave out the config's own rollout")
    ap.add_argument("--checkpoint", default=None, help="an orbax checkpoint folder of a run (default: the model)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    cfg = train.parse(args.gin_file, args.gin_param)
    W = cfg.rollout.num_leaves
    bad = [k for k in args.slots if not 1 <= k <= W]
    if bad:
        raise SystemExit(f"--slots: each k must be in [1, W={W}], got {bad}")
    out = compare(cfg, args.batches, args.seed, args.checkpoint, args.slots, not args.no_config_arm)
    print_table(out, f"device: {jax.devices()[0].device_kind}; {args.batches} batches x {cfg.prompts_per_step} "
                     f"prompts x {W} leaf slots; w. = weighted by leaf_weight (the policy's view), d. = distinct "
                     "leaves (what was decoded)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"config": args.gin_file, "gin_params": args.gin_param, "batches": args.batches,
                       "seed": args.seed, "checkpoint": args.checkpoint, "device": jax.devices()[0].device_kind,
                       "methods": out}, f, indent=2)
    return out


if __name__ == "__main__":
    main()
