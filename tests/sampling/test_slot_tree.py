"""Slot trees (``TreeConfig.allocation = "slots"``) and path masses: structure, equality with independent sampling
at k = W, and the sampler-level unbiasedness test against a policy whose response distribution is known exactly.

The unbiasedness test (:func:`test_leaf_distribution_matches_the_policy`): a scripted policy picks the first
response token A or B with probability 1/2, then stops (EOS) after each further token with probability 0.5 after A
(short answers) and 0.1 after B (long answers); responses have at most T = 8 tokens in D = 4 segments of S = 2.
The exact distribution of (first token, response length) has 14 cells. Each tree's leaves give one weighted
histogram (leaf weights: ``forest.leaf_weight``, or 1 each for TreePO's own unweighted counting); trees are
independent, leaves of a tree are not, so the test compares the mean of the per-tree histograms over 512 trees with
the exact cell probabilities using the standard error across trees: every |z| must stay below 4 (a 2-sided level
of 6e-5 per cell, 1e-3 over the 14 cells). Slot trees and mass-weighted ``"transfer"`` trees without fallback pass;
TreePO's official allocation with leaves counted equally must fail (asserted: |z| > 6 somewhere; the A-first
short answers are under-sampled), so the test can fail.
"""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.forest import NodeStatus, forest_from_paths, path_mass
from treejax.sampling import decode, tree
from treejax.sampling.branching import LogProbWeighted

from tests.sampling.test_tree import TOY, TOY_TREE, _prompts, _toy_logprobs, check_forest

# ----------------------------------------------------------------------------------------------- structure
SLOT_TREE = dataclasses.replace(TOY_TREE, allocation="slots", num_leaves=7)


