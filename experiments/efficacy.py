"""The efficacy study: methods x seeds, held-out accuracy against training wall-clock seconds and decoded tokens.

Run every config x seed on one accelerator (each run a fresh ``treejax-train`` process, so each pays its own
compilation, as a user's run would; one after another, or ``--parallel N`` at once), then write the report::

    python experiments/efficacy.py run --seeds 0 1 2 --out runs/efficacy \\
        configs/efficacy_grpo.gin configs/efficacy_slots_k8.gin configs/efficacy_treepo.gin
    python experiments/efficacy.py report --runs runs/efficacy --out experiments/results/unbiased \\
        [--rollouts experiments/results/unbiased/rollouts_efficacy.json]   # compare_rollouts.py --json output

``run`` writes ``<out>/<method>/seed<k>/`` (the run's log folder; ``<method>`` is the config's file name without
``efficacy_``) and skips runs whose ``summary.json`` exists, so an interrupted sweep continues where it stopped;
seeds are the outer loop, so a partial sweep has every method at the same number of seeds. Extra ``--gin_param``
bindings go to every run (e.g. ``RunConfig.model='/path/to/smollm2.gguf'``).

``report`` reads every ``summary.json`` and writes:

* ``efficacy.json``: per run, its held-out curve (step, training seconds, decoded tokens, greedy accuracy) and its
  mean per-step times; per method, the curves' mean and min/max over seeds, and the table's numbers;
* ``efficacy.png``: held-out greedy accuracy against training seconds and against decoded tokens (mean over seeds,
  band = min..max over seeds at each evaluation step, drawn at the seeds' mean x);
* ``efficacy.md``: the table (below) and the time split.

Definitions. *Training seconds* at evaluation step ``s`` = wall-clock seconds from the end of the step-0 evaluation
to the end of step ``s``, minus the time spent in evaluations in between and minus the first step's compilation
(its time above the run's median step time, reported apart): rollout, scoring, old log-probs, update and host work,
nothing of the model load, the evaluations or the compiler (whose time depends on the persistent compilation
cache, not on the method).
*Decoded tokens* = the sampler's ``rollout/decoded_tokens`` summed over steps (a shared prefix counts once;
dynamic-sampling refills included). *Target* = GRPO's final accuracy, mean over its seeds; *time / tokens to
target* = the mean over seeds of training seconds / tokens at the first evaluation step where the method's
mean-over-seeds accuracy is at or above the target (no interpolation between evaluation steps; "-" when never
reached). Ratios are to GRPO's own time / tokens to the target.
"""

from __future__ import annotations

import argparse
import glob
import json
import math
import os
import subprocess
import sys
import time

import numpy as np

BASELINE = "grpo"


def method_name(config_path: str) -> str:
    stem = os.path.splitext(os.path.basename(config_path))[0]
    return stem[len("efficacy_"):] if stem.startswith("efficacy_") else stem


