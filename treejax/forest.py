"""The rollout forest as fixed-capacity arrays: the one data model the sampler, estimators and trainer share.

A *forest* holds, for each of ``P`` prompts, a tree of fixed-length segments whose ``W`` leaves are the
prompt's rollouts. Python node objects don't jit, so the tree is stored as arrays of static capacity:

Node arrays, per prompt ``p`` (``N`` node slots, node ``0`` is the root = the prompt itself, depth 0):
  * ``node_parent[p, n]``  parent node id, ``-1`` for the root and for unused slots;
  * ``node_depth[p, n]``   0 for the root, ``k`` for the node holding segment ``k`` (1-based), ``-1`` if unused;
  * ``node_status[p, n]``  a :class:`NodeStatus` code.

Leaf arrays, per prompt ``p`` and leaf ``w`` (exactly ``W`` leaves per prompt, always):
  * ``leaf_path[p, w, d]``  node id at depth ``d`` on leaf ``w``'s path, ``d = 0..D`` (column 0 is the
    root, id 0); ``-1`` past the leaf's last segment. Leaves that share ``leaf_path[p, :, d]`` form the
    *subgroup* of that node.
  * ``leaf_status[p, w]``   a :class:`NodeStatus` code: why the leaf ended.
  * ``leaf_length[p, w]``   number of response tokens of the leaf.
  * ``leaf_weight[p, w]``   the leaf's share of the prompt's sample, times ``W`` (so ``1`` for every leaf of a
    sample that counts leaves equally): what an unbiased estimate of an expectation under the policy weights
    the leaf by. Slot trees (``TreeConfig.allocation = "slots"``) and independent samples: ``1`` for every
    leaf (a path that holds ``n`` slots is stored ``n`` times, so plain means over the ``W`` leaves are
    already the policy's expectation). TreePO's ``"transfer"`` allocation: ``W m(l)`` with the path mass
    ``m(l) = prod over the ancestors v of l of 1 / c(v)`` (``c(v)``: v's number of children; see
    :func:`path_mass`), ``0`` for unused leaf slots. ``None`` means all ones.

A tree whose node child counts are fixed before the children are drawn (they may depend on anything decoded so
far) and that never gives a node children after its subtree has ended (no fallback re-entry) is an unbiased
sample when its leaves are weighted by ``leaf_weight``; leaves counted equally (TreePO's estimators) are not.

Per-token arrays, per prompt, leaf and response position ``t = 0..T-1`` with ``T = D * S``:
  * ``tokens[p, w, t]``      sampled token ids (0 past ``leaf_length``, whatever the tokenizer's pad id);
  * ``logprobs[p, w, t]``    log pi(token | prefix) under the policy at temperature 1 (0 past the end);
  * ``segment_index[p, w, t]`` the 0-based segment (depth - 1) that token ``t`` belongs to, ``t // S``,
    ``-1`` past the end;
  * ``loss_mask[p, w, t]``   1.0 where the token is an action the loss trains on, else 0.0.

Segments have a fixed length ``S``: token ``t`` of a response always sits in segment ``t // S``; only a
leaf's last segment may be shorter (EOS, answer, repetition or length stop inside it).

Nodes as token spans (multi-turn trees, :mod:`treejax.sampling.turn_tree`): a node need not hold ``S`` tokens.
  * ``node_span[p, n] = (start, length)``  the response tokens ``[start, start + length)`` of node ``n`` on every
    leaf through it (a node's span starts where its parent's ends: ``start = start(parent) + length(parent)``,
    the root is ``(0, 0)``); ``None`` means fixed segments, where node ``n`` at depth ``d`` starts at
    ``(d - 1) S`` (:meth:`Forest.spans` derives the lengths).
  * ``segment_index[p, w, t]`` is then the depth - 1 of the node holding token ``t`` (``t // S`` only for fixed
    segments), and :meth:`Forest.token_nodes` the node's id;
  * ``policy_mask[p, w, t]``  "who wrote it": 1.0 on tokens the policy sampled, 0.0 on tokens the environment
    wrote (observations, tool results); ``None`` means every token of the response was sampled. Observation
    tokens are in the KV and in the trainer's forward, but ``loss_mask`` is 0 on them (:func:`forest_from_spans`
    builds it so), so they never enter a loss.
"""

