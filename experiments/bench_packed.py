"""Tree-packed vs expanded update step: time, speedup, MFU, tokens/s and compiled peak memory, on random weights.

One synthetic TreePO forest per setting (``P`` prompts, ``W = 16`` leaves, ``b = 2`` branches, depth ``D``,
``S``-token segments; binary for depths ``1 .. log2 W`` and chains below, every leaf runs to full length ``D * S``
unless ``--eos-frac`` stops some early), prompts of ``Lp`` random tokens. The same leaves are trained twice by the
jitted ``update(state, batch)`` of :mod:`treejax.rl.update` (fp32 master weights, bf16 compute, AdamW, remat,
micro-batches over whole trees):

* expanded: ``forest_to_batch``, one row per leaf (``P * W`` rows of ``Lp + D * S``), attention ``--attention``
  (auto: cuDNN flash on GPU);
* packed: ``treejax.rl.packing`` (prompt and every node segment once, preorder rows bucketed to
  ``--granule``), tree attention ``--tree-attention`` (auto: the block-sparse Pallas kernel on GPU, its TPU
  form on TPU).

Both start from the same state; the first step's loss of each is printed (equal up to bf16 rounding). Timing:
median of ``--repeats`` steps after one compile + warm-up step. FLOPs (useful work, remat recompute not
counted): ``3 * (2 * N_matmul * tokens + 4 * layers * Q * H * sum_tokens(position + 1))`` over the real tokens of
each layout (a token at position ``t`` attends to exactly ``t + 1`` keys in both layouts), so the expanded
layout's FLOPs are larger by the redundancy the packing removes; ``MFU = FLOPs / time / peak`` (H100/H200 SXM
dense bf16: 989 TFLOP/s) and ``leaf tok/s`` = expanded response+prompt tokens / time (the same for both
layouts, so its ratio is the speedup). Peak memory: the compiled update's ``memory_analysis()`` (arguments +
outputs + temporaries - donated aliases), per program; ``device peak`` is the process-wide high-water mark.

GPU (the issue-12 table; 4 prompts x 16 leaves per update, one tree per micro-batch in both layouts; settings
after ``--budget-s`` seconds are skipped so the call ends in about 5 minutes on one H100, compile included):

  python experiments/bench_packed.py --preset qwen2.5-0.5b qwen2.5-1.5b --prompt-len 64 1024

Where an update's time goes: ``--profile DIR`` traces one more step of each layout, and
``python experiments/trace_summary.py DIR`` sums its device kernels by name.

CPU smoke (tiny model, tiny shapes, about a minute):

  python experiments/bench_packed.py --preset tiny --prompts 2 --segment 16 --prompt-len 8 32 --granule 16 \
      --micro 2 --repeats 1
"""

from __future__ import annotations

import argparse
import sys
import time
import traceback

import jax
import jax.numpy as jnp
import numpy as np

from treejax.forest import forest_from_paths
from treejax.models import transformer, tree_attention
from treejax.rl import packing
from treejax.rl.batch import expanded_batch, forest_to_batch
from treejax.rl.layouts import Expanded, Packed
from treejax.rl.losses import LossConfig
from treejax.rl.optimizer import OptimizerConfig, make_optimizer
from treejax.rl.train_state import TrainState
from treejax.rl.update import make_update_fn

sys.path.insert(0, __file__.rsplit("/", 1)[0])
from bench_update import get_config, peak_flops  # noqa: E402


