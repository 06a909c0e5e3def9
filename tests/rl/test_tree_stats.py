"""treejax.rl.tree_stats: sibling correlation and effective sample size against brute-force references, on
independent samples, slot trees with copies, and random correlated data."""

import numpy as np

from treejax.rl import tree_stats


def _independent_paths(P, W):
    path = np.full((P, W, 3), -1)
    path[:, :, 0] = 0
    path[:, :, 1] = 1 + np.arange(W)[None, :]
    return path


def _slot_paths(P, W, k):
    """k depth-1 subtrees of W // k copies each (every subtree one answer repeated)."""
    path = np.full((P, W, 3), -1)
    path[:, :, 0] = 0
    path[:, :, 1] = 1 + np.arange(W)[None, :] // (W // k)
    return path


def test_independent_samples_have_no_sibling_correlation_and_full_ess():
    rng = np.random.RandomState(0)
    P, W = 400, 8
    path = _independent_paths(P, W)
    x = rng.rand(P, 1) + rng.randn(P, W)  # prompts differ in mean: must not show up as correlation
    sums = tree_stats.sibling_sums(path, np.ones((P, W)), x)
    assert sums["sib_w"] == 0  # no two leaves share a depth-1 node
    assert np.isnan(tree_stats.sibling_correlation(sums))
    np.testing.assert_allclose(tree_stats.effective_samples(path, np.ones((P, W)), float("nan")), W)


def test_copies_are_fully_correlated_and_count_once():
    rng = np.random.RandomState(1)
    P, W, k = 300, 8, 2
    path = _slot_paths(P, W, k)
    x = np.repeat(rng.randn(P, k), W // k, axis=1) + 3 * rng.rand(P, 1)
    rho = tree_stats.sibling_correlation(tree_stats.sibling_sums(path, np.ones((P, W)), x))
    np.testing.assert_allclose(rho, 1.0, atol=1e-12)
    np.testing.assert_allclose(tree_stats.effective_samples(path, np.ones((P, W)), rho), k)


def test_correlation_matches_the_generating_model_and_brute_force():
    """x = prompt effect + subtree effect (variance r) + leaf noise (variance 1 - r): rho = r."""
    rng = np.random.RandomState(2)
    P, W, k, r = 4000, 8, 4, 0.6
    path = _slot_paths(P, W, k)
    path[:, :, 2] = 10 + np.arange(W)[None, :]  # each leaf its own depth-2 node: distinct leaves
    x = (5 * rng.rand(P, 1) + np.sqrt(r) * np.repeat(rng.randn(P, k), W // k, axis=1)
         + np.sqrt(1 - r) * rng.randn(P, W))
    w = np.ones((P, W))
    sums = tree_stats.sibling_sums(path, w, x)
    # brute force over pairs of the first prompts
    sib, across = [], []
    for p in range(50):
        for i in range(W):
            for j in range(W):
                if i != j:
                    (sib if path[p, i, 1] == path[p, j, 1] else across).append(0.5 * (x[p, i] - x[p, j]) ** 2)
    part = tree_stats.sibling_sums(path[:50], w[:50], x[:50])
    np.testing.assert_allclose(part["sib"] / part["sib_w"], np.mean(sib), rtol=1e-10)
    np.testing.assert_allclose(part["across"] / part["across_w"], np.mean(across), rtol=1e-10)
    rho = tree_stats.sibling_correlation(sums)
    assert abs(rho - r) < 0.05
    # ESS of a mean of k groups of m equally correlated members: W / (1 + (m - 1) rho)
    np.testing.assert_allclose(tree_stats.effective_samples(path, w, rho), W / (1 + (W // k - 1) * rho))


def test_weights_enter_pairs_and_means():
    path = _independent_paths(1, 3)
    path[0, 2, 1] = 1  # leaves 0 and 2 share node 1
    w = np.array([[2.0, 0.5, 0.5]])
    x = np.array([[1.0, 3.0, 2.0]])
    s = tree_stats.sibling_sums(path, w, x)
    np.testing.assert_allclose(s["sib_w"], 2 * 2.0 * 0.5)
    np.testing.assert_allclose(s["sib"], 2 * 2.0 * 0.5 * 0.5 * 1.0)
    np.testing.assert_allclose(s["across_w"], 2 * (2.0 * 0.5 + 0.5 * 0.5))
    np.testing.assert_allclose(tree_stats.weighted_mean(x, w), (2 + 1.5 + 1) / 3)
    ess = tree_stats.effective_samples(path, w, 0.5)
    np.testing.assert_allclose(ess, 9.0 / (4.5 + 0.5 * 2.0))