from __future__ import annotations

import enum

import jax
import jax.numpy as jnp
import numpy as np
from flax import struct


class NodeStatus(enum.IntEnum):
    """Status codes of nodes and leaves (stored as int32 in ``node_status`` / ``leaf_status``)."""

    UNUSED = 0
    ALIVE = 1  # decoding continues below this node
    FINISHED = 2  # ended with EOS after a task-recognized answer (e.g. a closed \\boxed{...})
    EOS = 3  # ended with EOS (or another stop token) without a recognized answer
    TRUNCATED = 4  # hit the maximum response length or the maximum depth
    REPETITION = 5  # stopped by the n-gram repetition detector
    PRUNED = 6  # cut by a pruning rule

    @classmethod
    def names(cls) -> list[str]:
        return [s.name.lower() for s in cls]


@struct.dataclass
class Forest:
    """Rollout forest of ``P`` prompts x ``W`` leaves (see module docstring for every field's meaning)."""

    node_parent: jax.Array  # [P, N] int32
    node_depth: jax.Array  # [P, N] int32
    node_status: jax.Array  # [P, N] int32
    leaf_path: jax.Array  # [P, W, D + 1] int32
    leaf_status: jax.Array  # [P, W] int32
    leaf_length: jax.Array  # [P, W] int32
    tokens: jax.Array  # [P, W, T] int32
    logprobs: jax.Array  # [P, W, T] float32
    segment_index: jax.Array  # [P, W, T] int32
    loss_mask: jax.Array  # [P, W, T] float32
    leaf_weight: jax.Array | None = None  # [P, W] float32, None = all ones
    segment_length: int = struct.field(pytree_node=False, default=1)
    node_span: jax.Array | None = None  # [P, N, 2] int32 (start, length); None = fixed segments of S tokens
    policy_mask: jax.Array | None = None  # [P, W, T] float32, 1 = sampled by the policy; None = all sampled

    @property
    def fixed_segments(self) -> bool:
        """True when every node holds ``S`` tokens (``t // S`` is the segment of token ``t``)."""
        return self.node_span is None

    def spans(self) -> jax.Array:
        """int32[P, N, 2]: each node's ``(start, length)`` in the response (:attr:`node_span`, or for fixed segments
        ``start = (depth - 1) S`` and the length the longest leaf through the node has there; ``(0, 0)`` for the
        root and unused slots)."""
        if self.node_span is not None:
            return self.node_span
        S = self.segment_length
        P, N = self.node_parent.shape
        start = jnp.where(self.node_depth >= 1, (self.node_depth - 1) * S, 0)
        d = jnp.arange(1, self.leaf_path.shape[2])[None, None, :]
        seg_len = jnp.clip(self.leaf_length[:, :, None] - (d - 1) * S, 0, S)  # [P, W, D]
        ids = self.leaf_path[:, :, 1:]
        length = jnp.zeros((P, N + 1), jnp.int32).at[
            jnp.arange(P)[:, None, None], jnp.where(ids >= 0, ids, N)].max(seg_len.astype(jnp.int32))[:, :N]
        return jnp.stack([start, length], axis=-1).astype(jnp.int32)

    def token_nodes(self) -> jax.Array:
        """int32[P, W, T]: the node holding each response token (``-1`` past the leaf's end)."""
        col = jnp.clip(self.segment_index + 1, 0, self.leaf_path.shape[2] - 1)
        node = jnp.take_along_axis(self.leaf_path, col, axis=-1)
        return jnp.where(self.segment_index >= 0, node, -1)

    def policy_tokens(self) -> jax.Array:
        """float32[P, W, T]: 1 on the response tokens the policy sampled (:attr:`policy_mask`, or every token)."""
        valid = (self.segment_index >= 0).astype(jnp.float32)
        return valid if self.policy_mask is None else valid * self.policy_mask

    @property
    def num_prompts(self) -> int:
        return self.leaf_path.shape[0]

    @property
    def num_leaves(self) -> int:
        return self.leaf_path.shape[1]

    @property
    def max_depth(self) -> int:
        return self.leaf_path.shape[2] - 1

    @property
    def max_response_length(self) -> int:
        return self.tokens.shape[2]

    def leaf_weights(self) -> jax.Array:
        """float32[P, W]: :attr:`leaf_weight`, or ones when it is ``None``."""
        if self.leaf_weight is None:
            return jnp.ones(self.leaf_path.shape[:2], jnp.float32)
        return self.leaf_weight

    def distinct_leaves(self) -> jax.Array:
        """bool[P, W]: the first leaf slot of each distinct leaf (a slot tree stores a path once per slot)."""
        return first_of_duplicates(self.leaf_path)

    def leaf_depth(self) -> jax.Array:
        """[P, W] number of segments on each leaf's path (the depth of its last node)."""
        return jnp.sum(self.leaf_path[:, :, 1:] >= 0, axis=-1).astype(jnp.int32)