# --------------------------------------------------------------------------------------------------------- run
def run(configs: list[str], seeds: list[int], out: str, gin_params: list[str], dry_run: bool = False,
        parallel: int = 1, devices: list[str] | None = None, stop_after: float | None = None) -> None:
    """Every config x seed, seeds as the outer loop; ``parallel > 1`` keeps up to that many runs going at once
    (each its own process; its output goes to ``<log_dir>.log``). ``devices`` (GPU ids): each new run goes to the
    device with the fewest runs going (``CUDA_VISIBLE_DEVICES``), so ``--parallel 8 --devices 0 1 2 3`` keeps two
    runs on each of 4 GPUs; without it every run sees every device. Concurrent runs share their card, so their
    seconds compare only with runs that shared it in the same way. ``stop_after``: no run starts after that many
    seconds (the runs going are waited for; a later call continues the sweep)."""
    names = [method_name(c) for c in configs]
    if len(set(names)) != len(names):
        raise SystemExit(f"two configs have the same method name: {names}")
    for c in configs:
        if not os.path.exists(c):
            raise SystemExit(f"no such config: {c}")
    jobs = []
    for seed in seeds:
        for config, name in zip(configs, names):
            log_dir = os.path.join(out, name, f"seed{seed}")
            if os.path.exists(os.path.join(log_dir, "summary.json")):
                print(f"[efficacy] {name} seed {seed}: done already ({log_dir})", flush=True)
                continue
            cmd = [sys.executable, "-m", "treejax.train", "--gin_file", config]
            cmd += ["--overwrite"] if os.path.exists(log_dir) else []  # what an interrupted run left
            cmd += ["--gin_param", f"RunConfig.seed={seed}", "--gin_param", f"RunConfig.log_dir='{log_dir}'"]
            for p in gin_params:
                cmd += ["--gin_param", p]
            print(f"[efficacy] {name} seed {seed}: {' '.join(cmd)}", flush=True)
            if not dry_run:
                jobs.append((f"{name} seed {seed}", log_dir, cmd))
    running, failed = [], []
    t_sweep = time.perf_counter()

    def reap(block: bool):
        for item in list(running):
            label, proc, t0, fh, _ = item
            if proc.poll() is None and not block:
                continue
            code = proc.wait()
            if fh is not None:
                fh.close()
            running.remove(item)
            print(f"[efficacy] {label}: exit {code} after {time.perf_counter() - t0:.0f} s", flush=True)
            if code != 0:
                failed.append(label)
            if block:
                return

    for label, log_dir, cmd in jobs:
        while len(running) >= max(parallel, 1):
            reap(block=False)
            if len(running) >= max(parallel, 1):
                time.sleep(1.0)
        if stop_after is not None and time.perf_counter() - t_sweep > stop_after:
            print(f"[efficacy] {label}: not started (stop_after={stop_after:.0f} s passed)", flush=True)
            continue
        fh = None
        if parallel > 1:
            os.makedirs(os.path.dirname(log_dir), exist_ok=True)
            fh = open(log_dir + ".log", "w")
        env, device = None, None
        if devices:
            device = min(devices, key=lambda d: sum(1 for item in running if item[4] == d))
            env = dict(os.environ, CUDA_VISIBLE_DEVICES=str(device))
            print(f"[efficacy] {label}: on device {device}", flush=True)
        running.append((label, subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT if fh else None, env=env),
                        time.perf_counter(), fh, device))
        if parallel <= 1:
            reap(block=True)
            if failed:
                raise SystemExit(f"run {failed[0]} failed; see {log_dir}")
    while running:
        reap(block=True)
    if failed:
        raise SystemExit(f"runs failed: {failed}")


# ------------------------------------------------------------------------------------------------------ report
def _step_seconds(h: dict) -> float:
    return sum(float(h.get(k, 0.0)) for k in ("time/rollout_s", "time/scoring_s", "time/logp_s", "time/update_s"))


def curve_of(summary: dict) -> dict:
    """A run's held-out curve: per evaluation step its training seconds, decoded tokens and greedy accuracy."""
    evals = sorted(summary["evals"], key=lambda e: e["step"])
    if not evals or evals[0]["step"] != 0:
        raise ValueError(f"{summary.get('log_dir')}: the run has no step-0 evaluation")
    hist = sorted(summary["history"], key=lambda h: h["step"])
    tokens_by_step, total = {}, 0
    for h in hist:
        total += int(h.get("rollout/decoded_tokens", 0))
        tokens_by_step[h["step"]] = total
    # the first step compiles the rollout and the update: its time above a typical step's is compilation
    typical = float(np.median([_step_seconds(h) for h in hist[1:]])) if len(hist) > 1 else 0.0
    compile_s = max(_step_seconds(hist[0]) - typical, 0.0) if hist else 0.0
    steps, seconds, tokens, acc = [], [], [], []
    eval_time = 0.0
    for e in evals:
        if e["step"] > 0:
            eval_time += e["eval_s"]
        steps.append(int(e["step"]))
        seconds.append(0.0 if e["step"] == 0 else e["wall_s"] - evals[0]["wall_s"] - eval_time - compile_s)
        tokens.append(0 if e["step"] == 0 else tokens_by_step[e["step"]])
        acc.append(float(e["accuracy"]))
    keys = ("time/rollout_s", "time/scoring_s", "time/logp_s", "time/update_s")
    split = {k.split("/")[1]: float(np.median([h[k] for h in hist[1:] if k in h])) for k in keys
             if any(k in h for h in hist[1:])}
    leaf = [h["rollout/mean_leaf_length"] for h in hist if "rollout/mean_leaf_length" in h]
    return {"step": steps, "seconds": seconds, "tokens": tokens, "accuracy": acc, "median_step_times": split,
            "compile_s": compile_s, "model": os.path.basename(str(summary.get("model", "?"))), "mean_leaf_length": float(np.mean(leaf)) if leaf else float("nan")}


