"""One prompt's tree as a run of packed tokens (:func:`build_tree`), the unit :mod:`treejax.rl.packing` places
into rows.

The prompt (the root, preorder number 0) and every node's segment are stored once, in depth-first preorder, so an
ancestor's tokens precede its descendants'. Per token: the id, its RoPE position (a node's tokens continue its
parent's: ``n_p + (d - 1) S + k``), the preorder interval ``[node_lo, node_hi]`` of its node's subtree (the tree
mask: ``j`` is visible from ``i`` iff ``node_lo[j] <= node_lo[i] <= node_hi[j]`` and ``j <= i``) and ``prev``, the
index of the token whose hidden state predicts it. Per (leaf, response token) pair: the index of its token
(``pair_index``) and whether it is trainable (``pair_valid``: a real token with a predecessor). Everything is
tree-local; :func:`treejax.rl.packing.plan_packing` offsets it into rows.
"""

from __future__ import annotations

import dataclasses

import numpy as np

PAD_NODE = 1 << 30  # node_lo / node_hi of padding tokens (above every real preorder number)


@dataclasses.dataclass
class PackedTree:
    tokens: np.ndarray  # [n]
    positions: np.ndarray
    node_lo: np.ndarray  # tree-local preorder numbers (root 0)
    node_hi: np.ndarray
    prev: np.ndarray  # tree-local indices, -1 none
    real: np.ndarray  # [n] bool (False: alignment padding)
    pair_index: np.ndarray  # [W, T] tree-local
    pair_valid: np.ndarray  # [W, T] bool
    num_nodes: int


