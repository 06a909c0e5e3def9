"""Learn: one step's rollouts -> advantages -> mini-batches -> old / reference log-probs -> PPO updates.

    rollouts = source.sample(learner.sampler_params(state.params), key, step)     collect (treejax.rl.rollouts)
    state, metrics, info = learn(learner, state, rollouts, key, ref_params)       learn (this module)

:func:`learn` runs one path for every layout (:mod:`treejax.rl.layouts`): the estimator's per-token advantages
(optionally times ``Forest.leaf_weight``), the layout's pool of (leaf, token) pairs, ``epochs`` shuffles of
``mini_batches`` mini-batch plans, the old / reference log-probs computed on the first epoch's mini-batches (the
update's exact rows and programs, so the first PPO ratio is 1) and scattered back into the pool, then one optax
update per mini-batch. Nothing here waits for the device: the only host reads are the ones the packed layout's
planner needs (the forest, already on the host after scoring); the metrics come back as device arrays and the
loop reads them one step late (:class:`treejax.metrics.DeferredMetrics`). :func:`rl_step` is collect + learn
(the loop's step; tests and benchmarks drive it with their own sources).

Per-token clip ranges: an estimator may return ``Advantages.clip_scale [P, W, T]`` (A2TGPO's adaptive turn clip);
the pool then carries it per pair (``Batch.token_eps_scale``, gathered like the advantages in either layout) to
``policy_loss(..., eps_scale_BxT=...)``, on top of the per-leaf ``eps_scale``. Estimators without one leave the
batch without that array, so their programs are the same as before it existed.

Shapers (``StepConfig.shapers``, :mod:`treejax.rl.shaping`): the old-log-prob pass then also returns each pair's
entropy and top-k log-probs (:meth:`Layout.pair_stats`, the same forward), the reference pass runs when a shaper
reads it, and the shapers rewrite the pool's advantages and clip scales in the forest's response layout before the
updates.

Log-probabilities (verl's and tunix's practice)::

    sampler_logp   log q(y_t | y_<t)   from the sampler (bf16 weights and KV cache on GPU, decode kernels)
    old_logp       log pi_old(y_t | y_<t)  the trainer's own forward under the pre-update parameters
                   (``old_logp="trainer"``, default; same forward, dtypes and micro-batching as the update),
                   or the sampler's (``old_logp="sampler"``: no extra forward, but the first PPO ratio is then
                   exp(log pi_old - log q) != 1 wherever the two numerics differ), or the trainer's forward under
                   the parameters' moving average (``old_logp="ewma"``, PPO-EWMA's proximal policy)
    ref_logp       log pi_ref(y_t | y_<t)  the initial weights, kept frozen, when ``LossConfig.kl_coef > 0``

With trainer-side ``old_logp`` truncated importance sampling (``LossConfig.tis_cap``) weights each token by
``min(exp(old_logp - sampler_logp), C)``, correcting for the sampler/trainer mismatch, reported as
``mismatch/abs_mean`` and ``mismatch/abs_max`` of ``old_logp - sampler_logp`` over trained pairs.
"""

from __future__ import annotations

import dataclasses
import threading
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from treejax.forest import Forest
from treejax.models.config import ModelConfig
from treejax.parallel import multihost
from treejax.precision import ResolvedPrecision
from treejax.rl import tree_stats
from treejax.rl.advantages import estimator_spec
from treejax.rl.advantages.registry import Advantages
from treejax.rl.allocation.groups import group_forest, group_leaves, ungroup
from treejax.rl.batch import Batch
from treejax.rl.config import StepConfig
from treejax.models import lora
from treejax.rl.optimizer import proximal_params
from treejax.rl.precompile import AheadOfTime, abstract, precompile_ladder
from treejax.rl.layouts import Layout, make_layout
from treejax.rl.pseudo_labels import label_accuracy
from treejax.rl.losses import LossConfig
from treejax.rl.rollouts import RolloutSource, Rollouts
from treejax.rl.shaping import apply_shapers, needed_stats, shaping_inputs
from treejax.rl.update import reduce_metrics, split_micro

