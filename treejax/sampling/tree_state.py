"""The tree rollout's dynamic state as typed pytrees (the loop carry of :mod:`treejax.sampling.tree`).

``P`` prompts x ``W`` leaves live in ``R = P * W`` cache rows (prompt ``p`` owns rows ``p*W .. p*W+W-1``) and in
``R`` leaf slots (prompt ``p``'s ``w``-th leaf is slot ``p*W + w``). ``T = D * S`` tokens per path, ``D1 = D + 1``
path entries (node id at depth ``d``, ``-1`` past the path's end), ``N`` nodes per prompt, ``K`` top-k log-probs
per token (0 unless a branching rule asks for them).

  * :class:`Paths`    per-path buffers (tokens, log-probs, statistics, node path, length), leading axis ``R``:
                      the same layout for the path decoding in a row and for a stored leaf, so storing a leaf is
                      one scatter (:meth:`Paths.put`) and re-entering from a leaf one gather (:meth:`Paths.take`);
  * :class:`Rows`     the path each cache row decodes (its :class:`Paths` plus the row protocol of
                      :mod:`treejax.sampling.decode`: pending token, position, key epoch, live flag, depth);
  * :class:`Leaves`   the leaf store (:class:`Paths` plus status and the row still holding the leaf's KV);
  * :class:`Nodes`    the forest's node arrays and per-prompt counters of nodes and leaves;
  * :class:`Counters` scalar counters reported next to the forest;
  * :class:`TreeState` all of the above plus the KV cache: the ``lax.while_loop`` carry over segments.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from flax import struct

from treejax.forest import NodeStatus


def _take(tree, src_R: jax.Array):
    return jax.tree.map(lambda x: jnp.take(x, src_R, axis=0), tree)


@struct.dataclass
class Paths:
    """Per-path buffers, leading axis ``R`` (rows or leaf slots).

    ``tokens_RxT`` sampled ids; ``logp_RxT`` policy log-probs (temperature 1); ``slogp_RxT`` sampling log-probs;
    ``entropy_RxT`` policy entropy per token (zeros unless asked for); ``topk_RxTxK`` the policy's ``K`` largest
    log-probs per token, descending (``K = 0`` unless a branching rule asks); ``extra_RxTxC`` the rule's
    per-token statistics (:mod:`treejax.sampling.token_stats`, ``C = len(rule.token_stats)``, usually 0);
    ``path_RxD1`` node id per depth; ``length_R`` response tokens so far. Entries at ``t >= length`` are 0.
    """

    tokens_RxT: jax.Array
    logp_RxT: jax.Array
    slogp_RxT: jax.Array
    entropy_RxT: jax.Array
    topk_RxTxK: jax.Array
    path_RxD1: jax.Array
    length_R: jax.Array
    extra_RxTxC: jax.Array

    @classmethod
    def empty(cls, R: int, T: int, D: int, K: int, root: bool, C: int = 0) -> Paths:
        """Zero buffers; ``path`` is ``-1`` everywhere except the root (node 0 at depth 0) when ``root``."""
        f32 = jnp.zeros((R, T), jnp.float32)
        path = jnp.full((R, D + 1), -1, jnp.int32)
        return cls(tokens_RxT=jnp.zeros((R, T), jnp.int32), logp_RxT=f32, slogp_RxT=f32, entropy_RxT=f32,
                   topk_RxTxK=jnp.zeros((R, T, K), jnp.float32),
                   path_RxD1=path.at[:, 0].set(0) if root else path, length_R=jnp.zeros((R,), jnp.int32),
                   extra_RxTxC=jnp.zeros((R, T, C), jnp.float32))

    def take(self, src_R: jax.Array) -> Paths:
        """Entry ``r`` of the result is entry ``src_R[r]`` of ``self`` (a gather along the leading axis)."""
        return _take(self, src_R)

    def put(self, dst_R: jax.Array, other: Paths) -> Paths:
        """``self`` with entry ``dst_R[r]`` replaced by ``other``'s entry ``r``; ``dst_R[r] = R`` drops it."""
        return jax.tree.map(lambda a, b: a.at[dst_R].set(b, mode="drop"), self, other)


@struct.dataclass
class Rows:
    """The path decoding in each cache row (leading axis ``R``).

    ``pending_R`` the last token (its KV not yet cached) and ``position_R`` its position (decode protocol);
    ``epoch_R`` how many times the row was handed to a new path (its sampling-key epoch); ``alive_R`` the row
    decodes in the next segment; ``depth_R`` the path's depth (segments decoded); ``slots_R`` the leaf slots the
    path holds (slot trees: it is stored that many times when it ends; 1 under ``"transfer"``); ``paths`` its
    buffers.
    """

    pending_R: jax.Array
    position_R: jax.Array
    epoch_R: jax.Array
    alive_R: jax.Array
    depth_R: jax.Array
    slots_R: jax.Array
    paths: Paths

    def take(self, src_R: jax.Array) -> Rows:
        """Row ``r`` of the result is row ``src_R[r]`` (a fork copies a parent's row state)."""
        return _take(self, src_R)

    def put(self, dst_R: jax.Array, other: Rows) -> Rows:
        """``self`` with rows ``dst_R`` replaced by ``other`` (merging a row subset back)."""
        return jax.tree.map(lambda a, b: a.at[dst_R].set(b), self, other)


