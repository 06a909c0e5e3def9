"""Random valid rollout forests for tests and notebooks (host-side NumPy), plus a hypothesis strategy.

A random tree of W leaves and max depth D is grown top-down: the leaves under a node are split into random
non-empty blocks (its children); a node holding a single leaf may end there (an early stop) or continue as
a chain; at depth D every leaf ends. So every leaf's last node is its own, never an ancestor of another
leaf — as in TreePO's sampler. Node ids (1..) are shuffled so code can't rely on their order.
"""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from treejax.forest import Forest, NodeStatus, forest_from_paths, forest_from_spans

_LEAF_STATUSES = np.array(
    [NodeStatus.FINISHED, NodeStatus.EOS, NodeStatus.TRUNCATED, NodeStatus.REPETITION, NodeStatus.PRUNED], np.int32
)


def random_tree_paths(rng: np.random.Generator, num_leaves: int, max_depth: int, max_branch: int = 3,
                      stop_prob: float = 0.3) -> np.ndarray:
    """[W, D+1] leaf paths of one random tree (column 0 = root id 0, -1 past each leaf's end)."""
    paths = np.full((num_leaves, max_depth + 1), -1, np.int64)
    paths[:, 0] = 0
    next_id = [1]

    def grow(leaves: np.ndarray, depth: int):
        if depth == max_depth:
            return
        if len(leaves) == 1 and depth >= 1 and rng.random() < stop_prob:
            return  # early stop: the single leaf ends at this node
        if depth + 1 == max_depth:
            blocks = [leaves[i : i + 1] for i in range(len(leaves))]  # last level: one node per leaf
        else:
            k = int(rng.integers(1, min(max_branch, len(leaves)) + 1))
            labels = np.concatenate([np.arange(k), rng.integers(0, k, len(leaves) - k)])
            rng.shuffle(labels)
            blocks = [leaves[labels == b] for b in range(k)]
        for block in blocks:
            paths[block, depth + 1] = next_id[0]
            next_id[0] += 1
            grow(block, depth + 1)

    grow(np.arange(num_leaves), 0)
    num_nodes = next_id[0]
    perm = np.concatenate([[0], 1 + rng.permutation(num_nodes - 1)])
    return np.where(paths >= 0, perm[np.maximum(paths, 0)], -1)


def random_forest(rng: np.random.Generator, num_prompts: int, num_leaves: int, max_depth: int,
                  segment_length: int, max_branch: int = 3, stop_prob: float = 0.3, vocab_size: int = 50) -> Forest:
    """A valid :class:`Forest` of random trees, random lengths/statuses/tokens/log-probs.

    Node arrays are padded to the static capacity ``N = 1 + W * D`` (the most nodes W leaves of depth <= D can
    have), so every forest of the same (P, W, D, S) has the same shapes (one jit compilation)."""
    paths = np.stack([random_tree_paths(rng, num_leaves, max_depth, max_branch, stop_prob) for _ in range(num_prompts)])
    depth = np.sum(paths[:, :, 1:] >= 0, axis=-1)
    lengths = (depth - 1) * segment_length + rng.integers(1, segment_length + 1, depth.shape)
    status = rng.choice(_LEAF_STATUSES, size=depth.shape)
    t = max_depth * segment_length
    tokens = rng.integers(0, vocab_size, (num_prompts, num_leaves, t))
    logprobs = -rng.exponential(1.0, (num_prompts, num_leaves, t)).astype(np.float32)
    forest = forest_from_paths(paths, lengths, segment_length, status, tokens, logprobs)
    return pad_nodes(forest, 1 + num_leaves * max_depth)


def pad_nodes(forest: Forest, num_nodes: int) -> Forest:
    """Pads the node arrays to ``num_nodes`` slots (unused: parent -1, depth -1, status UNUSED)."""
    have = forest.node_parent.shape[1]
    if have > num_nodes:
        raise ValueError(f"forest has {have} node slots, more than the requested capacity {num_nodes}")
    pad = ((0, 0), (0, num_nodes - have))
    return forest.replace(
        node_parent=jnp.pad(forest.node_parent, pad, constant_values=-1),
        node_depth=jnp.pad(forest.node_depth, pad, constant_values=-1),
        node_status=jnp.pad(forest.node_status, pad, constant_values=int(NodeStatus.UNUSED)),
    )


