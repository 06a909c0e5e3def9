"""One prompt's tree as a run of packed tokens (:func:`build_tree`), the unit :mod:`treejax.rl.packing` places
into rows.

The prompt (the root, preorder number 0) and every node's tokens are stored once, in depth-first preorder, so an
ancestor's tokens precede its descendants'. A node is a token *span* of its leaves' responses, ``(start, length)``
(:attr:`treejax.forest.Forest.node_span`: a turn of a multi-turn tree, policy tokens then observation tokens; for
fixed segments of ``S`` tokens ``start = (d - 1) S``, :meth:`treejax.forest.Forest.spans`). Per token: the id, its
RoPE position (a node's tokens continue its parent's: ``n_p + start + k``), the preorder interval
``[node_lo, node_hi]`` of its node's subtree (the tree mask: ``j`` is visible from ``i`` iff
``node_lo[j] <= node_lo[i] <= node_hi[j]`` and ``j <= i``) and ``prev``, the index of the token whose hidden state
predicts it (the previous token of the node, the parent's last token at a node's first token). Per (leaf, response
token) pair: the index of its token (``pair_index``) and whether it is trainable (``pair_valid``: a real token with
a predecessor). Everything is tree-local; :func:`treejax.rl.packing.plan_packing` offsets it into rows.
"""

from __future__ import annotations

import dataclasses

import numpy as np

PAD_NODE = 1 << 30  # node_lo / node_hi of padding tokens: PAD_NODE + column in a packed row (above every real number)


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
               node_depth: np.ndarray | None = None, node_span: np.ndarray | None = None) -> PackedTree:
    """One prompt's tree: prompt + node spans (preorder), each stored once. ``leaf_path [W, D+1]``,
    ``leaf_length [W]``, ``tokens [W, T]`` are the prompt's leaves; ``node_parent`` / ``node_depth [N]`` (the
    forest's own tree, optional) are read instead of rebuilt from the paths, and the paths are checked against
    them. ``node_span [N, 2]`` (optional): each node's ``(start, length)`` in its leaves' responses
    (:meth:`treejax.forest.Forest.spans`); ``None``: fixed segments of ``S`` tokens (node at depth ``d`` starts at
    ``(d - 1) S`` and holds the longest cover of its leaves, at most ``S``).

    Raises ``ValueError`` on an inconsistent tree: a gap in a path, a node with two parents or depths, a node on a
    path that holds none of a leaf's tokens, a node that does not start where its parent ends (with fixed segments:
    a node with children shorter than ``S``), a leaf longer than its path, leaves that disagree on a shared token."""
    W = leaf_path.shape[0]
    if W and np.any(leaf_path[:, 0] != 0):
        raise ValueError(f"prompt {p}: leaf_path[:, 0] must be the root 0")
    nodes, prev_end = _node_table(p, leaf_path, leaf_length, tokens.shape[1], S, node_parent, node_depth, node_span)
    _check_covers(p, nodes, leaf_length, prev_end, S, fixed=node_span is None)
    order, pre, hi = _preorder(nodes.parent, nodes.depth)
    row, (toks, pos, lo, hi_t, prev, real) = _lay_out(nodes, order, pre, hi, prompt, tokens, align, pad_id)
    idx, pair_valid = _pair_map(p, leaf_path, leaf_length, tokens, nodes, row, toks, prev)
    return PackedTree(toks, pos, lo, hi_t, prev, real, idx, pair_valid, len(order))


@dataclasses.dataclass
class _NodeTable:
    """Per node id ``[num_ids]`` of one tree: ``parent`` / ``depth`` (-1: no stored leaf passes through it; the
    root has depth 0), its span ``start`` / ``length`` in its leaves' responses, and ``rep``, a leaf whose response
    covers the longest part of it (the one whose tokens are stored)."""

    parent: np.ndarray
    depth: np.ndarray
    start: np.ndarray
    length: np.ndarray
    rep: np.ndarray


