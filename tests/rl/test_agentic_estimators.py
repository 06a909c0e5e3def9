"""Multi-turn estimators (gigpo, hgpo, salt, tree_grpo, treeps, portool, portool_tool) on hand-made turn forests:
jitted == the loop-based references of ``agentic_references.py``, hand-computed cases, masks, options."""

from __future__ import annotations

import functools

import agentic_references as ref
import jax
import numpy as np
import pytest

from treejax.forest import forest_from_spans
from treejax.rl import advantages as adv
from treejax.rl.advantages.agentic import node_state_keys
from treejax.testing.forests import random_forest, random_tree_paths, with_copies

TOL = dict(rtol=1e-5, atol=1e-5)


def turn_forest(prompts, N=None, T=None):
    """``prompts``: list of (paths [W, D+1], {node: (action tokens, observation tokens)}) -> a turn Forest with node
    capacity ``N`` and response length ``T`` (default: the smallest that fit)."""
    P = len(prompts)
    W, D1 = np.asarray(prompts[0][0]).shape
    N = N or max(max(nodes) for _, nodes in prompts) + 1
    paths = np.stack([np.asarray(p, np.int32) for p, _ in prompts])
    length = np.zeros((P, N), np.int64)
    for p, (_, nodes) in enumerate(prompts):
        for n, (a, o) in nodes.items():
            length[p, n] = len(a) + len(o)
    if T is None:
        T = max(sum(length[p, n] for n in row[1:] if n >= 0) for p in range(P) for row in paths[p])
    tok = np.zeros((P, W, T), np.int32)
    pm = np.zeros((P, W, T), np.float32)
    for p, (_, nodes) in enumerate(prompts):
        for w in range(W):
            t = 0
            for n in paths[p, w, 1:]:
                if n < 0:
                    break
                a, o = nodes[n]
                tok[p, w, t:t + len(a) + len(o)] = list(a) + list(o)
                pm[p, w, t:t + len(a)] = 1
                t += len(a) + len(o)
    return forest_from_spans(paths, length, tok, policy_mask=pm)


# Branching at depths 0, 1, 2; leaves of depths 1, 2, 3; node 4 is an early end holding two slots (2, 3); nodes 3
# and 7 (different branches, different action lengths) carry the same observation [50, 51]; nodes 6 and 10 are
# identical turns (action and observation) under those two identical states.
BIG_NODES = {1: ([11, 12], [101, 102]), 2: ([13], [103, 104, 105]), 3: ([14, 15], [50, 51]), 4: ([16], []),
             5: ([17, 18], []), 6: ([19], [60]), 7: ([20, 21, 22], [50, 51]), 8: ([23], []), 9: ([24], []),
             10: ([19], [60]), 12: ([25, 26], [])}
BIG_PATHS = [[0, 1, 3, 5], [0, 1, 3, 6], [0, 1, 4, -1], [0, 1, 4, -1], [0, 2, 7, 9], [0, 2, 7, 10],
             [0, 2, 8, -1], [0, 12, -1, -1]]
# A second prompt: chains and a fork at depth 2, observation [7] repeated at depths 1 and 2 (a state revisited).
SECOND_NODES = {1: ([1], [7]), 2: ([2], [7]), 3: ([3], [7]), 4: ([4, 4], []), 5: ([5], [8]), 6: ([6], []),
                7: ([1], [7]), 8: ([9], []), 9: ([2], [])}
SECOND_PATHS = [[0, 1, 3, 4], [0, 1, 3, 6], [0, 1, 5, -1], [0, 2, 8, -1], [0, 2, 8, -1], [0, 7, 9, -1],
                [0, 7, 9, -1], [0, 7, -1, -1]]

# The hand-computed case: w3, w4 are two slots of a path that ended at depth 1; nodes 1 and 2 share observation [50].
SMALL_PATHS = [[0, 1, 3], [0, 1, 4], [0, 2, 5], [0, 6, -1], [0, 6, -1]]
SMALL_NODES = {1: ([11], [50]), 2: ([12, 13], [50]), 3: ([14], []), 4: ([15], []), 5: ([16], []), 6: ([17], [])}
SMALL_R = np.array([[1.0, 0.0, 1.0, 0.0, 0.0]], np.float32)