def lay_out_nodes(paths, node_length, *node_arrays, width: int):
    """Per-leaf response arrays of a turn forest from per-node ones (host): ``node_arrays[i]`` ``[P, N, M]`` holds
    node n's values in its first ``node_length[p, n]`` columns; each returned ``[P, W, width]`` array has the nodes of
    leaf w's path (``paths [P, W, D+1]``, column 0 the root) end to end, zeros after. What
    :func:`treejax.forest.forest_from_spans` takes as ``tokens`` / ``logprobs`` / ``policy_mask``."""
    paths = np.asarray(paths)
    P, W, _ = paths.shape
    outs = [np.zeros((P, W, width), np.asarray(a).dtype) for a in node_arrays]
    for p in range(P):
        for w in range(W):
            pos = 0
            for n in paths[p, w, 1:]:
                if n < 0:
                    break
                k = int(node_length[p, n])
                for out, a in zip(outs, node_arrays):
                    out[p, w, pos:pos + k] = np.asarray(a)[p, n, :k]
                pos += k
    return outs


def two_small_trees():
    """Two small hand-built trees of 3 leaves and 4-token segments for packing tests: a node that ends a leaf and has
    children, a leaf inside its first segment, leaves sharing a node share its tokens; prompts of 5 and 3 tokens
    (the second right-padded). Returns ``(forest, prompts [2, 5], prompt_lengths [2])``."""
    paths = np.array([[[0, 1, 2], [0, 1, 3], [0, 4, -1]], [[0, 1, -1], [0, 2, -1], [0, 2, 3]]])
    lengths = np.array([[8, 7, 3], [4, 2, 6]])
    tok = np.random.RandomState(0).randint(3, 200, (2, 3, 8))
    tok[0, 1, :4] = tok[0, 0, :4]
    tok[1, 2, :4] = tok[1, 1, :4]
    forest = forest_from_paths(paths, lengths, 4, tokens=tok)
    return forest, np.array([[5, 6, 7, 8, 9], [1, 2, 3, 0, 0]]), np.array([5, 3])


def hand_turn_forest():
    """A small hand-built turn forest: one prompt, 4 slots: root -> n1 -> {n3 (w0), n4 (w1)}; root -> n2 -> n5 ->
    n6 (w2, w3: duplicate slots). Node lengths n1..n6 = 3, 2, 2, 1, 2, 2; observation tokens (policy_mask 0)
    inside n1, n2 and n5. Returns ``(paths [1, 4, 4], node_length [1, 7], tokens [1, 4, 8], policy_mask [1, 4, 8],
    forest)`` (:func:`treejax.forest.forest_from_spans`)."""
    from treejax.forest import forest_from_spans

    paths = np.array([[[0, 1, 3, -1], [0, 1, 4, -1], [0, 2, 5, 6], [0, 2, 5, 6]]])
    node_length = np.array([[0, 3, 2, 2, 1, 2, 2]])
    tok = np.zeros((1, 4, 8), np.int32)
    pm = np.zeros((1, 4, 8), np.float32)
    tok[0, 0, :5], pm[0, 0, :5] = [70, 71, 72, 73, 74], [1, 1, 0, 1, 1]
    tok[0, 1, :4], pm[0, 1, :4] = [70, 71, 72, 75], [1, 1, 0, 1]
    tok[0, 2, :6], pm[0, 2, :6] = [80, 81, 82, 83, 84, 85], [1, 0, 1, 0, 1, 1]
    tok[0, 3], pm[0, 3] = tok[0, 2], pm[0, 2]
    return paths, node_length, tok, pm, forest_from_spans(paths, node_length, tok, policy_mask=pm)


