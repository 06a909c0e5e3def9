"""Shared pieces of the estimators: group statistics that are exactly zero on equal rewards, token broadcast,
and the batch-global token-weighted whitening of REINFORCE++ / TreePO (verl's ``masked_whiten``).

Exact zeros: a group mean is computed *relative to the leaf itself*, ``R_i - mean_G(R) = mean_{j in G}(R_i -
R_j)``, so a group of equal rewards gives exactly 0 (a plain float mean of W copies of 0.3 is not exactly 0.3,
and whitening would then blow the rounding error up to O(1e-4)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from treejax.forest import subgroup_masks


def materialize(x: jax.Array) -> jax.Array:
    """Rounds ``x`` to its dtype before it is summed: an optimization barrier keeps XLA from contracting a
    product into the following add (FMA) under jit, so jitted and op-by-op results are bit-identical."""
    return jax.lax.optimization_barrier(x)


def scaled_sum(x: jax.Array, divisor: int, axis=None) -> jax.Array:
    """``sum(x) * float32(1 / divisor)`` for a *static* divisor: under jit XLA rewrites a division by a
    constant into a multiplication by its reciprocal, op-by-op execution does not; writing the
    multiplication explicitly makes both bit-identical."""
    return jnp.sum(x, axis=axis) * np.float32(1.0 / max(int(divisor), 1))


def centered_by_groups(rewards_W: jax.Array, group_DxWxW: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For one prompt: ``a[d, i] = R_i - mean_{j in G_d(i)} R_j`` and ``|G_d(i)|`` ([D', W] each).

    ``group_DxWxW[d, i, j]`` says leaf j is in leaf i's group at level d (rows of leaves without a node at
    that level are all False; then ``a = 0`` and size 0).
    """
    size = jnp.sum(group_DxWxW.astype(jnp.float32), axis=-1)
    diff = rewards_W[:, None] - rewards_W[None, :]  # [W, W]: R_i - R_j
    a = jnp.sum(jnp.where(group_DxWxW, diff[None], 0.0), axis=-1) / jnp.maximum(size, 1.0)
    return a, size


def leaf_groups(leaf_path_WxD1: jax.Array) -> jax.Array:
    """[W, D+1] -> [D+1, W, W] subgroup membership of one prompt (see :func:`treejax.forest.subgroup_masks`)."""
    return subgroup_masks(leaf_path_WxD1)


def broadcast_leaves(leaf_PxW: jax.Array, loss_mask_PxWxT: jax.Array) -> jax.Array:
    """Per-leaf scalars -> per-token values, 0 where the loss mask is 0."""
    return jnp.where(loss_mask_PxWxT > 0, leaf_PxW[:, :, None], 0.0).astype(jnp.float32)


def broadcast_segments(seg_PxWxD: jax.Array, segment_index_PxWxT: jax.Array, loss_mask_PxWxT: jax.Array) -> jax.Array:
    """Per-segment values -> per-token values via ``segment_index`` (token t takes its segment's value);
    0 where the loss mask is 0 or the token has no segment (``segment_index < 0``)."""
    idx = jnp.clip(segment_index_PxWxT, 0, seg_PxWxD.shape[-1] - 1)
    vals = jnp.take_along_axis(seg_PxWxD, idx, axis=-1)
    keep = (loss_mask_PxWxT > 0) & (segment_index_PxWxT >= 0)
    return jnp.where(keep, vals, 0.0).astype(jnp.float32)


def whiten_stats(x_PxWxT: jax.Array, mask_PxWxT: jax.Array, eps: float = 1e-8, unbiased: bool = True):
    """``(mu, 1 / sqrt(var + eps))`` of the tokens with mask > 0 (see :func:`masked_whiten`)."""
    m = mask_PxWxT > 0
    n = jnp.sum(m.astype(jnp.float32))
    safe_n = jnp.maximum(n, 1.0)
    mu = jnp.sum(jnp.where(m, x_PxWxT, 0.0)) / safe_n
    centered = jnp.where(m, x_PxWxT - mu, 0.0)
    denominator = jnp.where(unbiased & (n > 1), n - 1.0, safe_n) if unbiased else safe_n
    var = materialize(jnp.sum(materialize(centered * centered)) / denominator)
    return mu, jax.lax.rsqrt(var + eps)


def masked_whiten(x_PxWxT: jax.Array, mask_PxWxT: jax.Array, eps: float = 1e-8, unbiased: bool = True) -> jax.Array:
    """Batch-global token-weighted whitening: ``(x - mu) / sqrt(var + eps)`` over all tokens with mask > 0.

    ``mu = sum(m x) / sum(m)``, ``var = sum(m (x - mu)^2) / sum(m)`` times ``n / (n - 1)`` when ``unbiased``
    (Bessel, as verl's ``masked_whiten`` -> ``masked_var(unbiased=True)``; verl raises for n <= 1, here the
    correction is skipped so a single token gives 0). Masked-out tokens are returned as 0; all-zero inputs
    give exactly 0. Every leaf weighs by its number of valid tokens (token-mean, as the official code).
    """
    mu, inv = whiten_stats(x_PxWxT, mask_PxWxT, eps, unbiased)
    return jnp.where(mask_PxWxT > 0, (x_PxWxT - mu) * inv, 0.0)


def whiten_or_mask(tokens_PxWxT: jax.Array, mask_PxWxT: jax.Array, whiten: bool, eps: float) -> jax.Array:
    if whiten:
        return masked_whiten(tokens_PxWxT, mask_PxWxT, eps=eps)
    return jnp.where(mask_PxWxT > 0, tokens_PxWxT, 0.0)


def check_rewards(forest, rewards_PxW: jax.Array) -> jax.Array:
    """Validates the reward shape against the forest (a Python-level check on static shapes)."""
    expected = forest.leaf_path.shape[:2]
    if tuple(rewards_PxW.shape) != tuple(expected):
        raise ValueError(f"rewards_PxW has shape {tuple(rewards_PxW.shape)}, the forest has [P, W] = {tuple(expected)}")
    return jnp.asarray(rewards_PxW, jnp.float32)