def subgroup_masks(leaf_path: jax.Array) -> jax.Array:
    """[..., W, D+1] node paths -> [..., D+1, W, W] booleans: ``m[d, i, j]`` iff leaves i and j share their
    depth-``d`` node (and leaf i has one). Row ``i`` at depth ``d`` is leaf i's subgroup at that depth."""
    path = jnp.swapaxes(leaf_path, -1, -2)  # [..., D+1, W]
    same = path[..., :, :, None] == path[..., :, None, :]
    valid = (path >= 0)[..., :, :, None]
    return same & valid


def end_nodes(leaf_path: jax.Array) -> jax.Array:
    """int32[..., W]: the node each leaf ends at (its deepest path entry; ``-1`` for an unused leaf slot)."""
    depth = jnp.sum(leaf_path[..., 1:] >= 0, axis=-1)
    end = jnp.take_along_axis(leaf_path, depth[..., None], axis=-1)[..., 0]
    return jnp.where(leaf_path[..., 0] >= 0, end, -1)


def first_of_duplicates(leaf_path: jax.Array) -> jax.Array:
    """bool[..., W]: leaf slot ``w`` is used and no earlier slot ends at the same node (the first copy)."""
    end = end_nodes(leaf_path)
    W = end.shape[-1]
    earlier = jnp.tril(jnp.ones((W, W), bool), k=-1).reshape((1,) * (end.ndim - 1) + (W, W))  # [w, v]: v < w
    dup = jnp.any((end[..., :, None] == end[..., None, :]) & earlier, axis=-1)
    return (end >= 0) & ~dup


def path_mass(node_parent: jax.Array, leaf_path: jax.Array) -> jax.Array:
    """float32[P, W]: each leaf slot's share of the prompt's sample under the tree's allocation.

    ``m(l) = prod over the ancestors v of l's end node of 1 / c(v)`` (``c(v)``: v's number of children, from
    ``node_parent``), divided by the number of leaf slots that end at the same node (the copies of a slot
    tree's path share its mass); ``0`` for unused slots (``leaf_path[:, w, 0] < 0``). For a tree whose child
    counts are fixed before the children are drawn, ``sum_l m(l) f(l)`` is an unbiased estimate of ``E f``
    under the policy; the masses of a prompt sum to 1 when every path ended in a stored leaf.

    >>> import numpy as np
    >>> paths = np.array([[[0, 1, -1], [0, 2, 3], [0, 2, 4]]])  # node 1 stops early, node 2 splits in two
    >>> f = forest_from_paths(paths, np.array([[1, 2, 2]]), 1)
    >>> print(np.asarray(path_mass(f.node_parent, f.leaf_path)))
    [[0.5  0.25 0.25]]
    """
    node_parent = jnp.asarray(node_parent)
    leaf_path = jnp.asarray(leaf_path)
    P, N = node_parent.shape
    children = jnp.zeros((P, N + 1), jnp.float32).at[
        jnp.arange(P)[:, None], jnp.where(node_parent >= 0, node_parent, N)].add(1.0)[:, :N]
    depth = jnp.sum(leaf_path[:, :, 1:] >= 0, axis=-1)  # [P, W]
    anc = leaf_path[:, :, :-1]  # the node at depth d is an ancestor iff d < depth
    c = jnp.take_along_axis(children[:, None, :], jnp.maximum(anc, 0), axis=-1)  # [P, W, D]
    is_anc = jnp.arange(anc.shape[-1])[None, None, :] < depth[:, :, None]
    mass = jnp.prod(jnp.where(is_anc, 1.0 / jnp.maximum(c, 1.0), 1.0), axis=-1)
    end = end_nodes(leaf_path)
    copies = jnp.sum((end[:, :, None] == end[:, None, :]) & (end[:, None, :] >= 0), axis=-1)
    return jnp.where(end >= 0, mass / jnp.maximum(copies, 1), 0.0).astype(jnp.float32)