def _initial_nodes(p: int, leaf_path: np.ndarray, node_parent, node_depth, node_span):
    """``(parent, depth, start, length)`` before the paths are read: the forest's parents and depths (restricted to
    the nodes some stored leaf passes through) when given, else -1; the spans when given (the root's is the prompt:
    ``(0, 0)``), else zeros."""
    num_ids = int(leaf_path.max()) + 1
    parent = np.full(num_ids, -1, np.int64)
    depth = np.full(num_ids, -1, np.int64)
    if node_parent is not None:  # the forest's arrays, restricted to the nodes some stored leaf passes through
        seen = np.zeros(num_ids, bool)
        seen[leaf_path[leaf_path >= 0]] = True
        parent = np.where(seen, np.asarray(node_parent[:num_ids], np.int64), -1)
        depth = np.where(seen, np.asarray(node_depth[:num_ids], np.int64), -1)
    if node_span is None:
        start = np.zeros(num_ids, np.int64)
        length = np.zeros(num_ids, np.int64)
    else:
        span = np.asarray(node_span, np.int64)
        if span.shape[0] < num_ids or span.shape[1:] != (2,):
            raise ValueError(f"prompt {p}: node_span has shape {span.shape}, expected [>= {num_ids}, 2]")
        start, length = span[:num_ids, 0].copy(), span[:num_ids, 1].copy()
        start[0], length[0] = 0, 0  # the root is the prompt
    return parent, depth, start, length


def _link(p: int, d: int, ids: np.ndarray, par: np.ndarray, parent: np.ndarray, depth: np.ndarray,
          known_tree: bool) -> None:
    """The nodes ``ids`` at depth ``d`` with parents ``par``: checked against the forest's tree when it is known,
    else recorded (a node seen twice must have one parent and one depth)."""
    if known_tree:
        if np.any(parent[ids] != par) or np.any(depth[ids] != d):
            raise ValueError(f"prompt {p}: leaf_path disagrees with the forest's node_parent / node_depth at "
                             f"depth {d}")
    else:
        known = parent[ids]
        if np.any((known >= 0) & (known != par)) or np.any((depth[ids] >= 0) & (depth[ids] != d)):
            raise ValueError(f"prompt {p}: a node has two parents or two depths in leaf_path")
        parent[ids] = par
        depth[ids] = d


def _span_cover(p: int, d: int, ids: np.ndarray, w_on: np.ndarray, par: np.ndarray, start: np.ndarray,
                length: np.ndarray, prev_end: np.ndarray, leaf_length: np.ndarray, T: int) -> np.ndarray:
    """Spans at depth ``d``: each node starts where its leaves' parent node ends and ends within the ``T`` response
    tokens; returns ``[W]`` how many of each leaf's tokens its node at depth ``d`` holds."""
    s = start[ids[w_on]]
    if np.any(s != prev_end[w_on]):
        k = int(np.argmax(s != prev_end[w_on]))
        n = ids[w_on][k]
        raise ValueError(f"prompt {p}: node {n} at depth {d} starts at response token {s[k]} but its parent "
                         f"{par[k]} ends at {prev_end[w_on][k]} (a node's span starts where its parent's "
                         "ends)")
    if np.any(start[ids[w_on]] + length[ids[w_on]] > T):
        n = ids[w_on][int(np.argmax(start[ids[w_on]] + length[ids[w_on]] > T))]
        raise ValueError(f"prompt {p}: node {n}'s span ({start[n]}, {length[n]}) ends past the {T} response "
                         "tokens")
    return np.clip(leaf_length - start[np.maximum(ids, 0)], 0, length[np.maximum(ids, 0)])