def synthetic_tree(P: int, W: int, D: int, S: int, Lp: int, vocab: int, eos_frac: float, seed: int = 0):
    """``(prompts [P, Lp], lengths [P], forest)``: per prompt a b=2 tree (binary down to ``log2 W``, chains
    below), consistent shared tokens; a fraction ``eos_frac`` of leaves stops inside its last segment."""
    rng = np.random.default_rng(seed)
    levels = int(np.log2(W))
    paths = np.full((P, W, D + 1), -1, np.int64)
    paths[:, :, 0] = 0
    nid = 1
    ids = {}
    for w in range(W):
        for d in range(1, D + 1):
            key = (w >> max(levels - d, 0), d) if d <= levels else (w, d)
            if key not in ids:
                ids[key] = nid
                nid += 1
            paths[:, w, d] = ids[key]
    node_tokens = rng.integers(3, vocab, (P, nid, S))
    tokens = np.zeros((P, W, D * S), np.int64)
    for d in range(1, D + 1):
        tokens[:, :, (d - 1) * S: d * S] = node_tokens[np.arange(P)[:, None], paths[:, :, d]]
    length = np.full((P, W), D * S)
    stop = rng.random((P, W)) < eos_frac
    length = np.where(stop, (D - 1) * S + rng.integers(1, S + 1, (P, W)), length)
    forest = forest_from_paths(paths, length, S, tokens=tokens)
    prompts = rng.integers(3, vocab, (P, Lp)).astype(np.int32)
    return prompts, np.full((P,), Lp, np.int32), forest


def n_matmul(cfg) -> int:
    E, F, Q, K, H, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.vocab_size)
    return cfg.num_layers * (E * Q * H + 2 * E * K * H + Q * H * E + 3 * E * F) + E * V


def useful_flops(cfg, positions_real: np.ndarray) -> float:
    """``3 * (2 N tokens + 4 layers Q H sum(pos + 1))`` over real tokens (module docstring)."""
    tokens = positions_real.size
    attn = 4 * cfg.num_layers * cfg.num_heads * cfg.head_dim * float(np.sum(positions_real.astype(np.float64) + 1))
    return 3 * (2 * n_matmul(cfg) * tokens + attn)


def compiled_peak_gb(compiled) -> float:
    try:
        m = compiled.memory_analysis()
        total = m.argument_size_in_bytes + m.output_size_in_bytes + m.temp_size_in_bytes - m.alias_size_in_bytes
        return total / 2**30
    except Exception:  # noqa: BLE001  (not every backend reports it)
        return float("nan")


def device_peak_gb() -> float:
    stats = jax.devices()[0].memory_stats() or {}
    return stats.get("peak_bytes_in_use", float("nan")) / 2**30


