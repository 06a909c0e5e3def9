"""Do the tokens a tree saves become seconds? Rollout seconds per call against decoded tokens, tree vs independent.

For each arm (independent sampling, slot trees ``k``) and each ``row_buckets`` setting, one warm-up call and
``--repeats`` timed calls of the compiled rollout on the same random prompts; reports decoded tokens per call,
rounds, median seconds per call, and the *token-proportional* prediction

    predicted_s(arm) = independent_s * decoded_tokens(arm) / decoded_tokens(independent)

(same ``row_buckets``) with the ratio measured / predicted: 1.0 means the tree's saved tokens are saved seconds;
the long-regime issue's target is <= 1.2 for k = 2, 4, 8.

Weights are random (``--preset``), so answers have no natural end: a path stops when it samples one of
``V / --mean-length`` stop ids (a near-geometric length with that mean, cut at ``--max-tokens``), which puts the
same kind of tail into every arm as a real policy's few long answers. A real model's lengths are more
concentrated; ``compare_rollouts.py`` measures the same ratio on a real model and task.

    python experiments/bench_rollout_seconds.py --preset qwen2.5-1.5b --prompts 8 --leaves 16 --segment 64 \
        --max-tokens 512 --mean-length 185 --slots 2 4 8 --row-buckets 1 4 8
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from treejax.models import presets
from treejax.models import transformer as T
from treejax.sampling import decode, tree
from treejax.sampling.strategies import Temperature


def arms(W: int, S: int, max_tokens: int, slots: list[int], stop_ids: tuple[int, ...], buckets: int) -> dict:
    """``{name: TreeConfig}``: independent sampling and slot trees with ``init_divergence = k``, b = 2."""
    common = dict(strategy=Temperature(1.0), stop_ids=stop_ids, row_buckets=buckets)
    out = {"independent": tree.independent_config(W, max_tokens, S, fallback=False, **common)}
    for k in slots:
        out[f"slots k={k}"] = tree.TreeConfig(num_leaves=W, max_depth=-(-max_tokens // S), segment_length=S,
                                              branch_factor=2, allocation="slots", init_divergence=k,
                                              max_response_length=max_tokens, **common)
    return out


def time_arm(fns, tc, params, toks, lens, repeats: int) -> dict:
    ro = tree.make_tree_rollout(fns, tc)
    jax.block_until_ready(ro(params, toks, lens, jax.random.key(0)))  # compile + warm-up
    times, decoded, rounds = [], [], []
    for r in range(repeats):
        t0 = time.perf_counter()
        forest, info = ro(params, toks, lens, jax.random.key(r + 1))
        jax.block_until_ready(forest)
        times.append(time.perf_counter() - t0)
        decoded.append(int(info.decoded_tokens))
        rounds.append(int(info.segments))
    return {"s": float(np.median(times)), "decoded": float(np.mean(decoded)), "rounds": float(np.mean(rounds))}


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny", help="model preset ('tiny' = tiny qwen2.5 shape)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=128)
    ap.add_argument("--leaves", type=int, default=16)
    ap.add_argument("--segment", type=int, default=64)
    ap.add_argument("--max-tokens", type=int, default=512)
    ap.add_argument("--mean-length", type=float, default=185.0)
    ap.add_argument("--slots", type=int, nargs="+", default=[2, 4, 8])
    ap.add_argument("--row-buckets", type=int, nargs="+", default=[1, 4])
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--dtype", default=None, help="default bfloat16 on GPU, float32 on CPU")
    ap.add_argument("--xla", action="append", default=[], metavar="OPTION=VALUE",
                    help="an XLA option added to the sampler's compiler options (decode.SAMPLER_COMPILER_OPTIONS)")
    ap.add_argument("--json", default=None)
    a = ap.parse_args(argv)
    for item in a.xla:
        name, _, value = item.partition("=")
        decode.SAMPLER_COMPILER_OPTIONS[name] = value
    dtype = a.dtype or ("float32" if jax.devices()[0].platform == "cpu" else "bfloat16")
    cfg = (presets.tiny_config("qwen2.5-0.5b") if a.preset == "tiny" else presets.get_config(a.preset))
    cfg = cfg.replace(param_dtype=dtype, compute_dtype=dtype)
    params = jax.jit(lambda k: T.init_params(cfg, k))(jax.random.key(0))
    fns = decode.make_model_fns(cfg, cache_dtype=dtype)
    V = cfg.sampling_vocab_size
    n_stop = max(1, int(round(V / a.mean_length)))
    stop_ids = tuple(range(V - n_stop, V))
    rng = np.random.RandomState(0)
    toks = rng.randint(3, V - n_stop, (a.prompts, a.prompt_len)).astype(np.int32)
    lens = np.full((a.prompts,), a.prompt_len, np.int32)
    dev = jax.devices()[0]
    print(f"device: {getattr(dev, 'device_kind', dev.platform)}  sampler XLA options {decode.SAMPLER_COMPILER_OPTIONS}  preset {a.preset} ({dtype}), P={a.prompts} W="
          f"{a.leaves} S={a.segment} max {a.max_tokens} tokens, {n_stop} stop ids (mean length ~{a.mean_length:.0f})")
    print(f"{'arm':<14}{'buckets':>8}{'tokens/call':>13}{'tok ratio':>10}{'rounds':>8}{'s/call':>9}"
          f"{'predicted':>11}{'meas/pred':>10}")
    rows = []
    for nb in a.row_buckets:
        res = {name: time_arm(fns, tc, params, toks, lens, a.repeats)
               for name, tc in arms(a.leaves, a.segment, a.max_tokens, a.slots, stop_ids, nb).items()}
        ind = res["independent"]
        for name, r in res.items():
            ratio = r["decoded"] / ind["decoded"]
            pred = ind["s"] * ratio
            row = dict(arm=name, row_buckets=nb, **r, token_ratio=ratio, predicted_s=pred, meas_over_pred=r["s"] / pred)
            rows.append(row)
            print(f"{name:<14}{nb:>8}{r['decoded']:>13.0f}{ratio:>10.2f}{r['rounds']:>8.1f}{r['s']:>9.3f}"
                  f"{pred:>11.3f}{r['s'] / pred:>10.2f}")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(dict(device=getattr(dev, "device_kind", dev.platform), args=vars(a), rows=rows), f, indent=1)


if __name__ == "__main__":
    main()