SHUFFLE_STREAM = 0xE70C  # fold_in stream of the mini-batch shuffle keys


def make_stats_fn(layout: Layout, num_micro_batches: int) -> Callable:
    """``fn(params, batch, with_entropy, top_k, with_hidden) -> {"logp", "entropy"?, "topk_logp"?, "hidden"?}`` per
    pair: the shapers' trainer pass (:meth:`Layout.pair_stats`), micro-batched like :func:`make_logprob_fn` (its
    ``logp`` is the same forward's, so it serves as the old log-probs)."""

    def fn(params, batch: Batch, with_entropy: bool, top_k: int, with_hidden: bool = False):
        stats = lambda inputs: layout.pair_stats(params, inputs, with_entropy=with_entropy, top_k=top_k,  # noqa: E731
                                                 with_hidden=with_hidden)
        if num_micro_batches == 1:
            return stats(batch.inputs)
        rows = batch.num_rows
        out = jax.lax.map(stats, jax.tree.map(lambda a: split_micro(a, num_micro_batches), batch.inputs))
        return {k: jnp.swapaxes(v, 0, 1).reshape((rows,) + v.shape[2:]) for k, v in out.items()}

    return fn


def make_logprob_fn(layout: Layout, num_micro_batches: int) -> Callable[[Any, Batch], jax.Array]:
    """``fn(params, batch) -> logp [rows, *pairs]``: the update's forward without gradients, micro-batched the same
    way (strided micro-batches, ``lax.map``), so old / reference log-probs have the update's numerics."""

    def fn(params, batch: Batch):
        if num_micro_batches == 1:
            return layout.pair_logprobs(params, batch.inputs)
        rows = batch.num_rows
        micro = jax.tree.map(lambda a: split_micro(a, num_micro_batches), batch.inputs)
        out = jax.lax.map(lambda mb: layout.pair_logprobs(params, mb), micro)
        return jnp.swapaxes(out, 0, 1).reshape((rows,) + out.shape[2:])  # [M, B/M, ...] -> rows back in order

    return fn


@jax.jit
def with_logprobs(batch: Batch, old_logp: jax.Array | None, ref_logp: jax.Array | None,
                  behaviour_logp: jax.Array | None = None) -> tuple[Batch, dict]:
    """The pool's batch with the trainer's old log-probs (``None``: the sampler's serve as pi_old and the sampler
    copy is dropped) and the reference log-probs, and the off-policy metrics (one program: every process of a
    multi-process run dispatches the same few programs, in the same order).

    Metrics over trained pairs: the sampler/trainer mismatch ``old_logp - sampler_logp`` (``mismatch/...``) and
    the behaviour importance weight ``w = exp(old_logp - sampler_logp)`` = pi_prox / q before any truncation
    (``offpolicy/iw_mean|min|max``; TIS multiplies the loss by ``min(w, tis_cap)``). With ``behaviour_logp`` (the
    trainer's forward under the parameters that *sampled* the rollout, :class:`treejax.rl.collect.AsyncCollector`
    with ``split_staleness``) the weight splits exactly as ``w = w_stale * w_numerics``: ``offpolicy/stale_iw_...``
    = ``exp(old_logp - behaviour_logp)`` (policy lag; exactly 1 when nothing is stale) and ``mismatch/numerics_...``
    = ``|behaviour_logp - sampler_logp|`` (the sampler's numerics alone)."""
    if old_logp is None:
        return batch.replace(old_logp=batch.sampler_logp, sampler_logp=None, ref_logp=ref_logp), {}
    metrics = logp_mismatch(old_logp, batch.sampler_logp, batch.loss_mask)
    metrics.update(_weight_stats("offpolicy/iw", old_logp - batch.sampler_logp, batch.loss_mask))
    if behaviour_logp is not None:
        metrics.update(_weight_stats("offpolicy/stale_iw", old_logp - behaviour_logp, batch.loss_mask))
        numerics = logp_mismatch(behaviour_logp, batch.sampler_logp, batch.loss_mask)
        metrics.update({k.replace("mismatch/", "mismatch/numerics_"): v for k, v in numerics.items()})
    return batch.replace(old_logp=old_logp, ref_logp=ref_logp), metrics