def _node_table(p: int, leaf_path: np.ndarray, leaf_length: np.ndarray, T: int, S: int, node_parent, node_depth,
                node_span) -> tuple[_NodeTable, np.ndarray]:
    """The tree's nodes read depth by depth from the leaf paths (:class:`_NodeTable`), and ``prev_end [W]``: where
    each leaf's last node ends in its response. Fixed segments: the node at depth ``d`` starts at ``(d - 1) S`` and
    its length is the longest cover of its leaves, at most ``S``; spans: as given, checked
    (:func:`_span_cover`)."""
    W, D1 = leaf_path.shape
    fixed, known_tree = node_span is None, node_parent is not None
    parent, depth, start, length = _initial_nodes(p, leaf_path, node_parent, node_depth, node_span)
    rep = np.full(parent.shape[0], -1, np.int64)
    depth[0] = 0
    prev_end = np.zeros(W, np.int64)  # where each leaf's node at depth d - 1 ends in its response
    for d in range(1, D1):
        ids = leaf_path[:, d]
        on = ids >= 0
        if not np.any(on):
            continue
        if np.any(leaf_path[~on, d:] >= 0):
            raise ValueError(f"prompt {p}: a leaf path has a gap at depth {d}")
        w_on = np.nonzero(on)[0]
        par = leaf_path[w_on, d - 1]
        _link(p, d, ids[w_on], par, parent, depth, known_tree)
        if fixed:
            start[ids[w_on]] = (d - 1) * S
            cov = np.clip(leaf_length - (d - 1) * S, 0, S)
            np.maximum.at(length, ids[w_on], cov[w_on])
        else:
            cov = _span_cover(p, d, ids, w_on, par, start, length, prev_end, leaf_length, T)
        if np.any(on & (cov <= 0)):
            w = int(np.argmax(on & (cov <= 0)))
            raise ValueError(f"prompt {p}, leaf {w}: node {ids[w]} at depth {d} holds no token "
                             f"(leaf_length {leaf_length[w]}, " +
                             (f"segment length {S})" if fixed else f"span ({start[ids[w]]}, {length[ids[w]]}))"))
        order = w_on[np.argsort(cov[w_on], kind="stable")]  # the last write per node is its longest cover
        rep[ids[order]] = order
        prev_end[w_on] = start[ids[w_on]] + length[ids[w_on]]
    return _NodeTable(parent, depth, start, length, rep), prev_end


def _check_covers(p: int, nodes: _NodeTable, leaf_length: np.ndarray, prev_end: np.ndarray, S: int,
                  fixed: bool) -> None:
    """With fixed segments every node with children is a full segment (only a leaf's last segment may be
    shorter); no leaf runs past its path's last node."""
    parent, depth, length = nodes.parent, nodes.depth, nodes.length
    has_child = np.zeros(parent.shape[0], bool)
    has_child[parent[parent >= 0]] = True
    if fixed:  # every node with children is a full segment (only a leaf's last segment may be shorter)
        bad = has_child & (depth >= 1) & (length < S)
        if np.any(bad):
            raise ValueError(f"prompt {p}: node {int(np.argmax(bad))} has children but only "
                             f"{int(length[np.argmax(bad)])} < S={S} tokens")
    long_leaf = leaf_length > prev_end
    if np.any(long_leaf):
        w = int(np.argmax(long_leaf))
        raise ValueError(f"prompt {p}, leaf {w}: leaf_length {leaf_length[w]} runs past its path's last node, which "
                         f"ends at response token {prev_end[w]}")


def _preorder(parent: np.ndarray, depth: np.ndarray) -> tuple[list, np.ndarray, np.ndarray]:
    """``(order, pre, hi)``: the used nodes in depth-first preorder from the root (children by id), each node's
    preorder number ``pre`` and the largest preorder number ``hi`` in its subtree (its subtree is ``[pre, hi]``)."""
    num_ids = parent.shape[0]
    children: list[list[int]] = [[] for _ in range(num_ids)]
    for n in np.nonzero(depth >= 1)[0]:
        children[parent[n]].append(int(n))
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
    return order, pre, hi


