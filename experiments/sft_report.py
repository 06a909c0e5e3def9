"""The SFT study's table (docs/sft.md): cross-entropy vs OTR on the efficacy task.

    python experiments/sft_report.py [experiments/results/sft]

Reads the ``<arm>-s<seed>.json`` summaries of ``treejax-sft`` runs (``configs/sft_chain_sum.gin``,
``configs/sft_otr.gin``; ``sft_then_grpo`` is a ``treejax-train`` summary of ``configs/efficacy_grpo.gin`` started from
the cross-entropy run's HF export) and prints held-out greedy accuracy (mean, each seed), its value at every
evaluation, the mean greedy answer length after training and the run's seconds.
"""

import collections
import glob
import json
import os
import sys

ARMS = {"sft_nll": ("cross-entropy", "configs/sft_chain_sum.gin"),
        "sft_otr": ("OTR, K = 256 at tau = 1.3, beta = -0.1", "configs/sft_otr.gin"),
        "sft_otr_exact": ("OTR, exact expectation over q", "OTRConfig.samples = 0"),
        "sft_then_grpo": ("cross-entropy, then 40 GRPO steps (treejax-train)", "efficacy_grpo.gin from hf_export")}


def main(folder: str) -> None:
    runs = collections.defaultdict(list)
    for f in sorted(glob.glob(os.path.join(folder, "*.json"))):
        arm, seed = os.path.basename(f)[:-5].rsplit("-s", 1)
        runs[arm].append((int(seed), json.load(open(f))))
    device = {s["device"] for r in runs.values() for _, s in r}
    print(f"device: {', '.join(sorted(device))}\n")
    print("| objective | config | seeds | held-out acc after (mean) | per seed | acc at steps 0/10/20/30/40 (seed 0) | "
          "greedy answer length | seconds |")
    print("|---|---|---|---|---|---|---|---|")
    for arm in [a for a in ARMS if a in runs]:
        rs = sorted(runs[arm], key=lambda x: x[0])
        acc = [s["evals"][-1]["accuracy"] for _, s in rs]
        curve = " / ".join(f"{e['accuracy']:.1%}" for e in rs[0][1]["evals"])
        length = sum(s["evals"][-1]["mean_length"] for _, s in rs) / len(rs)
        secs = sum(s["total_s"] for _, s in rs) / len(rs)
        name, cfg = ARMS[arm]
        print(f"| {name} | `{cfg}` | {len(rs)} | {sum(acc) / len(acc):.1%} | {' / '.join(f'{a:.1%}' for a in acc)} | "
              f"{curve} | {length:.1f} | {secs:.0f} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "results", "sft"))