# every forest of the reference test has these shapes (one compilation per estimator case)
P_, W_, D_, N_, T_ = 2, 8, 3, 25, 16


@functools.lru_cache(maxsize=None)
def big_forest():
    return turn_forest([(BIG_PATHS, BIG_NODES), (SECOND_PATHS, SECOND_NODES)], N_, T_)


@functools.lru_cache(maxsize=None)
def small_forest():
    return turn_forest([(SMALL_PATHS, SMALL_NODES)])


@functools.lru_cache(maxsize=None)
def random_turn_forest(seed: int, P=P_, W=W_, D=D_):
    """Random trees whose turns have 1-2 action tokens and 0-1 observation tokens from a 2-token vocabulary (so
    identical observations in different branches are common), with slot copies of early-ended paths."""
    rng = np.random.default_rng(seed)
    prompts = []
    for _ in range(P):
        paths = random_tree_paths(rng, W, D)
        for w in range(1, W):  # a copy of the previous slot (a path stored once per slot)
            if rng.random() < 0.25:
                paths[w] = paths[w - 1]
        ids = sorted({int(n) for n in paths[:, 1:].ravel() if n >= 0})
        nodes = {n: (list(rng.integers(1, 4, rng.integers(1, 3))), list(rng.integers(50, 52, rng.integers(0, 2))))
                 for n in ids}
        prompts.append((paths, nodes))
    rewards = rng.choice(np.array([0.0, 0.5, 1.0], np.float32), (P, W))
    for p, (paths, _) in enumerate(prompts):  # copies share their reward
        for w in range(1, W):
            if np.array_equal(paths[w], paths[w - 1]):
                rewards[p, w] = rewards[p, w - 1]
    return turn_forest(prompts, N_, T_), rewards


CASES = [
    ("gigpo", adv.GiGPOOptions()),
    ("gigpo", adv.GiGPOOptions(mode="mean_std_norm", omega=0.5, gamma=1.0, match_observations=False)),
    ("hgpo", adv.HGPOOptions()),
    ("hgpo", adv.HGPOOptions(max_observations=2, alpha=2.0, weight_offset=1, scale_by_std=True, skip_zero=False,
                             trajectory_weight=0.5)),
    ("salt", adv.SALTOptions()),
    ("salt", adv.SALTOptions(merge="observation", scale_by_std=False)),
    ("salt", adv.SALTOptions(merge="content", unbiased_std=False)),
    ("tree_grpo", adv.TreeGRPOOptions()),
    ("tree_grpo", adv.TreeGRPOOptions(mode="two_stage", unbiased_std=False)),
    ("treeps", adv.TreePSOptions()),
    ("treeps", adv.TreePSOptions(normalize=True, episode_weight=0.5)),
    ("portool", adv.PORToolOptions()),
    ("portool", adv.PORToolOptions(beta=0.8, unbiased_std=False)),
    ("portool_tool", adv.PORToolToolOptions(tool_weight=0.3)),
]
IDS = [f"{n}-{i}" for i, (n, _) in enumerate(CASES)]


@functools.lru_cache(maxsize=None)
def compiled(name):
    return jax.jit(adv.get_estimator(name), static_argnames="options")


def tool_success(forest, seed=0):
    """[P, N]: 1 / 0 / NaN (no call) / -1 (no call) per node."""
    rng = np.random.default_rng(seed)
    return rng.choice(np.array([1.0, 0.0, np.nan, -1.0], np.float32), forest.node_parent.shape)


def check(name, options, forest, R):
    inputs = {"tool_success_PxN": tool_success(forest)} if name == "portool_tool" else {}
    out = compiled(name)(forest, R, options=options, **inputs)
    kind, values = ref.expected(name, options, forest, R, **inputs)
    got = out.leaves if kind == "leaves" else out.segments
    np.testing.assert_allclose(np.asarray(got), values, **TOL)
    np.testing.assert_allclose(np.asarray(out.tokens), ref.to_tokens(forest, kind, values), **TOL)
    np.testing.assert_array_equal(np.asarray(out.loss_mask), np.asarray(forest.loss_mask))
    tokens = np.asarray(out.tokens)
    assert np.all(tokens[np.asarray(forest.loss_mask) == 0] == 0)  # exactly 0: observation tokens and padding
    assert np.all(np.isfinite(tokens))