def logp_mismatch(old_logp: jax.Array, sampler_logp: jax.Array, mask: jax.Array) -> dict:
    """Mean and max ``|old_logp - sampler_logp|`` over trained pairs (0 when none)."""
    on = mask > 0
    d = jnp.where(on, jnp.abs(old_logp - sampler_logp), 0.0)
    return {"mismatch/abs_mean": jnp.sum(d) / jnp.maximum(jnp.sum(on), 1), "mismatch/abs_max": jnp.max(d)}


def _weight_stats(prefix: str, log_w: jax.Array, mask: jax.Array) -> dict:
    """Mean / min / max of ``exp(log_w)`` over trained pairs (1 when there are none)."""
    on = mask > 0
    w = jnp.exp(jnp.where(on, log_w, 0.0))
    any_on = jnp.any(on)
    return {f"{prefix}_mean": jnp.where(any_on, jnp.sum(jnp.where(on, w, 0.0)) / jnp.maximum(jnp.sum(on), 1), 1.0),
            f"{prefix}_min": jnp.where(any_on, jnp.min(jnp.where(on, w, jnp.inf)), 1.0),
            f"{prefix}_max": jnp.where(any_on, jnp.max(jnp.where(on, w, 0.0)), 1.0)}


@dataclasses.dataclass(frozen=True, eq=False)
class Learner:
    """What :func:`learn` runs, built once per run by :func:`make_learner`.

    ``estimator(forest, rewards_PxW, inputs) -> Advantages`` (jitted); ``logprobs(params, batch) -> [rows,
    *pairs]`` (jitted, no gradient); ``stats(params, batch, with_entropy, top_k, with_hidden)``: the shapers' trainer pass
    (:func:`make_stats_fn`); ``update(state, batch) -> (state, metrics)`` (jitted with shardings and
    donation by the caller); ``place(batch)``: a mini-batch's placement before the update and the log-prob
    passes; ``sampler_params(params)``: the sampler's copy of the weights (cast, and gathered on a mesh)."""

    config: StepConfig
    precision: ResolvedPrecision
    layout: Layout
    estimator: Callable
    logprobs: Callable[[Any, Batch], jax.Array]
    update: Callable[[Any, Batch], tuple[Any, dict]]
    place: Callable[[Batch], Batch]
    sampler_params: Callable[[Any], Any]
    stats: Callable | None = None
    grouped_estimator: Callable | None = None  # (forest, rewards, inputs, rows_PxC) -> Advantages (row groups)
    update_fn: Callable | None = None  # the update as given (``sharded_update``'s has ``precompile``)

    @property
    def estimator_inputs(self) -> tuple[str, ...]:
        """The estimator's declared extra inputs (``EstimatorSpec.inputs``) a rollout source must supply."""
        return estimator_spec(self.config.estimator).inputs


