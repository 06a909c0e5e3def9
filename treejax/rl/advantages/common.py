"""Shared pieces of the estimators: group statistics that are exactly zero on equal rewards, token broadcast,
and the batch-global token-weighted whitening of REINFORCE++ / TreePO (verl's ``masked_whiten``).

Exact zeros: a group mean is computed *relative to the leaf itself*, ``R_i - mean_G(R) = mean_{j in G}(R_i -
R_j)``, so a group of equal rewards gives exactly 0 (a plain float mean of W copies of 0.3 is not exactly 0.3,
and whitening would then blow the rounding error up to O(1e-4)).

Sums: every reduction of the estimators goes through :func:`pairwise_sum`, a balanced tree of elementwise adds.
Its rounding error grows like ``log2(n) * 2^-24`` instead of the ``n * 2^-24`` bound of a sequential float32
sum (over the ~100 tokens of a small batch, ``jnp.sum`` moved whitened values by up to ~20 ulps = 2.5e-6
relative), and its order of operations is fixed by the program itself, so jitted, op-by-op and GPU results
are bit-identical (XLA does not reassociate float adds, but it picks the order inside a ``reduce`` per
backend and per fusion).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np



def materialize(x: jax.Array) -> jax.Array:
    """``x`` rounded to its dtype *here*, also under jit, so jitted and op-by-op results are bit-identical.

    Two jit-only rewrites change float results: XLA's algebraic simplifier reassociates products with
    constants (``(s * c) * b -> (s * b) * c``; an optimization barrier stops it), and XLA's CPU/GPU backends
    always let LLVM contract a multiply feeding an add into one fused multiply-add (one rounding instead of
    two; the barrier is gone by then). ``where(isnan(x), nan, x)`` is the identity, but a select between the
    multiply and the add is not looked through by the contraction. Op by op, neither rewrite happens.
    """
    x = jax.lax.optimization_barrier(x)
    return jnp.where(jnp.isnan(x), jnp.nan, x)


def masked_product(x: jax.Array, y: jax.Array, keep: jax.Array) -> jax.Array:
    """``where(keep, x * y, 0)``, the product rounded before the sum it feeds (see :func:`materialize`)."""
    return jnp.where(keep, materialize(x * y), 0.0)


def pairwise_sum(x: jax.Array, axis: int | None = None) -> jax.Array:
    """``sum(x, axis)`` as a balanced binary tree of elementwise adds (``axis=None``: over all elements).

    The axis is zero-padded to a power of two ``2^k`` and halved k times (``x[:h] + x[h:]``): each output is
    then a fixed tree of depth k, with error at most ``k * 2^-24 * sum|x|`` (sequential: ``(n-1) * 2^-24``), and
    the same bits under jit, op by op and on any backend. Cost: n adds, like ``jnp.sum``.
    """
    x = jnp.asarray(x)
    if axis is None:
        x, axis = jnp.ravel(x), 0
    x = jnp.moveaxis(x, axis, 0)
    n = x.shape[0]
    if n == 0:
        return jnp.zeros(x.shape[1:], x.dtype)
    size = 1 << (n - 1).bit_length()
    if size != n:
        x = jnp.concatenate([x, jnp.zeros((size - n,) + x.shape[1:], x.dtype)], axis=0)
    while x.shape[0] > 1:
        half = x.shape[0] // 2
        x = x[:half] + x[half:]
    return x[0]


def scaled_sum(x: jax.Array, divisor: int, axis=None) -> jax.Array:
    """``pairwise_sum(x) * float32(1 / divisor)`` for a *static* divisor: under jit XLA rewrites a division by a
    constant into a multiplication by its reciprocal, op-by-op execution does not; writing the
    multiplication explicitly makes both bit-identical. The result is materialized: otherwise XLA's algebraic
    simplifier moves the constant factor across a following multiplication (``(s * c) * b -> (s * b) * c``)."""
    return materialize(pairwise_sum(x, axis=axis) * np.float32(1.0 / max(int(divisor), 1)))


def count_scaled_sum(x: jax.Array, count: jax.Array, axis=None) -> jax.Array:
    """``pairwise_sum(x) * float32(1 / count)`` for a *traced* integer ``count`` (a group's used slots), clamped
    to >= 1. ``1 / float32(count)`` is the correctly rounded reciprocal, the same bits as the static
    ``np.float32(1 / n)`` of :func:`scaled_sum` (checked for every count up to 70,000), so a full group gives
    exactly :func:`scaled_sum`'s result."""
    inv = 1.0 / jnp.maximum(count, 1).astype(jnp.float32)
    return materialize(pairwise_sum(x, axis=axis) * inv)


def centered_by_groups(rewards_W: jax.Array, group_DxWxW: jax.Array) -> tuple[jax.Array, jax.Array]:
    """For one prompt: ``a[d, i] = R_i - mean_{j in G_d(i)} R_j`` and ``|G_d(i)|`` ([D', W] each).

    ``group_DxWxW[d, i, j]`` says leaf j is in leaf i's group at level d (rows of leaves without a node at
    that level are all False; then ``a = 0`` and size 0).
    """
    size = jnp.sum(group_DxWxW.astype(jnp.float32), axis=-1)  # integer counts: exact in any order
    diff = rewards_W[:, None] - rewards_W[None, :]  # [W, W]: R_i - R_j
    a = pairwise_sum(jnp.where(group_DxWxW, diff[None], 0.0), axis=-1) / jnp.maximum(size, 1.0)
    return a, size


BASELINES = ("group", "other_subtrees")


def check_baseline(name: str, baseline: str) -> None:
    if baseline not in BASELINES:
        raise ValueError(f"{name}.baseline must be one of {BASELINES}, got {baseline!r}")


def other_subtrees_deviation(leaf_path_WxD1: jax.Array, rewards_W: jax.Array) -> jax.Array:
    """Leave-one-subtree-out centring for one prompt, [W]: ``R_i - mean_{j: n_1(j) != n_1(i)} R_j`` with
    ``n_1(i)`` leaf i's depth-1 node; 0 where every leaf shares i's depth-1 node (no independent baseline).

    Leaves under one depth-1 node share a prefix, so their rewards are correlated with R_i and an in-group mean
    that includes them biases the policy gradient; leaves under the other depth-1 nodes were drawn independently
    of i's subtree. On independent samples (every leaf its own depth-1 node) this is RLOO's baseline exactly;
    on a slot tree it is also unbiased (the other subtrees' slots are exact draws of the policy).
    """
    first = leaf_path_WxD1[:, 1]
    other = (first[:, None] != first[None, :]) & (first[:, None] >= 0) & (first[None, :] >= 0)
    n = jnp.sum(other, axis=-1, dtype=jnp.int32).astype(jnp.float32)
    diff = rewards_W[:, None] - rewards_W[None, :]
    return jnp.where(n > 0, pairwise_sum(jnp.where(other, diff, 0.0), axis=-1) / jnp.maximum(n, 1.0), 0.0)


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
    """``(mu, 1 / sqrt(var + eps))`` of the tokens with mask > 0 (see :func:`masked_whiten`).

    Shifted-data algorithm: with ``c`` = the first valid token's value, ``d = x - c``, ``mu = c + mean(d)`` and
    ``var = sum((d - mean(d))^2) / (n - 1)``, all sums pairwise. A batch whose valid tokens all hold one value
    gives ``mu`` equal to that value exactly, hence exactly 0 after whitening, and a common offset of the tokens
    does not cancel catastrophically in the variance. The token count is summed in int32 (exact past 2^24).
    """
    m = mask_PxWxT > 0
    n = jnp.sum(m, dtype=jnp.int32).astype(jnp.float32)
    safe_n = jnp.maximum(n, 1.0)
    m_flat, x_flat = jnp.ravel(m), jnp.ravel(x_PxWxT)
    shift = jnp.where(m_flat[jnp.argmax(m_flat)], x_flat[jnp.argmax(m_flat)], 0.0)
    d = jnp.where(m, x_PxWxT - shift, 0.0)
    mean_d = pairwise_sum(d) / safe_n
    centered = d - mean_d
    denominator = jnp.where(n > 1, n - 1.0, safe_n) if unbiased else safe_n
    var = materialize(pairwise_sum(masked_product(centered, centered, m)) / denominator)
    return shift + mean_d, jax.lax.rsqrt(var + eps)


def masked_whiten(x_PxWxT: jax.Array, mask_PxWxT: jax.Array, eps: float = 1e-8, unbiased: bool = True) -> jax.Array:
    """Batch-global token-weighted whitening: ``(x - mu) / sqrt(var + eps)`` over all tokens with mask > 0.

    ``eps`` (1e-8, verl's value) keeps a (near-)constant batch well-defined: the scale is at most
    ``1 / sqrt(eps) = 1e4``, and a batch whose valid tokens are all equal whitens to exactly 0 (see
    :func:`whiten_stats`), never to amplified rounding noise.

    ``mu = sum(m x) / sum(m)``, ``var = sum(m (x - mu)^2) / sum(m)`` times ``n / (n - 1)`` when ``unbiased``
    (Bessel, as verl's ``masked_whiten`` -> ``masked_var(unbiased=True)``; verl raises for n <= 1, here the
    correction is skipped so a single token gives 0). Masked-out tokens are returned as 0; all-zero inputs
    give exactly 0. Every leaf weighs by its number of valid tokens (token-mean, as the official code).
    """
    mu, inv = whiten_stats(x_PxWxT, mask_PxWxT, eps, unbiased)
    return jnp.where(mask_PxWxT > 0, (x_PxWxT - mu) * inv, 0.0)


def check_rewards(forest, rewards_PxW: jax.Array) -> jax.Array:
    """Validates the reward shape against the forest (a Python-level check on static shapes)."""
    expected = forest.leaf_path.shape[:2]
    if tuple(rewards_PxW.shape) != tuple(expected):
        raise ValueError(f"rewards_PxW has shape {tuple(rewards_PxW.shape)}, the forest has [P, W] = {tuple(expected)}")
    return jnp.asarray(rewards_PxW, jnp.float32)