def _first_reaching(mean_acc, target):
    for i, a in enumerate(mean_acc):
        if a >= target - 1e-12:
            return i
    return None


def summarize(runs: dict[str, dict[int, dict]], baseline: str = BASELINE) -> dict:
    """Per method: mean/min/max curves over seeds and the table's numbers (see the module docstring); the target
    and the ratios are ``baseline``'s."""
    if baseline not in runs:
        raise SystemExit(f"no {baseline!r} runs to compare with (methods found: {sorted(runs)})")
    methods = {}
    for name, by_seed in runs.items():
        curves = [curve_of(s) for _, s in sorted(by_seed.items())]
        steps = curves[0]["step"]
        for c in curves:
            if c["step"] != steps:
                raise SystemExit(f"{name}: seeds evaluated at different steps ({c['step']} vs {steps})")
        acc = np.array([c["accuracy"] for c in curves])
        sec = np.array([c["seconds"] for c in curves])
        tok = np.array([c["tokens"] for c in curves], np.float64)
        methods[name] = {
            "seeds": sorted(by_seed), "step": steps,
            "device": ", ".join(sorted({str(s.get("device") or "not recorded") for s in by_seed.values()})),
            "accuracy_mean": acc.mean(0).tolist(), "accuracy_min": acc.min(0).tolist(),
            "accuracy_max": acc.max(0).tolist(), "seconds_mean": sec.mean(0).tolist(),
            "tokens_mean": tok.mean(0).tolist(),
            "final_accuracy": acc[:, -1].tolist(), "initial_accuracy": float(acc[:, 0].mean()),
            "median_step_times": {k: float(np.mean([c["median_step_times"][k] for c in curves]))
                                  for k in curves[0]["median_step_times"]},
            "compile_s": float(np.mean([c["compile_s"] for c in curves])),
            "mean_leaf_length": float(np.mean([c["mean_leaf_length"] for c in curves])),
            "runs": {seed: c for seed, c in zip(sorted(by_seed), curves)},
        }
    target = float(np.mean(methods[baseline]["final_accuracy"]))
    for name, m in methods.items():
        i = _first_reaching(m["accuracy_mean"], target)
        m["target"] = target
        m["step_to_target"] = None if i is None else m["step"][i]
        m["seconds_to_target"] = None if i is None else m["seconds_mean"][i]
        m["tokens_to_target"] = None if i is None else m["tokens_mean"][i]
    base = methods[baseline]
    for m in methods.values():
        for what in ("seconds", "tokens"):
            a, b = m[f"{what}_to_target"], base[f"{what}_to_target"]
            m[f"{what}_ratio"] = None if a is None or not b else a / b
    return {"target": target, "baseline": baseline, "methods": methods}