def make_learner(model_config: ModelConfig, cfg: StepConfig, precision: ResolvedPrecision, update: Callable,
                 layout: Layout | None = None, batch_sharding: Callable | None = None,
                 sampler_shardings: Any = None, sampler_view: Callable | None = None,
                 share_sampler_leaves: bool = False) -> Learner:
    """Builds the :class:`Learner`. ``update`` is the jitted ``update(state, batch)`` of ``layout`` (default:
    :func:`~treejax.rl.layouts.make_layout` of ``cfg``; pass the one the update was built with).
    ``batch_sharding(batch)`` (optional) places each mini-batch before the update and the old / reference passes
    (e.g. ``jax.device_put`` with the mesh's batch sharding: without it those passes take the layout the
    mini-batch gather gives, which on a mesh can be replicated, so every device computes every row).
    ``sampler_shardings`` (optional, a pytree of shardings like the params): where the sampler's weight copy
    lives (e.g. ``treejax.parallel.axis_rules.SAMPLER_RULES``: gathered over ``fsdp`` once per step); the cast is
    then jitted with these output shardings even when the dtype does not change. ``sampler_view(params)``
    (optional): the weights the sampler decodes with, before the cast (LoRA's merged ``W + s A B``:
    :func:`treejax.rl.setup.sampler_weights_fn`). ``share_sampler_leaves`` (no mesh, no view): cast leaf by leaf
    outside jit, so leaves already in the sampler dtype are the state's own arrays, not a copy (LoRA's unmerged
    bf16 base: 15 GB at 7B)."""
    if layout is None:
        layout = make_layout(model_config, cfg.packing, pad_id=cfg.pad_id, attention_impl=cfg.attention_impl,
                             row_multiple=cfg.row_multiple, chunk_size=cfg.logprob_chunk_size)
    spec = estimator_spec(cfg.estimator)
    options = cfg.estimator_options if cfg.estimator_options is not None else spec.default_options()
    estimator = jax.jit(lambda f, r, inputs: spec.fn(f, r, options, **inputs))
    grouped = jax.jit(lambda f, r, inputs, rows: grouped_advantages(spec.fn, options, f, r, inputs, rows))
    place = batch_sharding or (lambda b: b)
    cast = precision.sampler_params if sampler_view is None else (
        lambda p: precision.sampler_params(sampler_view(p)))
    if sampler_shardings is not None:  # cast (and gather) once per step
        sampler_params = jax.jit(cast, out_shardings=sampler_shardings)
    elif sampler_view is not None:
        sampler_params = jax.jit(cast)  # the view (e.g. LoRA's merge) and the cast, once per step
    elif share_sampler_leaves:
        sampler_params = precision.sampler_params  # eager: casts only the leaves in another dtype
    elif precision.sampler_dtype == precision.param_dtype:
        sampler_params = lambda p: p  # noqa: E731
    else:
        sampler_params = jax.jit(cast)  # cast once per step
    return Learner(cfg, precision, layout, estimator,
                   AheadOfTime(jax.jit(make_logprob_fn(layout, cfg.micro_batches))),
                   lambda state, batch: update(state, place(batch)), place, sampler_params,
                   jax.jit(make_stats_fn(layout, cfg.micro_batches), static_argnums=(2, 3, 4)), grouped, update)


def grouped_advantages(fn: Callable, options: Any, forest: Forest, rewards_RxW: jax.Array, inputs: dict,
                       rows_PxC: jax.Array) -> Advantages:
    """The estimator over each prompt's whole group of rows (``Rollouts.groups_PxC``, a source that gives a prompt several rows): the rows merged into
    ``[P, C * W]`` groups with unused slots (:func:`treejax.rl.allocation.group_forest`), the estimator run
    there (it must honour unused slots: ``EstimatorSpec.ragged``), its per-leaf outputs put back in the rows'
    layout (rows in no group get 0 and a zero loss mask). Per-leaf inputs ``[R, W, ...]`` are grouped like the
    rewards; per-prompt inputs ``[R]`` (ReMax's greedy reward) are read at each prompt's first row."""
    R = rewards_RxW.shape[0]

    def group_input(x):
        return x[rows_PxC[:, 0]] if x.ndim == 1 else group_leaves(x, rows_PxC)

    out = fn(group_forest(forest, rows_PxC), group_leaves(rewards_RxW, rows_PxC), options,
             **{k: group_input(v) for k, v in inputs.items()})
    back = lambda x: None if x is None else ungroup(x, rows_PxC, R)  # noqa: E731
    clip = None if out.clip_scale is None else jnp.where(  # 1 on rows in no group
        back(jnp.ones_like(out.clip_scale)) > 0, back(out.clip_scale), 1.0)
    return Advantages(tokens=back(out.tokens), loss_mask=back(out.loss_mask) * forest.loss_mask,
                      leaves=back(out.leaves), segments=back(out.segments), clip_scale=clip)


