"""A prompt's rows as one group: ``[P', W]`` forest rows -> ``[P, C * W]`` groups with unused slots, and back.

With allocation (:mod:`treejax.rl.allocation.base`) a prompt's rollouts sit in up to ``C`` rows of the
step's forest: its pre-rollout row and its extra chunks. ``rows_PxC[p, c]`` is the row of prompt ``p``'s
``c``-th chunk (``c = 0``: the pre-rollout), ``-1`` where it has none. :func:`group_forest` merges them into
one tree per prompt:

* node ids of chunk ``c`` move to ``c * N + n`` (``N`` node slots per row); every chunk's root is the group's
  root ``0`` (all chunks decode from the same prompt), so chunk ``c >= 1``'s own root slot is unused;
* leaf slot ``c * W + w`` is chunk ``c``'s leaf ``w``; a missing chunk's slots are unused: ``leaf_path = -1``
  (column 0 included), ``loss_mask = 0``, ``leaf_weight = 0``, length 0;
* ``leaf_weight`` is kept: each chunk is an unbiased sample with weights summing to ``W`` (``W`` x path mass, or
  1 per slot), so ``k`` chunks sum to ``k W``, the group's rollouts.

An estimator that honours unused slots (``EstimatorSpec.ragged``: its group statistics run over the slots with
``leaf_path[..., 0] >= 0``) then gives each prompt's advantages over all its rollouts, and
:func:`ungroup` puts per-leaf values back in the rows' layout (rows in no group, the budget's filler rows, get 0).
"""

from __future__ import annotations

import jax.numpy as jnp

from treejax.forest import Forest, NodeStatus


def _gather_rows(x_RxWx, rows_PxC, fill=0):
    """``[R, W, ...] -> [P, C * W, ...]``, ``fill`` where ``rows_PxC < 0``."""
    got = jnp.take(x_RxWx, jnp.maximum(rows_PxC, 0), axis=0)  # [P, C, W, ...]
    have = (rows_PxC >= 0).reshape(rows_PxC.shape + (1,) * (x_RxWx.ndim - 1))
    got = jnp.where(have, got, jnp.asarray(fill, x_RxWx.dtype))
    P, C = rows_PxC.shape
    return got.reshape((P, C * x_RxWx.shape[1]) + x_RxWx.shape[2:])


def group_leaves(x_RxW, rows_PxC):
    """Per-leaf arrays ``[R, W, ...]`` (rewards, estimator inputs) as ``[P, C * W, ...]`` (0 in unused slots)."""
    return _gather_rows(jnp.asarray(x_RxW), jnp.asarray(rows_PxC))


def group_forest(forest: Forest, rows_PxC) -> Forest:
    """The ``[P, C * W]`` group forest of ``forest``'s rows (module docstring)."""
    rows = jnp.asarray(rows_PxC, jnp.int32)
    P, C = rows.shape
    N = forest.node_parent.shape[1]
    have_PxC = rows >= 0
    offset = (jnp.arange(C, dtype=jnp.int32) * N)[None, :, None]  # [1, C, 1]

    def nodes(x_RxN):
        return jnp.take(x_RxN, jnp.maximum(rows, 0), axis=0)  # [P, C, N]

    n = jnp.arange(N)[None, None, :]
    own_root = (n == 0) & (jnp.arange(C)[None, :, None] > 0)  # chunk c >= 1's root slot: merged into the group's
    used_node = have_PxC[:, :, None] & ~own_root
    par = nodes(forest.node_parent)
    parent = jnp.where(par > 0, par + offset, par)  # children of a chunk root hang under the group's root 0
    parent = jnp.where(used_node, parent, -1).reshape(P, C * N)
    depth = jnp.where(used_node, nodes(forest.node_depth), -1).reshape(P, C * N)
    status = jnp.where(used_node, nodes(forest.node_status), int(NodeStatus.UNUSED)).reshape(P, C * N)

    path = jnp.take(forest.leaf_path, jnp.maximum(rows, 0), axis=0)  # [P, C, W, D+1]
    path = jnp.where(path > 0, path + offset[..., None], path)
    path = jnp.where(have_PxC[:, :, None, None], path, -1).reshape(P, -1, path.shape[-1])

    def leaves(x, fill=0):
        return _gather_rows(x, rows, fill)

    return Forest(node_parent=parent, node_depth=depth, node_status=status, leaf_path=path,
                  leaf_status=leaves(forest.leaf_status), leaf_length=leaves(forest.leaf_length),
                  tokens=leaves(forest.tokens), logprobs=leaves(forest.logprobs),
                  segment_index=leaves(forest.segment_index, -1),
                  loss_mask=leaves(forest.loss_mask), leaf_weight=leaves(forest.leaf_weights()),
                  segment_length=forest.segment_length)


def ungroup(x_PxCW, rows_PxC, num_rows: int):
    """Per-leaf values of the groups ``[P, C * W, ...]`` back in the rows' layout ``[R, W, ...]`` (``R =
    num_rows``); rows in no group get 0."""
    x = jnp.asarray(x_PxCW)
    rows = jnp.asarray(rows_PxC, jnp.int32)
    P, C = rows.shape
    W = x.shape[1] // C
    per_chunk = x.reshape((P * C, W) + x.shape[2:])
    target = jnp.where(rows >= 0, rows, num_rows).reshape(P * C)  # missing chunks go to a dropped extra row
    out = jnp.zeros((num_rows + 1, W) + x.shape[2:], x.dtype).at[target].set(per_chunk)
    return out[:num_rows]


__all__ = ["group_forest", "group_leaves", "ungroup"]
