"""One RL step as one function: rollouts -> estimator inputs -> advantages -> batch -> old / reference log-probs
-> PPO updates. The training loop (:mod:`treejax.rl.loop`), ``experiments/bench_update.py`` and the learning-signal
test all call :func:`rl_step`; they differ only in where rollouts and rewards come from (a :class:`RolloutSource`).

Log-probabilities (verl's and tunix's practice)::

    sampler_logp   log q(y_t | y_<t)   from the sampler (bf16 weights and KV cache on GPU, decode kernels)
    old_logp       log pi_old(y_t | y_<t)  the trainer's own forward under the pre-update parameters
                   (``old_logp="trainer"``, default; same forward, dtypes and micro-batching as the update),
                   or the sampler's (``old_logp="sampler"``: no extra forward, but the first PPO ratio is then
                   exp(log pi_old - log q) != 1 wherever the two numerics differ)
    ref_logp       log pi_ref(y_t | y_<t)  the initial weights, kept frozen, when ``LossConfig.kl_coef > 0``

With trainer-side ``old_logp`` the first mini-batch's ratio ``exp(logp - old_logp)`` is 1 up to the forward's
run-to-run reproducibility, and truncated importance sampling (``LossConfig.tis_cap``) weights each token by
``min(exp(old_logp - sampler_logp), C)``, correcting for the sampler/trainer mismatch. The step reports that
mismatch: ``mismatch/abs_mean`` and ``mismatch/abs_max`` of ``old_logp - sampler_logp`` over trained tokens.

Estimator inputs: an estimator's ``EstimatorSpec.inputs`` are supplied by the step — ``greedy_reward_P`` (ReMax)
is the verifier reward of one greedy rollout per prompt, asked of the rollout source.

Timing: each phase (rollout, scoring, old/ref log-probs, update) is closed with ``block_until_ready`` on its output
so the split is real; no metric is copied to the host here (the caller reads them one step late,
``treejax.metrics.DeferredMetrics``), and the mini-batch shuffle runs on the device.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Protocol

import jax
import jax.numpy as jnp
import numpy as np

from treejax.forest import Forest
from treejax.models.config import ModelConfig
from treejax.precision import ResolvedPrecision
from treejax.rl.advantages import estimator_spec
from treejax.parallel import multihost
from treejax.rl import packing as packing_lib
from treejax.rl import tree_stats
from treejax.rl.batch import forest_to_batch
from treejax.rl.losses import LossConfig
from treejax.rl.update import gather_pairs, packed_logprobs, sequence_logprobs, split_micro, trainable_mask

OLD_LOGP_SOURCES = ("trainer", "sampler")
KNOWN_INPUTS = ("greedy_reward_P",)


@dataclasses.dataclass
class Rollouts:
    """What a rollout source returns for one step (``P`` prompts, ``W`` leaves each).

    ``scores_PxW`` are verifier scores in [0, 1] (``None`` when there is no verifier: accuracy is then not
    reported); ``rewards_PxW`` the shaped rewards the estimator sees. ``info`` holds host ints (decoded tokens,
    forks, stop counts) and ``time/scoring_s``.
    """

    forest: Forest
    rewards_PxW: jax.Array
    scores_PxW: np.ndarray | None
    prompts_PxLp: np.ndarray
    lengths_P: np.ndarray
    info: dict[str, Any]
    examples: list | None = None


class RolloutSource(Protocol):
    def sample(self, params: Any, key: jax.Array, step: int) -> Rollouts:
        """Rollouts of ``P`` prompts from the sampler's ``params``."""

    def greedy_rewards(self, params: Any, rollouts: Rollouts) -> np.ndarray:
        """``[P]`` reward of one greedy completion of each prompt of ``rollouts`` (ReMax's baseline)."""


#: ``StepConfig.leaf_weighting``: ``"count"`` trains every leaf slot with weight 1 (TreePO's official weighting;
#: slot trees and independent samples are unbiased this way); ``"mass"`` multiplies each leaf's per-token
#: advantages by ``Forest.leaf_weight`` (``W`` x path mass for ``"transfer"`` trees), so the policy-gradient sum
#: ``sum_l w_l A_l grad log pi(l)`` weighs every leaf by the share of the policy's sample it stands for (the PPO
#: clip of a leaf with ``w > 0`` is unchanged by the scale); the estimators' baselines are left as they are.
LEAF_WEIGHTINGS = ("count", "mass")