def _lay_out(nodes: _NodeTable, order: list, pre: np.ndarray, hi: np.ndarray, prompt: np.ndarray,
             tokens: np.ndarray, align: int, pad_id: int):
    """The packed tree's tokens, node by node in preorder (the root = the prompt first), each node's stored length
    padded to a multiple of ``align``. Returns ``(row, (tokens, positions, node_lo, node_hi, prev, real))``: where
    each node's tokens begin, and the per-token arrays (module docstring)."""
    parent, depth, start, length, rep = nodes.parent, nodes.depth, nodes.start, nodes.length, nodes.rep
    n_p = int(prompt.shape[0])
    seg_len = np.where(np.arange(parent.shape[0]) == 0, n_p, length)
    stored = np.where(seg_len > 0, -(-seg_len // align) * align, 0)
    row = np.zeros(parent.shape[0], np.int64)  # where each node's tokens begin in the packed tree
    cursor = 0
    for n in order:
        row[n] = cursor
        cursor += stored[n]
    n_tok = cursor
    toks = np.full(n_tok, pad_id, np.int32)
    pos = np.zeros(n_tok, np.int32)
    lo = np.full(n_tok, PAD_NODE, np.int64)
    hi_t = np.full(n_tok, PAD_NODE, np.int64)
    prev = np.full(n_tok, -1, np.int64)
    real = np.zeros(n_tok, bool)
    for n in order:
        a, m = row[n], seg_len[n]
        if m == 0:
            continue
        sl = slice(a, a + m)
        if n == 0:
            toks[sl] = prompt
            pos[sl] = np.arange(n_p)
        else:
            off = start[n]
            toks[sl] = tokens[rep[n], off: off + m]
            pos[sl] = n_p + off + np.arange(m)
        lo[sl], hi_t[sl], real[sl] = pre[n], hi[n], True
        prev[sl] = np.arange(a - 1, a + m - 1)
        if n == 0:
            prev[a] = -1
        elif depth[n] == 1:
            prev[a] = n_p - 1 if n_p > 0 else -1
        else:  # the parent's last token
            prev[a] = row[parent[n]] + seg_len[parent[n]] - 1
    return row, (toks, pos, lo, hi_t, prev, real)


def _pair_map(p: int, leaf_path: np.ndarray, leaf_length: np.ndarray, tokens: np.ndarray, nodes: _NodeTable,
              row: np.ndarray, toks: np.ndarray, prev: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The gather map ``(pair_index, pair_valid) [W, T]``: response token ``t`` of leaf ``w`` sits in the node of
    its path whose span holds ``t``, at ``row[node] + t - start[node]`` (fixed segments: the node at depth ``t // S
    + 1``, at ``row[node] + t % S``); a pair is valid when the token is real and has a predecessor. Raises when
    leaves sharing a node disagree on its tokens."""
    start, length = nodes.start, nodes.length
    W, D1 = leaf_path.shape
    T = tokens.shape[1]
    t = np.arange(T)
    node_wt = np.full((W, T), -1, np.int64)
    for d in range(1, D1):
        ids = leaf_path[:, d]
        c = np.maximum(ids, 0)
        s, e = start[c][:, None], (start[c] + length[c])[:, None]
        inside = (ids >= 0)[:, None] & (t[None, :] >= s) & (t[None, :] < e)
        node_wt = np.where(inside, ids[:, None], node_wt)
    valid = (t[None, :] < leaf_length[:, None]) & (node_wt >= 0)
    node_c = np.where(valid, node_wt, 0)
    idx = np.where(valid, row[node_c] + t[None, :] - start[node_c], 0)
    if np.any(valid & (toks[idx] != tokens)):
        w, tt = np.argwhere(valid & (toks[idx] != tokens))[0]
        n = node_wt[w, tt]
        raise ValueError(f"prompt {p}: leaves sharing node {n} disagree on its token {tt - start[n]} "
                         f"(leaf {w} has {tokens[w, tt]}, the node {toks[idx[w, tt]]})")
    pair_valid = valid & (prev[idx] >= 0)
    return idx, pair_valid