@struct.dataclass
class Leaves:
    """The leaf store (slot ``p*W + w`` = prompt ``p``'s ``w``-th leaf, in the order leaves ended).

    ``status_R`` a :class:`NodeStatus`; ``row_R`` the cache row that still holds the leaf's KV (``-1`` once a
    live path decodes in that row): fallbacks re-enter only from resident leaves. A slot tree stores a path
    that ends holding ``n`` slots in ``n`` consecutive leaf slots (the same path repeated).
    """

    paths: Paths
    status_R: jax.Array
    row_R: jax.Array


@struct.dataclass
class Nodes:
    """Per-prompt node arrays of the forest and per-prompt counts.

    ``parent_PxN``, ``depth_PxN``, ``status_PxN`` (see :class:`treejax.forest.Forest`); ``next_P`` the next free
    node id; ``leaves_P`` leaves stored so far (``F`` in the budget formula).
    """

    parent_PxN: jax.Array
    depth_PxN: jax.Array
    status_PxN: jax.Array
    next_P: jax.Array
    leaves_P: jax.Array

    @classmethod
    def root(cls, P: int, N: int) -> Nodes:
        i32 = jnp.int32
        return cls(parent_PxN=jnp.full((P, N), -1, i32), depth_PxN=jnp.full((P, N), -1, i32).at[:, 0].set(0),
                   status_PxN=jnp.zeros((P, N), i32).at[:, 0].set(int(NodeStatus.ALIVE)),
                   next_P=jnp.ones((P,), i32), leaves_P=jnp.zeros((P,), i32))


@struct.dataclass
class Counters:
    """Scalar counters: ``segment`` loop iterations, ``decoded`` sampled tokens, ``forks`` rows copied at branch
    points, ``fallbacks`` / ``from_root`` fallback events (from the root: no resident leaf), ``root_restarts``
    new paths a rule started at the root instead of forking them (ROSE's epsilon-root), ``stops_K`` leaves per
    :class:`NodeStatus` code."""

    segment: jax.Array
    decoded: jax.Array
    forks: jax.Array
    fallbacks: jax.Array
    from_root: jax.Array
    stops_K: jax.Array
    root_restarts: jax.Array

    @classmethod
    def zeros(cls) -> Counters:
        z = jnp.int32(0)
        return cls(segment=z, decoded=z, forks=z, fallbacks=z, from_root=z,
                   stops_K=jnp.zeros((len(NodeStatus),), jnp.int32), root_restarts=z)


@struct.dataclass
class TreeState:
    """The segment loop's carry: the KV cache (rows in logical order) and the groups above."""

    cache: object
    rows: Rows
    leaves: Leaves
    nodes: Nodes
    counters: Counters


def shard_state(model, state: TreeState) -> TreeState:
    """Per-row arrays (rows and leaf slots) constrained like the cache rows on ``model.mesh`` (identity without
    one); per-prompt and scalar arrays are left alone."""
    return state.replace(rows=model.shard_rows(state.rows), leaves=model.shard_rows(state.leaves))


@struct.dataclass
class RolloutInfo:
    """What one tree rollout did (the second output of ``make_tree_rollout``'s ``rollout``), as device arrays.

    Scalars: ``decoded_tokens`` (sampled tokens, each shared prefix once), ``prefilled_tokens``, ``forks`` (rows
    copied at branch points; root restarts included), ``fallbacks`` / ``fallback_from_root`` (fallback events;
    from the root: no resident leaf), ``root_restarts`` (new paths started at the root by the rule, e.g. ROSE's
    epsilon-root), ``segments`` (loop rounds), ``complete`` (every prompt has ``W`` leaves). ``stops_K``: leaves per
    :class:`NodeStatus` code (:attr:`stops` by name). Per prompt: ``num_nodes_P``, ``init_divergence_P``. Per leaf
    token ``[P, W, T]`` (0 past a leaf's end): ``sampling_logprobs_PxWxT`` (log q under the sampling strategy, e.g.
    after top-p) and ``entropy_PxWxT`` (of the policy at temperature 1; zeros unless ``TreeConfig.with_entropy`` or
    the branching rule needs it). With continuations (``make_tree_rollout(..., continuations=...)``):
    ``continuations`` (:class:`~treejax.sampling.continuation.Continuations`) and ``continuation_tokens`` (their
    decoded tokens, also counted in ``decoded_tokens``); else ``None`` and 0."""

    decoded_tokens: jax.Array
    prefilled_tokens: jax.Array
    forks: jax.Array
    fallbacks: jax.Array
    fallback_from_root: jax.Array
    segments: jax.Array
    stops_K: jax.Array
    complete: jax.Array
    root_restarts: jax.Array
    num_nodes_P: jax.Array
    init_divergence_P: jax.Array
    sampling_logprobs_PxWxT: jax.Array
    entropy_PxWxT: jax.Array
    continuation_tokens: jax.Array | int = 0
    continuations: Any = None

    @property
    def stops(self) -> dict[str, jax.Array]:
        """Leaves per end status, by :class:`NodeStatus` name."""
        return {name: self.stops_K[int(code)] for name, code in zip(NodeStatus.names(), NodeStatus)}

    def as_dict(self) -> dict:
        """The counters under the names the rollout's ``info`` dict had (``stops`` a dict by name)."""
        return dict(decoded_tokens=self.decoded_tokens, prefilled_tokens=self.prefilled_tokens, forks=self.forks,
                    fallbacks=self.fallbacks, fallback_from_root=self.fallback_from_root,
                    root_restarts=self.root_restarts, segments=self.segments,
                    stops=self.stops, complete=self.complete, num_nodes=self.num_nodes_P,
                    init_divergence=self.init_divergence_P, sampling_logprobs=self.sampling_logprobs_PxWxT,
                    entropy=self.entropy_PxWxT)
