"""The allocation study's tables (docs/rollout-budget.md): held-out accuracy against decoded tokens.

    python experiments/allocation_report.py [experiments/results/allocation]

Reads the ``<arm>-s<seed>.json`` run summaries (``treejax-train`` with the configs below, seeds 0-2, copied back
from the GPU) and prints two markdown tables:

1. per method: final held-out greedy accuracy (mean over seeds, and each seed), decoded tokens, extra rows per
   step, seconds;
   ("extra rows": allocation's extra chunks, replayed rows, or rows re-rolled with exemplars); then, for the
   sources with a sampler story, the rollout seconds, the sampler's segment rounds and APRIL's stale-token share;
2. the accuracy-compute front: each method's mean curve (held-out accuracy every 5 steps against the mean
   cumulative decoded tokens at that step), the accuracy each method has at a few token budgets (linear
   interpolation on its mean curve), and the tokens and the seconds since the run started (``time/step_s``:
   loading, compiles and evaluations included; runs shared one GPU 3 at a time, so seconds compare roughly) each
   method needs to first reach the GRPO baseline's final accuracy (``-`` when its curve never does).
"""

from __future__ import annotations

import collections
import glob
import json
import os
import sys

import numpy as np

ARMS = {"grpo": ("GRPO, 8 prompts x 16 chains, dynamic sampling (the baseline)", "efficacy_grpo.gin"),
        "grpo8": ("GRPO, 8 prompts x 8 chains, dynamic sampling", "efficacy_grpo_8.gin"),
        "dars": ("DARS-HW: 8 x 8 + <= 8 extra rows of 8, <= 64 per prompt", "efficacy_dars.gin"),
        "gdro": ("Rollout-GDRO: 8 x 8 + <= 8 extra rows, <= 32 per prompt", "efficacy_gdro.gin"),
        "xrpo": ("XRPO allocator: 8 x 8 + 8 extra rows, <= 32 per prompt", "efficacy_xrpo.gin"),
        "xrpo80": ("XRPO allocator, 80 steps (same config)", "efficacy_xrpo.gin, num_steps = 80"),
        "dars80": ("DARS-HW, 80 steps (same config)", "efficacy_dars.gin, num_steps = 80"),
        "gdro80": ("Rollout-GDRO, 80 steps (same config)", "efficacy_gdro.gin, num_steps = 80"),
        "replay": ("Replay: 6 fresh x 16 + 2 replayed rows, TIS cap 2", "efficacy_replay.gin"),
        "dots_replay": ("DOTS (2 reference + 4 selected of 24) + replay of 2 rows", "efficacy_dots_replay.gin"),
        "ewma": ("GRPO 8 x 16 with PPO-EWMA (proximal EMA 0.9, TIS cap 2)",
                 "efficacy_grpo.gin, old_logp = 'ewma', proximal_ewma = 0.9, tis_cap = 2.0"),
        "grpo_b": ("GRPO baseline again, run beside APRIL / Prompt-GDRO / exemplars (same calls)",
                   "efficacy_grpo.gin"),
        "april": ("APRIL: 8 + 8 groups launched, stop at 8 complete, carry the rest, TIS cap 2", "efficacy_april.gin"),
        "prompt_gdro": ("Prompt-GDRO: 8 picked of 4 x 8 candidates by pass-rate bucket weights",
                        "efficacy_prompt_gdro.gin"),
        "exemplars": ("XRPO exemplars: all-fail prompts re-rolled with a solved exemplar", "efficacy_exemplars.gin")}
BASELINE = "grpo"


def curve(summary: dict, x: str = "rollout/decoded_tokens") -> tuple[np.ndarray, np.ndarray]:
    """(``x`` so far, held-out accuracy) at each evaluation step of one run: the cumulative decoded tokens, or with
    ``x = "time/step_s"`` the run's seconds since it started (already cumulative: loading, compiles and the
    evaluations included)."""
    cum, total = 0.0, {0: 0.0}
    for row in summary["history"]:
        cum = row[x] if x == "time/step_s" else cum + row[x]
        total[int(row["step"])] = cum
    steps = [e["step"] for e in summary["evals"]]
    return np.array([total[s] for s in steps], float), np.array([e["accuracy"] for e in summary["evals"]])


def mean_curve(runs: list[dict], x: str = "rollout/decoded_tokens") -> tuple[np.ndarray, np.ndarray]:
    curves = [curve(s, x) for s in runs]
    n = min(len(t) for t, _ in curves)
    return np.mean([t[:n] for t, _ in curves], 0), np.mean([a[:n] for _, a in curves], 0)


