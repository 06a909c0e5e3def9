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
    if s["history"]:
        last = s["history"][-1]
        lines.append(f"  last step: reward {last['reward/mean']:+.3f}, rollout accuracy {last['reward/accuracy']:.1%}"
                     f", rollout {last['time/rollout_s']:.1f} s, update {last['time/update_s']:.1f} s")
    tree, ind = s["tree_decoded_tokens"], s["independent_decoded_tokens"]
    if ind:
        lines.append(f"  decoded tokens: tree {tree} vs independent sampling {ind} "
                     f"({1 - tree / ind:+.1%} saved); rollout time {s['tree_rollout_s']:.1f} s vs "
                     f"{s['independent_rollout_s']:.1f} s")
    else:
        lines.append(f"  decoded tokens (tree): {tree}")
    lines += [
        f"  TensorBoard logs: {s['log_dir']}",
        f"  checkpoint:       {s['checkpoint_dir']}",
    ]
    if s.get("hf_export"):
        lines.append(f"  HF export:        {s['hf_export']}")
    if s.get("tree_picture"):
        lines.append(f"  tree picture:     {s['tree_picture']}")
    return "\n".join(lines)
