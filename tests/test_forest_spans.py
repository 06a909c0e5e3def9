"""Nodes as token spans (treejax.forest): forest_from_spans' invariants (a node starts where its parent ends, a leaf
is its path's spans end to end, every token knows its node, the loss mask is the policy mask), the fixed-segment
derivation of spans, and clear errors for inconsistent input."""

from __future__ import annotations

import numpy as np
import pytest

from treejax.forest import forest_from_paths, forest_from_spans

PATHS = np.array([[[0, 1, 2, -1], [0, 1, 3, 4], [0, 1, 3, 5], [0, 1, 3, 5]]])  # leaf 3 copies leaf 2's path
LENGTH = np.array([[0, 3, 2, 4, 1, 2]])
NODE_TOKENS = {1: [1, 2, 3], 2: [4, 5], 3: [6, 7, 8, 9], 4: [10], 5: [11, 12]}


def _tokens(paths=PATHS, node_tokens=NODE_TOKENS, T=12):
    out = np.zeros(paths.shape[:2] + (T,), np.int32)
    for w in range(paths.shape[1]):
        seq = [t for n in paths[0, w, 1:] if n >= 0 for t in node_tokens[int(n)]]
        out[0, w, :len(seq)] = seq
    return out


def test_span_forest_invariants():
    tok = _tokens()
    policy = (tok % 2 == 1).astype(np.float32)  # odd ids "sampled", even ids "observations"
    f = forest_from_spans(PATHS, LENGTH, tok, policy_mask=policy, max_response_length=14)
    spans, parent, depth = np.asarray(f.spans()), np.asarray(f.node_parent), np.asarray(f.node_depth)
    assert not f.fixed_segments and f.tokens.shape == (1, 4, 14)
    for n in range(1, 6):  # a node starts where its parent ends
        p = parent[0, n]
        assert spans[0, n, 0] == spans[0, p, 0] + spans[0, p, 1] and spans[0, n, 1] == LENGTH[0, n]
        assert depth[0, n] == depth[0, p] + 1
    np.testing.assert_array_equal(np.asarray(f.leaf_length), [[5, 8, 9, 9]])
    nodes, seg = np.asarray(f.token_nodes()), np.asarray(f.segment_index)
    for w in range(4):
        k = int(f.leaf_length[0, w])
        for n in PATHS[0, w, 1:]:
            if n < 0:
                continue
            a, L = spans[0, n]
            assert np.all(nodes[0, w, a:a + L] == n) and np.all(seg[0, w, a:a + L] == depth[0, n] - 1)
            np.testing.assert_array_equal(np.asarray(f.tokens[0, w, a:a + L]), NODE_TOKENS[int(n)])
        assert np.all(nodes[0, w, k:] == -1) and np.all(seg[0, w, k:] == -1)
        np.testing.assert_array_equal(np.asarray(f.loss_mask[0, w, :k]), policy[0, w, :k])
        assert np.all(np.asarray(f.loss_mask[0, w, k:]) == 0)
    np.testing.assert_array_equal(np.asarray(f.policy_tokens()), np.asarray(f.loss_mask))
    # slot copies share their path's mass (the sampler passes explicit unit weights for slot trees)
    np.testing.assert_allclose(np.asarray(f.leaf_weights()), [[2.0, 1.0, 0.5, 0.5]])
    ones = forest_from_spans(PATHS, LENGTH, tok, leaf_weight=np.ones((1, 4)))
    np.testing.assert_array_equal(np.asarray(ones.leaf_weights()), 1.0)


def test_fixed_segments_derive_their_spans():
    paths = np.array([[[0, 1, 2], [0, 1, 3], [0, 4, -1]]])
    f = forest_from_paths(paths, np.array([[7, 5, 2]]), 4)
    assert f.fixed_segments
    np.testing.assert_array_equal(np.asarray(f.spans())[0], [[0, 0], [0, 4], [4, 3], [4, 1], [0, 2]])
    seg, nodes = np.asarray(f.segment_index), np.asarray(f.token_nodes())
    np.testing.assert_array_equal(nodes[0, 0, :8], [1, 1, 1, 1, 2, 2, 2, -1])
    np.testing.assert_array_equal(seg[0, 2, :3], [0, 0, -1])


def test_inconsistent_spans_are_refused():
    tok = _tokens()
    bad = tok.copy()
    bad[0, 2, 4] = 63  # leaf 2 disagrees with leaf 1 on node 3's tokens
    with pytest.raises(ValueError, match="disagree on its tokens"):
        forest_from_spans(PATHS, LENGTH, bad)
    with pytest.raises(ValueError, match="has length 0"):
        forest_from_spans(PATHS, np.array([[0, 3, 0, 4, 1, 2]]), tok)
    with pytest.raises(ValueError, match="more than the response arrays"):
        forest_from_spans(PATHS, LENGTH, tok[:, :, :8])
    with pytest.raises(ValueError, match=r"\[P=1, N\]"):
        forest_from_spans(PATHS, np.zeros((2, 6)), tok)
