"""Asynchronous vs synchronous rollouts: throughput and held-out accuracy from the runs' ``summary.json`` files.

The runs (``experiments/async_runs.sh``, one ``treejax-train`` process each, on a 2-GPU machine) write
``<arm>-s<seed>.json`` copies of their summaries into one folder; this prints the table::

    python experiments/async_report.py experiments/results/async --baseline sync2

*Steady steps/s*: steps 2..N (the first step's compilation left out) over their wall-clock seconds minus the
held-out evaluations between them, mean over seeds; *loop steps/s*: the summary's ``steps_per_s`` (the whole step
loop, compilation and evaluations included). *Accuracy*: greedy held-out accuracy after the last step.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import re
import statistics as st


def steady_steps_per_s(summary: dict) -> float:
    h = summary["history"]
    t = [row["time/step_s"] for row in h]
    evals = {e["step"]: e.get("eval_s", 0.0) for e in summary["evals"]}
    span = sum(b - a - evals.get(h[i]["step"], 0.0) for i, (a, b) in enumerate(zip(t, t[1:])))
    return (len(t) - 1) / span


def arm_rows(folder: str) -> dict[str, list[dict]]:
    arms: dict[str, list[dict]] = {}
    for path in sorted(glob.glob(os.path.join(folder, "*-s*.json"))):
        m = re.match(r"(.+)-s(\d+)\.json$", os.path.basename(path))
        if m:
            with open(path) as f:
                s = json.load(f)
            s["_seed"] = int(m.group(2))
            arms.setdefault(m.group(1), []).append(s)
    return arms


def table(arms: dict[str, list[dict]], baseline: str | None) -> str:
    base = st.mean(steady_steps_per_s(s) for s in arms[baseline]) if baseline in arms else None
    med = lambda runs, k: st.median(r.get(k, 0.0) for s in runs for r in s["history"][1:])  # noqa: E731
    lines = ["| arm | card x devices | seeds | steady steps/s (per seed) | vs " + (baseline or "-") +
             " | loop steps/s | accuracy after (per seed) | rollout s | update s | learner waits s | staleness |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for arm, runs in sorted(arms.items()):
        sps = [steady_steps_per_s(s) for s in runs]
        acc = [s["eval_after"]["accuracy"] * 100 for s in runs]
        a = runs[0].get("async")
        wait, stale = (f"{med(runs, 'time/wait_rollout_s'):.3f}", f"{a['mean_staleness']:.2f}") if a else ("-", "0")
        lines.append(
            f"| {arm} | {runs[0]['device']} x {runs[0]['num_devices']} | {len(runs)} | {st.mean(sps):.3f} "
            f"({', '.join(f'{x:.3f}' for x in sps)}) | {st.mean(sps) / base:.2f}x | "
            f"{st.mean(s['steps_per_s'] for s in runs):.3f} | {st.mean(acc):.1f}% "
            f"({', '.join(f'{x:.1f}' for x in acc)}) | {med(runs, 'time/rollout_s'):.3f} | "
            f"{med(runs, 'time/update_s'):.3f} | {wait} | {stale} |")
    return "\n".join(lines)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("folder")
    p.add_argument("--baseline", default="sync2")
    args = p.parse_args(argv)
    print(table(arm_rows(args.folder), args.baseline))


if __name__ == "__main__":
    main()
