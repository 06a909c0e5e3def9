"""How often does a judge agree with the task's verifier? (docs/judges.md, "How good is the judge")

The policy (the run's model) answers ``--problems`` held-out problems of the config's task greedily, the verifier
scores each answer, and the judge of the config's FAPO / SSL stage (``ScorerConfig``) scores the same answers in
three ways: verdict-token probabilities (``logprob``), a greedy decoded verdict parsed by its regex (``decode``)
and the least per-line PRM step score (``steps``). Printed per way: agreement (``score >= 0.5`` equals the
verifier's verdict), the majority-class baseline (always answering the more common verdict), the AUC of the score
for telling correct from wrong answers (0.5: chance) and the mean score of correct / wrong answers.

    python experiments/judge_agreement.py --gin_file configs/efficacy_fapo.gin --problems 48
"""

from __future__ import annotations

import argparse
import json
import os
import time

import jax
import numpy as np


def auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """P(score of a correct answer > score of a wrong one) + ties / 2 (Mann-Whitney); NaN scores count as 0.5."""
    s = np.nan_to_num(scores, nan=0.5)
    pos, neg = s[labels], s[~labels]
    if not len(pos) or not len(neg):
        return float("nan")
    return float(np.mean((pos[:, None] > neg[None]) + 0.5 * (pos[:, None] == neg[None])))


def policy_answers(cfg, n: int, max_new_tokens: int):
    """``(examples, texts, correct)``: greedy answers of the run's model to the first ``n`` held-out problems."""
    from treejax.data.prompts import encode_examples, pad_token_lists
    from treejax.data.tasks import get_task
    from treejax.models.registry import load_model
    from treejax.sampling.decode import generate

    task = get_task(cfg.task, **dict(cfg.task_options))
    examples = list(task.examples("eval"))[:n]
    model_config, params, tok = load_model(cfg.model)
    prompts, lens = pad_token_lists(encode_examples(tok, examples), pad_id=tok.pad_id or 0)
    out = generate(params, model_config, prompts, lens, jax.random.key(0), max_new_tokens)
    toks, n_out = np.asarray(out.tokens), np.asarray(out.lengths)
    texts = [tok.decode(toks[i, : n_out[i]].tolist(), skip_special_tokens=True) for i in range(len(examples))]
    correct = np.array([task.score(t, ex) >= 1.0 for t, ex in zip(texts, examples)])
    return examples, texts, correct


def judge_all(scorer_cfg, policy_model, examples, texts) -> dict:
    """The judge's scores of every answer in the three ways (module docstring)."""
    import dataclasses

    from treejax.scorers.judge import judge_scores
    from treejax.scorers.model import load_scorer
    from treejax.scorers.prm import line_steps, step_scores

    scorer = load_scorer(scorer_cfg, policy_model)
    q = [str(e.metadata.get("question", "")) for e in examples]
    a = [e.ground_truth for e in examples]
    out = {"logprob": judge_scores(scorer, q, texts, a)}
    dec = dataclasses.replace(scorer, config=dataclasses.replace(scorer.config, mode="decode"))
    out["decode"] = judge_scores(dec, q, texts, a)
    steps = step_scores(scorer, q, [line_steps(t) for t in texts])
    with np.errstate(all="ignore"):
        out["steps"] = np.array([np.nanmin(r) if np.isfinite(r).any() else np.nan for r in steps], np.float32)
    return out


def main(argv=None):
    from treejax.gin_surface import parse

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--gin_file", default="configs/efficacy_fapo.gin")
    ap.add_argument("--problems", type=int, default=48)
    ap.add_argument("--max_new_tokens", type=int, default=128)
    ap.add_argument("--out", default="experiments/results/judge_agreement.json")
    ap.add_argument("--gin_param", action="append", default=[],
                    help="a gin binding over the config (repeatable), e.g. \"ScorerConfig.model='/path/smollm2.gguf'\"")
    args = ap.parse_args(argv)
    t0 = time.perf_counter()
    cfg = parse([args.gin_file], args.gin_param, check_mesh=False)
    scorer_cfg = next(s.scorer for s in cfg.rollouts if hasattr(s, "scorer"))
    examples, texts, correct = policy_answers(cfg, args.problems, args.max_new_tokens)
    t1 = time.perf_counter()
    scores = judge_all(scorer_cfg, cfg.model, examples, texts)
    print(f"policy answers {t1 - t0:.0f} s, judging them three ways {time.perf_counter() - t1:.0f} s")
    base = max(correct.mean(), 1 - correct.mean())
    result = {"config": args.gin_file, "policy": cfg.model, "judge": scorer_cfg.model, "task": cfg.task,
              "problems": len(texts), "verifier_accuracy": float(correct.mean()), "majority_baseline": float(base)}
    print(f"{len(texts)} held-out problems of {cfg.task}; policy {cfg.model} greedy accuracy {correct.mean():.1%}; "
          f"judge {scorer_cfg.model}; always-the-majority baseline {base:.1%}")
    for way, s in scores.items():
        ok = np.isfinite(s)
        agree = float(np.mean((np.nan_to_num(s, nan=0.0) >= 0.5) == correct))
        row = {"agreement": agree, "auc": auc(s, correct), "parsed": float(ok.mean()),
               "mean_correct": float(np.nanmean(s[correct])) if correct.any() else None,
               "mean_wrong": float(np.nanmean(s[~correct])) if (~correct).any() else None}
        result[way] = row
        print(f"  {way:8s} agreement {agree:.1%}  AUC {row['auc']:.3f}  parsed {ok.mean():.0%}  mean score "
              f"correct {row['mean_correct']}  wrong {row['mean_wrong']}")
    result["seconds"] = time.perf_counter() - t0
    print(f"{result['seconds']:.0f} s")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