def build_tree(p: int, prompt: np.ndarray, leaf_path: np.ndarray, leaf_length: np.ndarray, tokens: np.ndarray,
                S: int, align: int, pad_id: int, node_parent: np.ndarray | None = None,
                node_depth: np.ndarray | None = None) -> PackedTree:
    """One prompt's tree: prompt + node segments (preorder), each stored once. ``leaf_path [W, D+1]``,
    ``leaf_length [W]``, ``tokens [W, T]`` are the prompt's leaves; ``node_parent`` / ``node_depth [N]`` (the
    forest's own tree, optional) are read instead of rebuilt from the paths, and the paths are checked against
    them."""
    W, D1 = leaf_path.shape
    T = tokens.shape[1]
    n_p = int(prompt.shape[0])
    if W and np.any(leaf_path[:, 0] != 0):
        raise ValueError(f"prompt {p}: leaf_path[:, 0] must be the root 0")
    # Per node: parent, depth, covered length (max over the leaves through it) and a leaf that covers it all.
    num_ids = int(leaf_path.max()) + 1
    known_tree = node_parent is not None
    parent = np.full(num_ids, -1, np.int64)
    depth = np.full(num_ids, -1, np.int64)
    if known_tree:  # the forest's arrays, restricted to the nodes some stored leaf passes through
        seen = np.zeros(num_ids, bool)
        seen[leaf_path[leaf_path >= 0]] = True
        parent = np.where(seen, np.asarray(node_parent[:num_ids], np.int64), -1)
        depth = np.where(seen, np.asarray(node_depth[:num_ids], np.int64), -1)
    length = np.zeros(num_ids, np.int64)
    rep = np.full(num_ids, -1, np.int64)
    depth[0] = 0
    for d in range(1, D1):
        ids = leaf_path[:, d]
        on = ids >= 0
        if not np.any(on):
            continue
        cov = np.clip(leaf_length - (d - 1) * S, 0, S)
        if np.any(on & (cov <= 0)):
            w = int(np.argmax(on & (cov <= 0)))
            raise ValueError(f"prompt {p}, leaf {w}: node {ids[w]} at depth {d} holds no token "
                             f"(leaf_length {leaf_length[w]}, segment length {S})")
        if np.any(leaf_path[~on, d:] >= 0):
            raise ValueError(f"prompt {p}: a leaf path has a gap at depth {d}")
        w_on = np.nonzero(on)[0]
        order = w_on[np.argsort(cov[w_on], kind="stable")]  # the last write per node is its longest cover
        rep[ids[order]] = order
        np.maximum.at(length, ids[w_on], cov[w_on])
        par = leaf_path[w_on, d - 1]
        if known_tree:
            if np.any(parent[ids[w_on]] != par) or np.any(depth[ids[w_on]] != d):
                raise ValueError(f"prompt {p}: leaf_path disagrees with the forest's node_parent / node_depth at "
                                 f"depth {d}")
            continue
        known = parent[ids[w_on]]
        if np.any((known >= 0) & (known != par)) or np.any((depth[ids[w_on]] >= 0) & (depth[ids[w_on]] != d)):
            raise ValueError(f"prompt {p}: a node has two parents or two depths in leaf_path")
        parent[ids[w_on]] = par
        depth[ids[w_on]] = d
    # Every node with children is a full segment (only a leaf's last segment may be shorter).
    has_child = np.zeros(num_ids, bool)
    has_child[parent[parent >= 0]] = True
    bad = has_child & (depth >= 1) & (length < S)
    if np.any(bad):
        raise ValueError(f"prompt {p}: node {int(np.argmax(bad))} has children but only "
                         f"{int(length[np.argmax(bad)])} < S={S} tokens")
    children: list[list[int]] = [[] for _ in range(num_ids)]
    for n in np.nonzero(depth >= 1)[0]:
        children[parent[n]].append(int(n))
    # Preorder numbering and row placement (the root = the prompt first).
    order, stack = [], [0]
    while stack:
        n = stack.pop()
        order.append(n)
        stack.extend(reversed(children[n]))
    pre = np.full(num_ids, -1, np.int64)
    pre[order] = np.arange(len(order))
    hi = pre.copy()
    for n in reversed(order):  # children after parents in preorder: reversed order finishes subtrees first
        if parent[n] >= 0:
            hi[parent[n]] = max(hi[parent[n]], hi[n])
    seg_len = np.where(np.arange(num_ids) == 0, n_p, length)
    stored = np.where(seg_len > 0, -(-seg_len // align) * align, 0)
    start = np.zeros(num_ids, np.int64)
    cursor = 0
    for n in order:
        start[n] = cursor
        cursor += stored[n]
    n_tok = cursor
    toks = np.full(n_tok, pad_id, np.int32)
    pos = np.zeros(n_tok, np.int32)
    lo = np.full(n_tok, PAD_NODE, np.int64)
    hi_t = np.full(n_tok, PAD_NODE, np.int64)
    prev = np.full(n_tok, -1, np.int64)
    real = np.zeros(n_tok, bool)
    for n in order:
        a, m = start[n], seg_len[n]
        if m == 0:
            continue
        sl = slice(a, a + m)
        if n == 0:
            toks[sl] = prompt
            pos[sl] = np.arange(n_p)
        else:
            off = (depth[n] - 1) * S
            toks[sl] = tokens[rep[n], off: off + m]
            pos[sl] = n_p + off + np.arange(m)
        lo[sl], hi_t[sl], real[sl] = pre[n], hi[n], True
        prev[sl] = np.arange(a - 1, a + m - 1)
        if n == 0:
            prev[a] = -1
        elif depth[n] == 1:
            prev[a] = n_p - 1 if n_p > 0 else -1
        else:
            prev[a] = start[parent[n]] + S - 1
    # Gather map: response token t of leaf w sits at start[node at depth t // S + 1] + t % S.
    t = np.arange(T)
    valid = t[None, :] < leaf_length[:, None]
    col = np.minimum(t // S + 1, D1 - 1)
    node_wt = np.take_along_axis(leaf_path, np.broadcast_to(col, (W, T)), axis=1)
    valid &= node_wt >= 0
    node_c = np.where(valid, node_wt, 0)
    idx = np.where(valid, start[node_c] + t[None, :] % S, 0)
    if np.any(valid & (toks[idx] != tokens)):
        w, tt = np.argwhere(valid & (toks[idx] != tokens))[0]
        raise ValueError(f"prompt {p}: leaves sharing node {node_wt[w, tt]} disagree on its token {tt % S} "
                         f"(leaf {w} has {tokens[w, tt]}, the node {toks[idx[w, tt]]})")
    pair_valid = valid & (prev[idx] >= 0)
    return PackedTree(toks, pos, lo, hi_t, prev, real, idx, pair_valid, len(order))