def learn(learner: Learner, state, ro: Rollouts, key: jax.Array, ref_params: Any = None, *, timed: bool = False,
          behaviour_params: Any = None) -> tuple[Any, dict[str, jax.Array], dict[str, Any]]:
    """One step's learning from ``ro`` (module docstring). Returns ``(state, device_metrics, host_info)``.

    ``device_metrics``: the update metrics (``update/...``: means over mini-batches, ratio extremes of the
    *first* mini-batch as ``update/first_ratio_min|max``) and the log-prob mismatch, still on the device.
    ``host_info``: the layout's plan sizes (packed: ``packing/...``); with ``timed`` (benchmarks) also
    ``time/logp_s`` and ``time/update_s``, each phase closed by waiting for its output (two device syncs the
    loop does not make). ``behaviour_params`` (asynchronous rollouts, optional): the trainer's parameters of the
    policy version that sampled ``ro``; their log-probs split the importance weight into its staleness and
    numerics parts (:func:`with_logprobs`; one more forward)."""
    cfg, layout = learner.config, learner.layout
    t0 = time.perf_counter()
    adv = step_advantages(learner, ro)
    P, W = ro.rewards_PxW.shape
    eps_scale = (jnp.ones((P, W), jnp.float32) if cfg.clip_scale_fn is None
                 else jnp.asarray(cfg.clip_scale_fn(ro.forest, ro.rewards_PxW), jnp.float32))
    # an estimator's per-token clip scale (Advantages.clip_scale) rides along as the pairs' token_eps_scale; the
    # loss multiplies it with the per-leaf eps_scale (clip_scale_fn, then the shapers'). None: no extra array
    pool = layout.pool(ro, adv.tokens, adv.loss_mask, eps_scale, token_eps_scale_PxWxT=adv.clip_scale)
    if pool.units % cfg.mini_batches:
        raise ValueError(f"{pool.units} mini-batch units (rows, or prompts with the packed update) do not split "
                         f"into mini_batches={cfg.mini_batches}")
    perms = [jax.random.permutation(jax.random.fold_in(jax.random.fold_in(key, SHUFFLE_STREAM), e), pool.units)
             for e in range(cfg.epochs)]
    first = [layout.plan(pool, units) for units in _mini_batches(perms[0], pool.units, cfg.mini_batches)]
    state, b, mismatch, logp_used = _pass_logprobs(learner, state, ro, pool, first, ref_params, behaviour_params)
    logp_pool = pool
    pool = dataclasses.replace(pool, batch=b)
    t_logp = _wait(b.old_logp) if timed else None
    all_metrics = []
    for e, perm in enumerate(perms):
        for m, units in enumerate(_mini_batches(perm, pool.units, cfg.mini_batches)):
            plan = first[m] if e == 0 else layout.plan(pool, units)
            state, metrics = learner.update(state, layout.assemble(pool, plan))
            all_metrics.append(metrics)
    if _ladder_wanted(learner):  # once per run, after this step's programs are compiled (no CPU contention with
        # them): the packed layout's other row counts, compiled on a background thread
        start_ladder(learner, state, logp_pool, pool, first[0], logp_used=logp_used)
    device_metrics = {f"update/{k}": v for k, v in mean_metrics(all_metrics).items()}
    device_metrics["update/first_ratio_min"] = all_metrics[0]["ratio_min"]
    device_metrics["update/first_ratio_max"] = all_metrics[0]["ratio_max"]
    device_metrics.update(mismatch)
    info = layout.describe(first)
    if timed:
        info.update({"time/logp_s": t_logp - t0, "time/update_s": _wait(state.step) - t_logp})
    return state, device_metrics, info


def step_advantages(learner: Learner, ro: Rollouts) -> Advantages:
    """The estimator's advantages of ``ro`` (over each prompt's group of rows when the source groups rows), with
    the source's fixed advantages where it sets them (``Rollouts.fixed_advantage_PxW``) and, with ``leaf_weighting = "mass"``, each leaf's
    tokens times its ``Forest.leaf_weight``. Raises when the source did not supply an input the estimator reads."""
    cfg = learner.config
    missing = [name for name in learner.estimator_inputs if name not in ro.estimator_inputs]
    if missing:
        raise ValueError(f"estimator {cfg.estimator!r} needs inputs {missing} that the rollout source did not supply "
                         f"(Rollouts.estimator_inputs has {sorted(ro.estimator_inputs)})")
    inputs = {name: ro.estimator_inputs[name] for name in learner.estimator_inputs}
    if ro.groups_PxC is None:
        adv = learner.estimator(ro.forest, ro.rewards_PxW, inputs)
    else:  # the source's row groups: each prompt's advantages over all of its rows
        if not estimator_spec(cfg.estimator).ragged:
            raise ValueError(f"estimator {cfg.estimator!r} does not honour unused leaf slots, so it cannot take "
                             "a source's row groups (EstimatorSpec.ragged)")
        adv = learner.grouped_estimator(ro.forest, ro.rewards_PxW, inputs, jnp.asarray(ro.groups_PxC, jnp.int32))
    if ro.fixed_advantage_PxW is not None:  # rows whose advantage the source fixed, not the estimator's
        adv = with_fixed_advantages(adv, ro.forest, ro.fixed_advantage_PxW)
    if cfg.leaf_weighting == "mass":
        adv = adv.replace(tokens=adv.tokens * ro.forest.leaf_weights()[:, :, None])
    return adv


