"""Update-step MFU and the time split of one RL step, on random weights.

MFU table (one row per preset): the jitted ``update(state, batch)`` of ``treejax.rl.update`` (fp32 master weights,
bf16 compute, AdamW, gradient accumulation over micro-batches, per-layer rematerialisation) on a mini-batch of
``rows`` sequences of ``seq`` tokens. Model FLOPs per step (the standard count, causal attention halved):

    FLOPs = 3 * (2 * N_matmul * tokens + 2 * layers * seq * Q * H * tokens)   (forward + 2x backward)

with ``N_matmul`` the parameters that multiply activations (embedding gather excluded, output head included).
MFU = FLOPs / time / peak dense bf16 FLOP/s (H100/H200 SXM: 989e12). Remat recompute is not counted as useful.

RL-step split (``--rl-step``): prompts -> TreePO tree rollout -> rewards (a synthetic per-token reward, no
verifier) -> TreePO advantages -> batch -> one update, each stage timed after a warm-up call.

  python experiments/bench_update.py --preset qwen2.5-0.5b qwen2.5-1.5b --rows 64 --seq 2048 --micro 4 --remat dots --rl-step
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np

from treejax.models import presets, transformer
from treejax.rl.losses import LossConfig
from treejax.rl.optimizer import OptimizerConfig, make_optimizer
from treejax.rl.train_state import TrainState
from treejax.rl.batch import expanded_batch
from treejax.rl.layouts import Expanded
from treejax.rl.update import make_update_fn

ATTENTION = "auto"  # set by --attention
REMAT = "full"  # set by --remat / --no-remat
CHUNK = 16384  # set by --logprob-chunk
PROFILE = None  # set by --profile
PEAK_FLOPS = {"h100": 989e12, "h200": 989e12}


def peak_flops() -> tuple[str, float | None]:
    kind = jax.devices()[0].device_kind
    for k, v in PEAK_FLOPS.items():
        if k in kind.lower():
            return kind, v
    return kind, None


def step_flops(cfg, rows: int, seq: int) -> float:
    E, F, Q, K, H, V = (cfg.hidden_size, cfg.intermediate_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_dim,
                        cfg.vocab_size)
    per_layer = E * Q * H + 2 * E * K * H + Q * H * E + 3 * E * F
    n_matmul = cfg.num_layers * per_layer + E * V
    tokens = rows * seq
    attn = 2 * cfg.num_layers * seq * Q * H * tokens  # QK^T and PV, causal (half of 4 * ...)
    return 3 * (2 * n_matmul * tokens + attn)


def make_batch(cfg, rows: int, seq: int, key):
    tokens = jax.random.randint(key, (rows, seq), 3, cfg.sampling_vocab_size, jnp.int32)
    prompt = seq // 8
    mask = (jnp.arange(seq)[None, :] >= prompt).astype(jnp.float32) * jnp.ones((rows, 1))
    return expanded_batch({"tokens": tokens, "positions": jnp.broadcast_to(jnp.arange(seq, dtype=jnp.int32), (rows, seq)),
                           "segment_ids": jnp.ones((rows, seq), jnp.int32), "loss_mask": mask,
                           "old_logp": -5.0 * mask, "advantages": jax.random.normal(key, (rows, seq)) * mask})


def get_config(preset: str):
    """Full preset (fp32 master weights, bf16 compute) or ``tiny`` (a tiny qwen2.5 shape, for CPU smoke runs)."""
    if preset == "tiny":
        return presets.tiny_config("qwen2.5-0.5b", compute_dtype="bfloat16")
    return presets.get_config(preset, param_dtype="float32", compute_dtype="bfloat16")


def bench_update(preset: str, rows: int, seq: int, micro: int, repeats: int = 3):
    cfg = get_config(preset)
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-6, warmup_steps=0, total_steps=100))
    params = jax.jit(lambda k: transformer.init_params(cfg, k))(jax.random.key(0))
    state = jax.jit(lambda p: TrainState.create(p, optimizer))(params)
    del params
    layout = Expanded(cfg, attention_impl=ATTENTION, chunk_size=CHUNK)
    update = jax.jit(make_update_fn(layout, LossConfig(eps_high=0.28, dual_clip_c=10.0), optimizer,
                                    num_micro_batches=micro, remat=REMAT),
                     donate_argnames=("state",))
    batch = make_batch(cfg, rows, seq, jax.random.key(2))
    state, m = update(state, batch)
    jax.block_until_ready(m)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        state, m = update(state, batch)
        jax.block_until_ready(m)
        times.append(time.perf_counter() - t0)
    if PROFILE:
        with jax.profiler.trace(f"{PROFILE}/{preset}", create_perfetto_trace=True):
            state, m = update(state, batch)
            jax.block_until_ready(m)
    return float(np.median(times)), step_flops(cfg, rows, seq), cfg


def bench_rl_step(preset: str, prompts: int, W: int, D: int, S: int, micro: int, old_logp: str = "trainer"):
    """The loop's own :func:`treejax.rl.step.rl_step` on random weights and prompts (synthetic reward)."""
    from treejax.precision import Precision
    from treejax.rl.config import StepConfig
    from treejax.rl.step import make_learner, rl_step
    from treejax.sampling.decode import make_model_fns
    from treejax.sampling.strategies import Temperature
    from treejax.sampling.tree import TreeConfig, make_tree_rollout
    from treejax.testing.sources import FixedPromptRollouts

    cfg = get_config(preset)
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-6, warmup_steps=0, total_steps=100))
    params = jax.jit(lambda k: transformer.init_params(cfg, k))(jax.random.key(0))
    state = jax.jit(lambda p: TrainState.create(p, optimizer))(params)
    del params
    precision = Precision(compute_dtype=cfg.compute_dtype).resolve()
    rollout = make_tree_rollout(make_model_fns(cfg, cache_dtype=precision.cache_dtype),
                                TreeConfig(num_leaves=W, max_depth=D, segment_length=S, branch_factor=2,
                                           strategy=Temperature(1.0), stop_ids=()))
    loss = LossConfig(eps_high=0.28, dual_clip_c=10.0)
    layout = Expanded(cfg, attention_impl=ATTENTION, chunk_size=CHUNK)
    update = jax.jit(make_update_fn(layout, loss, optimizer, num_micro_batches=micro, remat=REMAT),
                     donate_argnames=("state",))
    fns = make_learner(cfg, StepConfig(estimator="treepo", loss=loss, old_logp=old_logp, micro_batches=micro,
                                       logprob_chunk_size=CHUNK, attention_impl=ATTENTION), precision, update, layout)
    rng = np.random.RandomState(0)
    prompt_tokens = rng.randint(3, cfg.sampling_vocab_size, (prompts, 64)).astype(np.int32)
    source = FixedPromptRollouts(rollout, prompt_tokens, np.full((prompts,), 64, np.int32),
                                 lambda f: jnp.mean((f.tokens % 7 == 0) * f.loss_mask, -1))  # synthetic reward
    for it in range(2):  # the first iteration compiles
        t0 = time.perf_counter()
        state, ro, metrics, host = rl_step(fns, state, source, jax.random.key(it), it, timed=True)
        total = time.perf_counter() - t0
    times = {k[5:-2]: v for k, v in host.items() if k.startswith("time/") and k != "time/learn_dispatch_s"}
    times["host overhead"] = total - sum(times.values())
    return times, host["rollout/decoded_tokens"]


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", nargs="+", default=["qwen2.5-0.5b"])
    ap.add_argument("--rows", type=int, default=64)
    ap.add_argument("--seq", type=int, default=2048)
    ap.add_argument("--micro", type=int, default=8)
    ap.add_argument("--rl-step", action="store_true")
    ap.add_argument("--no-remat", action="store_true", help="keep activations instead of per-layer remat")
    ap.add_argument("--remat", default="full", choices=["none", "full", "dots"],
                    help="per-layer remat policy (transformer.forward); --no-remat = none")
    ap.add_argument("--logprob-chunk", type=int, default=16384, help="vocabulary chunk of the log-prob head")
    ap.add_argument("--profile", default=None, help="write a perfetto trace of one update step to this folder")
    ap.add_argument("--attention", default="auto", choices=["auto", "xla", "cudnn"],
                    help="training attention (auto: cudnn on GPU)")
    ap.add_argument("--rl-prompts", type=int, default=16)
    args = ap.parse_args(argv)
    global ATTENTION, REMAT, CHUNK, PROFILE
    ATTENTION = args.attention
    REMAT = "none" if args.no_remat else args.remat
    CHUNK = args.logprob_chunk
    PROFILE = args.profile
    kind, peak = peak_flops()
    print(f"device: {kind}; peak dense bf16 {peak / 1e12 if peak else float('nan'):.0f} TFLOP/s; "
          f"training attention {args.attention}; remat {REMAT}; log-prob chunk {CHUNK}")
    print(f"\n{'preset':<14}{'rows':>6}{'seq':>7}{'micro':>7}{'step s':>9}{'TFLOP/s':>10}{'MFU':>8}")
    for preset in args.preset:
        dt, flops, _ = bench_update(preset, args.rows, args.seq, args.micro)
        mfu = flops / dt / peak if peak else float("nan")
        print(f"{preset:<14}{args.rows:>6}{args.seq:>7}{args.micro:>7}{dt:>9.3f}{flops / dt / 1e12:>10.1f}"
              f"{mfu:>8.1%}", flush=True)
    if args.rl_step:
        for preset in args.preset:
            t, decoded = bench_rl_step(preset, args.rl_prompts, 16, 4, 256, args.micro)
            total = sum(t.values())
            print(f"\nRL step split, {preset}: {args.rl_prompts} prompts x 16 leaves (b=2, D=4, S=256), "
                  f"{decoded} decoded tokens, one update")
            for k, v in t.items():
                print(f"  {k:<26}{v:>8.3f} s  {v / total:>6.1%}")


if __name__ == "__main__":
    main()