@pytest.mark.parametrize("name,options", CASES, ids=IDS)
def test_matches_reference_on_turn_forests(name, options):
    f = big_forest()
    R = np.array([[1, 0, 1, 1, 0, 1, 0, 0.5], [0, 1, 0.5, 1, 1, 0, 0, 1]], np.float32)
    check(name, options, f, R)
    for seed in range(3):
        check(name, options, *random_turn_forest(seed))


# one case per estimator in the default run; the option variants (one more compilation each) are slow
_FIRST = {n: i for i, (n, _) in reversed(list(enumerate(CASES)))}
FIXED_CASES = [c if _FIRST[c[0]] == i else pytest.param(*c, marks=pytest.mark.slow) for i, c in enumerate(CASES)]


@pytest.mark.parametrize("name,options", FIXED_CASES, ids=IDS)
def test_matches_reference_on_fixed_segments(name, options):
    """Forests of fixed segments (``forest_from_paths``: no spans, no observation tokens): every node is a
    segment, states are node identities, ``content`` merging compares the segments' tokens."""
    rng = np.random.default_rng(5)
    for _ in range(2):
        f = random_forest(rng, 2, 5, 3, 2, vocab_size=3)
        f, R = with_copies(rng, f, rng.choice(np.array([0.0, 1.0], np.float32), (2, 5)), 0.3)
        check(name, options, f, R)


def test_observation_keys_match_content_not_position():
    f = big_forest()
    h, c = (np.asarray(x)[0] for x in node_state_keys(f))
    # nodes 3 (slot 0, depth 2) and 7 (slot 4, depth 2): same observation after actions of different lengths
    assert c[0, 2] == c[4, 2] == 2 and np.array_equal(h[0, 2], h[4, 2])
    assert c[0, 1] == 2 and c[4, 1] == 3 and not np.array_equal(h[0, 1], h[4, 1])
    assert np.array_equal(h[1, 3], h[5, 3])  # nodes 6 and 10: observation [60]
    assert c[2, 2] == 0 and np.all(c[:, 0] == 0)  # node 4 has no observation; the root none
    ha, ca = (np.asarray(x)[0] for x in node_state_keys(f, "all"))
    assert np.array_equal(ha[1, 3], ha[5, 3]) and ca[1, 3] == 2
    assert not np.array_equal(ha[0, 2], ha[4, 2])  # different actions


def _segments(name, options, **inputs):
    return np.asarray(compiled(name)(small_forest(), SMALL_R, options=options, **inputs).segments)[0]


def test_gigpo_hand_computed():
    # gamma = 0.5: returns G(1) = mean(0.5, 0) = 0.25, G(2) = 0.5, G(6) = 0 (w3, w4: two slots); depth 2: 1, 0, 1.
    # Episode: R - 0.4. Root group (5 slot-steps) mean 0.2 -> A^S = 0.05, 0.05, 0.3, -0.2, -0.2.
    # Depth 2: parents 1 and 2 share observation [50] -> one group {1, 0, 1}, mean 2/3.
    got = _segments("gigpo", adv.GiGPOOptions(gamma=0.5))
    expected = [[0.65, 0.6 + 1 / 3], [-0.35, -0.4 - 2 / 3], [0.9, 0.6 + 1 / 3], [-0.6, 0.0], [-0.6, 0.0]]
    np.testing.assert_allclose(got, expected, **TOL)
    # without matching, node 5 is alone under node 2 (A^S = 0) and 3, 4 are +-0.5 around 0.5
    got = _segments("gigpo", adv.GiGPOOptions(gamma=0.5, match_observations=False))
    np.testing.assert_allclose(got[:3, 1], [1.1, -0.9, 0.6], **TOL)