def tokens_to_reach(tokens: np.ndarray, acc: np.ndarray, target: float) -> float | None:
    """The tokens at which the mean curve first reaches ``target`` (linear between evaluations), or None."""
    for i in range(len(acc)):
        if acc[i] >= target - 1e-9:
            if i == 0:
                return float(tokens[0])
            a0, a1, t0, t1 = acc[i - 1], acc[i], tokens[i - 1], tokens[i]
            return float(t0 + (target - a0) / (a1 - a0) * (t1 - t0))
    return None


def main(folder: str) -> None:
    runs = collections.defaultdict(list)
    for f in sorted(glob.glob(os.path.join(folder, "*.json"))):
        arm, seed = os.path.basename(f)[:-5].rsplit("-s", 1)
        runs[arm].append((int(seed), json.load(open(f))))
    arms = [a for a in ARMS if a in runs]
    device = sorted({s["device"] for r in runs.values() for _, s in r})
    print(f"device: {', '.join(device)}; held-out accuracy before training: "
          f"{runs[arms[0]][0][1]['evals'][0]['accuracy']:.1%} (256 problems)\n")
    print("| method | gin | seeds | steps | held-out acc (mean) | per seed | decoded tokens (mean) | extra rows / step "
          "| seconds (mean) |")
    print("|---|---|---|---|---|---|---|---|---|")
    for arm in arms:
        rs = [s for _, s in sorted(runs[arm], key=lambda x: x[0])]
        acc = [s["evals"][-1]["accuracy"] for s in rs]
        extra = [np.mean([h.get("alloc/extra_rows", h.get("replay/replayed_rows", h.get("exemplars/injected", 0)))
                          for h in s["history"]]) for s in rs]
        print(f"| {ARMS[arm][0]} | `{ARMS[arm][1]}` | {len(rs)} | {rs[0]['steps']} | {np.mean(acc):.1%} | "
              f"{', '.join(f'{a:.1%}' for a in acc)} | {np.mean([s['decoded_tokens'] for s in rs]):,.0f} | "
              f"{np.mean(extra):.1f} | {np.mean([s['total_s'] for s in rs]):.0f} |")
    print("\n| method | rollout s (mean) | update s (mean) | segment rounds | sampler calls | stale token share |")
    print("|---|---|---|---|---|---|")
    for arm in arms:
        rs = [s for _, s in runs[arm]]
        tot = lambda k: np.mean([sum(h.get(k, 0) for h in s["history"]) for s in rs])  # noqa: E731
        stale = np.mean([np.mean([h.get("partial/stale_token_frac", 0.0) for h in s["history"]]) for s in rs])
        print(f"| {arm} | {tot('time/rollout_s'):.1f} | {tot('time/update_s'):.1f} | {tot('rollout/segments'):.0f} | "
              f"{tot('rollout/rollout_calls'):.0f} | {stale:.1%} |")
    base_t, base_a = mean_curve([s for _, s in runs[BASELINE]])
    target = float(base_a[-1])
    budgets = [100_000, 200_000, 300_000, 400_000]
    print(f"\nAccuracy-compute front (mean curves over seeds); target = {ARMS[BASELINE][0]}'s final accuracy "
          f"{target:.1%} at {base_t[-1]:,.0f} tokens.\n")
    base_s, _ = mean_curve([s for _, s in runs[BASELINE]], "time/step_s")
    print("| method | " + " | ".join(f"acc at {b // 1000}k tokens" for b in budgets)
          + " | tokens to reach the target | vs the baseline | seconds to reach it | vs the baseline |")
    print("|---|" + "---|" * (len(budgets) + 4))
    for arm in arms:
        t, a = mean_curve([s for _, s in runs[arm]])
        at = [f"{np.interp(b, t, a):.1%}" if b <= t[-1] else "-" for b in budgets]
        need = tokens_to_reach(t, a, target)
        secs, a_s = mean_curve([s for _, s in runs[arm]], "time/step_s")
        need_s = tokens_to_reach(secs, a_s, target)
        rel = "-" if need is None else f"{need / base_t[-1] - 1:+.0%}"
        rel_s = "-" if need_s is None else f"{need_s / base_s[-1] - 1:+.0%}"
        print(f"| {arm} | " + " | ".join(at) + f" | {'-' if need is None else f'{need:,.0f}'} | {rel} | "
              f"{'-' if need_s is None else f'{need_s:.0f}'} | {rel_s} |")


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(os.path.abspath(__file__)), "results",
                                                            "allocation"))