def table(summary: dict, device: str) -> str:
    def fmt(x, spec):
        return "-" if x is None or (isinstance(x, float) and math.isnan(x)) else format(x, spec)

    # runs on different cards in one report: each row names its card (times compare only within a card)
    cards = len({m.get("device") for m in summary["methods"].values()}) > 1
    card = (lambda m: f" {m.get('device')} |") if cards else (lambda m: "")  # noqa: E731
    lines = [
        f"Held-out greedy accuracy ({device}); target = {summary['baseline']}'s final mean accuracy "
        f"{100 * summary['target']:.1f}%." + (" Seconds compare only between rows of the same card." if cards else ""),
        "",
        "| method |" + (" card |" if cards else "") + " seeds | start | final (mean, min-max) | train s (final) | "
        "tokens (final) | step to target | s to target | ratio | tokens to target | ratio |",
        "|---|" + ("---|" if cards else "") + "---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, m in summary["methods"].items():
        f = np.array(m["final_accuracy"]) * 100
        lines.append(
            f"| {name} |{card(m)} {len(m['seeds'])} | {100 * m['initial_accuracy']:.1f}% | {f.mean():.1f}% "
            f"({f.min():.1f}-{f.max():.1f}) | {m['seconds_mean'][-1]:.0f} | {m['tokens_mean'][-1] / 1e6:.2f} M | "
            f"{fmt(m['step_to_target'], 'd')} | {fmt(m['seconds_to_target'], '.0f')} | "
            f"{fmt(m['seconds_ratio'], '.2f')} | "
            f"{'-' if m['tokens_to_target'] is None else format(m['tokens_to_target'] / 1e6, '.2f') + ' M'} | "
            f"{fmt(m['tokens_ratio'], '.2f')} |")
    lines += ["", "Median seconds per training step, first-step compilation (excluded above), decoded tokens per "
              "step and mean leaf length (means over seeds; runs of the loop since the collect -> learn re-cut "
              "count the old log-probs in the update's time and show - for them):", "",
              "| method |" + (" card |" if cards else "") + " rollout | scoring | old log-probs | update | compile | "
              "tokens / step | mean leaf tokens |", "|---|" + ("---|" if cards else "") + "---|---|---|---|---|---|---|"]
    for name, m in summary["methods"].items():
        t = m["median_step_times"]
        per_step = m["tokens_mean"][-1] / max(m["step"][-1], 1)
        lines.append(f"| {name} |{card(m)} " + " | ".join(fmt(t.get(k), ".3f") for k in ("rollout_s", "scoring_s", "logp_s",
                                                                                   "update_s"))
                     + f" | {m['compile_s']:.0f} s | {per_step:,.0f} | {m['mean_leaf_length']:.1f} |")
    return "\n".join(lines) + "\n"


def rollout_table(paths: list[str]) -> str:
    """The "does a tree pay?" diagnostic of each arm under the base policy (experiments/compare_rollouts.py JSON):
    weighted (w.) leaf statistics = what the leaves stand for under the policy, distinct (d.) = what was decoded."""
    lines = ["| config | arm | tokens / call | s / call | w. length | w. truncated | d. length | d. truncated | "
             "ESS / prompt | ESS / 1k tokens | vs independent |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    for p in paths:
        with open(p) as f:
            data = json.load(f)
        config = ", ".join(os.path.basename(c) for c in data.get("config") or []) or os.path.basename(p)
        for arm, s in data["methods"].items():
            w, d = s["weighted"], s["distinct"]
            lines.append(
                f"| {config} | {arm} | {s['decoded_per_call']:,.0f} | {s['rollout_s_per_call']:.3f} | "
                f"{w['length_mean']:.1f} | {100 * w['truncated']:.1f}% | {d['length_mean']:.1f} | "
                f"{100 * d['truncated']:.1f}% | {s['ess_per_prompt']:.2f} | {s['ess_per_1k_tokens']:.2f} | "
                f"{s['ess_per_token_vs_independent']:.2f} |")
    return "\n".join(lines) + "\n"


def plot(summary: dict, path: str, device: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    for name, m in summary["methods"].items():
        acc, lo, hi = (100 * np.array(m[k]) for k in ("accuracy_mean", "accuracy_min", "accuracy_max"))
        for ax, x in ((axes[0], np.array(m["seconds_mean"])), (axes[1], np.array(m["tokens_mean"]) / 1e6)):
            (line,) = ax.plot(x, acc, marker="o", ms=3, label=f"{name} ({len(m['seeds'])} seeds)")
            ax.fill_between(x, lo, hi, color=line.get_color(), alpha=0.15)
    for ax, xlabel in ((axes[0], "training seconds (evaluations and compilation excluded)"), (axes[1], "decoded tokens (M)")):
        ax.axhline(100 * summary["target"], color="grey", ls=":", lw=1, label=f"{summary['baseline']} final (mean)")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("held-out greedy accuracy (%)")
        ax.grid(alpha=0.3)
    axes[0].legend(fontsize=8, loc="lower right")
    models = sorted({str(r.get("model", "?")) for m in summary["methods"].values() for r in m["runs"].values()})
    fig.suptitle(f"Held-out accuracy against compute: {', '.join(models)}, {device}", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def load_runs(runs_dir: str) -> dict[str, dict[int, dict]]:
    """``{method: {seed: summary}}`` from ``<runs_dir>/<method>/seed<k>/summary.json`` (what ``run`` writes) or
    ``<runs_dir>/<method>_seed<k>.json`` (summaries copied flat, as committed under experiments/results)."""
    found = []
    for path in glob.glob(os.path.join(runs_dir, "*", "seed*", "summary.json")):
        found.append((os.path.basename(os.path.dirname(os.path.dirname(path))),
                      os.path.basename(os.path.dirname(path))[len("seed"):], path))
    for path in glob.glob(os.path.join(runs_dir, "*_seed*.json")):
        method, _, seed = os.path.splitext(os.path.basename(path))[0].rpartition("_seed")
        found.append((method, seed, path))
    runs: dict[str, dict[int, dict]] = {}
    for method, seed, path in sorted(found):
        if not seed.isdigit():
            continue
        with open(path) as f:
            runs.setdefault(method, {})[int(seed)] = json.load(f)
    if not runs:
        raise SystemExit(f"no runs under {runs_dir} (expected <method>/seed<k>/summary.json or <method>_seed<k>.json)")
    return runs


def report(runs_dir: str, out: str, rollouts: list[str], device: str | None, baseline: str = BASELINE) -> dict:
    runs = load_runs(runs_dir)
    order = [baseline] + sorted(m for m in runs if m != baseline)
    summary = summarize({m: runs[m] for m in order if m in runs}, baseline)
    found = sorted({s.get("device") for by_seed in runs.values() for s in by_seed.values()} - {None})
    device = device or (", ".join(found) if found else "device not recorded")
    os.makedirs(out, exist_ok=True)
    md = table(summary, device)
    if rollouts:
        md += "\nTree vs independent sampling under the base policy (experiments/compare_rollouts.py):\n\n"
        md += rollout_table(rollouts)
    with open(os.path.join(out, "efficacy.md"), "w") as f:
        f.write(md)
    with open(os.path.join(out, "efficacy.json"), "w") as f:
        json.dump({"device": device, **summary}, f, indent=1, default=float)
    plot(summary, os.path.join(out, "efficacy.png"), device)
    print(md)
    return summary


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="run configs x seeds")
    r.add_argument("configs", nargs="+")
    r.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    r.add_argument("--out", default="runs/efficacy")
    r.add_argument("--gin_param", action="append", default=[])
    r.add_argument("--dry_run", action="store_true")
    r.add_argument("--parallel", type=int, default=1, help="runs at once (default 1)")
    r.add_argument("--devices", nargs="+", default=None, help="GPU ids: each run on the least busy one")
    r.add_argument("--stop_after", type=float, default=None, help="start no run after this many seconds")
    p = sub.add_parser("report", help="write efficacy.json / .png / .md from the runs")
    p.add_argument("--runs", default="runs/efficacy")
    p.add_argument("--out", default="experiments/results/efficacy")
    p.add_argument("--rollouts", nargs="*", default=[], help="compare_rollouts.py JSON files for the length table")
    p.add_argument("--device", default=None, help="the accelerator's name (default: read from the runs)")
    p.add_argument("--baseline", default=BASELINE, help=f"the method the others are compared with ({BASELINE!r})")
    args = ap.parse_args(argv)
    if args.cmd == "run":
        run(args.configs, args.seeds, args.out, args.gin_param, args.dry_run, args.parallel, args.devices,
            args.stop_after)
    else:
        report(args.runs, args.out, args.rollouts, args.device, args.baseline)


if __name__ == "__main__":
    main()