@dataclasses.dataclass(frozen=True)
class StepConfig:
    """Static settings of :func:`rl_step` (a subset of ``RunConfig``)."""

    estimator: str = "treepo"
    estimator_options: Any = None
    loss: LossConfig = LossConfig()
    old_logp: str = "trainer"
    epochs: int = 1
    mini_batches: int = 1
    micro_batches: int = 1
    pad_id: int = 0
    logprob_chunk_size: int = 8192
    attention_impl: str = "auto"
    clip_scale_fn: Callable | None = None  # (forest, rewards_PxW) -> [P, W] per-sample clip-range multiplier
    packing: packing_lib.PackingConfig | None = None  # None: expanded rows; else the tree-packed update
    row_multiple: int = 1  # packed row count multiple (micro-batches x batch-sharded devices)
    leaf_weighting: str = "count"  # "count" | "mass": scale each leaf's advantages by forest.leaf_weight

    def __post_init__(self):
        if self.leaf_weighting not in LEAF_WEIGHTINGS:
            raise ValueError(f"leaf_weighting must be one of {LEAF_WEIGHTINGS}, got {self.leaf_weighting!r}")
        if self.old_logp not in OLD_LOGP_SOURCES:
            raise ValueError(f"old_logp must be one of {OLD_LOGP_SOURCES}, got {self.old_logp!r}")
        if self.old_logp == "sampler" and self.loss.tis_cap is not None:
            raise ValueError("LossConfig.tis_cap needs old_logp='trainer': with old_logp='sampler' the sampler's "
                             "log-probs are both the PPO denominator and the TIS reference, so TIS is a no-op")
        for name in ("epochs", "mini_batches", "micro_batches"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        missing = [i for i in estimator_spec(self.estimator).inputs if i not in KNOWN_INPUTS]
        if missing:
            raise ValueError(f"estimator {self.estimator!r} needs inputs {missing} that the RL step cannot supply "
                             f"(supplied: {KNOWN_INPUTS})")


def make_logprob_fn(model_config: ModelConfig, num_micro_batches: int, chunk_size: int = 8192,
                    attention_impl: str = "auto") -> Callable:
    """``fn(params, batch) -> logp [B, L]``: the update's forward without gradients, micro-batched the same way
    (strided micro-batches, ``lax.map``), so old/reference log-probs have the update's numerics."""

    def one(params, tokens, positions, segment_ids):
        return sequence_logprobs(params, model_config, tokens, positions, segment_ids, chunk_size=chunk_size,
                                 attention_impl=attention_impl)

    def fn(params, batch):
        args = (batch["tokens"], batch["positions"], batch.get("segment_ids", jnp.ones_like(batch["tokens"])))
        if num_micro_batches == 1:
            return one(params, *args)
        B = args[0].shape[0]
        out = jax.lax.map(lambda xs: one(params, *xs), tuple(split_micro(a, num_micro_batches) for a in args))
        return jnp.swapaxes(out, 0, 1).reshape((B,) + out.shape[2:])  # [M, B/M, L] -> rows back in order

    return fn


def make_packed_logprob_fn(model_config: ModelConfig, num_micro_batches: int, chunk_size: int = 8192,
                           attention_impl: str = "auto") -> Callable:
    """``fn(params, packed) -> logp [R, Wr, T]``: the packed update's forward without gradients (unique tokens
    scored once, then gathered to (leaf, token) pairs), micro-batched over rows like the update."""

    def one(params, mb):
        logp = packed_logprobs(params, model_config, mb, chunk_size=chunk_size, attention_impl=attention_impl)
        return gather_pairs(logp, mb.pair_index)

    def fn(params, batch):
        if num_micro_batches == 1:
            return one(params, batch)
        R = batch.num_rows
        micro = jax.tree.map(lambda a: split_micro(a, num_micro_batches), batch)
        out = jax.lax.map(lambda mb: one(params, mb), micro)
        return jnp.swapaxes(out, 0, 1).reshape((R,) + out.shape[2:])

    return fn


def logp_mismatch(old_logp_BxL: jax.Array, sampler_logp_BxL: jax.Array, mask_BxL: jax.Array) -> dict:
    """Mean and max ``|old_logp - sampler_logp|`` over trained tokens (0 when none)."""
    on = mask_BxL > 0
    d = jnp.where(on, jnp.abs(old_logp_BxL - sampler_logp_BxL), 0.0)
    return {"mismatch/abs_mean": jnp.sum(d) / jnp.maximum(jnp.sum(on), 1), "mismatch/abs_max": jnp.max(d)}


@dataclasses.dataclass(frozen=True, eq=False)
class StepFns:
    """Jitted pieces of :func:`rl_step`, built once per run by :func:`make_step_fns`."""

    config: StepConfig
    precision: ResolvedPrecision
    sampler_params: Callable
    estimator_inputs: tuple[str, ...]  # the estimator's declared extra inputs (EstimatorSpec.inputs)
    estimator: Callable
    to_batch: Callable
    logprobs: Callable
    prepare: Callable  # (batch, old_logp, ref_logp) -> batch with old/ref/sampler log-probs and metrics
    take_rows: Callable
    update: Callable  # (state, mini_batch) -> (state, metrics): jitted with shardings + donation by the caller
    pairs: Callable | None = None  # packed: (forest, adv_tokens, adv_mask) -> per-pair arrays [P * W, T]
    packed_logprobs: Callable | None = None  # packed: (params, PackedBatch) -> logp [R, Wr, T]
    layout: packing_lib.LayoutFloor | None = None  # packed + sticky: the largest layout met (host state)
    place: Callable = lambda batch: batch  # noqa: E731  mini-batch placement before the update and old/ref passes


def make_step_fns(model_config: ModelConfig, cfg: StepConfig, precision: ResolvedPrecision,
                  update: Callable, batch_sharding: Callable | None = None,
                  sampler_shardings: Any = None) -> StepFns:
    """Builds :class:`StepFns`. ``update`` is the jitted ``update(state, batch)``; ``batch_sharding(batch)`` (optional)
    places each mini-batch before it and before the trainer's old / reference log-prob passes (e.g.
    ``jax.device_put`` with the mesh's batch sharding: without it those passes take the layout the mini-batch
    gather gives, which on a mesh can be replicated, so every device computes every row).
    ``sampler_shardings`` (optional, a pytree of shardings like the params): where the sampler's weight copy lives
    (e.g. ``treejax.parallel.axis_rules.SAMPLER_RULES``: gathered over ``fsdp`` once per step, not per decode
    step); the cast is then jitted with these output shardings even when the dtype does not change."""
    spec = estimator_spec(cfg.estimator)
    options = cfg.estimator_options if cfg.estimator_options is not None else spec.default_options()
    estimator = jax.jit(lambda f, r, inputs: spec.fn(f, r, options, **inputs))

    @jax.jit
    def to_batch(prompts, lens, forest, adv_tokens, adv_mask, eps_scale_PxW):
        return forest_to_batch(prompts, lens, forest, adv_tokens, adv_mask, cfg.pad_id, eps_scale_PxW=eps_scale_PxW)

    logprobs = jax.jit(make_logprob_fn(model_config, cfg.micro_batches, cfg.logprob_chunk_size,
                                       cfg.attention_impl))

    @jax.jit
    def prepare(batch, old_logp, ref_logp):
        batch = dict(batch)
        sampler = batch["sampler_logp"]
        metrics = {}
        if old_logp is not None:
            batch["old_logp"] = old_logp
            metrics = logp_mismatch(old_logp, sampler, trainable_mask(batch))
        else:
            batch["old_logp"] = sampler
            del batch["sampler_logp"]
        if ref_logp is not None:
            batch["ref_logp"] = ref_logp
        return batch, metrics

    take_rows = jax.jit(lambda batch, idx: jax.tree.map(lambda v: jnp.take(v, idx, axis=0), batch))
    place = batch_sharding or (lambda b: b)
    same = precision.sampler_dtype == precision.param_dtype
    if sampler_shardings is not None:  # cast (and gather) once per step
        sampler_params = jax.jit(precision.sampler_params, out_shardings=sampler_shardings)
    else:
        sampler_params = (lambda p: p) if same else jax.jit(precision.sampler_params)  # cast once per step
    pairs = packed_fn = None
    if cfg.packing is not None:
        pairs = jax.jit(packing_lib.forest_pairs)
        packed_fn = jax.jit(make_packed_logprob_fn(model_config, cfg.micro_batches, cfg.logprob_chunk_size,
                                                   cfg.packing.attention_impl))
    layout = packing_lib.LayoutFloor() if cfg.packing is not None and cfg.packing.sticky else None
    return StepFns(cfg, precision, sampler_params, spec.inputs, estimator, to_batch, logprobs, prepare,
                   take_rows, lambda state, batch: update(state, place(batch)), pairs, packed_fn, layout, place)


def _sync(x):
    jax.block_until_ready(x)
    return time.perf_counter()


def rl_step(fns: StepFns, state, source: RolloutSource, key: jax.Array, step: int,
            ref_params: Any = None) -> tuple[Any, Rollouts, dict, dict]:
    """One RL step (module docstring). Returns ``(state, rollouts, device_metrics, host_info)``.

    ``device_metrics``: the update metrics of every mini-batch (``update/...``: means over mini-batches, ratio
    extremes of the *first* mini-batch as ``update/first_ratio_min|max``) and the log-prob mismatch, all still on
    the device. ``host_info``: decoded-token counters, rollout accuracy and the phase times (seconds); with the
    packed update also ``packing/unique_tokens`` (real tokens in the packed rows), ``packing/expanded_tokens``
    (tokens the expanded rows would hold) and ``packing/row_tokens`` (packed row slots, padding included), summed
    over the first epoch's mini-batches, and with sticky layouts ``packing/layouts`` (distinct layouts so far).
    """
    cfg = fns.config
    t0 = time.perf_counter()
    with fns.precision.matmul_context():
        sampler_params = fns.sampler_params(state.params)
        ro = source.sample(sampler_params, key, step)
        t_rollout = _sync(ro.forest.tokens)
        inputs = {}
        if "greedy_reward_P" in fns.estimator_inputs:
            inputs["greedy_reward_P"] = jnp.asarray(source.greedy_rewards(sampler_params, ro), jnp.float32)
        t_inputs = time.perf_counter()
        adv = fns.estimator(ro.forest, ro.rewards_PxW, inputs)
        if cfg.leaf_weighting == "mass":
            adv = adv.replace(tokens=adv.tokens * ro.forest.leaf_weights()[:, :, None])
        P, W = ro.rewards_PxW.shape
        eps_scale = (jnp.ones((P, W), jnp.float32) if cfg.clip_scale_fn is None
                     else jnp.asarray(cfg.clip_scale_fn(ro.forest, ro.rewards_PxW), jnp.float32))
        if cfg.packing is not None:
            state, all_metrics, mismatch, t_logp, packing_info = _packed_updates(fns, state, ro, adv, eps_scale, key,
                                                                                 ref_params)
        else:
            packing_info = {}
            batch = fns.to_batch(jnp.asarray(ro.prompts_PxLp), jnp.asarray(ro.lengths_P), ro.forest, adv.tokens,
                                 adv.loss_mask, eps_scale)
            rows = batch["tokens"].shape[0]
            per_mini = rows // cfg.mini_batches
            perms = [jax.random.permutation(jax.random.fold_in(jax.random.fold_in(key, 0xE70C), e), rows)
                     for e in range(cfg.epochs)]
            minis = [perms[0][m * per_mini: (m + 1) * per_mini] for m in range(cfg.mini_batches)]
            old = _per_mini_logprobs(fns, state.params, batch, minis) if cfg.old_logp == "trainer" else None
            ref = _per_mini_logprobs(fns, ref_params, batch, minis) if cfg.loss.kl_coef > 0 else None
            batch, mismatch = fns.prepare(batch, old, ref)
            t_logp = _sync(batch["old_logp"])

            all_metrics = []
            for perm in perms:
                for m in range(cfg.mini_batches):
                    mini = fns.take_rows(batch, perm[m * per_mini: (m + 1) * per_mini])
                    state, metrics = fns.update(state, mini)
                    all_metrics.append(metrics)
        t_update = _sync(state.step)

    device_metrics = {f"update/{k}": v for k, v in _mean_metrics(all_metrics).items()}
    device_metrics["update/first_ratio_min"] = all_metrics[0]["ratio_min"]
    device_metrics["update/first_ratio_max"] = all_metrics[0]["ratio_max"]
    device_metrics.update(mismatch)
    info = dict(ro.info)
    t_scoring = float(info.pop("time/scoring_s", 0.0))
    host = {
        "time/rollout_s": t_rollout - t0 - t_scoring, "time/scoring_s": t_scoring + (t_inputs - t_rollout),
        "time/logp_s": t_logp - t_inputs, "time/update_s": t_update - t_logp,
        "rollout/decoded_tokens": int(info.get("decoded_tokens", 0)),
        "reward/mean": float(np.asarray(ro.rewards_PxW).mean()),
        **{f"rollout/{k}": v for k, v in info.items() if k != "decoded_tokens"},
    }
    host.update(packing_info)
    host.update(tree_metrics(ro.forest, ro.rewards_PxW))
    if ro.scores_PxW is not None:
        host["reward/accuracy"] = float((np.asarray(ro.scores_PxW) >= 1.0).mean())
    return state, ro, device_metrics, host


def tree_metrics(forest, rewards_PxW) -> dict:
    """The rollout's shape, from one host gather of the forest's per-leaf arrays (:mod:`treejax.rl.tree_stats`):

    * ``rollout/mean_leaf_length``: the leaves' mean length weighted by ``forest.leaf_weight`` (the policy's
      expected response length for an unbiased tree: slot trees count a path once per slot, ``"transfer"`` trees
      by ``W`` x path mass);
    * ``rollout/distinct_leaves``: distinct leaves (paths) per prompt, mean over prompts, and
      ``rollout/mean_distinct_leaf_length`` their unweighted mean length (what the tree decoded);
    * ``rollout/sibling_reward_corr``: correlation of the rewards of leaves under one depth-1 node (left out when
      undefined: independent samples have no siblings, all-equal rewards no spread);
    * ``rollout/effective_leaves``: the effective sample size of a prompt's reward mean, mean over prompts (``W``
      for independent samples).
    """
    path, weight, first, length, rewards = (np.asarray(x, np.float64) if i else np.asarray(x) for i, x in enumerate(
        multihost.host_tree((forest.leaf_path, forest.leaf_weights(), forest.distinct_leaves(), forest.leaf_length,
                             rewards_PxW))))
    rho = tree_stats.sibling_correlation(tree_stats.sibling_sums(path, weight, rewards))
    out = {"rollout/mean_leaf_length": tree_stats.weighted_mean(length, weight),
           "rollout/distinct_leaves": float(first.sum() / first.shape[0]),
           "rollout/mean_distinct_leaf_length": tree_stats.weighted_mean(length, first),
           "rollout/effective_leaves": float(tree_stats.effective_samples(path, weight, rho).mean())}
    if np.isfinite(rho):
        out["rollout/sibling_reward_corr"] = float(rho)
    return out


def _packed_updates(fns: StepFns, state, ro: Rollouts, adv, eps_scale_PxW, key, ref_params):
    """The old / reference log-prob passes and the PPO updates on tree-packed mini-batches.

    Mini-batches are random groups of ``P / mini_batches`` *prompts* (whole trees; the expanded path draws
    groups of leaves), reshuffled each epoch. Old and reference log-probs are computed on the first epoch's
    packed mini-batches (the update's exact rows and programs, so the first ratio is 1) and kept per pair in the
    forest's leaf layout ``[P * W, T]``, from which every epoch's mini-batches are packed."""
    cfg = fns.config
    forest = ro.forest
    P, W, T = forest.tokens.shape
    pairs = dict(fns.pairs(forest, adv.tokens, adv.loss_mask))
    host = packing_lib.host_forest(ro.prompts_PxLp, ro.lengths_P, forest, pairs["loss_mask"])  # all processes'
    if P % cfg.mini_batches:
        raise ValueError(f"the packed update splits prompts into mini-batches: {P} prompts do not split into "
                         f"mini_batches={cfg.mini_batches}")
    eps_B = eps_scale_PxW.reshape(P * W)
    per_mini = P // cfg.mini_batches

    def plan(prompts):
        pl = packing_lib.plan_packing(host["prompts"], host["lengths"], host["path"], host["length"], host["tokens"],
                                      forest.segment_length, cfg.packing, prompts=prompts, trained_PxW=host["trained"],
                                      row_multiple=cfg.row_multiple, pad_id=cfg.pad_id,
                                      floor=None if fns.layout is None else fns.layout.shape)
        if fns.layout is not None:
            fns.layout.grow(pl.shape)
        return pl

    perms = [np.asarray(jax.random.permutation(jax.random.fold_in(jax.random.fold_in(key, 0xE70C), e), P))
             for e in range(cfg.epochs)]
    first = [plan(perms[0][m * per_mini: (m + 1) * per_mini]) for m in range(cfg.mini_batches)]

    def per_pair_logprobs(params):
        out = jnp.zeros((P * W, T), jnp.float32)
        for pl in first:
            b = packing_lib.packed_batch(pl, pairs, eps_B)
            out = packing_lib.unpack_pairs(b, fns.packed_logprobs(params, fns.place(b)), P * W, out=out)
        return out

    sampler = pairs["sampler_logp"]
    mismatch = {}
    if cfg.old_logp == "trainer":
        pairs["old_logp"] = per_pair_logprobs(state.params)
        mismatch = logp_mismatch(pairs["old_logp"], sampler, pairs["loss_mask"])
    else:
        del pairs["sampler_logp"]
    if cfg.loss.kl_coef > 0:
        pairs["ref_logp"] = per_pair_logprobs(ref_params)
    t_logp = _sync(pairs["old_logp"])
    all_metrics = []
    for e, perm in enumerate(perms):
        for m in range(cfg.mini_batches):
            pl = first[m] if e == 0 else plan(perm[m * per_mini: (m + 1) * per_mini])
            state, metrics = fns.update(state, packing_lib.packed_batch(pl, pairs, eps_B))
            all_metrics.append(metrics)
    info = {"packing/unique_tokens": sum(pl.unique_tokens for pl in first),
            "packing/expanded_tokens": sum(pl.expanded_tokens for pl in first),
            "packing/row_tokens": sum(pl.shape[0] * pl.shape[1] for pl in first)}
    if fns.layout is not None:
        info["packing/layouts"] = len(fns.layout.layouts)  # distinct layouts so far (one compile each)
    return state, all_metrics, mismatch, t_logp, info


def _per_mini_logprobs(fns: StepFns, params, batch: dict, minis: list) -> jax.Array:
    """``[B, L]`` log-probs computed on the first epoch's mini-batches (the update's exact shapes and micro-batch
    split, so both forwards run the same kernels on the same rows), scattered back to batch row order."""
    parts = [fns.logprobs(params, fns.place(fns.take_rows(batch, idx))) for idx in minis]
    order = jnp.concatenate(minis)
    return jnp.zeros_like(batch["sampler_logp"]).at[order].set(jnp.concatenate(parts))


def _mean_metrics(metrics: list[dict]) -> dict:
    """Means over mini-batches (extremes: max / min), computed on the device."""
    out = {}
    for k in metrics[0]:
        vals = jnp.stack([jnp.asarray(m[k], jnp.float32) for m in metrics])
        out[k] = jnp.max(vals) if k.endswith("_max") else jnp.min(vals) if k.endswith("_min") else jnp.mean(vals)
    return out


def initial_reference(params: Any, loss: LossConfig) -> Any:
    """The frozen reference policy for the KL term: a copy of the initial weights (``None`` when KL is off)."""
    if loss.kl_coef <= 0:
        return None
    return jax.tree.map(jnp.copy, params)


__all__ = ["Rollouts", "RolloutSource", "StepConfig", "StepFns", "make_step_fns", "make_logprob_fn",
           "make_packed_logprob_fn", "rl_step",
           "logp_mismatch", "initial_reference", "OLD_LOGP_SOURCES"]
