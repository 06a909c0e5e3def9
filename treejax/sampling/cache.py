"""KV-cache pytree of static capacity for the sampler, and row forking.

The cache is ``{"k": (k_0, ..., k_{layers-1}), "v": (...)}``: one ``[R, K, L, H]`` buffer per layer (bf16 by
default; logical axes :data:`CACHE_LOGICAL_AXES`, mapped onto the mesh by ``treejax.parallel``): ``R`` rows (one
per live path / sample) by ``L`` slots, slot ``t`` holding the key/value of the token at RoPE position ``t``. Any
pytree whose leaves carry the row axis at position 0 (and the slot axis at 2) works with :func:`fork_rows` (the
scripted toy policies of the tests use that).

Sharding (when the sampler is given a mesh: ``make_model_fns(config, mesh=...)`` or the ``mesh`` argument of
``make_tree_rollout`` / ``generate``): every per-layer buffer is constrained (``jax.lax.with_sharding_constraint``,
:func:`shard_cache`) to ``CACHE_LOGICAL_AXES`` through the rules table: with the default rules rows over
``(data, fsdp)``, KV heads over ``tensor``, slots and head_dim replicated. A dimension the mesh axes do not divide
(e.g. 2 KV heads on ``tensor=4``, or a row bucket smaller than ``data * fsdp``) is replicated on that axis
(``treejax.parallel.mesh.logical_to_spec``). The samplers re-apply the constraint wherever the cache is rebuilt
(creation, prefill, every decode step, prompt broadcast, row forks/permutations), so XLA keeps it sharded
through the loops; the per-row sampler state (pending tokens, positions, response buffers) is sharded over rows
the same way (:func:`shard_rows`). Without a mesh nothing is constrained (the programs are unchanged).

Forking a branch is a row copy: child row ``r`` takes parent row ``src[r]``'s whole cache row (the parent's
prefix is then exactly the child's prefix; slots past the fork point are overwritten as the child decodes
and are masked out until then). Nothing is ever re-prefilled.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax

from treejax.models import transformer
from treejax.models.config import ModelConfig
from treejax.parallel.axis_rules import DEFAULT_RULES, Rules
from treejax.parallel.mesh import with_logical_constraint

#: Logical axis names of each per-layer cache buffer (``cache_batch, cache_kv_heads, cache_length, cache_head_dim``).
CACHE_LOGICAL_AXES = transformer.ACTIVATION_AXES["cache"]


def init_kv_cache(config: ModelConfig, rows: int, length: int, dtype=jnp.bfloat16) -> dict:
    """Zeroed cache of ``rows x length`` slots (see :func:`treejax.models.transformer.init_cache`)."""
    if rows <= 0 or length <= 0:
        raise ValueError(f"cache rows and length must be positive, got rows={rows}, length={length}")
    return transformer.init_cache(config, rows, length, dtype)


def shard_cache(cache, mesh, rules: Rules = DEFAULT_RULES):
    """Constrains every cache leaf to its sharding on ``mesh`` (inside ``jit``): rank-4 leaves (the transformer's
    ``[R, K, L, H]`` buffers) by :data:`CACHE_LOGICAL_AXES`, any other leaf (e.g. a toy policy's cache) by its
    row axis 0 only. Non-dividing mesh axes are dropped per dimension (replicated)."""

    def one(x):
        axes = CACHE_LOGICAL_AXES if x.ndim == 4 else ("cache_batch",) + (None,) * (x.ndim - 1)
        return with_logical_constraint(x, axes, mesh, rules)

    return jax.tree.map(one, cache)


def shard_rows(tree, mesh, rules: Rules = DEFAULT_RULES):
    """Constrains every array of ``tree`` (each with the row axis at position 0) to be sharded over rows like the
    cache rows (logical ``cache_batch``), other axes replicated."""
    return jax.tree.map(lambda x: with_logical_constraint(x, ("cache_batch",) + (None,) * (x.ndim - 1), mesh, rules),
                        tree)


def fork_rows(cache, src_R: jax.Array, any_copy: jax.Array | None = None):
    """Row ``r`` of the result is row ``src_R[r]`` of ``cache`` (identity where ``src_R[r] == r``).

    One gather per cache leaf along the row axis (axis 0). ``any_copy`` (bool scalar) skips the gather when no
    row changes (the common case deep in a tree that has stopped branching).
    """

    def gather(c):
        return jax.tree.map(lambda x: jnp.take(x, src_R, axis=0), c)

    if any_copy is None:
        return gather(cache)
    return lax.cond(any_copy, gather, lambda c: c, cache)


def broadcast_prompt_rows(cache, src_R: jax.Array):
    """Same as :func:`fork_rows` without the skip: used once after prefill to copy each prompt's KV into all of
    its rows."""
    return fork_rows(cache, src_R)
