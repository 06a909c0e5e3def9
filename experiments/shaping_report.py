"""The shaping study's table (docs/credit-shaping.md): one row per method, mean and spread over seeds.

    python experiments/shaping_report.py [experiments/results/shaping]

Reads the ``<arm>-s<seed>.json`` run summaries that ``experiments/shaping_runs.sh`` copies back and prints a
markdown table: held-out greedy accuracy after 40 steps (mean, each seed), decoded tokens, the policy's mean
sampled response length over the last 5 steps, and the run's seconds (runs shared one GPU with 2-4 others, so
seconds compare only roughly). The ``tp_*`` arms ran ``configs/efficacy_treepo.gin`` (TreePO's transfer tree: the
branching rules need it), the ``grpo`` and ``spo_chain*`` arms (``experiments/results/spo_chain``), the ``grpo8x16*`` and ``nudge*`` arms
(``experiments/results/nudge``)
``configs/efficacy_grpo.gin`` / ``configs/efficacy_spo_chain.gin``, every other arm ``configs/efficacy_slots_k8.gin``.
"""

import collections
import glob
import json
import os
import sys

ARMS = {"base": ("TreePO slots (baseline)", "-"), "echo": ("ECHO shaping + adaptive clip", "@EchoShaping()"),
        "ear": ("ETTRL EAR", "@EntropyAdvantageReshaping()"), "rose": ("ROSE length penalty", "@RoseLengthPenalty()"),
        "prl": ("PRL KL-to-go", "@ProcessRewardShaping()"), "decs": ("DECS (estimator)", "estimator = 'decs'"),
        "ttrl_ear": ("TTRL + EAR (no labels, T = 0.6)", "majority + @EntropyAdvantageReshaping()"),
        "verl": ("VERL effective-rank bonus", "@EffectiveRankBonus()"),
        "base_rerun": ("TreePO slots (baseline, rerun with the VERL runs)", "-"),
        "ttrl_eval": ("test-time RL on the held-out problems (no labels, T = 1.0)", "train_split = 'eval', majority"),
        "ttrl_eval_t06": ("test-time RL on the held-out problems (no labels, T = 0.6)",
                          "train_split = 'eval', majority"),
        "tp_base": ("TreePO transfer tree (baseline of the two rules below)", "efficacy_treepo.gin"),
        "tp_rose": ("ROSE cosine-entropy branching", "TreeConfig.branching = @RoseBranching()"),
        "tp_rose_eps": ("ROSE cosine-entropy branching + epsilon-root 0.5", "@RoseBranching(), epsilon = 0.5"),
        "tp_arrol": ("ARRoL quality head + balanced pruning", "@QualityHead() + @QualityPrune()"),
        "tp_arrol_vote": ("ARRoL, as above, evaluated with k = 8 (see wmaj@8)", "EvalConfig.vote_probe"),
        "grpo": ("GRPO, 16 independent chains (baseline of SPO-chain)", "efficacy_grpo.gin"),
        "spo_chain": ("SPO-chain: 8 chains, int5 cuts (<= 8), K = 9 continuations", "efficacy_spo_chain.gin"),
        "spo_chain_k4": ("SPO-chain, smaller: <= 4 cuts, K = 4", "SPOChainOptions.samples = 4, max_cuts = 4"),
        "grpo8x16_nods": ("GRPO, 16 problems x 8 chains, no dynamic sampling (baseline of NudgeRL)",
                          "efficacy_grpo_8.gin, prompts_per_step = 16, dynamic_sampling = False"),
        "grpo8x16": ("GRPO, 16 problems x 8 chains, dynamic sampling (2 refills)",
                     "efficacy_grpo_8.gin, prompts_per_step = 16"),
        "nudge": ("NudgeRL: 2 hints x 4 rollouts, p_drop 0.5, lambda 1.1, distillation 0.1", "efficacy_nudge.gin"),
        "nudge_nodistill": ("NudgeRL without the distillation rows", "NudgeConfig.distill = False")}


def main(folder: str) -> None:
    runs = collections.defaultdict(list)
    for f in sorted(glob.glob(os.path.join(folder, "*.json"))):
        arm, seed = os.path.basename(f)[:-5].rsplit("-s", 1)
        runs[arm].append((int(seed), json.load(open(f))))
    device = {s["device"] for r in runs.values() for _, s in r}
    print(f"device: {', '.join(sorted(device))}; accuracy before training: "
          f"{next(iter(runs.values()))[0][1]['evals'][0]['accuracy']:.1%}\n")
    print("| method | gin | seeds | held-out acc (mean) | per seed | decoded tokens (mean) | sampled length, last 5 "
          "steps | seconds (mean) |")
    print("|---|---|---|---|---|---|---|---|")
    for arm in [a for a in ARMS if a in runs]:
        rs = sorted(runs[arm], key=lambda x: x[0])
        acc = [s["evals"][-1]["accuracy"] for _, s in rs]
        tok = [s["decoded_tokens"] for _, s in rs]
        length = [sum(x["rollout/mean_leaf_length"] for x in s["history"][-5:]) / 5 for _, s in rs]
        secs = [s["total_s"] for _, s in rs]
        name, gin = ARMS[arm]
        print(f"| {name} | `{gin}` | {len(rs)} | {sum(acc) / len(acc):.1%} | "
              f"{' / '.join(f'{a:.1%}' for a in acc)} | {sum(tok) / len(tok):,.0f} | {sum(length) / len(length):.1f} | "
              f"{sum(secs) / len(secs):.0f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results", "shaping"))