def _mini_batches(perm: jax.Array, units: int, mini_batches: int) -> list[jax.Array]:
    """The ``mini_batches`` consecutive slices of a shuffle ``perm`` of the pool's ``units``."""
    per_mini = units // mini_batches
    return [perm[m * per_mini: (m + 1) * per_mini] for m in range(mini_batches)]


def _pool_logprobs(learner: Learner, pool, first: list, params) -> jax.Array:
    """The trainer's log-probs of every pair of ``pool`` under ``params``, computed on the first epoch's
    mini-batches (``first``: the update's exact rows and programs) and scattered back into the pool."""
    layout = learner.layout
    parts = [learner.logprobs(params, learner.place(layout.assemble(pool, plan))) for plan in first]
    return layout.scatter(jnp.zeros_like(pool.batch.sampler_logp), first, parts)


def _pool_stats(learner: Learner, pool, first: list, params, with_entropy: bool, top_k: int,
                with_hidden: bool) -> dict:
    """The shapers' trainer pass (``logp`` and the statistics they read), per pair of ``pool``, as
    :func:`_pool_logprobs`; trailing dims past the pairs (top-k) are kept."""
    layout = learner.layout
    parts = [learner.stats(params, learner.place(layout.assemble(pool, plan)), with_entropy, top_k, with_hidden)
             for plan in first]
    pair_dims = parts[0]["logp"].ndim  # trailing dims past the pairs (top-k) are kept
    zeros = lambda v: jnp.zeros(pool.batch.sampler_logp.shape + v.shape[pair_dims:], v.dtype)  # noqa: E731
    return {k: layout.scatter(zeros(parts[0][k]), first, [p[k] for p in parts]) for k in parts[0]}


def _pass_logprobs(learner: Learner, state, ro: Rollouts, pool, first: list, ref_params: Any,
                   behaviour_params: Any) -> tuple[Any, Batch, dict, bool]:
    """The forwards before the updates: the shapers' statistics (when there are shapers), pi_old's log-probs
    (``old_logp``: the sampler's, the moving average's or the trainer's, which the shapers' pass gives when it
    ran), the reference's (KL or a shaper reads them) and the behaviour policy's (asynchronous rollouts); then the
    shapers. Returns ``(state, the pool's batch with them, the off-policy and shaping metrics, whether a log-prob
    pass ran)``."""
    cfg = learner.config
    stat_names, top_k = needed_stats(cfg.shapers)
    if "ref_logp" in stat_names and ref_params is None:
        raise ValueError(f"shapers {[s.name for s in cfg.shapers if 'ref_logp' in s.needs]} read the reference "
                         "policy's log-probs: pass ref_params=initial_reference(params, loss, shapers)")
    stats = (_pool_stats(learner, pool, first, state.params, "entropy" in stat_names, top_k, "hidden" in stat_names)
             if cfg.shapers else {})
    if cfg.old_logp == "sampler":
        old = None
    elif cfg.old_logp == "ewma":  # PPO-EWMA: the ratio against the parameters' moving average
        old = _pool_logprobs(learner, pool, first, lora.with_trainable(state.params, proximal_params(state.opt_state)))
    else:
        old = stats["logp"] if stats else _pool_logprobs(learner, pool, first, state.params)
    ref = (_pool_logprobs(learner, pool, first, lora.resolve_reference(ref_params, state.params))
           if cfg.loss.kl_coef > 0 or "ref_logp" in stat_names else None)
    behaviour = (_pool_logprobs(learner, pool, first, behaviour_params)
                 if behaviour_params is not None and old is not None else None)
    b, mismatch = with_logprobs(pool.batch, old, ref, behaviour)
    if cfg.shapers:
        x = shaping_inputs(learner.layout, b, dict(stats, ref_logp=ref), ro, ro.estimator_inputs.get("answer_step_PxW"),
                           ro.estimator_inputs.get("prm_steps_PxWxD"))
        masks = any(getattr(s, "masks", False) for s in cfg.shapers)  # a shaper that takes pairs out of the loss
        shaped = apply_shapers(cfg.shapers, x, state.aux, with_mask=masks)
        shaped_adv, shaped_eps, shaping_metrics, aux = shaped[:4]
        # the shapers' new state keeps the old one's placement (replicated on a mesh; the update is jitted with it)
        state = state.replace(aux=jax.tree.map(lambda new, old: jax.device_put(new, old.sharding), aux, state.aux))
        b = b.replace(advantages=learner.layout.from_response(shaped_adv, ro.lengths_P, b.advantages),
                      eps_scale=shaped_eps)
        if masks:
            b = b.replace(loss_mask=learner.layout.from_response(shaped[4], ro.lengths_P, b.loss_mask))
        mismatch = {**mismatch, **shaping_metrics}
    return state, b, mismatch, old is not None or ref is not None


