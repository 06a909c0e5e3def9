"""Sampler benchmark: decode tokens/s vs the HBM roofline, and tree vs independent sampling.

Decode table (one row per preset x rows x context x ``--attention`` implementation): the sampler's decode step
(model step with that decode attention + vocabulary masking + sampling + log-prob statistics), all rows live at
``context`` KV slots. Several ``--attention`` values (e.g. ``pallas pallas_mgpu ragged``) time them side by side in
one invocation; an implementation that fails to build, compile or run prints ``FAILED`` and its first error line,
and the others still run.
The cache is filled with random keys/values instead of a prefill (decode cost does not depend on the values).
tokens/s = rows * steps / time; the roofline assumes one pass over the bytes a step must read:

    bytes/step = weight bytes + KV bytes read (2 * layers * rows * context * K * H * bytes) + logits (rows * V * 4)
    roofline tokens/s = rows / (bytes/step / peak HBM bandwidth)

Peak bandwidth by device kind: H100 SXM 3.35e12 B/s, H200 4.8e12 B/s; on CPU a measured memcpy bandwidth.

Kernel table (``--kernel-table``): the bare per-row decode attention of one layer (``make_decode_attention`` of
each ``--attention`` value, the preset's heads, a bf16 cache of ``context`` live slots per row, ``steps`` calls in
one jitted loop, each call's output fed to the next call's query), microseconds per call and the KV read rate
``2 rows K context H 2 bytes / t`` against the peak bandwidth, and the speed-up over the first ``--attention``
value (``vs first``): the kernels compared without the model step.

Tree table: TreePO rollout (W leaves, branch factor b, depth D, segment S) vs independent sampling (W chains per
prompt, same API) on the same prompts: decoded tokens and wall time (compiled; random weights, so nearly no path
stops early: the tree's saving is structural, b^d paths at depth d until W).

Branching table (``--branching``): for each registered branching rule (default arguments), its boundary work
(per-path statistics -> pruning -> budget -> child counts, jitted on its own, on synthetic sampler state of
``rows`` paths x ``D * S`` tokens) next to one segment's decode (``S`` decode steps at ``rows`` live rows and
``context`` KV slots, with the per-token statistics the rule asks for), and the decode-step overhead of those
statistics (entropy, top-k log-probs) vs the plain step. Target: boundary <= 3% of a 512-token segment.

Optional ``--hf-baseline`` (needs torch with CUDA): transformers ``generate`` with a static cache and
``torch.compile`` on the same shapes, decode tokens/s from the difference of two generation lengths.

Examples:
  python experiments/bench_sampler.py --preset tiny --rows 16 64 --context 256            # CPU smoke run
  python experiments/bench_sampler.py --preset qwen2.5-0.5b qwen2.5-1.5b --rows 64 256 1024 --context 2048 \
      --tree-segment 512 --hf-baseline                                                     # GPU
  python experiments/bench_sampler.py --preset qwen2.5-0.5b --rows 256 --context 2048 --no-tree --no-decode \
      --branching --branch-segment 512 --branch-depth 8                                     # rules' boundary cost
  python experiments/bench_sampler.py --preset qwen2.5-0.5b qwen2.5-1.5b --rows 64 256 1024 --context 2048 \
      --attention pallas pallas_mgpu ragged --kernel-table --no-tree                       # GPU decode kernels
"""

from __future__ import annotations

import argparse
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np

from treejax.models import presets
from treejax.models import transformer as T
from treejax.models.config import HF_MODEL_CLASSES
from treejax.sampling import attention as attention_lib
from treejax.sampling import decode, tree
from treejax.sampling.strategies import Temperature

PEAK_BANDWIDTH = {"h100": 3.35e12, "h200": 4.8e12}
PROFILE = None  # --profile: folder for perfetto traces of one timed decode run
FUSE = None  # --no-fuse sets False (None: the sampler's default, fused on one device)


