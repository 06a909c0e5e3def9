"""Jitted kernels the tree sampler runs at segment boundaries: ranks within a row, repetition detection,
budget allocation, divergence weights (TreePO §2.2 / official ``vllm_rollout_spmd.py``). All are pure,
fixed-shape and masked."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def rank_within(mask_PxW: jax.Array) -> jax.Array:
    """int32[P, W]: exclusive rank of each True entry among the True entries of its row (its count of True
    entries before it)."""
    m = mask_PxW.astype(jnp.int32)
    return jnp.cumsum(m, axis=-1) - m


def ngram_repetition(tokens_BxS: jax.Array, lengths_B: jax.Array, n: int, count: int) -> jax.Array:
    """bool[B]: True where some token n-gram occurs at least ``count`` times among the first ``lengths_B[b]``
    tokens of row b (the last decoded segment).

    Occurrences may overlap (in ``a a a a`` the bigram ``a a`` occurs 3 times); an n-gram starting at position
    i counts only if it ends inside the valid prefix (``i + n <= length``). TreePO's code does the same test on
    decoded text (any 32-character substring occurring >= 8 times in the segment); on tokens the sampler picks
    ``n`` and ``count``. Cost O(B * S^2 * n) compares, done as S x S equality matrices (S = segment length).
    """
    if n < 1 or count < 1:
        raise ValueError(f"ngram_repetition needs n >= 1 and count >= 1, got n={n}, count={count}")
    b, s = tokens_BxS.shape
    if n > s:
        return jnp.zeros((b,), bool)
    starts = s - n + 1
    equal = jnp.ones((b, starts, starts), bool)
    for k in range(n):
        window = tokens_BxS[:, k : k + starts]
        equal = equal & (window[:, :, None] == window[:, None, :])
    valid = (jnp.arange(starts)[None, :] + n) <= lengths_B[:, None]  # [B, starts]
    occurrences = jnp.sum(equal & valid[:, None, :], axis=-1)  # [B, starts]
    return jnp.any(valid & (occurrences >= count), axis=-1)


def allocate_budget(weights_PxB: jax.Array, live_PxB: jax.Array, budget_P: jax.Array, minimum: int = 1) -> jax.Array:
    """int32[P, B]: split an integer budget over the live items of each row by the largest-remainder method.

    Per row with ``n`` live items: ``total = max(budget, minimum * n)`` (the minimum always wins over a
    smaller budget; a row with no live item gets 0 everywhere). Every live item first gets ``minimum``; the
    rest ``R = total - minimum * n`` is split proportionally to the live weights: item i gets
    ``floor(R w_i / sum w)`` and the ``R - sum floor`` leftover units go one each to the items with the largest
    remainders ``R w_i mod sum w``, ties broken by the lower index. Dead items get 0; the row sums to
    ``total`` exactly. Negative weights are treated as 0; if all live weights are 0 the split is uniform.
    Remainders are computed as ``R w_i - floor * sum w`` (not as a fraction) so equal remainders tie exactly
    for integer-valued weights.
    """
    if minimum < 0:
        raise ValueError(f"allocate_budget needs minimum >= 0, got {minimum}")
    live = live_PxB.astype(bool)
    w = jnp.where(live, jnp.maximum(weights_PxB.astype(jnp.float32), 0.0), 0.0)
    wsum = jnp.sum(w, axis=-1, keepdims=True)
    w = jnp.where(wsum > 0, w, live.astype(jnp.float32))
    wsum = jnp.sum(w, axis=-1, keepdims=True)
    n_live = jnp.sum(live, axis=-1).astype(jnp.int32)
    total = jnp.maximum(budget_P.astype(jnp.int32), minimum * n_live)
    rest = jnp.where(n_live > 0, total - minimum * n_live, 0)[:, None].astype(jnp.float32)
    num = rest * w
    safe = jnp.maximum(wsum, 1e-30)
    base = jnp.floor(num / safe)
    rem = num - base * safe
    base = jnp.where(rem < 0, base - 1, jnp.where(rem >= safe, base + 1, base))
    rem = num - base * safe
    base = jnp.where(live, base, 0.0).astype(jnp.int32)
    leftover = jnp.clip(rest[:, 0].astype(jnp.int32) - jnp.sum(base, axis=-1), 0, n_live)  # [P]
    idx = jnp.arange(w.shape[-1])
    ahead = (rem[:, None, :] > rem[:, :, None]) | ((rem[:, None, :] == rem[:, :, None]) & (idx[None, :] < idx[:, None])[None])
    rank = jnp.sum(ahead & live[:, None, :], axis=-1)  # live items ahead of item i
    extra = live & (rank < leftover[:, None])
    return jnp.where(live, minimum + base + extra.astype(jnp.int32), 0).astype(jnp.int32)


def divergence_weights(x_PxB: jax.Array, live_PxB: jax.Array, temperature, sign: float = 1.0) -> jax.Array:
    """float32[P, B]: ``softmax_{live}(sign * (x - min_live x) / T)``, 0 for dead items (all 0 if none live).

    TreePO's log-prob weighted branching: ``x`` is a path's mean log-prob (of its last segment or whole path);
    ``sign=+1`` favours confident paths, ``sign=-1`` uncertain ones; temperature ``T`` (a float or a traced
    scalar, e.g. from :func:`temperature_schedule`) flattens the weights as it grows. The min-shift is the
    official code's form (it does not change the softmax); it is computed stably by subtracting the max.
    """
    live = live_PxB.astype(bool)
    x = x_PxB.astype(jnp.float32)
    x_min = jnp.min(jnp.where(live, x, jnp.inf), axis=-1, keepdims=True)
    z = jnp.where(live, sign * (x - jnp.where(jnp.isfinite(x_min), x_min, 0.0)) / temperature, -jnp.inf)
    z_max = jnp.max(z, axis=-1, keepdims=True)
    e = jnp.where(live, jnp.exp(z - jnp.where(jnp.isfinite(z_max), z_max, 0.0)), 0.0)
    return e / jnp.maximum(jnp.sum(e, axis=-1, keepdims=True), 1e-30)


def temperature_schedule(step, num_steps: int, start: float = 5.0, end: float = 1.0, kind: str = "linear"):
    """Temperature at training step ``step`` (0-based), from ``start`` at step 0 to ``end`` at ``num_steps``
    and held at ``end`` afterwards (TreePO anneals 5.0 -> 1.0).

    ``kind="linear"``: ``start + (end - start) * min(step / num_steps, 1)``;
    ``kind="exponential"``: geometric interpolation ``start * (end / start) ** min(step / num_steps, 1)``.
    The released TreePO code names the endpoints, not the curve; linear is our default. Jittable in ``step``.
    """
    if num_steps <= 0:
        raise ValueError(f"num_steps must be > 0, got {num_steps}")
    frac = jnp.clip(jnp.asarray(step, jnp.float32) / num_steps, 0.0, 1.0)
    if kind == "linear":
        return start + (end - start) * frac
    if kind == "exponential":
        if start <= 0 or end <= 0:
            raise ValueError("exponential schedule needs start > 0 and end > 0")
        return start * (end / start) ** frac
    raise ValueError(f"unknown temperature schedule kind {kind!r}; valid: 'linear', 'exponential'")
