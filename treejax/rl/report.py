"""The end-of-run summary a user reads in the console."""

from __future__ import annotations


def format_summary(s: dict) -> str:
    """Human-readable summary of :func:`treejax.rl.loop.run`'s result."""
    before, after = s["eval_before"], s["eval_after"]
    lines = [
        "",
        f"treejax run: {s['model']} on {s['task']} with {s['estimator']}, {s['steps']} RL steps "
        f"in {s['total_s']:.0f} s",
        f"  held-out greedy accuracy: {before['accuracy']:.1%} before -> {after['accuracy']:.1%} after "
        f"(n = {after['n']})",
    ]
    if "pass@k" in after:
        k = after["k"]
        lines.append(f"  held-out with {k} samples: pass@1 {before['pass@1']:.1%} -> {after['pass@1']:.1%}, pass@{k} "
                     f"{before['pass@k']:.1%} -> {after['pass@k']:.1%}, maj@{k} {before['maj@k']:.1%} -> "
                     f"{after['maj@k']:.1%}")
    if s["history"]:
        last = s["history"][-1]
        acc = f", rollout accuracy {last['reward/accuracy']:.1%}" if "reward/accuracy" in last else ""
        lines.append(f"  last step: reward {last['reward/mean']:+.3f}{acc}, rollout {last['time/rollout_s']:.1f} s, "
                     f"scoring {last['time/scoring_s']:.1f} s, old log-probs {last['time/logp_s']:.1f} s, "
                     f"update {last['time/update_s']:.1f} s")
    if s.get("divergence"):
        d = s["divergence"]
        lines.append(f"  WARNING: training looked diverged at step(s) {', '.join(str(x['step']) for x in d)} "
                     f"({d[0]['why']}); the checkpoint and export hold that model. Lower "
                     "OptimizerConfig.learning_rate; RunConfig.nonfinite='raise' stops such a run before export.")
    lines.append(f"  decoded tokens: {s['decoded_tokens']} in {s['steps']} steps; precision: "
                 f"{s['precision']['param_dtype']} master, {s['precision']['compute_dtype']} compute")
    lines += [
        f"  TensorBoard logs: {s['log_dir']}",
        f"  checkpoint:       {s['checkpoint_dir']}",
    ]
    if s.get("hf_export"):
        lines.append(f"  HF export:        {s['hf_export']}")
    if s.get("tree_picture"):
        lines.append(f"  tree picture:     {s['tree_picture']}")
    return "\n".join(lines)
