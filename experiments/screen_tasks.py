"""Screen candidate tasks for an RL study: base accuracy and response lengths of a model on each.

    python experiments/screen_tasks.py --model smollm2-135m-instruct --num_problems 256 --k 4 \\
        --max_new_tokens 256 --json experiments/results/screen_smollm2.json

For every candidate (a task name, its task options and an instruction; the built-in list ``CANDIDATES`` or
``--only NAME``) the script builds the task with ``eval_size = num_problems`` held-out problems (construction fails
if the task has fewer distinct held-out problems, so a row that prints has at least that many), decodes one greedy
response per problem and, with ``--k > 0``, ``k`` samples at temperature 1 (:func:`treejax.rl.evaluation.evaluate`),
and reports:

* ``greedy``: greedy accuracy (the base accuracy an RL run starts from; a useful RL task has it in ~10-50%);
* ``pass@1`` / ``pass@k``: sampled accuracy, and the share of problems with at least one correct sample (the
  problems where a group of samples carries a learning signal);
* ``len``: mean greedy response length in tokens, ``len_s`` the sampled mean, and ``segs@L``: the sampled mean
  divided by the segment length ``L`` (``--segment_length``): how many tree segments a typical answer spans;
* ``trunc``: share of greedy responses that hit ``max_new_tokens`` without stopping.

The model is loaded once; every candidate uses the training loop's prompt formatting and the precision policy's
sampler dtypes (bf16 on GPU).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time

STEP_BY_STEP = ("Solve it step by step: write one short line per operation with its intermediate result, "
                "then give the final answer on the last line as 'Answer: <number>'.")

# name -> (task, task options). Options not given fall back to the task's defaults (eval_size: --num_problems).
CANDIDATES: dict[str, tuple[str, dict]] = {
    "chain_sum_2x1/just": ("chain_sum_2x1", dict(eval_size=32, system_prompt=None, instruction="Answer with just the number.",
                                                 extraction="last_number")),
    "chain_sum_3x1/steps": ("chain_sum_3x1", dict(system_prompt=None, instruction=STEP_BY_STEP,
                                                  extraction="last_number")),
    "chain_sum_4x1/steps": ("chain_sum", dict(min_terms=4, max_terms=4, min_digits=1, max_digits=1,
                                              system_prompt=None, instruction=STEP_BY_STEP,
                                              extraction="last_number")),
    "chain_sum_2x2/steps": ("chain_sum_2x2", dict(system_prompt=None, instruction=STEP_BY_STEP,
                                                  extraction="last_number")),
    "chain_sum_3x2/steps": ("chain_sum", dict(min_terms=3, max_terms=3, min_digits=1, max_digits=2,
                                              system_prompt=None, instruction=STEP_BY_STEP,
                                              extraction="last_number")),
    "leg_counting_easy/steps": ("leg_counting_easy", dict(system_prompt=None, instruction=STEP_BY_STEP,
                                                          extraction="last_number")),
    "leg_counting_easy/rg": ("leg_counting_easy", dict(extraction="last_number")),
    "chain_sum_3x1/rg": ("chain_sum_3x1", dict(extraction="last_number")),
    "chain_sum_2x2/rg": ("chain_sum_2x2", dict(extraction="last_number")),
    "products_2x1/steps": ("products", dict(min_terms=2, max_terms=2, min_digits=1, max_digits=2,
                                            system_prompt=None, instruction=STEP_BY_STEP, extraction="last_number")),
    # the long regime with a reasoning model (configs/include/qwen15_long_task.gin): reasoning-gym's own prompt,
    # the final <answer> tag or \\boxed{} read as the model writes it
    "basic_arithmetic_5x2/rg": ("basic_arithmetic", dict(min_terms=5, max_terms=5, min_digits=1, max_digits=2,
                                                         extraction="tags_or_boxed")),
    "basic_arithmetic_5x2/rg_tags": ("basic_arithmetic", dict(min_terms=5, max_terms=5, min_digits=1, max_digits=2,
                                                              extraction="tags")),
    "basic_arithmetic_3x1/steps": ("basic_arithmetic", dict(
        min_terms=3, max_terms=3, min_digits=1, max_digits=1, operators=("+", "-", "*"), allow_parentheses=False,
        allow_negation=False, system_prompt=None, instruction=STEP_BY_STEP, extraction="last_number")),
}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="smollm2-135m-instruct")
    ap.add_argument("--only", action="append", default=None, help=f"candidate name(s) from {sorted(CANDIDATES)}")
    ap.add_argument("--num_problems", type=int, default=256)
    ap.add_argument("--k", type=int, default=4)
    ap.add_argument("--max_new_tokens", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=256)
    ap.add_argument("--segment_length", type=int, default=32)
    ap.add_argument("--examples", type=int, default=2, help="greedy responses printed per candidate")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)

    import jax
    import numpy as np

    from treejax.data import get_task
    from treejax.models.registry import load_model
    from treejax.precision import Precision
    from treejax.rl.evaluation import EvalConfig, evaluate, prompt_width_for
    from treejax.sampling.decode import make_model_fns

    names = args.only or list(CANDIDATES)
    unknown = [n for n in names if n not in CANDIDATES]
    if unknown:
        raise SystemExit(f"unknown candidate(s) {unknown}; valid: {sorted(CANDIDATES)}")
    prec = Precision().resolve()
    model_config, params, tokenizer = load_model(args.model, param_dtype=prec.param_dtype,
                                                 compute_dtype=prec.compute_dtype)
    params = prec.sampler_params(jax.device_put(params))
    fns = make_model_fns(model_config, cache_dtype=prec.cache_dtype)
    config = EvalConfig(num_problems=args.num_problems, max_new_tokens=args.max_new_tokens,
                        batch_size=args.batch_size, k=args.k, temperature=1.0, seed=0)
    device = jax.devices()[0].device_kind
    rows = []
    for name in names:
        task_name, options = CANDIDATES[name]
        t0 = time.perf_counter()
        task = get_task(task_name, **{"size": 0, "eval_size": args.num_problems, "seed": 0, **options})
        examples = list(task.examples("eval"))
        width = prompt_width_for(tokenizer, examples)
        with prec.matmul_context():
            m = evaluate(params, fns, tokenizer, task, examples, width, config, with_details=True)
        lengths = np.array([p["greedy_length"] for p in m["problems"]])
        row = {"name": name, "task": task_name, "options": options, "n": m["n"], "greedy": m["accuracy"],
               "len": m["mean_length"], "trunc": float(np.mean(lengths >= args.max_new_tokens)),
               "len_p90": float(np.percentile(lengths, 90)), "seconds": time.perf_counter() - t0,
               "examples": [{"question": p["question"], "truth": p["ground_truth"], "response": p["greedy_text"],
                             "score": p["greedy_score"]} for p in m["problems"][: args.examples]]}
        if args.k:
            row.update({"pass@1": m["pass@1"], f"pass@{args.k}": m["pass@k"], "len_s": m["sample_mean_length"],
                        "segs": m["sample_mean_length"] / args.segment_length})
        rows.append(row)
        print(json.dumps({k: v for k, v in row.items() if k not in ("examples", "options")}), flush=True)
        for ex in row["examples"]:
            print(f"  Q: {ex['question']!r}  truth={ex['truth']!r}  score={ex['score']}\n  A: {ex['response']!r}")

    head = f"{'candidate':<28} {'greedy':>7} {'pass@1':>7} {'pass@k':>7} {'len':>6} {'len_s':>6} " \
           f"{'segs@' + str(args.segment_length):>8} {'trunc':>6}"
    print(f"\n{args.model} on {device}, {args.num_problems} held-out problems, k={args.k}, "
          f"max_new_tokens={args.max_new_tokens}\n{head}")
    for r in rows:
        print(f"{r['name']:<28} {r['greedy']:>7.3f} {r.get('pass@1', float('nan')):>7.3f} "
              f"{r.get(f'pass@{args.k}', float('nan')):>7.3f} {r['len']:>6.1f} {r.get('len_s', float('nan')):>6.1f} "
              f"{r.get('segs', float('nan')):>8.2f} {r['trunc']:>6.3f}")
    out = {"model": args.model, "device": device, "platform": platform.node(), "settings": vars(args), "rows": rows}
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2, default=float)
    return out


if __name__ == "__main__":
    main()
