"""What a user reads: the line after each step, the tree picture and sample texts, the end-of-run summary."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
from tqdm import tqdm

from treejax import viz
from treejax.parallel import multihost
from treejax.rl.rollouts import Rollouts, first_prompt
from treejax.rl.scoring import leaf_texts, reward_range


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
    if "tool_accuracy" in after:
        lines.append(f"  held-out with the tools (one greedy episode each): {before['tool_accuracy']:.1%} before -> "
                     f"{after['tool_accuracy']:.1%} after, {after['tool_calls_mean']:.2f} calls an episode")
    if "pass@k" in after:
        k = after["k"]
        lines.append(f"  held-out with {k} samples: pass@1 {before['pass@1']:.1%} -> {after['pass@1']:.1%}, pass@{k} "
                     f"{before['pass@k']:.1%} -> {after['pass@k']:.1%}, maj@{k} {before['maj@k']:.1%} -> "
                     f"{after['maj@k']:.1%}")
    if s["history"]:
        last = s["history"][-1]
        acc = f", rollout accuracy {last['reward/accuracy']:.1%}" if "reward/accuracy" in last else ""
        lines.append(f"  last step: reward {last['reward/mean']:+.3f}{acc}, rollout {last['time/rollout_s']:.1f} s, "
                     f"scoring {last['time/scoring_s']:.1f} s, update {last.get('time/update_s', 0.0):.1f} s")
    if s.get("divergence"):
        d = s["divergence"]
        lines.append(f"  WARNING: training looked diverged at step(s) {', '.join(str(x['step']) for x in d)} "
                     f"({d[0]['why']}); the checkpoint and export hold that model. Lower "
                     "OptimizerConfig.learning_rate; RunConfig.nonfinite='raise' stops such a run before export.")
    lines.append(f"  decoded tokens: {s['decoded_tokens']} in {s['steps']} steps; precision: "
                 f"{s['precision']['param_dtype']} master, {s['precision']['compute_dtype']} compute")
    mem = s.get("memory") or {}
    if mem.get("measured_peak_bytes") is not None or mem.get("planned_peak_bytes") is not None:
        gib = lambda b: "n/a" if b is None else f"{b / 2**30:.1f} GiB"  # noqa: E731
        lines.append(f"  device memory: peak {gib(mem.get('measured_peak_bytes'))} per device measured, "
                     f"{gib(mem.get('planned_peak_bytes'))} planned (treejax-plan)")
    if "compile_s" in s:
        later = s.get("compile_after_first_step_s")
        layouts = f", {s['packing_layouts']} packed layout(s)" if "packing_layouts" in s else ""
        lines.append(f"  programs: {s['compile_programs']} compiled or loaded in {s['compile_s']:.1f} s"
                     + ("" if later is None else f" ({later:.1f} s of it after the first step)") + layouts)
    lines += [
        f"  TensorBoard logs: {s['log_dir']}",
        f"  checkpoint:       {s['checkpoint_dir'] or 'none (RunConfig.save_final = False)'}",
    ]
    if s.get("hf_export"):
        lines.append(f"  HF export:        {s['hf_export']}")
    if s.get("tree_picture"):
        lines.append(f"  tree picture:     {s['tree_picture']}")
    return "\n".join(lines)


def step_line(done: int, total: int, host: dict, step_s: float) -> str:
    """The line printed as soon as step ``done`` ends: its host-side results, its time and an ETA (the remaining
    steps at this step's time; the first step also compiles, so its ETA is an upper bound). The update's metrics
    (loss, gradient norm, ...) are read one step later and follow in the step's full line."""
    parts = [f"reward {host['reward/mean']:+.3f}"]
    if "reward/accuracy" in host:
        parts.append(f"accuracy {100 * host['reward/accuracy']:.1f}%")
    parts.append(f"{host.get('rollout/decoded_tokens', 0)} decoded tokens")
    eta = f"ETA {tqdm.format_interval((total - done) * step_s)}" if done < total else "last step"
    return f"step {done}/{total} done in {step_s:.1f} s: {', '.join(parts)} | {eta}"


def sample_completions(tokenizer, ro: Rollouts, leaves: int = 3) -> str:
    """A few leaves of the first prompt as Markdown (reward, verifier score, text) for TensorBoard's text tab
    (gathers prompt 0's leaves in a multi-process run: call it on every process)."""
    texts = leaf_texts(tokenizer, first_prompt(ro.forest))[0]
    rewards = np.asarray(ro.rewards_PxW)[0]
    lines = []
    for w in range(min(leaves, len(texts))):
        score = "" if ro.scores_PxW is None else f", score {ro.scores_PxW[0, w]:.2f}"
        lines.append(f"**leaf {w}** (reward {rewards[w]:+.2f}{score}):\n\n    " + texts[w].replace("\n", "\n    "))
    return "\n\n".join(lines)


def write_tree_picture(cfg, tokenizer, writer, ro: Rollouts, done: int) -> str:
    """Draws prompt 0's tree of step ``done`` (``log_dir/tree_step{done}.png``; process 0 writes it and the
    sample texts to TensorBoard) and returns the picture's path. A collective: call it on every process."""
    picture = os.path.join(cfg.log_dir, f"tree_step{done}.png")
    first = first_prompt(ro.forest)  # gathered on every process
    if multihost.is_primary():
        texts = {}
        if cfg.tree_picture_text:  # the tree is on the host already: no collective here
            texts = dict(prompt_text=ro.examples[0].prompt_messages[-1]["content"],
                         leaf_texts=leaf_texts(tokenizer, first)[0])
        viz.draw_tree(first, np.asarray(ro.rewards_PxW)[:1], picture, prompt=0,
                      title=f"step {done}: prompt 0, {cfg.rollout.num_leaves} leaves",
                      reward_range=reward_range(cfg.reward_style, cfg.overlong_buffer, cfg.overlong_factor),
                      correct=ro.scores_PxW[:1] >= 1.0, **texts)
        writer.write_image(done, "rollout/tree", picture)
        writer.write_text(done, "rollout/samples", sample_completions(tokenizer, dataclasses.replace(ro, forest=first)))
    return os.path.abspath(picture)
