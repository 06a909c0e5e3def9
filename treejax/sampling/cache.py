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

Shared-prefix layout (:class:`SharedPrefixCache`, ``TreeConfig.prefix_cache = "shared"``): the ``W`` rows of a
prompt decode from the same prompt, so the prompt's KV (its first ``n_p = len_p - 1`` tokens, what
``decode.prefill_prompts`` writes) is stored ONCE per prompt, per layer ``[P, K, Lpre, H]``, and each row keeps
only its own suffix (the pending last prompt token and the response), per layer ``[R, K, Ls, H]``: row ``r``'s
token at position ``t`` sits in suffix slot ``t - n_{p(r)}``. The row leaves ``row_prompt`` (which prompt's
prefix a row reads) and ``row_rank`` (a rank unique among the rows of that prompt in one decode batch, used to
group queries by prompt: :func:`treejax.sampling.attention.cascade_decode_attention`) travel with the rows
through every row operation (:func:`map_rows`); the prefix part never does. Any code that maps a function over
cache rows must go through :func:`map_rows` (or :func:`fork_rows`), which passes the prefix through untouched.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import struct
from jax import lax

from treejax.models import transformer
from treejax.models.config import ModelConfig
from treejax.parallel.axis_rules import DEFAULT_RULES, Rules
from treejax.parallel.mesh import with_logical_constraint

#: Logical axis names of each per-layer cache buffer (``cache_batch, cache_kv_heads, cache_length, cache_head_dim``).
CACHE_LOGICAL_AXES = transformer.ACTIVATION_AXES["cache"]


@struct.dataclass
class SharedPrefixCache:
    """A KV cache whose prompt part is stored once per prompt (module docstring).

    ``rows``: the row leaves, row axis first: ``"k"``, ``"v"`` (tuples of per-layer suffix buffers
    ``[R, K, Ls, H]``), ``"row_prompt"`` ``int32[R]``, ``"row_rank"`` ``int32[R]`` (``< rows_per_prompt``).
    ``prefix``: per prompt: ``"k"``, ``"v"`` (tuples of per-layer ``[P, K, Lpre, H]``) and ``"length"``
    ``int32[P]`` (``n_p``: prefix tokens, = the prompt length - 1 after prefill). ``rows_per_prompt`` (static):
    ``W``, the bound on the rows of one prompt in a decode batch (the width of the query grouping).
    Positions ``>= dead_position`` (``Lpre + Ls``) mark dead rows (writes dropped, as in the per-row layout).
    """

    rows: dict
    prefix: dict
    rows_per_prompt: int = struct.field(pytree_node=False)

    @property
    def row_prompt(self) -> jax.Array:
        return self.rows["row_prompt"]

    @property
    def row_rank(self) -> jax.Array:
        return self.rows["row_rank"]

    @property
    def prefix_length(self) -> jax.Array:
        return self.prefix["length"]

    @property
    def suffix_length(self) -> int:
        return self.rows["k"][0].shape[2]

    @property
    def prefix_capacity(self) -> int:
        return self.prefix["k"][0].shape[2]

    def suffix_kv(self) -> dict:
        """The per-row suffix buffers as a plain cache ``{"k": (...), "v": (...)}``."""
        return {"k": self.rows["k"], "v": self.rows["v"]}

    def prefix_kv(self) -> dict:
        """The per-prompt prefix buffers as a plain cache ``{"k": (...), "v": (...)}`` (``P`` rows)."""
        return {"k": self.prefix["k"], "v": self.prefix["v"]}

    def with_suffix_kv(self, kv: dict) -> SharedPrefixCache:
        return self.replace(rows=dict(self.rows, k=kv["k"], v=kv["v"]))

    def with_prefix_kv(self, kv: dict, length_P: jax.Array) -> SharedPrefixCache:
        return self.replace(prefix=dict(self.prefix, k=kv["k"], v=kv["v"], length=length_P.astype(jnp.int32)))


def is_shared(cache) -> bool:
    """Whether ``cache`` is a :class:`SharedPrefixCache` (static: a Python type check)."""
    return isinstance(cache, SharedPrefixCache)


