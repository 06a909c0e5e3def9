"""The table of experiments/lora_runs.sh: per run, the steady-state seconds per phase (median over steps after
the first, which compiles), decoded tokens per second of the rollout, the learning phase's seconds, the
measured and planned peak device memory, the checkpoint's bytes.

  python experiments/lora_report.py ~/lora_out
"""

from __future__ import annotations

import glob
import json
import os
import statistics
import sys


def row(path: str) -> str:
    s = json.load(open(path))
    steady = s["history"][1:] or s["history"]
    med = lambda k: statistics.median(h.get(k, float("nan")) for h in steady)  # noqa: E731
    rollout, update, tokens = med("time/rollout_s"), med("time/update_s"), med("rollout/decoded_tokens")
    mem = s.get("memory") or {}
    gib = lambda b: "n/a" if b is None else f"{b / 2**30:.1f}"  # noqa: E731
    ck = path[:-5] + ".ckpt_bytes"
    ck_bytes = open(ck).read().strip() if os.path.exists(ck) else ""
    name = os.path.basename(path)[:-5]
    return (f"| {name} | {s['device']} x {s['num_devices']} | {rollout:.2f} | {tokens / rollout:,.0f} | "
            f"{update:.2f} | {rollout + update:.2f} | "
            f"{gib(mem.get('measured_peak_bytes'))} | {gib(mem.get('planned_peak_bytes'))} | "
            f"{int(ck_bytes) / 2**20 if ck_bytes else float('nan'):.1f} |")


def main(folder: str) -> None:
    print("| run | device | rollout s/step | decoded tok/s | learn s (old log-probs + update) | rollout + learn s | peak GiB measured | "
          "peak GiB planned | checkpoint MiB |")
    print("|---|---|---|---|---|---|---|---|---|")
    for path in sorted(glob.glob(os.path.join(folder, "*.json"))):
        print(row(path))


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else os.path.expanduser("~/lora_out"))
