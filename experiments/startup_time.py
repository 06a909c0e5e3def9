"""Start-up time of a second ``treejax-train`` run with and without the persistent compilation cache.

    python experiments/startup_time.py --out /tmp/startup [--gin_param ...]

Runs the quickstart (``treejax-train`` with the given extra bindings) four times, each into a fresh log folder:
twice with the cache off (``TREEJAX_COMPILATION_CACHE=off``) and twice with a fresh cache folder
(``TREEJAX_COMPILATION_CACHE=<out>/cache``), and prints the seconds from each command's start to its first step
line (``step 1/N done in ...``: model load, the held-out evaluation before training and the first RL step, with
their compiles). The second run of each pair is what a user sees when rerunning. ``--full`` lets the last run
finish and reports its wall time and the disk its log folder and the cache take.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(p, f)) for p, _, fs in os.walk(path) for f in fs)


def time_to_first_step(out: str, name: str, cache: str, params: list[str], full: bool = False) -> dict:
    log_dir = os.path.join(out, name)
    env = dict(os.environ, TREEJAX_COMPILATION_CACHE=cache)
    cmd = [sys.executable, "-m", "treejax.train", "--gin_param", f"RunConfig.log_dir='{log_dir}'"]
    cmd += sum((["--gin_param", p] for p in params), [])
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
    first = None
    for line in proc.stdout:
        if first is None and " done in " in line and line.split("step ", 1)[-1][:1].isdigit():
            first = time.perf_counter() - t0
            print(f"  {name}: first step line after {first:.1f} s", flush=True)
            if not full:
                proc.terminate()  # only this run's own process
                break
    proc.wait()
    row = {"run": name, "cache": cache, "first_step_s": first}
    if full:
        row.update(wall_s=time.perf_counter() - t0, log_dir_bytes=_du(log_dir),
                   checkpoint_bytes=_du(os.path.join(log_dir, "checkpoints")),
                   hf_export_bytes=_du(os.path.join(log_dir, "hf_export")))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="a scratch folder (emptied first)")
    ap.add_argument("--gin_param", action="append", default=[])
    ap.add_argument("--full", action="store_true", help="let the last run finish; report its wall time and disk")
    args = ap.parse_args()
    shutil.rmtree(args.out, ignore_errors=True)
    os.makedirs(args.out)
    cache = os.path.join(args.out, "cache")
    rows = [time_to_first_step(args.out, "off_1", "off", args.gin_param),
            time_to_first_step(args.out, "off_2", "off", args.gin_param),
            time_to_first_step(args.out, "cache_1", cache, args.gin_param),
            time_to_first_step(args.out, "cache_2", cache, args.gin_param, full=args.full)]
    rows[-1]["cache_bytes"] = _du(cache)
    print(json.dumps(rows, indent=1))
    print(f"second run, time to the first step line: {rows[1]['first_step_s']:.1f} s without the cache, "
          f"{rows[3]['first_step_s']:.1f} s with it")


if __name__ == "__main__":
    main()