def test_hgpo_hand_computed():
    # level 1 = GiGPO's step groups (a_1 above); level 2 (depth-2 steps only: parent [50] and the root) is the same
    # group, so a_2 = a_1 with weight 2; the trajectory term R - 0.4 joins with weight 1:
    # depth 1: (a_1 + A^E) / 2;  depth 2: (3 a_1 + A^E) / 4.
    got = _segments("hgpo", adv.HGPOOptions(gamma=0.5, max_observations=2, trajectory_weight=1.0))
    expected = [[0.325, 0.4], [-0.175, -0.6], [0.45, 0.4], [-0.3, 0.0], [-0.3, 0.0]]
    np.testing.assert_allclose(got, expected, **TOL)


def test_salt_hand_computed():
    # A = R - 0.4 (no std); node 1 holds slots 0, 1 -> 0.1; node 6 holds two slots of -0.4.
    got = _segments("salt", adv.SALTOptions(scale_by_std=False))
    np.testing.assert_allclose(got, [[0.1, 0.6], [0.1, -0.4], [0.6, 0.6], [-0.4, 0.0], [-0.4, 0.0]], **TOL)
    # merged by observation: nodes 1 and 2 (both [50] at depth 1) -> mean(0.6, -0.4, 0.6)
    got = _segments("salt", adv.SALTOptions(merge="observation", scale_by_std=False))
    np.testing.assert_allclose(got[:, 0], [0.8 / 3, 0.8 / 3, 0.8 / 3, -0.4, -0.4], **TOL)


def test_tree_grpo_hand_computed():
    # inter: R - 0.4 over std sqrt(0.3); intra: tree {w0, w1} -> +-0.5 / sqrt(0.5); tree {w2} alone and tree
    # {w3, w4} (equal rewards) -> 0.
    out = compiled("tree_grpo")(small_forest(), SMALL_R, options=adv.TreeGRPOOptions())
    s = np.sqrt(0.3)
    expected = [0.6 / s + np.sqrt(0.5), -0.4 / s - np.sqrt(0.5), 0.6 / s, -0.4 / s, -0.4 / s]
    np.testing.assert_allclose(np.asarray(out.leaves)[0], expected, **TOL)
    assert out.segments is None


def test_treeps_hand_computed():
    # V(root) = 0.4, V(1) = 0.5, V(2) = 1, V(6) = 0, V(3) = 1, V(4) = 0, V(5) = 1
    got = _segments("treeps", adv.TreePSOptions())
    np.testing.assert_allclose(got, [[0.1, 0.5], [0.1, -0.5], [0.6, 0.0], [-0.4, 0.0], [-0.4, 0.0]], **TOL)


def test_portool_hand_computed():
    # A_traj = (R - 0.4) / sqrt(0.3); root fork: V = 0.5, 1, 0 (mean 0.5, std 0.5) -> 0, 1, -1; node 1's fork:
    # V = 1, 0 -> +-1/sqrt(2); node 2 has one child -> 0. A = (A_traj + A_fork) / 2.
    t1, t0 = 0.6 / np.sqrt(0.3), -0.4 / np.sqrt(0.3)
    h = np.sqrt(0.5)
    expected = [[t1 / 2, (t1 + h) / 2], [t0 / 2, (t0 - h) / 2], [(t1 + 1) / 2, t1 / 2], [(t0 - 1) / 2, 0.0],
                [(t0 - 1) / 2, 0.0]]
    np.testing.assert_allclose(_segments("portool", adv.PORToolOptions()), expected, **TOL)