def device_bandwidth() -> tuple[str, float | None, str]:
    dev = jax.devices()[0]
    kind = getattr(dev, "device_kind", dev.platform)
    low = kind.lower()
    for key, bw in PEAK_BANDWIDTH.items():
        if key in low:
            return kind, bw, "peak"
    if dev.platform == "cpu":
        a = np.ones(64 * 2**20, np.uint8)
        b = np.empty_like(a)
        np.copyto(b, a)
        t0 = time.perf_counter()
        for _ in range(5):
            np.copyto(b, a)
        dt = (time.perf_counter() - t0) / 5
        return kind, 2 * a.nbytes / dt, "memcpy"
    return kind, None, "n/a"


def get_model_config(name: str, dtype: str):
    if name == "tiny":
        cfg = presets.tiny_config("qwen2.5-0.5b")
    else:
        cfg = presets.get_config(name)
    return cfg.replace(param_dtype=dtype, compute_dtype=dtype)


def weight_bytes(cfg) -> int:
    return cfg.num_params() * jnp.dtype(cfg.params_dtype).itemsize


def bench_decode(cfg, params, rows: int, context: int, steps: int, block: int, attention: str,
                 with_entropy: bool = False, top_k: int = 0):
    fns = decode.make_model_fns(cfg, attention=attention, block_size=block, cache_dtype="bfloat16",
                                fuse=None if FUSE else False)
    L = decode.attention_lib.round_cache_length(context + steps, fns.cache_multiple)
    strategy = Temperature(1.0)

    @jax.jit
    def make_cache(key):
        c = fns.init_cache(rows, L)
        return jax.tree.map(lambda x: 0.5 * jax.random.normal(key, x.shape, x.dtype), c)

    @functools.partial(jax.jit, donate_argnums=(1,), compiler_options=decode.SAMPLER_COMPILER_OPTIONS)
    def run(params, cache, key):
        rows_r = jnp.arange(rows, dtype=jnp.int32)
        params = fns.prepare(params)  # as the sampler does: unstack (and fuse) the layers once, outside the loop

        def body(i, carry):
            cache, tok, acc = carry
            pos = jnp.full((rows,), context - steps, jnp.int32) + i
            keys = decode.token_keys(key, rows_r, jnp.zeros_like(rows_r), pos)
            tok, lp, _, ent, topk, _, cache = decode.decode_token_stats(
                fns, strategy, params, cache, tok, pos, jnp.ones((rows,), bool), keys, with_entropy, top_k)
            return cache, tok, acc + jnp.sum(lp) + jnp.sum(ent) + jnp.sum(jnp.maximum(topk, -1e4))

        cache, tok, acc = jax.lax.fori_loop(0, steps, body, (cache, jnp.ones((rows,), jnp.int32), 0.0))
        return cache, tok, acc

    cache = make_cache(jax.random.key(0))
    cache, *_ = jax.block_until_ready(run(params, cache, jax.random.key(1)))  # compile + warm up
    times = []
    for r in range(3):
        t0 = time.perf_counter()
        cache, *_ = jax.block_until_ready(run(params, cache, jax.random.key(2 + r)))
        times.append(time.perf_counter() - t0)
    dt = float(np.median(times))
    if PROFILE and not (with_entropy or top_k):  # trace the plain step only
        with jax.profiler.trace(f"{PROFILE}/decode_{cfg.num_layers}L_{rows}rows", create_perfetto_trace=True):
            cache, *_ = jax.block_until_ready(run(params, cache, jax.random.key(9)))
    kv_read = 2 * cfg.num_layers * rows * context * cfg.num_kv_heads * cfg.head_dim * 2
    logits = rows * cfg.vocab_size * 4
    step_bytes = weight_bytes(cfg) + kv_read + logits
    return rows * steps / dt, step_bytes


