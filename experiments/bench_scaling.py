"""Scaling of one RL step over 1, 2, 4, ... devices of one process (random weights, synthetic reward).

For each preset and device count ``n`` the loop's own pieces run on a mesh over the first ``n`` devices: the
TreePO tree rollout (KV cache and rows sharded over the mesh, the Pallas decode kernel per shard), the trainer's
old-logp pass and the sharded, donated update (``treejax.parallel.mesh.place_train_state`` /
``sharded_update``, as :mod:`treejax.rl.loop` builds them), driven by :func:`treejax.rl.step.rl_step` (``timed=True``:
each phase closed by a device sync, so the split is exact).
The work is the same at every ``n`` (strong scaling: the RL recipe fixes the global batch), so the scaling
efficiency of a phase is

    efficiency(n) = t(1) / (n * t(n))

(1.0 = perfectly parallel). A step's first call compiles and is not timed; the table shows the median of the
timed steps. ``--mesh data`` replicates the weights (pure data parallel: one gradient all-reduce per
micro-batch); ``--mesh fsdp`` shards weights, gradients and optimizer state (ZeRO-3; the sampler's 16-bit copy is
gathered once per step, ``treejax.parallel.axis_rules.SAMPLER_RULES``).

  python experiments/bench_scaling.py --preset qwen2.5-0.5b qwen2.5-1.5b --devices 1 2 --json scaling.json
  python experiments/bench_scaling.py --preset tiny --devices 1 2 --prompts 4 --leaves 4 --segment 8   # CPU smoke
"""

from __future__ import annotations

import argparse
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from treejax.models import presets, transformer
from treejax.parallel.axis_rules import SAMPLER_RULES
from treejax.parallel.mesh import (MeshConfig, batch_placer, logical_to_sharding, make_mesh, mesh_context,
                                   place_train_state, sharded_update)
from treejax.precision import Precision
from treejax.rl.losses import LossConfig
from treejax.rl.optimizer import OptimizerConfig, make_optimizer
from treejax.rl.packing import PackingConfig
from treejax.rl.config import StepConfig
from treejax.rl.layouts import make_layout
from treejax.rl.step import make_learner, rl_step
from treejax.rl.train_state import TrainState
from treejax.rl.update import make_update_fn
from treejax.sampling.decode import make_model_fns
from treejax.sampling.strategies import Temperature
from treejax.sampling.tree import TreeConfig, make_tree_rollout
from treejax.testing.sources import FixedPromptRollouts

PHASES = ("rollout", "logp", "update", "step")


def get_config(preset: str):
    if preset == "tiny":
        return presets.tiny_config("qwen2.5-0.5b", compute_dtype="float32")
    return presets.get_config(preset, param_dtype="float32", compute_dtype="bfloat16")


VARIANTS = ("treepo", "treepo+packed", "grpo")


def run_one(preset: str, mesh, args, variant: str = "treepo") -> dict:
    """Times ``args.steps`` RL steps (after one compiling step) of ``preset`` on ``mesh`` (call it under
    ``mesh_context(mesh)``, as the loop runs).

    ``variant``: ``treepo`` (tree rollout, b = 2, expanded update), ``treepo+packed`` (the same with the
    tree-packed update, sticky layouts) or ``grpo`` (the same code with independent samples: b = 1, all
    ``leaves`` paths opened at the root, no fallback; GRPO advantages)."""
    devices, n = list(mesh.devices.flat), mesh.size
    cfg = get_config(preset)
    precision = Precision(compute_dtype=cfg.compute_dtype).resolve()
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-6, warmup_steps=0, total_steps=100))
    params = jax.jit(lambda k: transformer.init_params(cfg, k))(jax.random.key(0))
    create = lambda p: TrainState.create(p, optimizer)  # noqa: E731
    axes = transformer.param_logical_axes(cfg)
    state, state_sh = place_train_state(params, axes, create, optimizer, mesh)
    del params
    loss = LossConfig(eps_high=0.28, dual_clip_c=10.0)
    if variant not in VARIANTS:
        raise SystemExit(f"unknown variant {variant!r}; known: {VARIANTS}")
    packing = PackingConfig() if variant == "treepo+packed" else None
    # the loop's defaults: cudnn flash attention (expanded) / the Pallas tree kernel (packed) on a GPU
    layout = make_layout(cfg, packing, attention_impl="auto", row_multiple=args.micro * n)
    update_fn = make_update_fn(layout, loss, optimizer, num_micro_batches=args.micro, remat=args.remat)
    update = sharded_update(update_fn, state_sh, mesh)
    fns = make_learner(cfg, StepConfig(estimator="grpo" if variant == "grpo" else "treepo", loss=loss,
                                       micro_batches=args.micro, row_multiple=args.micro * n, packing=packing),
                       precision, update, layout, batch_sharding=batch_placer(mesh),
                       sampler_shardings=logical_to_sharding(axes, mesh, SAMPLER_RULES, state.params))
    model_fns = make_model_fns(cfg, cache_dtype=precision.cache_dtype, mesh=mesh)
    shape = (dict(branch_factor=1, init_divergence=args.leaves, fallback=False) if variant == "grpo"
             else dict(branch_factor=2))
    rollout = make_tree_rollout(model_fns, TreeConfig(num_leaves=args.leaves, max_depth=args.depth,
                                                      segment_length=args.segment, strategy=Temperature(1.0),
                                                      stop_ids=(), **shape))
    rng = np.random.RandomState(0)
    prompts = rng.randint(3, cfg.sampling_vocab_size, (args.prompts, args.prompt_len)).astype(np.int32)
    source = FixedPromptRollouts(rollout, prompts, np.full((args.prompts,), args.prompt_len, np.int32),
                                 lambda f: jnp.mean((f.tokens % 7 == 0) * f.loss_mask, -1))  # synthetic reward
    t0 = time.perf_counter()
    state, _, metrics, host = rl_step(fns, state, source, jax.random.key(0), 0, timed=True)
    jax.block_until_ready(metrics)
    compile_s = time.perf_counter() - t0
    rows = []
    for it in range(1, args.steps + 1):
        t0 = time.perf_counter()
        state, _, metrics, host = rl_step(fns, state, source, jax.random.key(it), it, timed=True)
        loss_value = float(metrics["update/loss"])
        total = time.perf_counter() - t0
        rows.append({"rollout": host["time/rollout_s"], "logp": host["time/logp_s"],
                     "update": host["time/update_s"], "step": total,
                     "decoded_tokens": host["rollout/decoded_tokens"], "loss": loss_value,
                     **{k: v for k, v in host.items() if k.startswith("packing/")}})
    med = {k: float(np.median([r[k] for r in rows])) for k in PHASES}
    tokens = int(np.median([r["decoded_tokens"] for r in rows]))
    return {"preset": preset, "variant": variant, "devices": n, "mesh": dict(mesh.shape),
            "device_kind": devices[0].device_kind,
            "first_step_s": compile_s, **{f"{k}_s": v for k, v in med.items()}, "decoded_tokens": tokens,
            "rollout_tokens_per_s": tokens / med["rollout"], "steps": rows}


