"""One optimizer step on a mini-batch of token sequences: micro-batched gradients of the policy loss, a
non-finite guard, and the optax update — a pure ``update(state, batch) -> (state, metrics)``.

Batch layout (every per-token array is ``[B, L]`` and aligned with ``tokens``)::

    tokens       int32   the full sequences (prompt + response, packed or padded)
    positions    int32   RoPE positions
    segment_ids  int32   optional; 0 = padding, equal nonzero ids attend causally to each other (packing)
    loss_mask    float   1.0 where tokens[b, t] is an action the loss trains on (never at t = 0)
    old_logp     float   log pi_old(tokens[b, t] | tokens[b, :t]) (the ratio's denominator)
    advantages   float   per-token advantages
    ref_logp     float   optional, reference-policy log-probs (KL term)
    sampler_logp float   optional, the sampler's log-probs (truncated importance sampling)
    eps_scale    float   optional ``[B]`` per-sequence clip-range multiplier

Or a :class:`treejax.rl.packing.PackedBatch` (the tree-packed update): each shared prompt / segment token stored
once with a tree attention mask; its log-prob and entropy are computed once per unique token
(:func:`packed_logprobs`), gathered to (leaf, token) pairs (:func:`gather_pairs`) and fed to the same
``losses.policy_loss`` with the expanded batch's denominator (:func:`packed_loss_denominator`): same loss and
gradient as the expanded batch of the same leaves.

The new log-probs are recomputed with ``transformer.forward`` + ``transformer.token_logprobs`` and shifted so
that ``logp[b, t]`` scores ``tokens[b, t]`` from the hidden state at ``t - 1`` (:func:`sequence_logprobs`).
Position ``t`` is trained only if ``loss_mask[b, t] > 0`` and ``t - 1`` lies in the same nonzero segment.

Gradient accumulation: the mini-batch of ``B`` rows is split into ``M = num_micro_batches`` strided
micro-batches (micro-batch ``m`` holds rows ``m, m + M, m + 2M, ...``, so a batch sharded over devices in
contiguous blocks stays evenly spread) and gradients are summed over a ``lax.scan``. Every micro-batch's loss is
divided by the *mini-batch's* aggregation denominator (``losses.loss_denominator``), so the accumulated gradient
equals the one-shot mini-batch gradient for every aggregation mode.

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
import numpy as np
import optax

from treejax.models import transformer
from treejax.models.config import ModelConfig
from treejax.rl import losses
from treejax.rl.packing import PackedBatch
from treejax.rl.train_state import TrainState

NONFINITE_POLICIES = ("skip", "raise")
REQUIRED_KEYS = ("tokens", "positions", "loss_mask", "old_logp", "advantages")
OPTIONAL_KEYS = ("segment_ids", "ref_logp", "sampler_logp", "eps_scale")
_ADDITIVE = ("loss", "pg_loss", "num_tokens")


def sequence_logprobs(
    params: Any,
    model_config: ModelConfig,
    tokens_BxL: jax.Array,
    positions_BxL: jax.Array,
    segment_ids_BxL: jax.Array | None = None,
    *,
    chunk_size: int = 8192,
    with_entropy: bool = False,
    remat: bool | str = False,
    attention_impl: str = "xla",
):
    """``logp[b, t] = log pi(tokens[b, t] | tokens[b, :t])`` aligned with ``tokens`` (``logp[:, 0] = 0``).

    Runs the training forward once and scores each next token in vocabulary chunks. With ``with_entropy`` also
    returns the entropy of the next-token distribution that produced ``tokens[b, t]`` (0 at ``t = 0``).
    """
    hidden = transformer.forward(params, model_config, tokens_BxL, positions_BxL, segment_ids_BxL, remat=remat,
                                 attention_impl=attention_impl)
    next_BxL = jnp.roll(tokens_BxL, -1, axis=1)  # targets of hidden[:, t] are tokens[:, t + 1]
    out = transformer.token_logprobs(params, model_config, hidden, next_BxL, chunk_size=chunk_size,
                                     with_entropy=with_entropy)
    shift = lambda x: jnp.concatenate([jnp.zeros_like(x[:, :1]), x[:, :-1]], axis=1)  # noqa: E731
    if with_entropy:
        return shift(out[0]), shift(out[1])
    return shift(out)


def trainable_mask(batch: dict[str, jax.Array]) -> jax.Array:
    """``loss_mask`` restricted to positions whose previous token is in the same nonzero segment."""
    mask = batch["loss_mask"].astype(jnp.float32)
    seg = batch.get("segment_ids")
    if seg is None:
        seg = jnp.ones_like(batch["tokens"])
    prev_seg = jnp.concatenate([jnp.zeros_like(seg[:, :1]), seg[:, :-1]], axis=1)
    return mask * ((seg == prev_seg) & (seg != 0)).astype(jnp.float32)


def packed_logprobs(
    params: Any,
    model_config: ModelConfig,
    batch: PackedBatch,
    *,
    chunk_size: int = 8192,
    with_entropy: bool = False,
    remat: bool | str = False,
    attention_impl: str = "xla",
):
    """Log-probs (and entropies) of every unique token of a packed batch, ``[R, L]``, computed once.

    ``hidden = forward_tree(tokens)``; token ``i`` is scored from the hidden state of its predictor
    ``prev[i]`` (the previous token of its node, or its parent's last token at a node's first token)::

        logp[r, i] = log_softmax(h[r, prev[r, i]] W)[tokens[r, i]],   H[r, i] = entropy of that distribution

    (values at tokens without a predecessor, ``prev = -1``, are meaningless and never gathered as trained pairs).
    """
    hidden = transformer.forward_tree(params, model_config, batch.tokens, batch.positions, batch.node_lo,
                                      batch.node_hi, remat=remat, attention_impl=attention_impl)
    h_prev = jnp.take_along_axis(hidden, jnp.maximum(batch.prev, 0)[:, :, None], axis=1)
    return transformer.token_logprobs(params, model_config, h_prev, batch.tokens, chunk_size=chunk_size,
                                      with_entropy=with_entropy)


def gather_pairs(x_RxL: jax.Array, pair_index_RxWxT: jax.Array) -> jax.Array:
    """Per unique token ``[R, L]`` -> per (leaf slot, response token) pair ``[R, Wr, T]`` (the gather map of the
    packed batch; its transpose in the backward pass sums each pair's gradient into its unique token)."""
    R, Wr, T = pair_index_RxWxT.shape
    return jnp.take_along_axis(x_RxL, pair_index_RxWxT.reshape(R, Wr * T), axis=1).reshape(R, Wr, T)


def packed_loss_denominator(batch: PackedBatch, config: losses.LossConfig) -> jax.Array:
    """:func:`losses.loss_denominator` of the expanded batch the packed one stands for: token-mean and
    seq-mean-token-mean count trained pairs / leaves with a trained pair (the same numbers); Dr.GRPO's
    ``B * T_max`` uses the expanded batch's ``num_sequences`` and ``sequence_length`` (filler leaves included)."""
    if config.aggregation == "seq-mean-token-sum-norm":
        norm = config.norm_constant if config.norm_constant is not None else batch.sequence_length
        return jnp.asarray(batch.num_sequences * float(norm), jnp.float32)
    return losses.loss_denominator(batch.loss_mask.reshape(-1, batch.loss_mask.shape[-1]), config)


def validate_packed_batch(batch: PackedBatch) -> None:
    """Raises ``ValueError`` naming the first mis-shaped field of a :class:`PackedBatch`."""
    R, L = batch.tokens.shape
    for k in ("positions", "node_lo", "node_hi", "prev"):
        if tuple(getattr(batch, k).shape) != (R, L):
            raise ValueError(f"packed batch: {k} has shape {tuple(getattr(batch, k).shape)}, expected {(R, L)}")
    pshape = tuple(batch.pair_index.shape)
    if len(pshape) != 3 or pshape[0] != R:
        raise ValueError(f"packed batch: pair_index must be [R={R}, Wr, T], got {pshape}")
    for k in ("loss_mask", "advantages", "old_logp", "sampler_logp", "ref_logp"):
        v = getattr(batch, k)
        if v is not None and tuple(v.shape) != pshape:
            raise ValueError(f"packed batch: {k} has shape {tuple(v.shape)}, expected {pshape} (like pair_index)")
    for k in ("leaf_id", "eps_scale"):
        v = getattr(batch, k)
        if v is not None and tuple(v.shape) != pshape[:2]:
            raise ValueError(f"packed batch: {k} has shape {tuple(v.shape)}, expected {pshape[:2]}")
    if batch.num_sequences < 1 or batch.sequence_length < 1:
        raise ValueError("packed batch: num_sequences and sequence_length must be set (>= 1)")


def validate_batch(batch: dict[str, Any]) -> None:
    """Raises ``ValueError`` naming the first missing, unknown or mis-shaped batch entry."""
    for k in REQUIRED_KEYS:
        if k not in batch:
            raise ValueError(f"update batch is missing {k!r}; required keys: {REQUIRED_KEYS}")
    unknown = set(batch) - set(REQUIRED_KEYS) - set(OPTIONAL_KEYS)
    if unknown:
        raise ValueError(f"update batch has unknown keys {sorted(unknown)}; allowed: {REQUIRED_KEYS + OPTIONAL_KEYS}")
    shape = tuple(batch["tokens"].shape)
    if len(shape) != 2:
        raise ValueError(f"batch['tokens'] must be [B, L], got {shape}")
    for k, v in batch.items():
        want = shape[:1] if k == "eps_scale" else shape
        if tuple(v.shape) != want:
            raise ValueError(f"batch[{k!r}] has shape {tuple(v.shape)}, expected {want}")


def split_micro(x: jax.Array, num_micro: int) -> jax.Array:
    """[B, ...] -> [M, B/M, ...], micro-batch m = rows m, m+M, m+2M, ..."""
    b = x.shape[0]
    return jnp.swapaxes(x.reshape((b // num_micro, num_micro) + x.shape[1:]), 0, 1)


def _merge_metrics(stacked: dict[str, jax.Array], weights_M: jax.Array) -> dict[str, jax.Array]:
    """Combine per-micro-batch metrics: sums for additive ones, max/min for extremes, token-weighted means."""
    out = {}
    total = jnp.maximum(jnp.sum(weights_M), 1.0)
    for k, v in stacked.items():
        if k in _ADDITIVE:
            out[k] = jnp.sum(v)
        elif k.endswith("_max"):
            out[k] = jnp.max(v)
        elif k.endswith("_min"):
            out[k] = jnp.min(v)
        else:
            out[k] = jnp.sum(v * weights_M) / total
    return out


def _raise_nonfinite(finite, step, loss, grad_norm):
    if not bool(finite):
        raise FloatingPointError(
            f"non-finite update at step {int(step)}: loss={float(loss)}, grad_norm={float(grad_norm)}; "
            "params and optimizer state were left unchanged (set nonfinite='skip' to continue past such steps)"
        )


def make_grad_fn(
    model_config: ModelConfig,
    loss_config: losses.LossConfig,
    *,
    num_micro_batches: int = 1,
    logprob_chunk_size: int = 8192,
    remat: bool | str = False,
    attention_impl: str = "xla",
    tree_attention_impl: str = "xla",
) -> Callable[[Any, dict[str, jax.Array] | PackedBatch], tuple[jax.Array, dict[str, jax.Array], Any]]:
    """``grads(params, batch) -> (loss, metrics, grads)``: the policy loss of a mini-batch and its fp32 gradient,
    accumulated over ``num_micro_batches`` (module docstring). ``batch`` is the expanded dict layout or a
    :class:`~treejax.rl.packing.PackedBatch`; both give the same loss and gradient for the same leaves.

    Packed: unique tokens are scored once (:func:`packed_logprobs`, ``tree_attention_impl``), gathered to
    ``[R * Wr, T]`` pairs (:func:`gather_pairs`) and passed to :func:`losses.policy_loss` with the expanded
    batch's denominator (:func:`packed_loss_denominator`); micro-batches are strided groups of packed rows
    (whole trees)."""
    if num_micro_batches < 1:
        raise ValueError(f"num_micro_batches must be >= 1, got {num_micro_batches}")
    with_entropy = True  # entropy is always reported; its gradient only matters when entropy_coef > 0

    def micro_loss(params, mb, denominator):
        logp, entropy = sequence_logprobs(
            params, model_config, mb["tokens"], mb["positions"], mb.get("segment_ids"),
            chunk_size=logprob_chunk_size, with_entropy=with_entropy, remat=remat, attention_impl=attention_impl)
        return losses.policy_loss(
            logp, mb["old_logp"], mb["advantages"], mb["mask"], loss_config,
            ref_logp=mb.get("ref_logp"), entropy=entropy, sampler_logp=mb.get("sampler_logp"),
            eps_scale_B=mb.get("eps_scale"), denominator=denominator)

    def packed_micro_loss(params, mb: PackedBatch, denominator):
        logp, entropy = packed_logprobs(params, model_config, mb, chunk_size=logprob_chunk_size,
                                        with_entropy=with_entropy, remat=remat, attention_impl=tree_attention_impl)
        T = mb.pair_index.shape[-1]
        pairs = mb.pair_arrays()
        return losses.policy_loss(
            gather_pairs(logp, mb.pair_index).reshape(-1, T), pairs["old_logp"], pairs["advantages"],
            pairs["loss_mask"], loss_config, ref_logp=pairs.get("ref_logp"),
            entropy=gather_pairs(entropy, mb.pair_index).reshape(-1, T), sampler_logp=pairs.get("sampler_logp"),
            eps_scale_B=pairs.get("eps_scale"), denominator=denominator)

    plain_grad = jax.value_and_grad(micro_loss, has_aux=True)
    packed_grad = jax.value_and_grad(packed_micro_loss, has_aux=True)

    def grads_fn(params, batch):
        if isinstance(batch, PackedBatch):
            validate_packed_batch(batch)
            B = batch.num_rows
            data, grad_fn = batch, packed_grad
            denominator = packed_loss_denominator(batch, loss_config)
            what = "packed row count"
        else:
            validate_batch(batch)
            B = batch["tokens"].shape[0]
            mask = trainable_mask(batch)
            data = {k: v for k, v in batch.items() if k != "loss_mask"}
            data["mask"] = mask
            denominator = losses.loss_denominator(mask, loss_config)
            grad_fn, what = plain_grad, "batch size"
        if B % num_micro_batches:
            raise ValueError(f"{what} {B} is not divisible by num_micro_batches={num_micro_batches}")
        if num_micro_batches == 1:
            (loss, metrics), grads = grad_fn(params, data, denominator)
            return loss, metrics, jax.tree.map(lambda g: g.astype(jnp.float32), grads)
        micro = jax.tree.map(functools.partial(split_micro, num_micro=num_micro_batches), data)
        zeros = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)

        def body(acc, mb):
            (l, m), g = grad_fn(params, mb, denominator)
            acc = jax.tree.map(lambda a, gi: a + gi.astype(jnp.float32), acc, g)
            return acc, (l, m)

        grads, (loss_M, metrics_M) = jax.lax.scan(body, zeros, micro)
        metrics_M["loss"] = loss_M
        metrics = _merge_metrics(metrics_M, metrics_M["num_tokens"])
        return metrics.pop("loss"), metrics, grads

    return grads_fn


def make_update_fn(
    model_config: ModelConfig,
    loss_config: losses.LossConfig,
    optimizer: optax.GradientTransformation,
    *,
    num_micro_batches: int = 1,
    nonfinite: str = "skip",
    logprob_chunk_size: int = 8192,
    remat: bool | str = False,
    learning_rate_fn: Callable[[jax.Array], jax.Array] | None = None,
    attention_impl: str = "xla",
    tree_attention_impl: str = "xla",
) -> Callable[[TrainState, dict[str, jax.Array] | PackedBatch], tuple[TrainState, dict[str, jax.Array]]]:
    """Builds the pure ``update(state, batch) -> (new_state, metrics)`` (semantics in the module docstring).

    ``batch`` is either the expanded dict layout or a :class:`~treejax.rl.packing.PackedBatch` (the tree-packed
    update: same loss and gradient, each shared token computed once; see :func:`make_grad_fn`).
    ``optimizer`` must be the one that built ``state.opt_state``. ``learning_rate_fn`` (e.g.
    ``optimizer.learning_rate_schedule(cfg)``) only feeds the ``learning_rate`` metric, evaluated at
    ``state.step`` (the optimizer's own count lags behind it by the number of skipped non-finite steps). The returned function is
    not jitted: wrap it with ``jax.jit(..., donate_argnames="state")`` or ``treejax.parallel.mesh.jit_update``.

    Metrics: every ``losses.policy_loss`` metric (merged over micro-batches), ``loss``, ``grad_norm`` (before
    clipping), ``param_norm``, ``skipped`` (1.0 if the step was not applied), ``learning_rate`` if given.
    """
    if nonfinite not in NONFINITE_POLICIES:
        raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
    grads_fn = make_grad_fn(model_config, loss_config, num_micro_batches=num_micro_batches,
                            logprob_chunk_size=logprob_chunk_size, remat=remat, attention_impl=attention_impl,
                            tree_attention_impl=tree_attention_impl)

    def update(state: TrainState, batch) -> tuple[TrainState, dict[str, jax.Array]]:
        params = state.params
        loss, metrics, grads = grads_fn(params, batch)
        grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, params)
        grad_norm = optax.global_norm(grads)
        finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
        if nonfinite == "raise":
            jax.debug.callback(_raise_nonfinite, finite, state.step, loss, grad_norm)
        # Zero the non-finite gradients before the optimizer so no NaN enters any branch we might keep.
        safe_grads = jax.tree.map(lambda g: jnp.where(finite, g, jnp.zeros_like(g)), grads)
        updates, new_opt_state = optimizer.update(safe_grads, state.opt_state, params)
        new_params = optax.apply_updates(params, updates)
        keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)  # noqa: E731
        new_state = state.replace(
            params=keep(new_params, params),
            opt_state=keep(new_opt_state, state.opt_state),
            step=state.step + 1,
        )
        metrics = dict(metrics)
        metrics["loss"] = loss
        metrics["grad_norm"] = grad_norm
        metrics["param_norm"] = optax.global_norm(new_state.params)
        metrics["skipped"] = 1.0 - finite.astype(jnp.float32)
        if learning_rate_fn is not None:
            metrics["learning_rate"] = jnp.asarray(learning_rate_fn(state.step), jnp.float32)
        return new_state, metrics

    return update


def raise_if_skipped(metrics: dict[str, Any], step: int) -> None:
    """Host-side check for loops that prefer raising over skipping after reading a step's metrics."""
    if float(np.asarray(metrics["skipped"])) > 0:
        raise FloatingPointError(
            f"update at step {step} was skipped: loss={float(np.asarray(metrics['loss']))}, "
            f"grad_norm={float(np.asarray(metrics['grad_norm']))}")
