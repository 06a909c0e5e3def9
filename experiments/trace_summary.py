"""Where a profiled program's time goes: device kernel time summed by kernel name from ``jax.profiler`` traces.

Reads every ``perfetto_trace.json.gz`` under a folder (what ``jax.profiler.trace(dir, create_perfetto_trace=True)``
writes, e.g. ``bench_sampler.py --profile DIR`` or ``bench_packed.py --profile DIR``), takes the complete events
(``ph == "X"``) of the device processes (process names containing ``/device:``; on a machine without one, e.g. a
CPU run, every process, so the tool can be checked anywhere) and prints, per trace, the kernels by total time::

    share   total ms   calls   name

``share`` is of the summed kernel time (kernels on several streams may overlap, so it is a share of work, not of
wall time). ``--match SUBSTRING`` restricts to names containing it (e.g. ``tree_flash`` or ``fusion``).

    python experiments/trace_summary.py /tmp/prof --top 25
"""

from __future__ import annotations

import argparse
import collections
import glob
import gzip
import json
import os


def summarize(path: str, match: str | None = None) -> dict:
    """``{"processes": [...], "total_us": float, "kernels": [(name, total_us, calls), ...]}`` (largest first) of
    one perfetto trace file."""
    with gzip.open(path) as f:
        data = json.load(f)
    events = data["traceEvents"] if isinstance(data, dict) else data
    names = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {pid for pid, name in names.items() if "/device:" in name}
    pids = device or set(names)
    total, calls = collections.Counter(), collections.Counter()
    for e in events:
        if e.get("ph") == "X" and e.get("pid") in pids and "dur" in e:
            if match is None or match in e["name"]:
                total[e["name"]] += float(e["dur"])
                calls[e["name"]] += 1
    return dict(processes=sorted(names[p] for p in pids), total_us=sum(total.values()),
                kernels=[(n, t, calls[n]) for n, t in total.most_common()])


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("folder", help="a folder holding jax.profiler traces (searched recursively)")
    ap.add_argument("--top", type=int, default=25, help="kernels printed per trace")
    ap.add_argument("--match", default=None, help="only kernel names containing this")
    ap.add_argument("--json", default=None, help="write the summaries here")
    args = ap.parse_args(argv)
    files = sorted(glob.glob(os.path.join(args.folder, "**", "perfetto_trace.json.gz"), recursive=True))
    if not files:
        raise SystemExit(f"no perfetto_trace.json.gz under {args.folder!r} (jax.profiler.trace(..., "
                         "create_perfetto_trace=True) writes them)")
    out = {}
    for path in files:
        s = out[path] = summarize(path, args.match)
        print(f"\n{os.path.relpath(path, args.folder)}: {', '.join(s['processes'])}; "
              f"{s['total_us'] / 1e3:.3f} ms of events")
        print(f"{'share':>7} {'total ms':>10} {'calls':>7}  name")
        for name, t, n in s["kernels"][: args.top]:
            print(f"{100 * t / max(s['total_us'], 1e-9):6.1f}% {t / 1e3:10.3f} {n:7d}  {name[:100]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return out


if __name__ == "__main__":
    main()
