"""GiGPO with similar anchor states (gigpo_similar): host clusters of observations feed the anchor groups. With
clusters of identical observations it is exactly gigpo; with merged clusters it matches the slow reference whose
states are the clusters; the source's difflib clustering joins observations at the threshold."""

from __future__ import annotations

import numpy as np
import pytest

import agentic_references as ref
from test_agentic_estimators import big_forest
from treejax.rl.advantages.registry import estimator_spec
from treejax.rl.multiturn import state_clusters
from treejax.sampling.multiturn import Episode, TurnNode, TurnTree


def _clusters(forest, merge=None):
    """Cluster ids per node from the observation tuples (``merge``: {tuple: tuple} folds one into another)."""
    P, N = forest.node_parent.shape
    out = np.full((P, N), -1, np.int32)
    seg, nodes = np.asarray(forest.segment_index), np.asarray(forest.token_nodes())
    tok, pm = np.asarray(forest.tokens), np.asarray(forest.policy_mask)
    for p in range(P):
        ids = {}
        for n in range(1, N):
            where = np.argwhere(nodes[p] == n)
            if not len(where):
                continue
            w = where[0][0]
            obs = tuple(int(x) for x in tok[p, w][(nodes[p, w] == n) & (pm[p, w] == 0) & (seg[p, w] >= 0)])
            if obs:
                obs = (merge or {}).get(obs, obs)
                out[p, n] = ids.setdefault(obs, len(ids))
    return out


class _ClusterPrompt(ref.Prompt):
    def __init__(self, forest, p, clusters):
        super().__init__(forest, p)
        self.clusters = clusters[p]

    def state(self, w, d):
        n = int(self.paths[w, d])
        return ("cluster", int(self.clusters[n])) if d > 0 and self.clusters[n] >= 0 else ("node", self.prefix(w, d))


def _run(name, forest, R, **inputs):
    spec = estimator_spec(name)
    return np.asarray(spec.fn(forest, R, spec.default_options(), **inputs).segments)


def test_identical_clusters_give_gigpo_and_merged_clusters_match_the_reference():
    f = big_forest()
    R = np.array([[1, 0, 1, 1, 0, 1, 0, 0], [0, 1, 1, 0, 0, 1, 1, 0]], np.float32)
    exact = _clusters(f)
    np.testing.assert_array_equal(_run("gigpo_similar", f, R, state_cluster_PxN=exact), _run("gigpo", f, R))
    merged = _clusters(f, merge={(101, 102): (50, 51)})  # node 1's observation counted as similar to nodes 3, 7
    got = _run("gigpo_similar", f, R, state_cluster_PxN=merged)
    for p in range(2):
        want = ref.gigpo(_ClusterPrompt(f, p, merged), R[p].astype(np.float64))
        np.testing.assert_allclose(got[p], want, rtol=1e-5, atol=1e-5)
    assert not np.allclose(got, _run("gigpo", f, R))  # the merge changes some anchor groups
    with pytest.raises(ValueError, match="state_cluster_PxN has shape"):
        _run("gigpo_similar", f, R, state_cluster_PxN=exact[:, :3])


class _Tok:
    def decode(self, ids, skip_special_tokens=True):
        return "".join(chr(97 + (i % 26)) for i in ids)


def test_state_clusters_join_at_the_threshold():
    base = list(range(20))  # "abcdefghijklmnopqrst"
    near = base[:-1] + [23]  # one character of 20 differs: SequenceMatcher ratio 0.95
    far = [5] * 20

    def ep(obs):
        e = Episode()
        e._add([1], [0.0], policy=True)
        e._add(obs, [], policy=False)
        return e

    eps = [ep(base), ep(near), ep(far), Episode()]
    eps[3]._add([2, 3], [0.0, 0.0], policy=True)  # an answer turn: no observation
    nodes = [TurnNode(-1, 0, 0, 0)] + [TurnNode(0, 1, 0, len(e.tokens)) for e in eps]
    tree = TurnTree(nodes, [[0, 1], [0, 2], [0, 3], [0, 4]], eps)
    np.testing.assert_array_equal(state_clusters([tree], _Tok(), 6, 0.95), [[-1, 0, 0, 1, -1, -1]])
    np.testing.assert_array_equal(state_clusters([tree], _Tok(), 6, 1.0), [[-1, 0, 1, 2, -1, -1]])
