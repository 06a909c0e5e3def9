"""Running the shapers on a step's pool: the pool's per-pair arrays as :class:`ShapingInputs`, and back.

The pool (:class:`treejax.rl.layouts.Pool`) holds one row per leaf in both layouts (row ``p * W + w``);
:meth:`~treejax.rl.layouts.Layout.to_response` moves its per-pair arrays to the forest's response layout
``[P * W, T]`` (the packed pool already is), which reshapes to the shapers' ``[P, W, T]``.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np

from treejax.rl.shaping.base import ShapingInputs, masked_mean


def shaping_inputs(layout, batch, stats: dict, rollouts, answer_step=None, step_scores=None) -> ShapingInputs:
    """:class:`ShapingInputs` of a pool ``batch`` (advantages, loss mask, old log-probs, eps scale) and the
    trainer-pass ``stats`` (``entropy``, ``topk_logp``, ``ref_logp``), all in ``layout``'s pool layout;
    ``answer_step [P, W]`` and ``step_scores [P, W, D]`` pass through (the rollouts' estimator inputs)."""
    forest = rollouts.forest
    P, W, T = forest.tokens.shape

    def leaf(a):
        if a is None:
            return None
        if a.ndim > 1:  # per pair: to the response layout
            a = layout.to_response(a, rollouts.lengths_P, T)
        return a.reshape((P, W) + a.shape[1:])

    correct = rollouts.correct_PxW
    scores = (jnp.zeros((P, W), jnp.float32) if correct is None else jnp.asarray(np.asarray(correct), jnp.float32))
    return ShapingInputs(
        advantages=leaf(batch.advantages), loss_mask=leaf(batch.loss_mask), old_logp=leaf(batch.old_logp), rewards=jnp.asarray(rollouts.rewards_PxW, jnp.float32), scores=scores,
        leaf_length=forest.leaf_length, eps_scale=leaf(batch.eps_scale), leaf_path=forest.leaf_path,
        entropy=leaf(stats.get("entropy")), topk_logp=leaf(stats.get("topk_logp")),
        ref_logp=leaf(stats.get("ref_logp")), hidden=leaf(stats.get("hidden")), answer_step=answer_step,
        step_scores=None if step_scores is None else jnp.asarray(step_scores, jnp.float32),
        segment_length=forest.segment_length)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("with_mask",))
def apply_shapers(shapers: tuple, x: ShapingInputs, states: dict | None = None, *, with_mask: bool = False
                  ) -> tuple[jax.Array, jax.Array, dict, dict]:
    """Runs ``shapers`` in order; returns the final ``advantages [P * W, T]`` (response layout), ``eps_scale
    [P * W]``, the metrics ``shaping/<name>/<metric>`` (plus ``shaping/adv_abs_mean_before|after``) and the
    stateful shapers' new ``states`` (``{name: state}``, ``TrainState.aux``); with ``with_mask`` also the final
    loss mask ``[P * W, T]`` (a shaper's ``Shaped.keep`` zeroes pairs of it; later shapers see the new mask)."""
    states = dict(states or {})
    metrics = {"shaping/adv_abs_mean_before": masked_mean(jnp.abs(x.advantages), x.on)}
    for s in shapers:
        if s.stateful:
            if s.name not in states:
                raise ValueError(f"stateful shaper {s.name!r} has no state: build TrainState.aux with "
                                 "shaping.init_states(shapers, hidden_size)")
            out, states[s.name] = s.shape_stateful(x, states[s.name])
        else:
            out = s.shape(x)
        if out.keep is not None:
            x = x.replace(loss_mask=jnp.where(out.keep > 0, x.loss_mask, jnp.zeros((), x.loss_mask.dtype)))
        x = x.replace(advantages=jnp.where(x.on, out.advantages, 0.0), eps_scale=out.eps_scale)
        metrics.update({f"shaping/{s.name}/{k}": v for k, v in out.metrics.items()})
    metrics["shaping/adv_abs_mean_after"] = masked_mean(jnp.abs(x.advantages), x.on)
    rows = x.advantages.shape[0] * x.advantages.shape[1]
    out = (x.advantages.reshape((rows,) + x.advantages.shape[2:]), x.eps_scale.reshape(rows), metrics, states)
    return out + (x.loss_mask.reshape((rows,) + x.loss_mask.shape[2:]),) if with_mask else out


__all__ = ["shaping_inputs", "apply_shapers"]