def forest_from_paths(
    leaf_path: np.ndarray,
    leaf_length: np.ndarray,
    segment_length: int,
    leaf_status: np.ndarray | None = None,
    tokens: np.ndarray | None = None,
    logprobs: np.ndarray | None = None,
    num_nodes: int | None = None,
) -> Forest:
    """Builds a consistent :class:`Forest` from node paths alone (host-side; for tests, notebooks, synthetic data).

    ``leaf_path``: [P, W, D+1] int, column 0 must be 0 (the root). Node parents/depths are derived from the
    paths; tokens default to zeros and log-probs to zeros. Leaves that end at the same node are copies of one
    path (a slot tree's duplicates). ``leaf_weight`` is ``W`` x :func:`path_mass`. ``leaf_length`` [P, W] must
    fit the path's depth:
    ``(depth - 1) * S < length <= depth * S``. ``num_nodes``: the node capacity ``N`` (default: the largest id + 1;
    a forest concatenated with a sampler's needs its ``N``).
    """
    leaf_path = np.asarray(leaf_path, np.int32)
    leaf_length = np.asarray(leaf_length, np.int32)
    if leaf_path.ndim != 3:
        raise ValueError(f"leaf_path must be [P, W, D+1], got shape {leaf_path.shape}")
    num_prompts, num_leaves, depth_plus_one = leaf_path.shape
    if not np.all(leaf_path[:, :, 0] == 0):
        raise ValueError("leaf_path[:, :, 0] must be 0 (every path starts at the root)")
    if num_nodes is None:
        num_nodes = int(leaf_path.max()) + 1
    elif num_nodes <= int(leaf_path.max()):
        raise ValueError(f"num_nodes={num_nodes} does not hold node id {int(leaf_path.max())}")
    parent = np.full((num_prompts, num_nodes), -1, np.int32)
    depth = np.full((num_prompts, num_nodes), -1, np.int32)
    status = np.zeros((num_prompts, num_nodes), np.int32)
    for p in range(num_prompts):
        depth[p, 0] = 0
        for w in range(num_leaves):
            for d in range(1, depth_plus_one):
                n = leaf_path[p, w, d]
                if n < 0:
                    if np.any(leaf_path[p, w, d:] >= 0):
                        raise ValueError(f"leaf_path[{p}, {w}] has a gap at depth {d}")
                    break
                prev = leaf_path[p, w, d - 1]
                if parent[p, n] not in (-1, prev) or depth[p, n] not in (-1, d):
                    raise ValueError(f"node {n} of prompt {p} has two parents or depths")
                parent[p, n], depth[p, n] = prev, d
    leaf_depth = np.sum(leaf_path[:, :, 1:] >= 0, axis=-1)
    S = segment_length
    if np.any(leaf_length > leaf_depth * S) or np.any(leaf_length <= (leaf_depth - 1) * S):
        raise ValueError("leaf_length must satisfy (depth - 1) * S < length <= depth * S")
    T = (depth_plus_one - 1) * S
    t = np.arange(T)
    valid = t[None, None, :] < leaf_length[:, :, None]
    if leaf_status is None:
        leaf_status = np.full((num_prompts, num_leaves), int(NodeStatus.EOS), np.int32)
    for p in range(num_prompts):
        for w in range(num_leaves):
            status[p, leaf_path[p, w, leaf_depth[p, w]]] = leaf_status[p, w]
    status[(depth >= 0) & (status == 0)] = int(NodeStatus.ALIVE)
    tokens = np.zeros((num_prompts, num_leaves, T), np.int32) if tokens is None else tokens
    logprobs = np.zeros((num_prompts, num_leaves, T), np.float32) if logprobs is None else logprobs
    return Forest(
        node_parent=jnp.asarray(parent),
        node_depth=jnp.asarray(depth),
        node_status=jnp.asarray(status),
        leaf_path=jnp.asarray(leaf_path),
        leaf_status=jnp.asarray(leaf_status, jnp.int32),
        leaf_length=jnp.asarray(leaf_length),
        tokens=jnp.asarray(np.where(valid, tokens, 0), jnp.int32),
        logprobs=jnp.asarray(np.where(valid, logprobs, 0.0), jnp.float32),
        segment_index=jnp.asarray(np.where(valid, t[None, None, :] // S, -1), jnp.int32),
        loss_mask=jnp.asarray(valid, jnp.float32),
        leaf_weight=num_leaves * path_mass(parent, leaf_path),
        segment_length=S,
    )


def forest_from_spans(
    leaf_path: np.ndarray,
    node_length: np.ndarray,
    tokens: np.ndarray,
    logprobs: np.ndarray | None = None,
    policy_mask: np.ndarray | None = None,
    leaf_status: np.ndarray | None = None,
    max_response_length: int | None = None,
    leaf_weight: np.ndarray | None = None,
) -> Forest:
    """A :class:`Forest` whose nodes are token spans of any length (turns; host-side).

    ``leaf_path`` [P, W, D+1] as in :func:`forest_from_paths` (column 0 the root; leaves ending at the same node
    are copies of one path); ``node_length`` [P, N] the number of response tokens of each node (>= 1 for every
    node on a path; the root's is ignored); ``tokens`` / ``logprobs`` / ``policy_mask`` [P, W, T'] the leaves'
    response arrays (T' >= the longest leaf; leaves through a node must agree on its tokens); ``policy_mask``
    (default all 1) is 1 on sampled tokens; ``leaf_status`` as in :func:`forest_from_paths`.
    ``max_response_length``: the ``T`` of the result (default: ``tokens``' last axis). ``leaf_weight``: default
    ``W`` x :func:`path_mass`.

    The result has ``node_span`` (``start`` = the sum of the ancestors' lengths), ``leaf_length`` = the sum of
    the path's lengths, ``segment_index`` = the depth - 1 of each token's node, ``loss_mask = policy_mask`` on the
    response (observation tokens never enter a loss) and ``segment_length`` = the longest node (only for
    capacity estimates: spans are read from ``node_span``).
    """
    leaf_path = np.asarray(leaf_path, np.int32)
    node_length = np.asarray(node_length, np.int64)
    P, W, D1 = leaf_path.shape
    N = node_length.shape[1]
    if node_length.shape[0] != P:
        raise ValueError(f"node_length must be [P={P}, N], got {node_length.shape}")
    tokens = np.asarray(tokens)
    T_in = tokens.shape[2]
    T = int(max_response_length or T_in)
    on_path = np.zeros((P, N), bool)
    for p in range(P):
        ids = leaf_path[p, :, 1:]
        on_path[p, ids[ids >= 0]] = True
    if np.any(on_path & (node_length < 1)):
        p, n = np.argwhere(on_path & (node_length < 1))[0]
        raise ValueError(f"node {n} of prompt {p} is on a path but has length {node_length[p, n]} (must be >= 1)")
    lens = np.where(leaf_path[:, :, 1:] >= 0,
                    np.take_along_axis(node_length[:, None, :], np.maximum(leaf_path[:, :, 1:], 0), axis=-1), 0)
    leaf_length = lens.sum(-1)
    if np.any(leaf_length > min(T, T_in)):
        raise ValueError(f"a leaf holds {int(leaf_length.max())} tokens, more than the response arrays' "
                         f"{min(T, T_in)}")
    base = forest_from_paths(leaf_path, np.maximum(leaf_path[:, :, 1:] >= 0, 0).sum(-1).clip(1), 1,
                             leaf_status=leaf_status, num_nodes=N)
    start, seg = _span_layout(leaf_path, lens, N, T)
    valid = seg >= 0
    k = min(T, T_in)  # the response columns read from the inputs
    toks = _fit_response(tokens, 0, np.int32, valid, k)
    _check_shared_tokens(leaf_path, seg, valid, toks)
    lp = _fit_response(np.zeros(tokens.shape, np.float32) if logprobs is None else logprobs, 0.0, np.float32, valid, k)
    pm = _fit_response(np.ones(tokens.shape, np.float32) if policy_mask is None else policy_mask, 0.0, np.float32,
                       valid, k)
    span = np.stack([start, np.where(on_path, node_length, 0)], -1).astype(np.int32)
    weight = base.leaf_weight if leaf_weight is None else jnp.asarray(leaf_weight, jnp.float32)
    return base.replace(leaf_length=jnp.asarray(leaf_length, jnp.int32), tokens=jnp.asarray(toks),
                        logprobs=jnp.asarray(lp), segment_index=jnp.asarray(seg), loss_mask=jnp.asarray(pm),
                        leaf_weight=weight, segment_length=int(max(node_length.max(), 1)),
                        node_span=jnp.asarray(span), policy_mask=jnp.asarray(pm))


def _span_layout(leaf_path: np.ndarray, lens: np.ndarray, N: int, T: int) -> tuple[np.ndarray, np.ndarray]:
    """``(start [P, N], seg [P, W, T])`` of a span forest: each node starts at the sum of its ancestors' lengths
    (``lens [P, W, D]``: the lengths of each leaf's path nodes), and each response token's ``seg`` is its node's
    depth - 1 (-1 past the leaf)."""
    P, W, D1 = leaf_path.shape
    start = np.zeros((P, N), np.int64)
    seg = np.full((P, W, T), -1, np.int32)
    ends = np.concatenate([np.zeros((P, W, 1), np.int64), np.cumsum(lens, -1)], -1)  # [P, W, D+1]
    for p in range(P):
        for w in range(W):
            for d in range(1, D1):
                n = leaf_path[p, w, d]
                if n < 0:
                    break
                start[p, n] = ends[p, w, d - 1]
                seg[p, w, ends[p, w, d - 1]:ends[p, w, d]] = d - 1
    return start, seg


def _fit_response(x, fill, dtype, valid: np.ndarray, k: int) -> np.ndarray:
    """``x [P, W, T']``'s first ``k`` columns in a ``[P, W, T]`` array like ``valid`` (padded with ``fill``),
    ``fill`` off ``valid``."""
    out = np.full(valid.shape, fill, dtype)
    out[:, :, :k] = np.asarray(x)[:, :, :k]
    return np.where(valid, out, fill).astype(dtype)


def _check_shared_tokens(leaf_path: np.ndarray, seg: np.ndarray, valid: np.ndarray, toks: np.ndarray) -> None:
    """Raises unless the leaves through each node agree on its tokens."""
    P, W = leaf_path.shape[:2]
    for p in range(P):  # leaves through a node agree on its tokens
        tn = np.where(valid[p], np.take_along_axis(leaf_path[p], np.maximum(seg[p] + 1, 0), axis=-1), -1)
        for n in np.unique(tn[tn > 0]):
            per_leaf = [toks[p, w][tn[w] == n] for w in range(W) if np.any(tn[w] == n)]
            if any(not np.array_equal(per_leaf[0], x) for x in per_leaf[1:]):
                raise ValueError(f"prompt {p}: leaves through node {n} disagree on its tokens")


def chain_forest(leaf_length: np.ndarray, segment_length: int, max_depth: int, num_nodes: int,
                 leaf_status: np.ndarray, tokens: np.ndarray, logprobs: np.ndarray) -> Forest:
    """The :class:`Forest` of independent chains (GRPO's samples; host arrays ``[P, W]`` / ``[P, W, T]``): leaf
    ``w`` of prompt ``p`` is a chain of ``ceil(length / S)`` nodes hanging from the root, numbered in leaf order,
    as the tree sampler numbers a tree that never branches. ``num_nodes``: the sampler's node capacity."""
    leaf_length = np.asarray(leaf_length, np.int32)
    if np.any(leaf_length < 1) or np.any(leaf_length > max_depth * segment_length):
        raise ValueError(f"chain_forest: leaf lengths must be in [1, {max_depth * segment_length}]")
    depth = -(-leaf_length // segment_length)
    P, W = leaf_length.shape
    first = 1 + np.concatenate([np.zeros((P, 1), np.int32), np.cumsum(depth, axis=1)[:, :-1]], axis=1)
    d = np.arange(1, max_depth + 1)[None, None, :]
    ids = np.where(d <= depth[:, :, None], first[:, :, None] + d - 1, -1)
    leaf_path = np.concatenate([np.zeros((P, W, 1), np.int32), ids], axis=-1).astype(np.int32)
    return forest_from_paths(leaf_path, leaf_length, segment_length, leaf_status=leaf_status, tokens=tokens,
                             logprobs=logprobs, num_nodes=num_nodes)
