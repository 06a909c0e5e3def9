"""Attention over tree-packed rows (``treejax.rl.packing``): every token sees its node's ancestors and, causally,
its own node.

Each token carries its node's preorder interval ``[node_lo, node_hi]`` (``node_hi``: the last preorder number in
the node's subtree). With the row laid out in preorder (ancestors before descendants)::

    mask[i, j] = (j <= i) & (node_lo[j] <= node_lo[i] <= node_hi[j])

Implementations (``attention_impl``):

* ``"xla"``: the dense mask ``[B, L, L]`` and fp32 scores, with :func:`treejax.models.dense_attention.attention`.
  Exact on every backend; memory ``O(L^2)`` per row and head, so meant for CPU/TPU tests and short rows.
* ``"pallas"``: a block-sparse flash-attention kernel (Pallas, Triton on GPU): queries in blocks, keys in
  blocks, the mask computed per tile from the two interval vectors, tiles without any visible key skipped, online
  softmax in fp32; forward and backward kernels (:mod:`treejax.models.tree_flash`). On a non-GPU backend it
  runs in Pallas' interpreter (slow; correctness tests only).
* ``"auto"``: ``"pallas"`` on a GPU, ``"xla"`` elsewhere.

Sharding: the XLA path is partitioned by GSPMD like the rest of the update (rows over ``data x fsdp``, heads
over ``tensor``). GSPMD cannot split the Pallas call (it would gather every operand onto every device and run it
replicated), so under a context mesh (``jax.set_mesh``, which the training loop sets on multi-device meshes) the
kernel runs in ``jax.shard_map``: each device attends its own rows (whole trees: a row never attends another) and
its own heads (rows by the logical ``batch`` axis, heads by ``heads`` where that divides both head counts).
"""

from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from treejax.models import tree_flash
from treejax.models.dense_attention import attention, causal_mask
from treejax.parallel.mesh import rows_and_heads

TREE_ATTENTION_IMPLS = ("xla", "pallas", "auto")


def tree_mask(node_lo_BxL: jax.Array, node_hi_BxL: jax.Array) -> jax.Array:
    """Dense ``[B, L, L]`` attention mask of packed rows (True = attend):
    ``(j <= i) & (node_lo[j] <= node_lo[i] <= node_hi[j])``."""
    q = node_lo_BxL[:, :, None]
    return causal_mask(node_lo_BxL.shape[1])[None] & (node_lo_BxL[:, None, :] <= q) & (q <= node_hi_BxL[:, None, :])


def resolve_impl(attention_impl: str) -> str:
    if attention_impl not in TREE_ATTENTION_IMPLS:
        raise ValueError(f"tree attention_impl must be one of {TREE_ATTENTION_IMPLS}, got {attention_impl!r}")
    if attention_impl == "auto":
        return "pallas" if jax.default_backend() == "gpu" else "xla"
    return attention_impl


def make_tree_attention(node_lo_BxL: jax.Array, node_hi_BxL: jax.Array, attention_impl: str = "xla",
                        blocks: tree_flash.TreeFlashBlocks | None = None
                        ) -> Callable[[jax.Array, jax.Array, jax.Array], jax.Array]:
    """``attend(q [B, L, Q, H], k [B, L, K, H], v [B, L, K, H]) -> [B, L, Q, H]`` for rows with these intervals.

    Whatever depends only on the intervals (the dense mask) is built once here, outside the layer loop.
    ``blocks``: the Pallas kernel's tiles (default:
    :func:`treejax.models.tree_flash.default_blocks` of the head size)."""
    impl = resolve_impl(attention_impl)
    if impl == "xla":
        mask = tree_mask(node_lo_BxL, node_hi_BxL)
        return lambda q, k, v: attention(q, k, v, mask)
    interpret = jax.default_backend() != "gpu"
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return tree_flash.make_attention(node_lo_BxL, node_hi_BxL, blocks, interpret=interpret)
    return _per_shard(node_lo_BxL, node_hi_BxL, mesh, interpret, blocks)


def _per_shard(node_lo_BxL, node_hi_BxL, mesh, interpret: bool, blocks):
    """The Pallas tree attention inside ``jax.shard_map`` over rows and heads of the context ``mesh``."""
    lo = node_lo_BxL.astype(jnp.int32)
    hi = node_hi_BxL.astype(jnp.int32)

    def attend(q, k, v):
        rows, heads = rows_and_heads(mesh, lo.shape[0], q.shape[2], k.shape[2])
        qkv, pos = P(rows, None, heads, None), P(rows, None)
        tiles = blocks or tree_flash.default_blocks(q.shape[-1], q.shape[1])
        fn = lambda q, k, v, lo, hi: tree_flash.tree_flash_attention(  # noqa: E731
            q, k, v, lo, hi, tiles, interpret)
        return jax.shard_map(fn, in_specs=(qkv, qkv, qkv, pos, pos), out_specs=qkv, check_vma=False)(q, k, v, lo, hi)

    return attend
