"""Tree attention alone: the Pallas tree kernel's tiles swept against cuDNN flash attention on the expanded rows.

The attention of one packed micro-batch (one synthetic TreePO tree per prompt, as in ``bench_packed.py``: ``W``
leaves, ``b = 2``, depth ``D``, ``S``-token segments, ``Lp``-token prompts) is timed in isolation, forward and
forward + backward, for each tile setting of :mod:`treejax.models.tree_flash` given in ``--tiles``
(``block_q,block_k,block_bwd[,num_warps[,num_stages]][,key=value...]``: ``full=1`` mask-free full tiles,
``split=1`` the backward as separate ``dq`` and ``dk, dv`` kernels with ``dq=QxK`` / ``dkv=KxQ`` tiles, grid
block first, ``bwd_warps=N``; see ``TreeFlashBlocks.parse``), next to the same leaves' attention in the expanded
layout (``P * W`` right-padded rows, ``jax.nn.dot_product_attention(implementation='cudnn')``, causal with key
lengths), which is what the expanded update runs. Inputs are random ``bf16`` ``q [R, L, Q, H]``, ``k, v [R, L,
K, H]`` with the preset's head counts.

Useful FLOPs (the same in both layouts: a token at position ``t`` attends to ``t + 1`` keys in either): forward
``4 Q H sum_tokens(t + 1)``, backward 2.5x that (five matmuls against two), so ``fwd+bwd = 3.5x``; ``TFLOP/s``
divides them by the median time (after compile and one warm-up call) and ``MFU`` by the card's dense bf16 peak.
Every tile setting's forward output is checked against the first setting's (max abs diff printed): tiles and
variants change the summation order only (``full=1`` visits the full tiles first). Each row is labelled with its
setting, options included, and the table is preceded by what each setting resolves to at this head size.

GPU (the tile sweep behind ``tree_flash.default_blocks``)::

    python experiments/bench_tree_attention.py --preset qwen2.5-0.5b qwen2.5-1.5b --prompt-len 64 1024 \\
        --tiles 64,64,32 128,64,32 64,64,64 128,128,64 128,64,64 64,32,32 128,64,32,8 64,64,32,0,3

GPU (the kernel variants against the default, ``--tiles`` 128,64,64)::

    python experiments/bench_tree_attention.py --preset qwen2.5-0.5b qwen2.5-1.5b --prompt-len 64 1024 \\
        --tiles 128,64,64 128,64,64,full=1 128,64,64,0,3,full=1 128,64,64,split=1 128,64,64,full=1,split=1 \\
        128,64,64,full=1,split=1,dq=128x32,dkv=128x32 128,64,64,full=1,split=1,dq=64x64,dkv=128x64 \\
        128,64,64,full=1,split=1,dq=128x64,dkv=128x32,bwd_warps=8 64,64,64,full=1 128,128,64,full=1

The Mosaic GPU kernel (:mod:`treejax.models.tree_flash_mgpu`, ``attention_impl='pallas_mgpu'``) next to the Triton
kernel and cuDNN in the same call: ``--mgpu`` adds a row per Mosaic setting (``default`` or ``key=value`` options,
``TreeFlashMgpuBlocks.parse``: ``k=128,dq=64x128,dkv=64x128,stages=3``); its forward is checked against the first
Triton setting's (``max |out - triton|``). Depth-4 trees (0.5b and 1.5b heads) and TreePO's 14 x 512 (the Triton
rows: ``tree_flash.default_blocks``)::

    python experiments/bench_tree_attention.py --preset qwen2.5-0.5b qwen2.5-1.5b --prompt-len 64 1024 \\
        --mgpu default stages=3 k=128,dq=64x128,dkv=64x128 --json tree_attention_mgpu_h200.json
    python experiments/bench_tree_attention.py --preset qwen2.5-0.5b --prompt-len 64 --depth 14 --prompts 1 \\
        --mgpu default stages=3 k=128,dq=64x128,dkv=64x128 --json tree_attention_mgpu_depth14_h200.json

A Mosaic setting that fails to compile (e.g. ``k=128,...,stages=3`` at head 128: over the SMEM) prints ``FAILED``
with the first line of the error and the run goes on.

CPU smoke (Pallas interpreter, tiny shapes; ``--mgpu`` needs 64-wide heads and rows a multiple of 64: the
``qwen2.5-0.5b`` preset with a small tree, in Mosaic GPU's interpret mode)::

    python experiments/bench_tree_attention.py --preset tiny --prompts 1 --leaves 4 --depth 2 --segment 16 \\
        --prompt-len 8 --granule 16 --tiles 16,16,16 16,16,16,full=1 16,16,16,full=1,split=1,dq=32x16,dkv=32x16 \\
        --repeats 1
    python experiments/bench_tree_attention.py --preset qwen2.5-0.5b --prompts 1 --leaves 2 --depth 2 \\
        --segment 64 --prompt-len 40 --granule 64 --tiles 64,64,64 --mgpu default --repeats 1
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from treejax.models import tree_flash, tree_flash_mgpu
from treejax.rl import packing

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_packed import synthetic_tree  # noqa: E402
from bench_update import get_config, peak_flops  # noqa: E402


def parse_tiles(text: str) -> tree_flash.TreeFlashBlocks:
    try:
        return tree_flash.TreeFlashBlocks.parse(text)
    except ValueError as e:
        raise SystemExit(f"--tiles: {e}") from None


def parse_mgpu(text: str) -> tree_flash_mgpu.TreeFlashMgpuBlocks:
    try:
        return tree_flash_mgpu.TreeFlashMgpuBlocks.parse(text)
    except ValueError as e:
        raise SystemExit(f"--mgpu: {e}") from None


def timed(fn, args, repeats: int):
    """``(median seconds, output)`` after compile + one warm-up call."""
    out = jax.block_until_ready(fn(*args))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        out = jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)), out


def fwd_bwd(attend):
    """``(q, k, v, g) -> (out, dq, dk, dv)`` with cotangent ``g``."""
    def run(q, k, v, g):
        out, vjp = jax.vjp(attend, q, k, v)
        return (out,) + vjp(g)
    return jax.jit(run)


def bench_setting(preset: str, Lp: int, args, tiles: list[tree_flash.TreeFlashBlocks] | None,
                  mgpu: list[tree_flash_mgpu.TreeFlashMgpuBlocks] = ()) -> dict:
    """One preset and prompt length; ``tiles`` ``None``: ``tree_flash.default_blocks`` of the head size and row;
    ``mgpu``: Mosaic GPU kernel settings timed after the Triton ones."""
    cfg = get_config(preset)
    P, W, D, S = args.prompts, args.leaves, args.depth, args.segment
    Q, K, H = cfg.num_heads, cfg.num_kv_heads, cfg.head_dim
    prompts, lens, forest = synthetic_tree(P, W, D, S, Lp, cfg.sampling_vocab_size, args.eos_frac)
    plan = packing.plan_packing(prompts, lens, forest.leaf_path, forest.leaf_length, forest.tokens, S,
                                packing.PackingConfig(granule=args.granule), trained_PxW=np.ones((P, W), bool))
    R, L, _ = plan.shape
    tiles = tiles or [tree_flash.default_blocks(H, L)]
    real = plan.node_lo < packing.PAD_NODE
    work = 4.0 * Q * H * float(np.sum(plan.positions[real].astype(np.float64) + 1))
    peak = peak_flops()[1]
    print(f"\n{preset} (Q={Q}, K={K}, H={H}): P={P} W={W} D={D} S={S} Lp={Lp}; packed {R} rows x {L} "
          f"({plan.unique_tokens} unique tokens), expanded {P * W} rows x {Lp + D * S} ({plan.expanded_tokens} "
          f"tokens); forward {work / 1e12:.3f} TFLOP", flush=True)
    key = jax.random.split(jax.random.key(0), 8)
    dt = jnp.bfloat16
    rows = []
    tiles_of = {f"packed {b}": b for b in tiles}
    tiles_of.update({f"packed {b}": b for b in mgpu})
    width = max(22, *(len(name) for name in tiles_of))
    for name, blocks in tiles_of.items():
        try:
            print(f"  {name:<{width}} = {blocks.describe(L, H) if hasattr(blocks, 'describe') else blocks}")
        except ValueError as e:
            print(f"  {name:<{width}} = {e}")

    def report(name, t_f, t_fb, extra=""):
        mfu = lambda f, t: f"{f / t / peak:6.1%}" if peak else "   n/a"  # noqa: E731
        print(f"  {name:<{width}} fwd {t_f * 1e3:8.2f} ms ({work / t_f / 1e12:6.1f} TFLOP/s, MFU {mfu(work, t_f)})  "
              f"fwd+bwd {t_fb * 1e3:8.2f} ms ({3.5 * work / t_fb / 1e12:6.1f} TFLOP/s, MFU {mfu(3.5 * work, t_fb)})"
              f"{extra}", flush=True)
        blocks = tiles_of.get(name)
        kernel = None if blocks is None else "mgpu" if isinstance(blocks, tree_flash_mgpu.TreeFlashMgpuBlocks) \
            else "triton"
        rows.append(dict(preset=preset, prompt_len=Lp, layout=name, kernel=kernel,
                         tiles=str(blocks) if blocks else None,
                         options=dataclasses.asdict(blocks) if blocks else None, fwd_ms=t_f * 1e3,
                         fwd_bwd_ms=t_fb * 1e3, fwd_tflops=work / t_f / 1e12, fwd_bwd_tflops=3.5 * work / t_fb / 1e12))

    if jax.default_backend() == "gpu" and not args.no_cudnn:
        Le = Lp + D * S
        q, g = (jax.random.normal(key[i], (P * W, Le, Q, H), dt) for i in (0, 1))
        k, v = (jax.random.normal(key[i], (P * W, Le, K, H), dt) for i in (2, 3))
        lengths = jnp.asarray(np.repeat(lens, W) + np.asarray(forest.leaf_length).reshape(-1), jnp.int32)

        def dense(q, k, v):
            return jax.nn.dot_product_attention(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                                key_value_seq_lengths=lengths, implementation="cudnn")
        t_f, _ = timed(jax.jit(dense), (q, k, v), args.repeats)
        t_fb, _ = timed(fwd_bwd(dense), (q, k, v, g), args.repeats)
        report("expanded cudnn", t_f, t_fb)
        del q, k, v, g

    q, g = (jax.random.normal(key[i], (R, L, Q, H), dt) for i in (4, 5))
    k, v = (jax.random.normal(key[i], (R, L, K, H), dt) for i in (6, 7))
    lo, hi = jnp.asarray(plan.node_lo, jnp.int32), jnp.asarray(plan.node_hi, jnp.int32)
    interpret = jax.default_backend() != "gpu"
    ref = None
    for blocks in tiles:
        name = f"packed {blocks}"
        try:
            def attend(q, k, v, b=blocks):
                return tree_flash.tree_flash_attention(q, k, v, lo, hi, b, interpret)
            t_f, out = timed(jax.jit(attend), (q, k, v), args.repeats)
            t_fb, _ = timed(fwd_bwd(attend), (q, k, v, g), args.repeats)
        except Exception as e:  # noqa: BLE001  (a tile setting the compiler refuses is a row, not the end)
            print(f"  {name:<{width}} FAILED: {str(e).splitlines()[0][:200]}", flush=True)
            continue
        out = np.asarray(out.astype(jnp.float32))[real]
        if ref is None:
            ref, diff = out, ""
        else:
            diff = f"  max |out - first| {np.max(np.abs(out - ref)):.1e}"
        report(name, t_f, t_fb, diff)
    for blocks in mgpu:
        name = f"packed {blocks}"
        try:
            def attend(q, k, v, b=blocks):
                return tree_flash_mgpu.tree_flash_attention(q, k, v, lo, hi, b, interpret)
            t_f, out = timed(jax.jit(attend), (q, k, v), args.repeats)
            t_fb, _ = timed(fwd_bwd(attend), (q, k, v, g), args.repeats)
        except Exception as e:  # noqa: BLE001  (a setting Mosaic GPU refuses is a row, not the end)
            print(f"  {name:<{width}} FAILED: {str(e).splitlines()[0][:200] if str(e) else type(e).__name__}",
                  flush=True)
            continue
        out = np.asarray(out.astype(jnp.float32))[real]
        diff = "" if ref is None else f"  max |out - triton| {np.max(np.abs(out - ref)):.1e}"
        report(name, t_f, t_fb, diff)
    return rows


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", nargs="+", default=["qwen2.5-0.5b"])
    ap.add_argument("--prompt-len", nargs="+", type=int, default=[64, 1024])
    ap.add_argument("--prompts", type=int, default=1, help="trees per micro-batch")
    ap.add_argument("--leaves", type=int, default=16)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--segment", type=int, default=512)
    ap.add_argument("--eos-frac", type=float, default=0.0)
    ap.add_argument("--granule", type=int, default=128)
    ap.add_argument("--tiles", nargs="+", default=None,
                    help="tile settings (default: tree_flash.default_blocks of each preset's head size and row length)")
    ap.add_argument("--mgpu", nargs="+", default=[],
                    help="Mosaic GPU kernel settings to time next to the Triton ones ('default' or key=value options: "
                         "k=N, dq=QxK, dkv=KxQ, stages=N, full=0|1, skip=0|1)")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-cudnn", action="store_true", help="skip the expanded cuDNN baseline")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    tiles = [parse_tiles(t) for t in args.tiles] if args.tiles else None
    mgpu = [parse_mgpu(t) for t in args.mgpu]
    print(f"device: {peak_flops()[0]}; jax {jax.__version__}", flush=True)
    rows = []
    for preset in args.preset:
        for Lp in args.prompt_len:
            rows += bench_setting(preset, Lp, args, tiles, mgpu)
            if args.json:  # after every setting: a run cut short keeps what it measured
                with open(args.json, "w") as f:
                    json.dump(dict(device=peak_flops()[0], args=vars(args), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