def bench_attention(cfg, rows: int, context: int, steps: int, block: int, attention: str) -> float:
    """Seconds per call of the bare per-row decode attention ``attention`` (module docstring, kernel table)."""
    H, K, Q = cfg.head_dim, cfg.num_kv_heads, cfg.num_heads
    fn = attention_lib.make_decode_attention(attention, block, head_dim=H, cache_dtype="bfloat16")
    L = attention_lib.round_cache_length(context, block)
    ks = jax.random.split(jax.random.key(0), 3)
    q = jax.random.normal(ks[0], (rows, 1, Q, H), jnp.bfloat16)
    k, v = (jax.random.normal(kk, (rows, K, L, H), jnp.bfloat16) for kk in ks[1:])
    pos = jnp.full((rows,), context - 1, jnp.int32)

    @jax.jit
    def run(q, k, v):
        return jax.lax.fori_loop(0, steps, lambda i, q: fn(q, k, v, pos).astype(q.dtype), q)

    jax.block_until_ready(run(q, k, v))  # compile + warm up
    times = []
    for _ in range(3):
        t0 = time.perf_counter()
        jax.block_until_ready(run(q, k, v))
        times.append(time.perf_counter() - t0)
    return float(np.median(times)) / steps


def _failed(e: Exception) -> str:
    """``FAILED`` and the first line of an implementation's error (the table goes on with the others)."""
    return f"FAILED: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0][:200]}"


def kernel_table(cfg, preset: str, rows_list, contexts, steps: int, block: int, attentions, bw):
    """Prints the kernel table (module docstring): one row per rows x context x implementation."""
    print(f"\n{'preset':<14}{'rows':>6}{'context':>9}  {'attention':<13}{'us/call':>10}{'KV GB/s':>10}{'of peak':>9}"
          f"{'vs first':>9}   (bare decode attention, one layer, bf16 cache)")
    for rows in rows_list:
        for ctx in contexts:
            first = None
            for attention in attentions:
                head = f"{preset:<14}{rows:>6}{ctx:>9}  {attention:<13}"
                try:
                    t = bench_attention(cfg, rows, ctx, steps, block, attention)
                except Exception as e:  # noqa: BLE001  one implementation's failure must not end the table
                    print(head + _failed(e), flush=True)
                    continue
                first = first or t
                rate = 2 * rows * cfg.num_kv_heads * ctx * cfg.head_dim * 2 / t
                peak = f"{rate / bw:>9.2f}" if bw else f"{'n/a':>9}"
                print(f"{head}{1e6 * t:>10.1f}{rate / 1e9:>10.1f}{peak}{first / t:>8.2f}x", flush=True)


def bench_tree(cfg, params, prompts: int, prompt_len: int, W: int, b: int, D: int, S: int, attention: str,
               block: int, repeats: int = 2):
    fns = decode.make_model_fns(cfg, attention=attention, block_size=block, cache_dtype="bfloat16")
    rng = np.random.RandomState(0)
    toks = rng.randint(3, cfg.sampling_vocab_size, (prompts, prompt_len)).astype(np.int32)
    lens = np.full((prompts,), prompt_len, np.int32)
    common = dict(strategy=Temperature(1.0), stop_ids=tuple(cfg.eos_token_ids))
    tree_ro = tree.make_tree_rollout(fns, tree.TreeConfig(num_leaves=W, max_depth=D, segment_length=S,
                                                          branch_factor=b, **common))
    ind_ro = tree.make_independent_rollout(fns, W, D * S, segment_length=S, **common)
    out = {}
    for name, ro in (("tree", tree_ro), ("independent", ind_ro)):
        jax.block_until_ready(ro(params, toks, lens, jax.random.key(0)))
        times = []
        for r in range(repeats):
            t0 = time.perf_counter()
            forest, info = ro(params, toks, lens, jax.random.key(r + 1))
            jax.block_until_ready(forest)
            times.append(time.perf_counter() - t0)
        out[name] = (int(info.decoded_tokens), min(times), int(info.segments), int(info.forks))
    return out