def _check_slots(forest, info, tc, k_P):
    """Slot-tree promises: copies of a path sit in consecutive leaf slots; a node holding n slots with c children
    (c = min(b, n)) splits them as n // c + (i < n mod c); the root splits W over k paths; at most D rounds."""
    P, W = forest.leaf_path.shape[:2]
    path = np.asarray(forest.leaf_path)
    np.testing.assert_array_equal(np.asarray(forest.leaf_weight), np.ones((P, W)))
    assert int(info.segments) <= tc.max_depth
    depth = np.asarray(forest.leaf_depth())
    first = np.asarray(forest.distinct_leaves())
    for p in range(P):
        end = [path[p, w, depth[p, w]] for w in range(W)]
        for w in range(1, W):  # copies are consecutive
            if end[w] == end[w - 1]:
                assert not first[p, w]
                np.testing.assert_array_equal(np.asarray(forest.tokens[p, w]), np.asarray(forest.tokens[p, w - 1]))
                assert int(forest.leaf_status[p, w]) == int(forest.leaf_status[p, w - 1])
        assert first[p].sum() == len(set(end))
        slots = {}  # node -> leaf slots under it
        children = {}
        for w in range(W):
            for d in range(depth[p, w] + 1):
                slots[path[p, w, d]] = slots.get(path[p, w, d], 0) + 1
                if d:
                    children.setdefault(path[p, w, d - 1], set()).add(path[p, w, d])
        for node, kids in children.items():
            n, c = slots[node], len(kids)
            if node == 0:
                assert c == k_P[p]
            else:
                assert c == min(tc.branch_factor, n)
            assert sorted((slots[x] for x in kids), reverse=True) == [n // c + (i < n % c) for i in range(c)]


@pytest.mark.parametrize("init", [1, 2, 3])
def test_slot_tree_invariants(init):
    tc = dataclasses.replace(SLOT_TREE, init_divergence=init)
    rollout = tree.make_tree_rollout(TOY, tc)
    for seed, bias in [(0, 0.0), (1, 2.0), (2, -2.0)]:
        prompts, lengths = _prompts(seed)
        forest, info = rollout({"eos_bias": jnp.float32(bias)}, prompts, lengths, jax.random.key(seed))
        check_forest(forest, info, tc, prompts, lengths, _toy_logprobs(bias))
        _check_slots(forest, info, tc, np.full(3, init))
        assert int(info.fallbacks) == 0


def test_slot_tree_random_init_divergence():
    tc = dataclasses.replace(SLOT_TREE, num_leaves=8, init_divergence_range=(1, 5))
    forest, info = tree.make_tree_rollout(TOY, tc)({"eos_bias": jnp.float32(1.0)}, *_prompts(4, P=8),
                                                   jax.random.key(4))
    check_forest(forest, info, tc, *_prompts(4, P=8))
    _check_slots(forest, info, tc, np.asarray(info.init_divergence_P))


def test_slot_tree_with_k_equal_w_is_independent_sampling():
    """k = W root paths of one slot each never branch: exactly the independent sampler (same keys, same draws)."""
    W = SLOT_TREE.num_leaves
    slots = dataclasses.replace(SLOT_TREE, init_divergence=W, branch_factor=2)
    ind = dataclasses.replace(TOY_TREE, num_leaves=W, init_divergence=W, branch_factor=1, fallback=False)
    prompts, lengths = _prompts(5)
    params = {"eos_bias": jnp.float32(1.0)}
    a, ia = tree.make_tree_rollout(TOY, slots)(params, prompts, lengths, jax.random.key(3))
    b, ib = tree.make_tree_rollout(TOY, ind)(params, prompts, lengths, jax.random.key(3))
    for name in ("tokens", "logprobs", "leaf_length", "leaf_status", "leaf_path", "node_parent"):
        np.testing.assert_array_equal(np.asarray(getattr(a, name)), np.asarray(getattr(b, name)), err_msg=name)
    assert int(ia.decoded_tokens) == int(ib.decoded_tokens) and int(ia.forks) == 0


def test_slot_tree_config_errors():
    with pytest.raises(ValueError, match="TreeConfig.allocation='slot' is not one of"):
        tree.TreeConfig(allocation="slot")
    with pytest.raises(ValueError, match="splits a path's own slots"):
        tree.TreeConfig(allocation="slots", branching=LogProbWeighted())
    from treejax.sampling.branching import get_rule, rule_classes
    pruning = [n for n, c in rule_classes().items() if c.prunes]
    if pruning:
        with pytest.raises(ValueError, match="cannot use the pruning rule"):
            tree.TreeConfig(allocation="slots", branching=get_rule(pruning[0]))


# ----------------------------------------------------------------------------------------------- path mass
def test_path_mass_of_transfer_trees_sums_to_one_without_fallback():
    tc = dataclasses.replace(TOY_TREE, fallback=False)
    forest, info = tree.make_tree_rollout(TOY, tc)({"eos_bias": jnp.float32(1.5)}, *_prompts(6, P=6),
                                                   jax.random.key(6))
    w = np.asarray(forest.leaf_weight)
    np.testing.assert_allclose(w.sum(axis=1), tc.num_leaves, rtol=1e-6)
    used = np.asarray(forest.leaf_path)[:, :, 0] >= 0
    assert np.all(w[~used] == 0) and np.all(w[used] > 0)
    np.testing.assert_allclose(w, tc.num_leaves * np.asarray(path_mass(forest.node_parent, forest.leaf_path)))


def test_path_mass_by_hand():
    # root -> 1 (stops, 2 copies), 2; 2 -> 3, 4, 5
    paths = np.array([[[0, 1, -1], [0, 1, -1], [0, 2, 3], [0, 2, 4], [0, 2, 5]]])
    f = forest_from_paths(paths, np.array([[1, 1, 2, 2, 2]]), 1)
    np.testing.assert_allclose(np.asarray(path_mass(f.node_parent, f.leaf_path)),
                               [[0.25, 0.25, 1 / 6, 1 / 6, 1 / 6]], rtol=1e-6)
    np.testing.assert_array_equal(np.asarray(f.distinct_leaves()), [[True, False, True, True, True]])


# ----------------------------------------------------------------------------------------------- unbiasedness
V_EOS, V_A, V_B, V_FILL = 1, 2, 3, 4
Q_STOP = {V_A: 0.5, V_B: 0.1}
LP = 2  # every prompt has 2 tokens; the first response token sits at position LP


def make_ab_policy() -> decode.ModelFns:
    """First response token A or B (1/2 each, never EOS), then EOS with probability Q_STOP[first] per token."""
    logq = {k: np.log(v) for k, v in Q_STOP.items()}
    first = np.full(5, -1e9, np.float32)
    first[[V_A, V_B]] = np.log(0.5)
    after = {}
    for tok, q in Q_STOP.items():
        z = np.full(5, -1e9, np.float32)
        z[V_EOS], z[V_FILL] = logq[tok], np.log1p(-q)
        after[tok] = z

    def init_cache(rows, length):
        return {"tok": jnp.zeros((rows, 1, length), jnp.int32)}

    def prefill(params, tokens, positions, segment_ids, cache, rows):
        L = cache["tok"].shape[2]
        return {"tok": cache["tok"].at[rows[:, None], 0, jnp.where(segment_ids != 0, positions, L)].set(
            tokens, mode="drop")}

    def step(params, tokens, positions, cache):
        R = cache["tok"].shape[0]
        c = cache["tok"].at[jnp.arange(R), 0, positions].set(tokens, mode="drop")
        z = jnp.where((c[:, 0, LP] == V_A)[:, None], jnp.asarray(after[V_A]), jnp.asarray(after[V_B]))
        z = jnp.where((positions == LP - 1)[:, None], jnp.asarray(first)[None, :], z)
        return z, {"tok": c}

    return decode.ModelFns(init_cache, prefill, step, 5, 5, name="ab")


AB_TREE = tree.TreeConfig(num_leaves=8, max_depth=4, segment_length=2, branch_factor=2, stop_ids=(V_EOS,),
                          row_buckets=1)
T_MAX = AB_TREE.response_capacity  # 8


def exact_cells() -> np.ndarray:
    """[2, T + 1] probabilities of (first token A/B, response length 2..T) under the policy."""
    p = np.zeros((2, T_MAX + 1))
    for i, tok in enumerate((V_A, V_B)):
        q = Q_STOP[tok]
        for n in range(2, T_MAX):  # EOS is token n (1-based), n - 2 non-stops before it after the first token
            p[i, n] = 0.5 * (1 - q) ** (n - 2) * q
        p[i, T_MAX] = 0.5 * (1 - q) ** (T_MAX - 2)  # EOS at the last token, or truncated
    return p


def tree_histograms(tc, weighting: str, calls: int = 8, P: int = 64) -> np.ndarray:
    """[trees, 2, T + 1]: per tree, the weighted histogram of (first token, length) over its leaves."""
    rollout = tree.make_tree_rollout(make_ab_policy(), tc)
    prompts, lengths = np.full((P, LP), 4, np.int32), np.full((P,), LP)
    out = []
    for c in range(calls):
        forest, _ = rollout({}, prompts, lengths, jax.random.key(1000 + c))
        tok0 = np.asarray(forest.tokens[:, :, 0])
        length = np.asarray(forest.leaf_length)
        w = np.asarray(forest.leaf_weights()) if weighting == "weight" else (length > 0).astype(np.float64)
        h = np.zeros((P, 2, T_MAX + 1))
        for i, tok in enumerate((V_A, V_B)):
            for n in range(T_MAX + 1):
                h[:, i, n] = np.sum(w * ((tok0 == tok) & (length == n)), axis=1)
        out.append(h / h.sum(axis=(1, 2), keepdims=True))
    return np.concatenate(out)


def max_abs_z(h: np.ndarray) -> float:
    """Largest |z| over the cells: (mean over trees - exact) / (std over trees / sqrt(trees))."""
    p = exact_cells()
    cells = p > 0
    mean, se = h.mean(axis=0), h.std(axis=0, ddof=1) / np.sqrt(h.shape[0])
    assert np.all(h[:, ~cells] == 0)
    return float(np.max(np.abs(mean[cells] - p[cells]) / np.maximum(se[cells], 1e-12)))


@pytest.mark.parametrize("name,tc,weighting,unbiased", [
    ("independent", dataclasses.replace(AB_TREE, branch_factor=1, init_divergence=8, fallback=False), "count",
     True),
    ("slots k=2", dataclasses.replace(AB_TREE, allocation="slots", init_divergence=2), "count", True),
    ("slots k=3 uneven", dataclasses.replace(AB_TREE, allocation="slots", init_divergence=3), "count", True),
    ("transfer, no fallback, mass-weighted", dataclasses.replace(AB_TREE, fallback=False), "weight", True),
    ("treepo official (transfer + fallback, leaves counted equally)", AB_TREE, "count", False),
])
def test_leaf_distribution_matches_the_policy(name, tc, weighting, unbiased):
    z = max_abs_z(tree_histograms(tc, weighting))
    if unbiased:
        assert z < 4.0, f"{name}: max |z| = {z:.2f}"
    else:
        assert z > 6.0, f"{name}: max |z| = {z:.2f} (TreePO's equal counting should be detectably biased)"


def test_slot_tree_leaf_status_counts_are_slot_weighted():
    tc = dataclasses.replace(AB_TREE, allocation="slots", init_divergence=2)
    forest, info = tree.make_tree_rollout(make_ab_policy(), tc)({}, np.full((16, LP), 4, np.int32),
                                                               np.full((16,), LP), jax.random.key(0))
    status = np.asarray(forest.leaf_status)
    for name, code in zip(NodeStatus.names(), NodeStatus):
        assert int(info.stops[name]) == int(np.sum(status == int(code)))
