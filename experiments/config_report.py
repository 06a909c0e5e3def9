"""One table of the short real jobs of ``experiments/config_runs.sh``: per config, its exit status, estimator,
task, device, steps, held-out accuracy before -> after, decoded tokens, loop and total seconds, and the last line
of its log when it wrote no ``summary.json`` (what stopped it). When some job is multi-turn (its evaluation has
``tool_accuracy``: one greedy episode with the world per problem), a column "with tools before -> after (calls)"
gives that accuracy and the mean tool calls an episode after training; the plain column is then the single-turn
greedy answer without tools.

    python experiments/config_report.py OUT_DIR [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import sys


def rows(out: str) -> list[dict]:
    """One dict per ``NAME.log`` in ``out``."""
    result = []
    for log in sorted(f for f in os.listdir(out) if f.endswith(".log")):
        name = log[:-4]
        rc_path, summary_path = os.path.join(out, f"{name}.rc"), os.path.join(out, name, "summary.json")
        rc = open(rc_path).read().strip() if os.path.exists(rc_path) else "?"
        row = {"config": name, "rc": rc}
        if os.path.exists(summary_path):
            s = json.load(open(summary_path))
            acc = lambda e, k="accuracy": (s.get(e) or {}).get(k)  # noqa: E731
            row.update(tool_before=acc("eval_before", "tool_accuracy"), tool_after=acc("eval_after", "tool_accuracy"),
                       calls_after=acc("eval_after", "tool_calls_mean"),
                       estimator=s.get("estimator"), task=s.get("task"), device=s.get("device"),
                       steps=s.get("steps"), acc_before=acc("eval_before"), acc_after=acc("eval_after"),
                       n_eval=(s.get("eval_after") or {}).get("n"), decoded_tokens=s.get("decoded_tokens"),
                       loop_s=s.get("loop_s"), total_s=s.get("total_s"))
        else:
            lines = [ln.strip() for ln in open(os.path.join(out, log), errors="replace") if ln.strip()]
            row["last_line"] = lines[-1][:160] if lines else "(empty log)"
        result.append(row)
    return result


def table(rs: list[dict]) -> str:
    fmt = lambda x, p=1: "-" if x is None else (f"{100 * x:.{p}f}%" if isinstance(x, float) and x <= 1 else str(x))  # noqa: E731
    tools = any(r.get("tool_after") is not None for r in rs)
    cols = ["config", "rc", "estimator", "task", "steps", "accuracy before -> after (n)"]
    cols += ["with tools before -> after (calls)"] if tools else []
    cols += ["decoded tokens", "loop s", "total s"]
    out = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in rs:
        if "last_line" in r:
            out.append(f"| {r['config']} | {r['rc']} | no summary: {r['last_line']} |" + "|" * (len(cols) - 3))
            continue
        cells = [r["config"], r["rc"], r["estimator"], r["task"], r["steps"],
                 f"{fmt(r['acc_before'])} -> {fmt(r['acc_after'])} ({r['n_eval']})"]
        if tools:
            calls = "" if r.get("calls_after") is None else f" ({r['calls_after']:.2f})"
            cells.append("-" if r.get("tool_after") is None else
                         f"{fmt(r.get('tool_before'))} -> {fmt(r['tool_after'])}{calls}")
        cells += [r["decoded_tokens"], f"{r['loop_s']:.1f}", f"{r['total_s']:.1f}"]
        out.append("| " + " | ".join(str(c) for c in cells) + " |")
    devices = sorted({r["device"] for r in rs if r.get("device")})
    return "\n".join(out) + (f"\n\ndevice: {', '.join(devices)}" if devices else "")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--json", help="also write the rows to this JSON file")
    a = ap.parse_args(argv)
    if not os.path.isdir(a.out):
        print(f"config_report: {a.out} is not a folder", file=sys.stderr)
        return 2
    rs = rows(a.out)
    print(table(rs))
    if a.json:
        json.dump(rs, open(a.json, "w"), indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