def _ladder_wanted(learner: Learner) -> bool:
    floor = getattr(learner.layout, "floor", None)
    return (floor is not None and floor.precompiled is None and learner.layout.packing.precompile
            and hasattr(learner.update_fn, "precompile"))


def start_ladder(learner: Learner, state, logp_pool, pool, plan, *, logp_used: bool):
    """Compiles the update (and, when the step ran it, the log-prob pass) for every other row count of the packed
    layout's ladder on a background thread (:mod:`treejax.rl.precompile`); ``packing/precompiled`` counts the
    compiles done so far. Returns the thread (``None`` when the layout cannot grow)."""
    floor, layout = learner.layout.floor, learner.layout
    floor.precompiled = 0
    rungs = floor.ladder()
    if not rungs:
        return None
    jobs = [(learner.update_fn.precompile, (abstract(state), layout.assemble(pool, plan)), 1)]
    if logp_used and hasattr(learner.logprobs, "precompile"):
        jobs.append((learner.logprobs.precompile, (abstract(state.params),
                                                   learner.place(layout.assemble(logp_pool, plan))), 1))

    def done(count, seconds):
        floor.precompiled = count

    floor.stop = threading.Event()
    floor.thread = precompile_ladder(rungs, jobs, on_done=done, stop=floor.stop)
    return floor.thread


def stop_ladder(learner: Learner) -> None:
    """Ends a run's ahead-of-time compiles (:func:`start_ladder`): none starts any more, and the one running is
    waited for, so the process never exits in the middle of an XLA compile."""
    floor = getattr(learner.layout, "floor", None)
    thread = getattr(floor, "thread", None)
    if thread is not None:
        floor.stop.set()
        thread.join()


def with_fixed_advantages(adv: Advantages, forest: Forest, fixed_PxW) -> Advantages:
    """``adv`` with the leaves whose ``fixed_PxW`` is not NaN given that advantage on every token of the forest's
    loss mask (and that mask), in place of the estimator's (``Rollouts.fixed_advantage_PxW``)."""
    fixed = jnp.asarray(fixed_PxW, jnp.float32)
    on = ~jnp.isnan(fixed)[:, :, None]
    mask = forest.loss_mask
    return adv.replace(tokens=jnp.where(on, jnp.nan_to_num(fixed)[:, :, None] * mask, adv.tokens),
                       loss_mask=jnp.where(on, mask, adv.loss_mask))


def _wait(x) -> float:
    jax.block_until_ready(x)
    return time.perf_counter()


