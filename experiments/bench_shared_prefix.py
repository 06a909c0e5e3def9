"""Shared-prefix ("cascade") vs per-row KV cache in the tree sampler's decode step: tokens/s and peak memory.

For ``P`` prompts of ``prompt_len`` tokens and ``W`` rows per prompt (``R = P * W``), every variant runs ``steps``
decode steps of the sampler's real decode step (:func:`treejax.sampling.decode.decode_token_stats`: model step,
vocabulary masking, sampling, log-prob statistics; what ``tree_stages.decode_token_step`` calls), all rows live,
row ``r`` at position ``prompt_len - 1 + i`` at step ``i`` (the tree sampler's first segment without early stops):

* ``per_row`` (``TreeConfig.prefix_cache = "per_row"``): ``R`` rows of ``round(bucket(prompt_len) + steps)`` slots,
  the prompt's KV in every row; attention ``--attention`` (default ``auto``: Pallas on a GPU for 16-bit caches);
* ``shared`` (``"shared"``): the prompt's KV once per prompt (``[P, K, round(bucket(prompt_len)), H]``) plus ``R``
  suffix rows of ``round(steps + 1)`` slots; cascade attention with the passes ``make_model_fns`` picks
  (``cascade="auto"``: both through the Pallas kernel where the per-row attention is Pallas, i.e. on a GPU with a
  16-bit cache, XLA otherwise). ``--prefix-block-h`` / ``--prefix-num-warps`` (several values: one ``shared``
  variant per combination) set the Pallas prefix pass's queries per program and warps (default: the smallest
  power of two >= W G up to 128, and the kernel's 4 warps);
* ``shared_xla``: the same layout with the XLA cascade forced (``cascade="xla"``), for comparison.

The caches are filled with random keys/values instead of a prefill (decode cost does not depend on the values;
the prefill, identical work in both layouts except for the per-row broadcast copy, is not timed); the cache is
donated to the timed program, as the sampler's loop updates it in place, so a variant holds one cache. Each variant
runs in a fresh subprocess so its peak device memory (``memory_stats()["peak_bytes_in_use"]``, GPU only) is its
own; an out-of-memory failure is reported as ``OOM``. tokens/s = ``R * steps / t`` with ``t`` the median of
``--repeats`` timed runs after one warm-up (compile) run, each ended by ``block_until_ready``.

Examples:
  python experiments/bench_shared_prefix.py --tiny --out /tmp/shared_tiny.json                  # CPU smoke run
  python experiments/bench_shared_prefix.py --out results/shared_prefix_h200.json               # GPU (defaults:
      qwen2.5-0.5b, bf16, 64 prompts x 16 rows, prompt lengths 256 1024 4096, 128 steps)
  python experiments/bench_shared_prefix.py --variants per_row shared shared_xla \
      --prefix-block-h 16 32 64 128 --out results/shared_prefix_pallas_h200.json                # GPU block_h sweep
  python experiments/bench_shared_prefix.py --attention pallas_mgpu --variants per_row shared \
      --out results/shared_prefix_mgpu_h200.json                # GPU: Mosaic GPU per-row and cascade passes
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import time

import numpy as np

# Make ``treejax`` importable when the script is run as ``python experiments/bench_shared_prefix.py``.
_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if _REPO not in sys.path:
    sys.path.insert(0, _REPO)

VARIANTS = ("per_row", "shared", "shared_xla")


def model_config(name: str, tiny: bool, dtype: str):
    from treejax.models import presets

    cfg = presets.tiny_config(name) if tiny else presets.get_config(name)
    return cfg.replace(param_dtype=dtype, compute_dtype=dtype)


def run_variant(args, variant: str, prompt_len: int, block_h: int | None = None,
                num_warps: int | None = None) -> dict:
    """One measurement in this process (the child side): returns a JSON-able dict. ``block_h`` / ``num_warps``:
    the Pallas prefix pass of a ``shared`` variant (``None``: the defaults)."""
    import jax
    import jax.numpy as jnp

    from treejax.models import transformer as T
    from treejax.sampling import attention as attention_lib
    from treejax.sampling import decode
    from treejax.sampling.strategies import Temperature

    cfg = model_config(args.model, args.tiny, args.dtype)
    P, W, steps = args.prompts, args.rows_per_prompt, args.steps
    R = P * W
    cascade = dict(cascade="xla" if variant == "shared_xla" else "auto", cascade_block_h=block_h,
                   cascade_num_warps=num_warps) if variant != "per_row" else {}
    fns = decode.make_model_fns(cfg, attention=args.attention, block_size=args.block, cache_dtype=args.cache_dtype,
                                **cascade)
    impl = fns.attention if variant == "per_row" else f"cascade ({fns.cascade_attention})"
    if variant != "per_row" and fns.cascade_attention == "pallas":
        used_h = block_h or attention_lib.default_prefix_block_h(W * (cfg.num_heads // cfg.num_kv_heads))
        impl = f"cascade (pallas, block_h {used_h}, {num_warps or 4} warps)"
    bucket = decode.bucket_length(prompt_len)
    n = prompt_len - 1  # prefix tokens per prompt (the last prompt token is fed by the first decode step)
    if variant == "per_row":
        L = attention_lib.round_cache_length(bucket + steps, fns.cache_multiple)
        shape = dict(rows=R, slots=L)
    else:
        Lpre = attention_lib.round_cache_length(bucket, fns.cache_multiple)
        Ls = attention_lib.round_cache_length(steps + 1, fns.cache_multiple)
        shape = dict(prompts=P, prefix_slots=Lpre, rows=R, suffix_slots=Ls)
    out = dict(variant=variant, prompt_len=prompt_len, attention=impl, cache_shape=shape,
               cascade=fns.cascade_attention if variant != "per_row" else None, prefix_block_h=block_h,
               prefix_num_warps=num_warps,
               device=jax.devices()[0].device_kind, model=args.model + (" (tiny)" if args.tiny else ""))
    strategy = Temperature(1.0)

    @jax.jit
    def make_cache(key):
        c = (fns.init_cache(R, shape["slots"]) if variant == "per_row"
             else fns.init_shared_cache(P, W, shape["prefix_slots"], shape["suffix_slots"]))
        noise = jax.tree.map(lambda x: 0.5 * jax.random.normal(key, x.shape, x.dtype)
                             if jnp.issubdtype(x.dtype, jnp.floating) else x, c)
        if variant != "per_row":
            noise = noise.replace(prefix=dict(noise.prefix, length=jnp.full((P,), n, jnp.int32)))
        return noise

    @jax.jit
    def make_params(key):
        return T.init_params(cfg, key)

    @functools.partial(jax.jit, donate_argnums=(1,), compiler_options=decode.SAMPLER_COMPILER_OPTIONS)
    def run(params, cache, key):  # the cache is donated (updated in place, as in the sampler's loop)
        rows_r = jnp.arange(R, dtype=jnp.int32)
        params = fns.prepare(params)  # as the sampler does, once outside the loop

        def body(i, carry):
            cache, tok, acc = carry
            pos = jnp.full((R,), n, jnp.int32) + i
            keys = decode.token_keys(key, rows_r, jnp.zeros_like(rows_r), pos)
            tok, lp, _, _, _, _, cache = decode.decode_token_stats(fns, strategy, params, cache, tok, pos,
                                                                   jnp.ones((R,), bool), keys, False)
            return cache, tok, acc + jnp.sum(lp)

        return jax.lax.fori_loop(0, steps, body, (cache, jnp.ones((R,), jnp.int32), jnp.float32(0.0)))

    try:
        params = make_params(jax.random.key(0))
        cache = make_cache(jax.random.key(1))
        cache, *_ = jax.block_until_ready(run(params, cache, jax.random.key(2)))  # compile + warm-up
        times = []
        for r in range(args.repeats):
            t0 = time.perf_counter()
            cache, *_ = jax.block_until_ready(run(params, cache, jax.random.key(3 + r)))
            times.append(time.perf_counter() - t0)
    except Exception as e:  # noqa: BLE001  an allocation failure is a result (reported as OOM), anything else not
        text = f"{type(e).__name__}: {e}"
        if "RESOURCE_EXHAUSTED" in text or "out of memory" in text.lower() or "OOM" in text:
            out.update(status="OOM", error=text.splitlines()[0][:300])
            return out
        raise
    dt = float(np.median(times))
    stats = jax.devices()[0].memory_stats() or {}
    out.update(status="ok", times_s=times, median_s=dt, tokens_per_s=R * steps / dt,
               peak_bytes=stats.get("peak_bytes_in_use"),
               cache_bytes=int(sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(cache))))
    return out


def child_command(args, variant: str, prompt_len: int, block_h: int | None, num_warps: int | None) -> list[str]:
    cmd = [sys.executable, os.path.abspath(__file__), "--child", variant, "--prompt-len", str(prompt_len),
           "--model", args.model, "--prompts", str(args.prompts), "--rows-per-prompt", str(args.rows_per_prompt),
           "--steps", str(args.steps), "--repeats", str(args.repeats), "--block", str(args.block),
           "--attention", args.attention, "--dtype", args.dtype, "--cache-dtype", args.cache_dtype]
    cmd += ["--prefix-block-h", str(block_h)] if block_h else []
    cmd += ["--prefix-num-warps", str(num_warps)] if num_warps else []
    return cmd + (["--tiny"] if args.tiny else [])


def measure(args, variant: str, prompt_len: int, block_h: int | None = None, num_warps: int | None = None) -> dict:
    """Runs one variant in a fresh subprocess (separate peak memory); its last stdout line is the JSON result."""
    proc = subprocess.run(child_command(args, variant, prompt_len, block_h, num_warps), capture_output=True,
                          text=True)
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    if proc.returncode == 0 and lines:
        return json.loads(lines[-1])
    err = (proc.stderr or proc.stdout).strip().splitlines()
    tail = " | ".join(err[-3:])[:500]
    oom = "RESOURCE_EXHAUSTED" in proc.stderr or "out of memory" in proc.stderr.lower()
    return dict(variant=variant, prompt_len=prompt_len, status="OOM" if oom else f"failed (rc {proc.returncode})",
                error=tail, prefix_block_h=block_h, prefix_num_warps=num_warps)


def jobs(args) -> list[tuple[str, int | None, int | None]]:
    """``(variant, block_h, num_warps)`` per measurement at one prompt length: one ``shared`` per combination of
    ``--prefix-block-h`` x ``--prefix-num-warps`` (``None``: the default), every other variant once."""
    out = []
    for v in args.variants:
        if v == "shared":
            out += [(v, h, w) for h in args.prefix_block_h or [None] for w in args.prefix_num_warps or [None]]
        else:
            out.append((v, None, None))
    return out


def fmt_bytes(b) -> str:
    if b is None:
        return "n/a"
    return f"{b / 2**30:.2f} GiB" if b >= 2**30 else f"{b / 2**20:.1f} MiB"


def table(results: list[dict]) -> str:
    lines = ["| prompt len | variant | attention | tokens/s | median step (ms) | peak memory | KV cache | speed-up |",
             "|---:|---|---|---:|---:|---:|---:|---:|"]
    base = {r["prompt_len"]: r.get("tokens_per_s") for r in results if r["variant"] == "per_row"}
    for r in results:
        r = dict(r, variant=r["variant"] + "".join(f" {k}={r[k]}" for k in ("prefix_block_h", "prefix_num_warps")
                                                    if r.get(k)))
        if r.get("status") != "ok":
            lines.append(f"| {r['prompt_len']} | {r['variant']} | {r.get('attention', '')} | {r['status']} | | | | |")
            continue
        ref = base.get(r["prompt_len"])
        speed = (f"{r['tokens_per_s'] / ref:.2f}x" if ref else "n/a (no per_row run)" if r["prompt_len"] not in base
                 else "n/a (per_row failed)")
        step_ms = 1e3 * r["median_s"] / r["steps"]
        lines.append(f"| {r['prompt_len']} | {r['variant']} | {r['attention']} | {r['tokens_per_s']:.0f} | "
                     f"{step_ms:.2f} | {fmt_bytes(r['peak_bytes'])} | {fmt_bytes(r['cache_bytes'])} | {speed} |")
    return "\n".join(lines)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="qwen2.5-0.5b", help="preset name (treejax.models.presets)")
    ap.add_argument("--tiny", action="store_true", help="the preset's tiny config and small sizes (CPU check)")
    ap.add_argument("--prompt-lens", type=int, nargs="+", default=None, help="default 256 1024 4096 (tiny: 32 64)")
    ap.add_argument("--prompts", type=int, default=None, help="P (default 64; tiny 4)")
    ap.add_argument("--rows-per-prompt", type=int, default=16, help="W")
    ap.add_argument("--steps", type=int, default=None, help="decode steps (default 128; tiny 16)")
    ap.add_argument("--repeats", type=int, default=3, help="timed runs (median), after one warm-up")
    ap.add_argument("--block", type=int, default=256, help="attention block (make_model_fns block_size)")
    ap.add_argument("--attention", default="auto",
                    help="per_row attention impl: auto | ragged | pallas | pallas_mgpu | dense (a kernel also runs "
                         "the shared variant's cascade passes)")
    ap.add_argument("--dtype", default="bfloat16", help="params / compute dtype")
    ap.add_argument("--cache-dtype", default="bfloat16")
    ap.add_argument("--variants", nargs="+", default=["per_row", "shared"], choices=VARIANTS,
                    help="per_row | shared (cascade as make_model_fns picks it) | shared_xla (XLA cascade forced)")
    ap.add_argument("--prefix-block-h", type=int, nargs="+", default=None,
                    help="Pallas prefix pass: queries per program (powers of two >= 16), one shared variant each")
    ap.add_argument("--prefix-num-warps", type=int, nargs="+", default=None,
                    help="Pallas prefix pass: warps per program (default the kernel's 4), one shared variant each")
    ap.add_argument("--out", default=None, help="write the results as JSON here")
    ap.add_argument("--child", choices=VARIANTS, default=None, help=argparse.SUPPRESS)
    ap.add_argument("--prompt-len", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.prompts is None:
        args.prompts = 4 if args.tiny else 64
    if args.steps is None:
        args.steps = 16 if args.tiny else 128
    if args.tiny and args.block == 256:
        args.block = 16
    if args.child:
        result = run_variant(args, args.child, args.prompt_len, (args.prefix_block_h or [None])[0],
                             (args.prefix_num_warps or [None])[0])
        result["steps"] = args.steps
        print(json.dumps(result), flush=True)
        return
    lens = args.prompt_lens or ([32, 64] if args.tiny else [256, 1024, 4096])
    results = []
    for L in lens:
        for v, h, w in jobs(args):
            r = measure(args, v, L, h, w)
            r.setdefault("steps", args.steps)
            results.append(r)
            print(f"# {v} (block_h {h}, warps {w}) @ {L}: {r.get('status')} {r.get('tokens_per_s', '')}",
                  file=sys.stderr, flush=True)
    config = dict(model=args.model, tiny=args.tiny, prompts=args.prompts, rows_per_prompt=args.rows_per_prompt,
                  steps=args.steps, repeats=args.repeats, block=args.block, attention=args.attention,
                  prefix_block_h=args.prefix_block_h, prefix_num_warps=args.prefix_num_warps,
                  dtype=args.dtype, cache_dtype=args.cache_dtype,
                  device=next((r["device"] for r in results if "device" in r), None))
    print(f"device: {config['device']}; model {args.model}{' (tiny)' if args.tiny else ''}; P={args.prompts}, "
          f"W={args.rows_per_prompt}, {args.steps} decode steps, {args.dtype} params, {args.cache_dtype} cache\n")
    print(table(results))
    if args.out:
        os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
        with open(args.out, "w") as f:
            json.dump(dict(config=config, results=results), f, indent=1)


if __name__ == "__main__":
    main()
