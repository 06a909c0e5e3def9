"""One optimizer step on a mini-batch: micro-batched gradients of the policy loss, a non-finite guard, and the optax
update — a pure ``update(state, batch) -> (state, metrics)`` for any layout.

``batch`` is a :class:`~treejax.rl.batch.Batch` (per-pair arrays ``[rows, *pairs]``, the layout's ``inputs``); the
loss is ``losses.policy_loss`` of the layout's pair log-probs::

    logp, entropy = layout.pair_logprobs(params, batch.inputs, with_entropy=True)        [rows, *pairs]
    loss = policy_loss(logp, batch.old_logp, batch.advantages, batch.loss_mask, ...)   pairs flattened to [N, T]

(``batch.eps_scale`` / ``batch.token_eps_scale``, when present, are the loss's per-sequence ``eps_scale_B`` and
per-token ``eps_scale_BxT`` clip-range multipliers)

so the expanded and the tree-packed update are one function (same loss and gradient for the same leaves:
``tests/rl/test_packing.py``). The aggregation's denominator is the mini-batch's (:func:`batch_denominator`).

Gradient accumulation: the mini-batch of ``B`` rows is split into ``M = num_micro_batches`` strided
micro-batches (micro-batch ``m`` holds rows ``m, m + M, m + 2M, ...``, so a batch sharded over devices in
contiguous blocks stays evenly spread) and gradients are summed over a ``lax.scan``. Every micro-batch's loss is
divided by the *mini-batch's* aggregation denominator, so the accumulated gradient equals the one-shot mini-batch
gradient for every aggregation mode.

Non-finite guard: if the loss or any gradient is NaN/inf, the params and optimizer state are left unchanged
(``metrics["skipped"] = 1``). With ``nonfinite="raise"`` the step additionally raises a ``FloatingPointError``
through a host callback naming the step, loss and gradient norm (it surfaces when the step's outputs are next
read). Silently continuing is not an option.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from treejax.models import lora
from treejax.rl import losses
from treejax.rl.batch import Batch
from treejax.rl.config import NONFINITE_POLICIES
from treejax.rl.layouts import Layout
from treejax.rl.train_state import TrainState

_ADDITIVE = ("loss", "pg_loss", "num_tokens")


def batch_denominator(batch: Batch, config: losses.LossConfig) -> jax.Array:
    """:func:`losses.loss_denominator` of a batch: token-mean and seq-mean-token-mean count trained pairs /
    sequences with a trained pair; Dr.GRPO's ``B * T_max`` uses ``num_sequences`` and ``sequence_length`` (the
    expanded batch's, filler leaves included, whichever layout the batch is in)."""
    if config.aggregation == "seq-mean-token-sum-norm":
        norm = config.norm_constant if config.norm_constant is not None else batch.sequence_length
        return jnp.asarray(batch.num_sequences * float(norm), jnp.float32)
    return losses.loss_denominator(batch.flat("loss_mask"), config)