def run_layout(name, cfg, loss, batch, micro, args):
    """Compile, warm up and time one layout; returns a result dict (or the error)."""
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-6, warmup_steps=0, total_steps=100))
    layout = (Expanded(cfg, attention_impl=args.attention, chunk_size=args.logprob_chunk) if name == "expanded" else
              Packed(cfg, packing.PackingConfig(attention_impl=args.tree_attention), chunk_size=args.logprob_chunk,
                     blocks=args.blocks))
    update_fn = make_update_fn(layout, loss, optimizer, num_micro_batches=micro, remat=args.remat)
    params = jax.jit(lambda k: transformer.init_params(cfg, k))(jax.random.key(0))
    state = jax.jit(lambda p: TrainState.create(p, optimizer))(params)
    del params
    jitted = jax.jit(update_fn, donate_argnames=("state",))
    t0 = time.perf_counter()
    compiled = jitted.lower(state, batch).compile()
    t_compile = time.perf_counter() - t0
    state, m = compiled(state, batch)
    first_loss, first_gnorm = float(m["loss"]), float(m["grad_norm"])
    times = []
    for _ in range(args.repeats):
        t0 = time.perf_counter()
        state, m = compiled(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    if args.profile:  # one more step, traced (experiments/trace_summary.py sums its kernels)
        with jax.profiler.trace(f"{args.profile}/{name}_{cfg.num_layers}L_{batch.num_rows}rows",
                                create_perfetto_trace=True):
            state, m = compiled(state, batch)
            jax.block_until_ready(m)
    out = dict(layout=name, s=float(np.median(times)), compile_s=t_compile, loss=first_loss, grad_norm=first_gnorm,
               peak_gb=compiled_peak_gb(compiled), skipped=float(m["skipped"]))
    del state, compiled
    return out



def tree_kernel(args, cfg, row_length: int) -> str:
    """The tree attention the packed update runs (``auto`` resolved for the preset's heads and the row length; the
    tiles' kernel where ``--tree-blocks`` names tiles)."""
    if args.blocks is not None and args.tree_attention == "auto":
        return "pallas"
    return tree_attention.resolve_impl(args.tree_attention, head_dim=cfg.head_dim, row_length=row_length,
                                       dtype=jnp.dtype(cfg.compute_dtype))

def bench_setting(preset, Lp, args):
    cfg = get_config(preset)
    W, D, S, P = args.leaves, args.depth, args.segment, args.prompts
    prompts, lens, forest = synthetic_tree(P, W, D, S, Lp, cfg.sampling_vocab_size, args.eos_frac)
    rng = np.random.default_rng(1)
    adv = jnp.asarray(rng.normal(size=forest.tokens.shape).astype(np.float32)) * forest.loss_mask
    loss = LossConfig(eps_high=0.28, dual_clip_c=10.0)
    expanded = forest_to_batch(jnp.asarray(prompts), jnp.asarray(lens), forest, adv)
    expanded["old_logp"] = -5.0 * expanded["loss_mask"]
    del expanded["sampler_logp"]
    exp_pos = np.asarray(expanded["positions"])[np.asarray(expanded["segment_ids"]) > 0]
    expanded = expanded_batch(expanded)
    pcfg = packing.PackingConfig(granule=args.granule, align=args.align)
    trained = np.ones((P, W), bool)
    plan = packing.plan_packing(prompts, lens, forest.leaf_path, forest.leaf_length, forest.tokens, S, pcfg,
                                trained_PxW=trained, row_multiple=args.micro_packed)
    pairs = packing.forest_pairs(forest, adv)
    pairs["old_logp"] = -5.0 * pairs["loss_mask"]
    del pairs["sampler_logp"]
    packed = packing.packed_batch(plan, pairs)
    info = packing.describe(plan)
    pk_pos = plan.positions[plan.node_lo < packing.PAD_NODE]
    flops = {"expanded": useful_flops(cfg, exp_pos), "packed": useful_flops(cfg, pk_pos)}
    print(f"\n{preset}: P={P} W={W} b=2 D={D} S={S} Lp={Lp}: expanded {P * W} rows x {expanded.sequence_length}, "
          f"packed {info['rows']} rows x {info['row_length']} ({info['unique_tokens']} unique of "
          f"{info['expanded_tokens']} tokens: {info['token_saving']:.2f}x fewer; row fill {info['fill']:.0%}); tree "
          f"attention {args.tree_attention} -> {tree_kernel(args, cfg, info['row_length'])}", flush=True)
    results = {}
    for name, batch, micro in (("expanded", expanded, args.micro), ("packed", packed, args.micro_packed)):
        try:
            r = run_layout(name, cfg, loss, batch, micro, args)
        except Exception as e:  # noqa: BLE001  (report and go on: one call should return every row it can)
            msg = "".join(traceback.format_exception_only(type(e), e)).strip().splitlines()[0][:300]
            print(f"  {name:<9} FAILED: {msg}", flush=True)
            continue
        results[name] = r
        peak = peak_flops()[1]
        mfu = flops[name] / r["s"] / peak if peak else float("nan")
        print(f"  {name:<9} {r['s'] * 1e3:>9.1f} ms  MFU {mfu:>6.1%}  {flops[name] / r['s'] / 1e12:>7.1f} TFLOP/s  "
              f"leaf tok/s {info['expanded_tokens'] / r['s']:>10.0f}  peak {r['peak_gb']:>7.2f} GB  "
              f"loss {r['loss']:.6f}  compile {r['compile_s']:.0f} s  micro {micro}", flush=True)
    if len(results) == 2:
        e, p = results["expanded"], results["packed"]
        rel = lambda k: abs(p[k] - e[k]) / abs(e[k])  # noqa: E731
        print(f"  speedup {e['s'] / p['s']:.2f}x; first step rel. diff: loss {rel('loss'):.1e}, grad norm "
              f"{rel('grad_norm'):.1e} (bf16); peak memory packed/expanded {p['peak_gb'] / e['peak_gb']:.2f}",
              flush=True)
    return results


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", nargs="+", default=["qwen2.5-0.5b", "qwen2.5-1.5b"])
    ap.add_argument("--prompt-len", nargs="+", type=int, default=[64, 1024])
    ap.add_argument("--prompts", type=int, default=4, help="prompts (trees) per mini-batch")
    ap.add_argument("--leaves", type=int, default=16)
    ap.add_argument("--depth", type=int, default=4)
    ap.add_argument("--segment", type=int, default=512)
    ap.add_argument("--eos-frac", type=float, default=0.0, help="share of leaves that stop inside their last segment")
    ap.add_argument("--micro", type=int, default=4, help="expanded micro-batches (rows P*W split into this many)")
    ap.add_argument("--micro-packed", type=int, default=None,
                    help="packed micro-batches (default: --micro, i.e. the same leaves per micro-batch)")
    ap.add_argument("--granule", type=int, default=128)
    ap.add_argument("--align", type=int, default=1)
    ap.add_argument("--remat", default="full", choices=["none", "full", "dots"])
    ap.add_argument("--logprob-chunk", type=int, default=16384)
    ap.add_argument("--attention", default="auto", choices=["auto", "xla", "cudnn"], help="expanded attention")
    ap.add_argument("--tree-attention", default="auto",
                    choices=["auto", "xla", "pallas", "pallas_tpu", "pallas_mgpu"],
                    help="packed attention")
    ap.add_argument("--tree-blocks", default=None,
                    help="Pallas tree kernel tiles block_q,block_k,block_bwd[,num_warps[,num_stages]], then "
                         "key=value variants full=1, split=1, dq=QxK, dkv=KxQ, bwd_warps=N (TreeFlashBlocks.parse; "
                         "default: tree_flash.default_blocks of the head size and row length); with "
                         "--tree-attention pallas_mgpu: TreeFlashMgpuBlocks.parse options (k=N, dq=QxK, dkv=KxQ, "
                         "stages=N, full=0|1, skip=0|1)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--budget-s", type=float, default=240.0, help="skip the remaining settings after this long")
    ap.add_argument("--profile", default=None,
                    help="folder for a perfetto trace of one more update step per layout "
                         "(summed by experiments/trace_summary.py)")
    args = ap.parse_args(argv)
    if args.micro_packed is None:
        args.micro_packed = args.micro
    from treejax.models import tree_flash, tree_flash_mgpu

    blocks_cls = (tree_flash_mgpu.TreeFlashMgpuBlocks if args.tree_attention == "pallas_mgpu"
                  else tree_flash.TreeFlashBlocks)
    try:
        args.blocks = blocks_cls.parse(args.tree_blocks) if args.tree_blocks else None
    except ValueError as e:
        raise SystemExit(f"--tree-blocks: {e}") from None
    args.tree_blocks = str(args.blocks) if args.blocks else "default_blocks(head_dim, row_length)"
    kind, peak = peak_flops()
    print(f"device: {kind}; peak dense bf16 {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s; remat {args.remat}; "
          f"expanded attention {args.attention}; tree attention {args.tree_attention} (tiles {args.tree_blocks}); "
          f"jax {jax.__version__}", flush=True)
    t_start = time.perf_counter()
    rows = []
    for preset in args.preset:
        for Lp in args.prompt_len:
            if time.perf_counter() - t_start > args.budget_s:
                print(f"\n{preset} Lp={Lp}: skipped (time budget {args.budget_s:.0f} s spent)", flush=True)
                continue
            rows.append((preset, Lp, bench_setting(preset, Lp, args)))
    print("\n| preset | prompt | expanded ms | packed ms | speedup | peak GB exp / packed |")
    print("|---|---|---|---|---|---|")
    for preset, Lp, r in rows:
        e, p = r.get("expanded"), r.get("packed")
        f = lambda x, k, s=1.0: f"{x[k] * s:.1f}" if x else "failed"  # noqa: E731
        sp = f"{e['s'] / p['s']:.2f}x" if e and p else "-"
        print(f"| {preset} | {Lp} | {f(e, 's', 1e3)} | {f(p, 's', 1e3)} | {sp} | "
              f"{f(e, 'peak_gb')} / {f(p, 'peak_gb')} |")
    print(f"device peak (process): {device_peak_gb():.1f} GB; total {time.perf_counter() - t_start:.0f} s", flush=True)


if __name__ == "__main__":
    main()