def synthetic_path_stats(rows: int, W: int, S: int, D: int, K: int, seed: int = 0):
    """A :class:`PathStats` of ``rows`` paths (``rows / W`` prompts) half-way through a tree: random tokens,
    log-probs, entropies and top-k log-probs over ``D * S`` slots, lengths at segment boundaries, 3/4 live, and a
    random PRM score per path (for rules that read one, e.g. ETS; the PRM's forward itself is not timed here)."""
    from treejax.sampling.branching import PathStats

    P, T = rows // W, D * S
    k = jax.random.split(jax.random.key(seed), 6)
    depth = jax.random.randint(k[0], (P, W), 1, D, dtype=jnp.int32)
    length = depth * S
    logp = -jax.random.exponential(k[1], (P, W, T))
    topk = jnp.sort(-jax.random.exponential(k[2], (P, W, T, K)), axis=-1)[..., ::-1]
    path = jnp.where(jnp.arange(D + 1)[None, None, :] <= depth[:, :, None],
                     jax.random.randint(k[3], (P, W, D + 1), 0, W * D, dtype=jnp.int32), -1)
    live = jax.random.uniform(k[4], (P, W)) < 0.75
    return PathStats(live_PxW=live, ended_PxW=~live, status_PxW=jnp.where(live, 1, 3).astype(jnp.int32),
                     depth_PxW=depth, length_PxW=length, segment_start_PxW=length - S,
                     tokens_PxWxT=jax.random.randint(k[5], (P, W, T), 0, 50000, dtype=jnp.int32), logp_PxWxT=logp,
                     entropy_PxWxT=-logp, topk_PxWxTxK=topk, path_PxWxD1=path, leaves_P=jnp.full((P,), W // 4),
                     step=jnp.int32(3), segment=jnp.int32(2), key=jax.random.key(1), branch_factor=2,
                     segment_length=S, path_scores_PxW=jax.random.uniform(jax.random.key(2), (P, W)))


def bench_boundary(rule, rows: int, W: int, S: int, D: int, repeats: int = 20) -> float:
    """Seconds of one rule's boundary work (prune -> budget -> counts) on synthetic state (compiled, median)."""
    from treejax.sampling.tree_config import TreeConfig
    from treejax.sampling.tree_stages import branch_budget, prune_paths

    tc = TreeConfig(num_leaves=W, max_depth=D, segment_length=S, branch_factor=2, branching=rule)
    stats = synthetic_path_stats(rows, W, S, D, rule.top_k)

    @jax.jit
    def boundary(stats):
        if rule.prunes:
            stats = prune_paths(stats, rule)
        total = branch_budget(stats.live_PxW, jnp.sum(stats.ended_PxW, -1).astype(jnp.int32), stats.leaves_P, tc=tc)
        return rule.allocate(stats, total), stats.live_PxW

    jax.block_until_ready(boundary(stats))
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(boundary(stats))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def branching_table(cfg, params, rows: int, context: int, W: int, S: int, D: int, steps: int, block: int,
                    attention: str):
    """Prints the branching table (module docstring) for every registered rule with default arguments."""
    from treejax.sampling import branching

    decode_tps = {}
    print(f"\n{'rule':<16}{'boundary ms':>12}{'segment ms':>12}{'boundary %':>11}{'stats step':>11}"
          f"   (rows {rows}, context {context}, S={S}, D={D}, W={W}; stats step = decode step with the rule's "
          "per-token statistics / plain step)")
    for name, cls in sorted(branching.rule_classes().items()):
        rule = cls()
        sig = (bool(rule.needs_entropy), int(rule.top_k))
        for key in {(False, 0), sig}:
            if key not in decode_tps:
                decode_tps[key] = bench_decode(cfg, params, rows, context, steps, block, attention, *key)[0]
        segment_s = S * rows / decode_tps[sig]
        b = bench_boundary(rule, rows, W, S, D)
        print(f"{name:<16}{1e3 * b:>12.3f}{1e3 * segment_s:>12.1f}{100 * b / segment_s:>10.2f}%"
              f"{decode_tps[(False, 0)] / decode_tps[sig]:>10.3f}x", flush=True)


def bench_hf(preset: str, rows: int, context: int, steps: int):
    import torch
    import transformers

    cfg = get_model_config(preset, "bfloat16")
    name = HF_MODEL_CLASSES[cfg.architecture].removesuffix("ForCausalLM")
    hc = getattr(transformers, name + "Config")(
        vocab_size=cfg.vocab_size, hidden_size=cfg.hidden_size, intermediate_size=cfg.intermediate_size,
        num_hidden_layers=cfg.num_layers, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
        head_dim=cfg.head_dim, rope_theta=cfg.rope_theta, tie_word_embeddings=cfg.tie_word_embeddings,
        max_position_embeddings=max(cfg.max_position_embeddings, context + 2 * steps))
    model = getattr(transformers, name + "ForCausalLM")(hc).to(device="cuda", dtype=torch.bfloat16).eval()
    # Static cache: generate() compiles the decoding forward itself (torch.compile, CUDA graphs) — the setup the
    # transformers docs recommend; wrapping forward in torch.compile by hand breaks its in-place cache updates.
    model.generation_config.cache_implementation = "static"
    ids = torch.randint(3, cfg.sampling_vocab_size, (rows, context - steps), device="cuda")

    def gen(n):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, max_new_tokens=n, min_new_tokens=n, do_sample=True, top_k=0, top_p=1.0,
                           pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t0

    gen(steps), gen(8)  # compile / warm up both lengths
    return rows * (steps - 8) / max(gen(steps) - gen(8), 1e-9)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", nargs="+", default=["tiny"], help="model presets ('tiny' = tiny qwen2.5 shape)")
    ap.add_argument("--rows", nargs="+", type=int, default=[16, 64])
    ap.add_argument("--context", nargs="+", type=int, default=[256])
    ap.add_argument("--steps", type=int, default=32, help="decode steps timed per configuration")
    ap.add_argument("--dtype", default=None, help="param/compute dtype (default bfloat16 on GPU, float32 on CPU)")
    ap.add_argument("--attention", nargs="+", default=["auto"], choices=list(attention_lib.ATTENTION_IMPLS),
                    help="decode attention(s): several are timed side by side (the tree and branching tables take "
                         "the first)")
    ap.add_argument("--block-size", type=int, default=256, help="decode attention KV block (cache multiple)")
    ap.add_argument("--kernel-table", action="store_true",
                    help="also time the bare decode attention of each --attention value (one layer, no model step)")
    ap.add_argument("--random-weights", action="store_true", default=True,
                    help="random weights (the only mode: speed does not depend on the values)")
    ap.add_argument("--no-fuse", action="store_true", help="decode with unfused q/k/v and gate/up projections")
    ap.add_argument("--profile", default=None, help="folder for a perfetto trace of one decode run per row")
    ap.add_argument("--no-tree", action="store_true", help="skip tree vs independent sampling")
    ap.add_argument("--no-decode", action="store_true", help="skip the decode table")
    ap.add_argument("--tree-prompts", type=int, default=4)
    ap.add_argument("--tree-prompt-len", type=int, default=64)
    ap.add_argument("--tree-leaves", type=int, default=16)
    ap.add_argument("--tree-branch", type=int, default=2)
    ap.add_argument("--tree-depth", type=int, default=4)
    ap.add_argument("--tree-segment", type=int, default=32)
    ap.add_argument("--branching", action="store_true", help="branching rules' boundary cost table")
    ap.add_argument("--branch-segment", type=int, default=512, help="segment length S for --branching")
    ap.add_argument("--branch-depth", type=int, default=8, help="max depth D for --branching (T = D * S)")
    ap.add_argument("--branch-leaves", type=int, default=16, help="leaves per prompt W for --branching")
    ap.add_argument("--hf-baseline", action="store_true", help="also time transformers generate (needs CUDA)")
    ap.add_argument("--hf-only", action="store_true",
                    help="only the transformers baseline (run it in its own process so JAX holds no GPU memory)")
    args = ap.parse_args(argv)
    global PROFILE, FUSE
    PROFILE, FUSE = args.profile, not args.no_fuse

    kind, bw, bw_src = device_bandwidth()
    dtype = args.dtype or ("float32" if jax.devices()[0].platform == "cpu" else "bfloat16")
    print(f"device: {kind} ({jax.devices()[0].platform}); bandwidth {bw / 1e9 if bw else float('nan'):.1f} GB/s "
          f"({bw_src}); dtype {dtype}; attention {' '.join(args.attention)} (block {args.block_size})")
    hf_ok = False
    if args.hf_baseline:
        try:
            import torch
            hf_ok = torch.cuda.is_available()
        except ImportError:
            pass
        if not hf_ok:
            print("--hf-baseline: torch with CUDA not available; skipped")
    if args.hf_only:
        print(f"\n{'preset':<14}{'rows':>6}{'context':>9}{'HF tok/s':>12}  (transformers generate, static cache, "
              "torch.compile)")
        for preset in args.preset:
            for rows in args.rows:
                for ctx in args.context:
                    print(f"{preset:<14}{rows:>6}{ctx:>9}{bench_hf(preset, rows, ctx, args.steps):>12.0f}", flush=True)
        return
    print(f"\n{'preset':<14}{'rows':>6}{'context':>9}  {'attention':<13}{'tok/s':>12}{'roofline':>12}{'ratio':>8}"
          + (f"{'HF tok/s':>12}{'x HF':>7}" if hf_ok else ""))
    attention = args.attention[0]
    for preset in args.preset:
        cfg = get_model_config(preset, dtype)
        params = jax.jit(lambda k: T.init_params(cfg, k))(jax.random.key(0))
        for rows in ([] if args.no_decode else args.rows):
            for ctx in args.context:
                if ctx <= args.steps:
                    raise ValueError(f"--context ({ctx}) must exceed --steps ({args.steps})")
                hf = bench_hf(preset, rows, ctx, args.steps) if hf_ok else None
                for impl in args.attention:
                    head = f"{preset:<14}{rows:>6}{ctx:>9}  {impl:<13}"
                    try:
                        tps, step_bytes = bench_decode(cfg, params, rows, ctx, args.steps, args.block_size, impl)
                    except Exception as e:  # noqa: BLE001  one implementation's failure must not end the table
                        print(head + _failed(e), flush=True)
                        continue
                    roof = rows / (step_bytes / bw) if bw else float("nan")
                    line = f"{head}{tps:>12.0f}{roof:>12.0f}{tps / roof:>8.2f}"
                    if hf is not None:
                        line += f"{hf:>12.0f}{tps / hf:>7.2f}"
                    print(line, flush=True)
        if args.kernel_table:
            kernel_table(cfg, preset, args.rows, args.context, args.steps, args.block_size, args.attention, bw)
        if args.branching:
            for rows in args.rows:
                branching_table(cfg, params, rows, args.context[0], args.branch_leaves, args.branch_segment,
                                args.branch_depth, args.steps, args.block_size, attention)
        if not args.no_tree:
            W, b, D, S = args.tree_leaves, args.tree_branch, args.tree_depth, args.tree_segment
            res = bench_tree(cfg, params, args.tree_prompts, args.tree_prompt_len, W, b, D, S, attention,
                             min(args.block_size, 64) if jax.devices()[0].platform == "cpu" else args.block_size)
            (tt, ts, tseg, tf), (it, its, iseg, _) = res["tree"], res["independent"]
            print(f"\n{preset}: {args.tree_prompts} prompts x W={W}, b={b}, D={D}, S={S} "
                  f"(prompt {args.tree_prompt_len} tokens)")
            print(f"{'mode':<13}{'decoded':>10}{'wall s':>10}{'segments':>10}{'forks':>8}")
            print(f"{'tree':<13}{tt:>10}{ts:>10.3f}{tseg:>10}{tf:>8}")
            print(f"{'independent':<13}{it:>10}{its:>10.3f}{iseg:>10}{'-':>8}")
            print(f"tree decodes {100 * (1 - tt / it):.1f}% fewer tokens, {its / ts:.2f}x faster\n")


if __name__ == "__main__":
    main()