def split_micro(x: jax.Array, num_micro: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...], micro-batch m = rows m, m+M, m+2M, ..."""
    b = x.shape[0]
    return jnp.swapaxes(x.reshape((b // num_micro, num_micro) + x.shape[1:]), 0, 1)


def reduce_metrics(stacked: dict[str, jax.Array], weights: jax.Array | None = None,
                   additive: tuple[str, ...] = ()) -> dict[str, jax.Array]:
    """Combines metrics stacked over parts (micro-batches, mini-batches) by their names: ``*_max`` -> max,
    ``*_min`` -> min, names in ``additive`` -> sum, the rest -> mean (weighted by ``weights`` when given)."""
    out = {}
    for k, v in stacked.items():
        if k in additive:
            out[k] = jnp.sum(v)
        elif k.endswith("_max"):
            out[k] = jnp.max(v)
        elif k.endswith("_min"):
            out[k] = jnp.min(v)
        elif weights is None:
            out[k] = jnp.mean(v)
        else:
            out[k] = jnp.sum(v * weights) / jnp.maximum(jnp.sum(weights), 1.0)
    return out


def _raise_nonfinite(finite, step, loss, grad_norm):
    if not bool(finite):
        raise FloatingPointError(
            f"non-finite update at step {int(step)}: loss={float(loss)}, grad_norm={float(grad_norm)}; "
            "params and optimizer state were left unchanged (set nonfinite='skip' to continue past such steps)"
        )


def make_grad_fn(
    layout: Layout,
    loss_config: losses.LossConfig,
    *,
    num_micro_batches: int = 1,
    remat: bool | str = False,
) -> Callable[[Any, Batch], tuple[jax.Array, dict[str, jax.Array], Any]]:
    """``grads(params, batch, frozen=None) -> (loss, metrics, grads)``: the policy loss of a mini-batch and its fp32
    gradient with respect to ``params``, accumulated over ``num_micro_batches`` strided groups of rows (module
    docstring). ``frozen``: the rest of the model when ``params`` are LoRA adapters (:func:`treejax.models.lora.split`;
    the model runs on ``lora.combine(params, frozen)``, and no gradient of the frozen part is computed)."""
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")

    def micro_loss(params, mb: Batch, denominator, frozen):
        # entropy is always reported; its gradient only matters when entropy_coef > 0
        logp, entropy = layout.pair_logprobs(lora.combine(params, frozen), mb.inputs, with_entropy=True,
                                             remat=remat)
        flat = lambda x: x.reshape((-1, x.shape[-1]))  # noqa: E731
        return losses.policy_loss(
            flat(logp), mb.flat("old_logp"), mb.flat("advantages"), mb.flat("loss_mask"), loss_config,
            ref_logp=mb.flat("ref_logp"), entropy=flat(entropy), sampler_logp=mb.flat("sampler_logp"),
            eps_scale_B=mb.flat("eps_scale"), eps_scale_BxT=mb.flat("token_eps_scale"), denominator=denominator)

    grad_fn = jax.value_and_grad(micro_loss, has_aux=True)

    def grads_fn(params, batch: Batch, frozen=None):
        if not isinstance(batch, Batch):
            raise TypeError(f"the update takes a treejax.rl.batch.Batch, got {type(batch).__name__} (an expanded "
                            "dict batch: treejax.rl.batch.expanded_batch(d))")
        batch.validate()
        B = batch.num_rows
        denominator = batch_denominator(batch, loss_config)
        if B % num_micro_batches:
            raise ValueError(f"batch rows {B} are not divisible by num_micro_batches={num_micro_batches}")
        if num_micro_batches == 1:
            (loss, metrics), grads = grad_fn(params, batch, denominator, frozen)
            return loss, metrics, jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        micro = jax.tree.map(functools.partial(split_micro, num_micro=num_micro_batches), batch)
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

        def body(acc, mb):
            (l, m), g = grad_fn(params, mb, denominator, frozen)
            acc = jax.tree.map(lambda a, gi: a + gi.astype(jnp.float32), acc, g)
            return acc, (l, m)

        grads, (loss_M, metrics_M) = jax.lax.scan(body, zeros, micro)
        metrics_M["loss"] = loss_M
        metrics = reduce_metrics(metrics_M, metrics_M["num_tokens"], additive=_ADDITIVE)
        return metrics.pop("loss"), metrics, grads

    return grads_fn


def make_update_fn(
    layout: Layout,
    loss_config: losses.LossConfig,
    optimizer: optax.GradientTransformation,
    *,
    num_micro_batches: int = 1,
    nonfinite: str = "skip",
    remat: bool | str = False,
    learning_rate_fn: Callable[[jax.Array], jax.Array] | None = None,
) -> Callable[[TrainState, Batch], tuple[TrainState, dict[str, jax.Array]]]:
    """Builds the pure ``update(state, batch) -> (new_state, metrics)`` (semantics in the module docstring): the
    gradient of ``policy_loss . layout.pair_logprobs`` on a :class:`~treejax.rl.batch.Batch` of ``layout``.

    ``optimizer`` must be the one that built ``state.opt_state``. ``learning_rate_fn`` (e.g.
    ``optimizer.learning_rate_schedule(cfg)``) only feeds the ``learning_rate`` metric, evaluated at
    ``state.step`` (the optimizer's own count lags behind it by the number of skipped non-finite steps). The returned function is
    not jitted: wrap it with ``jax.jit(..., donate_argnames="state")`` or ``treejax.parallel.mesh.jit_update``.

    Metrics: every ``losses.policy_loss`` metric (merged over micro-batches), ``loss``, ``grad_norm`` (before
    clipping), ``param_norm``, ``skipped`` (1.0 if the step was not applied), ``learning_rate`` if given.
    """
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
    grads_fn = make_grad_fn(layout, loss_config, num_micro_batches=num_micro_batches, remat=remat)

    def update(state: TrainState, batch) -> tuple[TrainState, dict[str, jax.Array]]:
        params, frozen = lora.split(state.params)  # LoRA: only the adapters train (frozen is None otherwise)
        loss, metrics, grads = grads_fn(params, batch, frozen)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        grad_norm = optax.tree.norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if nonfinite == "raise":
            jax.debug.callback(_raise_nonfinite, finite, state.step, loss, grad_norm)
        # Zero the non-finite gradients before the optimizer so no NaN enters any branch we might keep.
        safe_grads = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
        updates, new_opt_state = optimizer.update(safe_grads, state.opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        new_state = state.replace(
            params=lora.combine(keep(new_params, params), frozen),
            opt_state=keep(new_opt_state, state.opt_state),
            step=state.step + 1,
        )
        metrics = dict(metrics)
        metrics["loss"] = loss
        metrics["grad_norm"] = grad_norm
        metrics["param_norm"] = optax.tree.norm(lora.split(new_state.params)[0])  # of the trainable params
        metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
        if learning_rate_fn is not None:
            metrics["learning_rate"] = jnp.asarray(learning_rate_fn(state.step), jnp.float32)
        return new_state, metrics

    return update


__all__ = ["make_update_fn", "make_grad_fn", "batch_denominator", "split_micro", "reduce_metrics",
           "NONFINITE_POLICIES"]