def rl_step(learner: Learner, state, source: RolloutSource, key: jax.Array, step: int, ref_params: Any = None, *,
            timed: bool = False) -> tuple[Any, Rollouts, dict, dict]:
    """Collect + learn: ``source.sample`` with the sampler's weights, then :func:`learn`. Returns ``(state,
    rollouts, device_metrics, host_info)``; ``host_info``: the rollout counters, rewards, accuracy, the tree's
    shape (:func:`tree_metrics`), the layout's plan sizes and ``time/rollout_s`` / ``time/scoring_s`` (host
    seconds; the rollout time includes waiting for the previous step's update, which the sampler's weights
    need) and ``time/learn_dispatch_s`` (host seconds to dispatch the learning; the device's share is the loop's
    ``time/update_s``, or with ``timed`` :func:`learn`'s exact ``time/logp_s`` / ``time/update_s``)."""
    t0 = time.perf_counter()
    with learner.precision.matmul_context():
        ro = source.sample(learner.sampler_params(state.params), key, step)
        t_rollout = time.perf_counter()
        state, device_metrics, layout_info = learn(learner, state, ro, key, ref_params, timed=timed)
    t_learn = time.perf_counter()
    host = {"time/rollout_s": t_rollout - t0 - ro.counters.scoring_s, "time/learn_dispatch_s": t_learn - t_rollout,
            **rollout_metrics(ro), **layout_info}
    return state, ro, device_metrics, host


def rollout_metrics(ro: Rollouts) -> dict:
    """The host metrics of one step's rollouts: ``time/scoring_s``, ``reward/mean``, ``reward/accuracy`` (over the
    main rows when the source groups rows (``Rollouts.main_rows``), whose own metrics come along; with
    verifier scores; with pseudo-label rewards also ``reward/label_accuracy``; with DECS's prefix hook
    ``rollout/redundant_token_frac``, the correct leaves' tokens after their answer step), the rollout counters
    and the tree's shape (:func:`tree_metrics`)."""
    main = ro.main_rows  # the step's uniform sample of the policy (a grouping source's first rows)
    host = {"time/scoring_s": ro.counters.scoring_s,
            "reward/mean": float(np.asarray(ro.rewards_PxW)[:main].mean()), **ro.counters.metrics(),
            **tree_metrics(ro.forest, ro.rewards_PxW), **(ro.extra_metrics or {})}
    if ro.scores_PxW is not None:
        host["reward/accuracy"] = float((np.asarray(ro.scores_PxW)[:main] >= 1.0).mean())
        if ro.label_leaf_P is not None:
            host["reward/label_accuracy"] = label_accuracy(ro.scores_PxW, ro.label_leaf_P)
    if "answer_step_PxW" in ro.estimator_inputs:  # DECS: tokens of correct leaves after the answer is stated
        step = np.asarray(ro.estimator_inputs["answer_step_PxW"])
        length = np.asarray(multihost.host_tree(ro.forest.leaf_length))
        ok = step >= 0
        host["rollout/redundant_token_frac"] = float((length - step)[ok].sum() / max(length[ok].sum(), 1))
    return host


def tree_metrics(forest: Forest, rewards_PxW) -> dict:
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


def mean_metrics(metrics: list[dict]) -> dict:
    """Means over mini-batches (extremes: max / min), computed on the device."""
    return reduce_metrics({k: jnp.stack([jnp.asarray(m[k], jnp.float32) for m in metrics]) for k in metrics[0]})


def initial_reference(params: Any, loss: LossConfig, shapers: tuple = ()) -> Any:
    """The frozen reference policy for the KL term and the shapers that read it: a copy of the initial weights
    (``None`` when neither needs it); with LoRA adapters, the base with the adapters off
    (:data:`treejax.models.lora.BASE_REFERENCE`, resolved against the current params when used: no copy)."""
    if loss.kl_coef <= 0 and "ref_logp" not in needed_stats(shapers)[0]:
        return None
    if lora.has_adapters(params):
        return lora.BASE_REFERENCE
    return jax.tree.map(jnp.copy, params)


__all__ = ["Learner", "make_learner", "make_logprob_fn", "learn", "rl_step", "rollout_metrics", "tree_metrics",
           "logp_mismatch",
           "initial_reference"]
