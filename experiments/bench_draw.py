"""Timing of the sampler's draw (``strategies.inverse_cdf_sample``) against ``jax.random.categorical``.

One jitted draw of ``B`` rows from random ``[B, V]`` logits, median of ``--repeats`` calls after warm-up.
``--reference FILE`` also times the ``inverse_cdf_sample`` of another strategies module (e.g. an older version
from ``git show REV:treejax/sampling/strategies.py > old.py``), interleaved with the current one so that both see
the same machine load. ``--decode PRESET`` additionally times a whole decode step (``bench_sampler.bench_decode``:
model step + masking + draw + log-prob statistics) with each draw.

Examples:
  python experiments/bench_draw.py --batch 256 --vocab 49152                      # CPU
  python experiments/bench_draw.py --vocab 49152 151936 --reference old.py --decode qwen2.5-0.5b   # GPU
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from treejax.sampling import strategies


def _load(path):
    spec = importlib.util.spec_from_file_location("reference_strategies", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the class is built
    spec.loader.exec_module(mod)
    return mod


def time_draws(draws: dict, B: int, V: int, repeats: int) -> dict[str, float]:
    logits = jax.random.normal(jax.random.key(1), (B, V), jnp.float32) * 3
    fns = {name: jax.jit(fn) for name, fn in draws.items()}
    for fn in fns.values():
        for _ in range(3):
            jax.block_until_ready(fn(jax.random.split(jax.random.key(0), B), logits))
    times = {name: [] for name in fns}
    for i in range(repeats):
        keys = jax.random.split(jax.random.key(10 + i), B)
        for name, fn in fns.items():
            t0 = time.perf_counter()
            jax.block_until_ready(fn(keys, logits))
            times[name].append(time.perf_counter() - t0)
    return {name: float(np.median(t)) for name, t in times.items()}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch", nargs="+", type=int, default=[256])
    ap.add_argument("--vocab", nargs="+", type=int, default=[49152])
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--reference", default=None, help="another strategies.py whose inverse_cdf_sample to time")
    ap.add_argument("--no-categorical", action="store_true")
    ap.add_argument("--decode", nargs="*", default=[], help="presets whose decode step to time with each draw")
    ap.add_argument("--decode-rows", type=int, default=256)
    ap.add_argument("--decode-context", type=int, default=2048)
    args = ap.parse_args(argv)
    draws = {"current": strategies.inverse_cdf_sample}
    reference = _load(args.reference) if args.reference else None
    if reference is not None:
        draws["reference"] = reference.inverse_cdf_sample
    if not args.no_categorical:
        draws["categorical"] = lambda k, z: jax.vmap(jax.random.categorical)(k, z)
    print(f"device: {jax.devices()[0].device_kind}; jax {jax.__version__}; median of {args.repeats} (ms)")
    print(f"{'B':>6}{'V':>9}" + "".join(f"{n:>13}" for n in draws))
    for B in args.batch:
        for V in args.vocab:
            t = time_draws(draws, B, V, args.repeats)
            print(f"{B:>6}{V:>9}" + "".join(f"{1e3 * t[n]:>13.3f}" for n in draws), flush=True)
    if args.decode:
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        import bench_sampler as bs
        from treejax.models import transformer as T

        bs.FUSE = True  # as bench_sampler's own CLI: fused projections on one device

        dtype = "float32" if jax.devices()[0].platform == "cpu" else "bfloat16"
        impls = {"current": strategies.inverse_cdf_sample}
        if reference is not None:
            impls["reference"] = reference.inverse_cdf_sample
        print(f"\ndecode tok/s ({args.decode_rows} rows, context {args.decode_context}, bench_sampler.bench_decode)")
        for preset in args.decode:
            cfg = bs.get_model_config(preset, dtype)
            params = jax.jit(lambda k: T.init_params(cfg, k))(jax.random.key(0))
            row = []
            for _ in range(2):  # alternate twice: machine drift shows up as a difference between the two passes
                for name, fn in impls.items():
                    strategies.inverse_cdf_sample = fn  # Strategy.sample looks the function up at call time
                    try:
                        tps, _ = bs.bench_decode(cfg, params, args.decode_rows, args.decode_context, 32, 256,
                                                 "auto")
                    finally:
                        strategies.inverse_cdf_sample = impls["current"]
                    row.append(f"{name} {tps:.0f}")
            print(f"{preset}: " + ", ".join(row), flush=True)


if __name__ == "__main__":
    main()