def test_portool_tool_hand_computed():
    # lambda = 0.5, node 1 succeeded, node 2 failed, others made no call (NaN / -1): returns from depth 1:
    # 1.5, 0.5, 1, 0, 0 (mean 0.6, var 0.425); V(1) = 1, V(2) = 1, V(6) = 0 -> root fork (1/3, 1/3, -2/3) / sqrt(1/3).
    succ = np.full((1, 7), np.nan, np.float32)
    succ[0, 1], succ[0, 2], succ[0, 3] = 1.0, 0.0, -1.0
    got = _segments("portool_tool", adv.PORToolToolOptions(tool_weight=0.5), tool_success_PxN=succ)
    t = np.array([0.9, -0.1, 0.4, -0.6, -0.6]) / np.sqrt(0.425)
    f = np.array([1 / 3, 1 / 3, -2 / 3]) / np.sqrt(1 / 3)
    h = np.sqrt(0.5)
    expected = [[(t[0] + f[0]) / 2, (t[0] + h) / 2], [(t[1] + f[0]) / 2, (t[1] - h) / 2],
                [(t[2] + f[1]) / 2, t[2] / 2], [(t[3] + f[2]) / 2, 0.0], [(t[4] + f[2]) / 2, 0.0]]
    np.testing.assert_allclose(got, expected, **TOL)


def test_tokens_follow_nodes_and_skip_observations():
    """Each policy token of a node carries its step's value; observation tokens (loss_mask 0) are exactly 0."""
    f = small_forest()
    out = compiled("treeps")(f, SMALL_R, options=adv.TreePSOptions())
    tok = np.asarray(out.tokens)[0]
    # slot 2: node 2 = action [12, 13] + observation [50], then node 5 = action [16]
    np.testing.assert_allclose(tok[2, :4], [0.6, 0.6, 0.0, 0.0], **TOL)
    assert np.asarray(f.loss_mask)[0, 2, 2] == 0 and tok[2, 2] == 0.0


def test_equal_rewards_give_exact_zeros():
    """All slots rewarded alike (0.7, not a binary fraction): every advantage is exactly 0 (gamma = 1: with
    discounting, shorter paths to the same reward are legitimately better)."""
    f = big_forest()
    R = np.full((2, 8), 0.7, np.float32)
    cases = [("gigpo", adv.GiGPOOptions(gamma=1.0, mode="mean_std_norm")),
             ("hgpo", adv.HGPOOptions(gamma=1.0, scale_by_std=True, trajectory_weight=1.0)), *CASES[4:]]
    for name, options in cases:
        inputs = {"tool_success_PxN": np.zeros((2, N_), np.float32)} if name == "portool_tool" else {}
        out = compiled(name)(f, R, options=options, **inputs)
        assert np.all(np.asarray(out.tokens) == 0), name


def test_registry_and_inputs():
    for name in ("gigpo", "hgpo", "salt", "tree_grpo", "treeps", "portool", "portool_tool"):
        assert adv.get_estimator(name) is getattr(adv, name)
    assert adv.estimator_spec("portool_tool").inputs == ("tool_success_PxN",)
    assert adv.estimator_spec("portool").inputs == ()
    with pytest.raises(ValueError, match="tool_success_PxN"):
        adv.portool_tool(small_forest(), SMALL_R, tool_success_PxN=np.zeros((1, 3), np.float32))


@pytest.mark.parametrize("cls,kwargs", [
    (adv.GiGPOOptions, dict(mode="std")), (adv.GiGPOOptions, dict(gamma=0.0)), (adv.GiGPOOptions, dict(omega=-1.0)),
    (adv.GiGPOOptions, dict(eps=0.0)), (adv.HGPOOptions, dict(max_observations=0)),
    (adv.HGPOOptions, dict(weight_offset=-1)), (adv.HGPOOptions, dict(alpha=float("nan"))),
    (adv.HGPOOptions, dict(trajectory_weight=-0.5)), (adv.HGPOOptions, dict(gamma=1.5)),
    (adv.SALTOptions, dict(merge="graph")), (adv.SALTOptions, dict(eps=-1e-6)),
    (adv.TreeGRPOOptions, dict(mode="product")), (adv.TreePSOptions, dict(episode_weight=-1.0)),
    (adv.PORToolOptions, dict(beta=1.5)), (adv.PORToolToolOptions, dict(beta=-0.1)),
    (adv.PORToolToolOptions, dict(tool_weight=float("inf"))),
])
def test_options_validation(cls, kwargs):
    with pytest.raises(ValueError):
        cls(**kwargs)