def random_rewards(rng: np.random.Generator, shape, kind: str) -> np.ndarray:
    """Rewards of a given ``kind``: "pm1" (+-1), "01", "grid" (multiples of 0.25 in [-1, 1], e.g. with an
    overlong penalty), "equal" (one value per prompt), "mixed" (a random choice of these per prompt),
    "uniform" (continuous in [-1, 1): every product and sum rounds, as with a learned reward model)."""
    p, w = shape
    if kind == "mixed":
        kinds = rng.choice(["pm1", "01", "grid", "equal"], size=p)
        return np.stack([random_rewards(rng, (1, w), k)[0] for k in kinds]).astype(np.float32)
    if kind == "pm1":
        return rng.choice([-1.0, 1.0], size=shape).astype(np.float32)
    if kind == "01":
        return rng.choice([0.0, 1.0], size=shape).astype(np.float32)
    if kind == "grid":
        return (rng.integers(-4, 5, size=shape) / 4.0).astype(np.float32)
    if kind == "uniform":
        return rng.uniform(-1.0, 1.0, size=shape).astype(np.float32)
    if kind == "equal":
        return np.repeat(rng.choice([-1.0, 0.0, 0.3, 1.0], size=(p, 1)), w, axis=1).astype(np.float32)
    raise ValueError(f"unknown reward kind {kind!r}; valid: pm1, 01, grid, equal, mixed, uniform")


def with_copies(rng: np.random.Generator, forest: Forest, rewards_PxW: np.ndarray, copy_prob: float):
    """A slot tree's duplicates: each leaf ``w >= 1`` becomes, with probability ``copy_prob``, a copy of leaf
    ``w - 1`` (path, length, status, tokens, log-probs and reward). Nodes only the overwritten leaves used are
    dropped (their ids stay unused); node arrays keep the capacity ``1 + W * D``."""
    P, W = forest.leaf_path.shape[:2]
    arrays = {k: np.asarray(getattr(forest, k)).copy() for k in ("leaf_path", "leaf_length", "leaf_status", "tokens",
                                                                  "logprobs")}
    rewards = np.asarray(rewards_PxW).copy()
    for p in range(P):
        for w in range(1, W):
            if rng.random() < copy_prob:
                for a in arrays.values():
                    a[p, w] = a[p, w - 1]
                rewards[p, w] = rewards[p, w - 1]
    out = forest_from_paths(arrays["leaf_path"], arrays["leaf_length"], forest.segment_length, arrays["leaf_status"],
                            arrays["tokens"], arrays["logprobs"])
    return pad_nodes(out, forest.node_parent.shape[1]), rewards


def forests(num_prompts: int, num_leaves: int, max_depth: int, segment_length: int, reward_kind: str = "mixed",
            copies: bool = False):
    """Hypothesis strategy of ``(forest, rewards_PxW)`` with fixed shapes (so one compiled function serves
    every example) and random structure: branchings, depths, early stops, lengths, rewards; ``copies``: leaves
    repeated as a slot tree stores them (:func:`with_copies`)."""
    from hypothesis import strategies as st

    @st.composite
    def _strategy(draw):
        seed = draw(st.integers(0, 2**32 - 1))
        max_branch = draw(st.integers(1, 4))
        stop_prob = draw(st.sampled_from([0.0, 0.3, 0.7]))
        rng = np.random.default_rng(seed)
        forest = random_forest(rng, num_prompts, num_leaves, max_depth, segment_length, max_branch, stop_prob)
        rewards = random_rewards(rng, (num_prompts, num_leaves), reward_kind)
        if copies:
            return with_copies(rng, forest, rewards, draw(st.sampled_from([0.3, 0.6])))
        return forest, rewards

    return _strategy()


def slot_turn_forest(slot_turns: list[list[list[bool]]], T: int | None = None, D: int | None = None) -> Forest:
    """A turn forest of independent slots: ``slot_turns[p][w]`` lists each turn's "has an observation"; a turn is
    one action token, then one observation token when it has one; ``D`` turns at most (default: the longest)."""
    P, W = len(slot_turns), len(slot_turns[0])
    D = D or max(len(t) for s in slot_turns for t in s)
    T = T or max(sum(1 + o for o in t) for s in slot_turns for t in s)
    paths = np.full((P, W, D + 1), -1, np.int32)
    length = np.zeros((P, 1 + W * D), np.int32)
    tok = np.zeros((P, W, T), np.int32)
    pm = np.zeros((P, W, T), np.float32)
    for p in range(P):
        n = 0
        for w, turns in enumerate(slot_turns[p]):
            paths[p, w, 0], i = 0, 0
            for d, obs in enumerate(turns):
                n += 1
                paths[p, w, d + 1], length[p, n] = n, 1 + obs
                tok[p, w, i], pm[p, w, i] = 1 + d, 1.0
                if obs:
                    tok[p, w, i + 1] = 9
                i += 1 + obs
    return forest_from_spans(paths, length, tok, policy_mask=pm)