def init_shared_cache(config: ModelConfig, prompts: int, rows_per_prompt: int, prefix_length: int,
                      suffix_length: int, dtype=jnp.bfloat16) -> SharedPrefixCache:
    """Zeroed :class:`SharedPrefixCache`: ``P = prompts`` prefixes of ``prefix_length`` slots (length 0 until
    prefill) and ``R = P * W`` rows of ``suffix_length`` slots; row ``r`` reads prompt ``r // W`` with rank
    ``r % W`` (the tree sampler's logical row order)."""
    W = rows_per_prompt
    if min(prompts, W, prefix_length, suffix_length) <= 0:
        raise ValueError(f"shared cache sizes must be positive, got prompts={prompts}, rows_per_prompt={W}, "
                         f"prefix_length={prefix_length}, suffix_length={suffix_length}")
    R = prompts * W
    suffix = transformer.init_cache(config, R, suffix_length, dtype)
    prefix = transformer.init_cache(config, prompts, prefix_length, dtype)
    r = jnp.arange(R, dtype=jnp.int32)
    return SharedPrefixCache(rows=dict(suffix, row_prompt=r // W, row_rank=r % W),
                             prefix=dict(prefix, length=jnp.zeros((prompts,), jnp.int32)), rows_per_prompt=W)


def dead_position(cache) -> int:
    """A position that marks a dead row for ``cache`` (its KV write is dropped, attention ignores it): the slot
    count ``L`` of a per-row cache (slot axis 2 of its first leaf), ``Lpre + Ls`` of a shared one (every row's
    suffix slot ``t - n_p`` is then ``>= Ls``)."""
    if is_shared(cache):
        return cache.prefix_capacity + cache.suffix_length
    return jax.tree.leaves(cache)[0].shape[2]


def map_rows(fn, cache, *others):
    """``fn`` applied to every row leaf of ``cache`` (zipped with the same leaves of ``others``, caches of the same
    structure), row axis first; a shared cache's prefix is passed through (taken from ``cache``). Every row
    operation on a cache (gather, permutation, slice, merge) goes through here."""
    if is_shared(cache):
        return cache.replace(rows=jax.tree.map(fn, cache.rows, *(o.rows for o in others)))
    return jax.tree.map(fn, cache, *others)


def renumber_rows(cache, rank_R: jax.Array):
    """A shared cache whose rows get the ranks ``rank_R`` (e.g. after forks copied a parent's rank into its
    children; ranks must be unique among the rows of a prompt in a decode batch); a per-row cache unchanged."""
    if is_shared(cache):
        return cache.replace(rows=dict(cache.rows, row_rank=rank_R.astype(jnp.int32)))
    return cache


def per_row_rows(cache, src_M: jax.Array):
    """Rows ``src_M`` of ``cache`` as a plain per-row cache (``{"k", "v"}``, slot ``t`` = position ``t``).

    A per-row cache: a row gather. A shared cache: each row's prefix and suffix are concatenated into
    ``Lpre + Ls`` slots: slot ``t < n_p`` from prompt ``p``'s prefix slot ``t``, slot ``t >= n_p`` from the row's
    suffix slot ``t - n_p`` (slots past ``n_p + Ls`` are zero). Used where rows are duplicated more than ``W``
    times per prompt (the continuations' work cache), so the prefix is copied per row there, as today."""
    if not is_shared(cache):
        return jax.tree.map(lambda x: jnp.take(x, src_M, axis=0), cache)
    Lp, Ls = cache.prefix_capacity, cache.suffix_length
    p_M = cache.row_prompt[src_M]
    n_M = cache.prefix_length[p_M]
    t = jnp.arange(Lp + Ls, dtype=jnp.int32)[None, :]
    from_prefix = (t < n_M[:, None])[:, None, :, None]
    j = t - n_M[:, None]
    in_suffix = ((j >= 0) & (j < Ls))[:, None, :, None]
    j_idx = jnp.clip(j, 0, Ls - 1)[:, None, :, None]

    def expand(pre_PxKxLpxH, suf_RxKxLsxH):
        pre = jnp.pad(jnp.take(pre_PxKxLpxH, p_M, axis=0), ((0, 0), (0, 0), (0, Ls), (0, 0)))
        suf = jnp.take_along_axis(jnp.take(suf_RxKxLsxH, src_M, axis=0), j_idx, axis=2)
        return jnp.where(from_prefix, pre, jnp.where(in_suffix, suf, jnp.zeros((), suf.dtype)))

    return {name: tuple(expand(pre, suf) for pre, suf in zip(cache.prefix[name], cache.rows[name]))
            for name in ("k", "v")}


def init_kv_cache(config: ModelConfig, rows: int, length: int, dtype=jnp.bfloat16) -> dict:
    """Zeroed cache of ``rows x length`` slots (see :func:`treejax.models.transformer.init_cache`)."""
    if rows <= 0 or length <= 0:
        raise ValueError(f"cache rows and length must be positive, got rows={rows}, length={length}")
    return transformer.init_cache(config, rows, length, dtype)


def shard_cache(cache, mesh, rules: Rules = DEFAULT_RULES):
    """Constrains every cache leaf to its sharding on ``mesh`` (inside ``jit``): rank-4 leaves (the transformer's
    ``[R, K, L, H]`` buffers) by :data:`CACHE_LOGICAL_AXES`, any other leaf (e.g. a toy policy's cache) by its
    row axis 0 only. Non-dividing mesh axes are dropped per dimension (replicated). A :class:`SharedPrefixCache`
    takes the same rules leaf by leaf: suffix buffers and ``row_prompt`` / ``row_rank`` over rows, the prefix
    buffers ``[P, K, Lpre, H]`` with prompts on the row axes and KV heads over ``tensor``, ``length [P]`` over
    prompts."""

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

    One gather per row leaf along the row axis (axis 0; :func:`map_rows`: a shared cache's prefix is not
    touched, and its ``row_prompt`` / ``row_rank`` travel with the rows, so a caller that duplicates rows must
    give the copies fresh ranks, :func:`renumber_rows`). ``any_copy`` (bool scalar) skips the gather when no
    row changes (the common case deep in a tree that has stopped branching).
    """

    def gather(c):
        return map_rows(lambda x: jnp.take(x, src_R, axis=0), c)

    if any_copy is None:
        return gather(cache)
    return lax.cond(any_copy, gather, lambda c: c, cache)


def broadcast_prompt_rows(cache, src_R: jax.Array):
    """Same as :func:`fork_rows` without the skip: used once after prefill to copy each prompt's KV into all of
    its rows."""
    return fork_rows(cache, src_R)
