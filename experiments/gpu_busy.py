"""Each GPU's busy fraction during a run's training steps, from ``nvidia-smi`` samples (``experiments/async_runs.sh``
writes them): the mean of ``utilization.gpu`` (the share of time a kernel was running) per GPU between the log
lines of the first and the last training step of every ``<arm>-s<seed>.log`` in the folder::

    python experiments/gpu_busy.py OUT
"""

from __future__ import annotations

import csv
import datetime as dt
import glob
import os
import re
import sys

STEP = re.compile(r"(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d+) step (\d+)/(\d+) done")


def samples(folder: str) -> list[tuple[dt.datetime, int, float]]:
    out = []
    for path in glob.glob(os.path.join(folder, "util-*.csv")):
        with open(path) as f:
            for row in csv.reader(f):
                try:
                    out.append((dt.datetime.strptime(row[0].strip(), "%Y/%m/%d %H:%M:%S.%f"), int(row[1]),
                                float(row[2])))
                except (ValueError, IndexError):
                    pass  # a line cut by the kill
    return out


def main(folder: str) -> None:
    rows = samples(folder)
    for log in sorted(glob.glob(os.path.join(folder, "*-s*.log"))):
        with open(log) as f:
            steps = [(int(m.group(2)), dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f"))
                     for m in map(STEP.match, f) if m]
        if len(steps) < 2:
            continue
        a, b = steps[0][1], steps[-1][1]
        per: dict[int, list[float]] = {}
        for t, gpu, u in rows:
            if a <= t <= b:
                per.setdefault(gpu, []).append(u)
        busy = ", ".join(f"GPU {g} {sum(v) / len(v):.1f}%" for g, v in sorted(per.items()))
        print(f"{os.path.basename(log)}: steps {steps[0][0]}..{steps[-1][0]} ({(b - a).total_seconds():.1f} s): {busy}")


if __name__ == "__main__":
    main(sys.argv[1])