def table(results: list[dict]) -> str:
    """Markdown table; efficiency against the same preset and variant on one device."""
    base = {(r["preset"], r["variant"]): r for r in results if r["devices"] == 1}
    lines = ["| preset | variant | devices | mesh | rollout s | decoded tok/s | old-logp s | update s | RL step s | "
             "efficiency rollout / update / step |", "|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(results, key=lambda r: (r["preset"], r["variant"], r["devices"])):
        b = base.get((r["preset"], r["variant"]))
        eff = "" if b is None else " / ".join(
            f"{b[f'{k}_s'] / (r['devices'] * r[f'{k}_s']):.2f}" for k in ("rollout", "update", "step"))
        mesh = "x".join(f"{k}={v}" for k, v in r["mesh"].items() if v > 1) or "1"
        lines.append(f"| {r['preset']} | {r['variant']} | {r['devices']} | {mesh} | {r['rollout_s']:.3f} | "
                     f"{r['rollout_tokens_per_s']:,.0f} | {r['logp_s']:.3f} | {r['update_s']:.3f} | "
                     f"{r['step_s']:.3f} | {eff} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", nargs="+", default=["qwen2.5-0.5b"])
    ap.add_argument("--devices", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--mesh", choices=("data", "fsdp"), default="data")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--leaves", type=int, default=16)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--segment", type=int, default=256)
    ap.add_argument("--micro", type=int, default=4)
    ap.add_argument("--remat", default="full", choices=["none", "full", "dots"])
    ap.add_argument("--steps", type=int, default=2, help="timed steps after the compiling one")
    ap.add_argument("--budget-s", type=float, default=None, help="skip the remaining cases after this many seconds")
    ap.add_argument("--variants", nargs="+", default=["treepo"], choices=VARIANTS)
    ap.add_argument("--json", default=None)
    ap.add_argument("--report", nargs="+", default=None, metavar="JSON",
                    help="print the table of earlier --json files (e.g. 1-device and 2-device runs) and exit")
    args = ap.parse_args(argv)
    if args.report:
        results = [r for path in args.report for r in json.load(open(path))["results"]]
        print(table(results))
        return results
    if (args.prompts * args.leaves) % (args.micro * max(args.devices)):
        raise SystemExit(f"--prompts x --leaves ({args.prompts * args.leaves} rows) must split into --micro "
                         f"{args.micro} x {max(args.devices)} devices")
    print(f"device: {jax.devices()[0].device_kind} x {jax.device_count()}, jax {jax.__version__}", flush=True)
    start, results = time.perf_counter(), []
    cases = [(p, v, n) for p in args.preset for v in args.variants for n in args.devices]
    for preset, variant, n in cases:
        if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
            print(f"skipped {preset} {variant} on {n} devices: past --budget-s {args.budget_s}", flush=True)
            continue
        if n > jax.device_count():
            raise SystemExit(f"--devices {n}: only {jax.device_count()} devices here")
        mesh = make_mesh(MeshConfig(data=n, fsdp=1) if args.mesh == "data" else MeshConfig(data=1, fsdp=n),
                         jax.devices()[:n])
        with mesh_context(mesh):  # as the loop runs (cuDNN / Pallas tree attention read the mesh)
            r = run_one(preset, mesh, args, variant)
        results.append(r)
        print(f"{preset} {variant} x{n}: first step {r['first_step_s']:.1f} s, rollout {r['rollout_s']:.3f} s, "
              f"old-logp {r['logp_s']:.3f} s, update {r['update_s']:.3f} s, step {r['step_s']:.3f} s, "
              f"{r['decoded_tokens']} decoded tokens, loss {r['steps'][-1]['loss']:.5f}", flush=True)
        for i, st in enumerate(r["steps"], 1):
            print(f"  step {i}: " + ", ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                                            for k, v in st.items()), flush=True)
        if args.json:
            with open(args.json, "w") as f:
                json.dump({"device": jax.devices()[0].device_kind, "args": vars(args), "results": results}, f,
                          indent=1)
    print(table(results))
    return results


if __name__ == "__main__":
    main(sys.argv[1:])
