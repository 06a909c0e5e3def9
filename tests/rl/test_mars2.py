"""MARS²'s path-level group advantage (treejax.rl.advantages.mars2): against a slow pure-Python reference on
hand-made trees, numbers worked by hand, the agent labels and per-agent token masks, option and run checks, and one
loop step of configs/efficacy_mars2.gin on the tiny model."""

import math
import os

import jax
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.forest import forest_from_paths
from treejax.rl.advantages import estimator_spec, get_estimator
from treejax.rl.advantages.mars2 import MARS2Options, agent_token_masks, mars2

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")

# Prompt 0: node 1 splits into 3 and 4 (4 stops at depth 2), 3 into 6 and 7; node 2 is a chain 2 -> 5 -> 8.
# Prompt 1: node 1 splits into 2 and 3 (both stop), node 4 -> 5 splits into 6 and 7.
PATHS = np.array([[[0, 1, 3, 6], [0, 1, 3, 7], [0, 1, 4, -1], [0, 2, 5, 8]],
                  [[0, 1, 2, -1], [0, 1, 3, -1], [0, 4, 5, 6], [0, 4, 5, 7]]])
LENGTHS = np.array([[6, 6, 4, 5], [4, 3, 6, 6]])  # segment length 2: the last segment may be shorter
REWARDS = np.array([[1.0, 0.0, 1.0, 0.0], [0.5, -1.0, 1.0, 1.0]], np.float32)
S = 2


def _forest():
    return forest_from_paths(PATHS, LENGTHS, S)


# ------------------------------------------------------------------------------- the slow reference
def _reference_nodes(paths, rewards, K, assignment):
    """One prompt, plain Python: per node id its leaves, parent, depth, mass share and agent."""
    leaves, parent, depth = {}, {}, {}
    for w, path in enumerate(paths):
        ids = [int(n) for n in path if n >= 0]
        for d, n in enumerate(ids):
            leaves.setdefault(n, []).append(w)
            depth[n] = d
            parent[n] = ids[d - 1] if d else -1
    children = {n: [m for m in parent if parent[m] == n] for n in parent}
    omega = []  # each leaf's path mass times W (forest_from_paths' leaf_weight)
    for path in paths:
        ids = [int(n) for n in path if n >= 0]
        omega.append(len(paths) * math.prod(1.0 / len(children[a]) for a in ids[:-1]))
    firsts = sorted(n for n in parent if depth[n] == 1)
    agent = {}
    for n in parent:
        if depth[n] == 0:
            continue
        if assignment == "depth":
            agent[n] = (depth[n] - 1) % K
        else:
            a = n
            while depth[a] > 1:
                a = parent[a]
            agent[n] = firsts.index(a) % K
    return leaves, parent, depth, children, omega, agent


def _reference_prompt(paths, rewards, opt: MARS2Options):
    leaves, parent, depth, children, omega, agent = _reference_nodes(paths, rewards, opt.agents, opt.assignment)
    value = {n: sum(omega[w] * rewards[w] for w in ws) / sum(omega[w] for w in ws) for n, ws in leaves.items()}
    mass = {n: sum(omega[w] for w in ws) / sum(omega) for n, ws in leaves.items()}
    shaped = {}
    for n in agent:
        sibs = [s for s in children[parent[n]] if s != n]
        sib = sum(value[s] for s in sibs) / len(sibs) if sibs else None
        par = value[parent[n]] if depth[n] >= 2 else None
        if par is not None and sib is not None:
            base = (1 - opt.lam) * par + opt.lam * sib
        else:
            base = par if par is not None else sib
        shaped[n] = value[n] if base is None else value[n] + opt.gamma * (value[n] - base)
    adv = {}
    for n in shaped:
        group = [m for m in shaped if opt.group == "tree" or agent[m] == agent[n]]
        u = {m: mass[m] if opt.node_weight == "mass" else 1.0 for m in group}
        mu = sum(u[m] * shaped[m] for m in group) / sum(u.values())
        sd = math.sqrt(sum(u[m] * (shaped[m] - mu) ** 2 for m in group) / sum(u.values()))
        adv[n] = (shaped[n] - mu) / (sd + opt.eps) if opt.scale else shaped[n] - mu
    return adv, agent


def _reference_tokens(opt: MARS2Options):
    tokens = np.zeros((2, 4, 6), np.float64)  # T = D S = 3 x 2
    for p in range(2):
        adv, _ = _reference_prompt(PATHS[p], REWARDS[p], opt)
        for w in range(4):
            for t in range(LENGTHS[p, w]):
                tokens[p, w, t] = adv[int(PATHS[p, w, t // S + 1])]
    return tokens


OPTIONS = [MARS2Options(), MARS2Options(node_weight="uniform"),
           MARS2Options(agents=2, group="agent"), MARS2Options(agents=2, assignment="branch", group="agent"),
           MARS2Options(gamma=1.5, lam=0.2, scale=False), MARS2Options(gamma=0.0, agents=3, group="agent"),
           MARS2Options(lam=1.0, node_weight="uniform", agents=2, group="agent")]


@pytest.mark.parametrize("opt", OPTIONS, ids=lambda o: f"{o.gamma}-{o.lam}-{o.agents}{o.assignment}-{o.group}-"
                                                       f"{o.node_weight}-{o.scale}")
def test_the_estimator_matches_the_slow_reference(opt):
    f = _forest()
    adv = jax.jit(lambda fo, r: mars2(fo, r, opt))(f, REWARDS)
    np.testing.assert_allclose(np.asarray(adv.tokens), _reference_tokens(opt), rtol=2e-5, atol=2e-5)
    np.testing.assert_array_equal(np.asarray(adv.loss_mask), np.asarray(f.loss_mask))
    assert adv.leaves is None and adv.segments.shape == (2, 4, 3)


def test_the_small_tree_by_hand():
    """Leaves [0,1,3], [0,1,4], [0,2,5], rewards 1, 0, 0, every node one sample. V(1) = 0.5, V(2) = 0; the first
    segments have no parent reward, so b(1) = V(2) and b(2) = V(1): r~(1) = 0.75, r~(2) = -0.25. b(3) = 0.5 V(1)
    + 0.5 V(4) = 0.25 -> r~(3) = 1.375; b(4) = 0.5 V(1) + 0.5 V(3) = 0.75 -> r~(4) = -0.375; node 5 has no
    sibling, b(5) = V(2) = 0 -> r~(5) = 0. Mean 0.3, population std sqrt(2.20625 / 5)."""
    f = forest_from_paths(np.array([[[0, 1, 3], [0, 1, 4], [0, 2, 5]]]), np.array([[2, 2, 2]]), 1)
    a = mars2(f, np.array([[1.0, 0.0, 0.0]]), MARS2Options(node_weight="uniform", eps=1e-12))
    sd = math.sqrt(2.20625 / 5)
    want = np.array([[[0.45, 1.075], [0.45, -0.675], [-0.55, -0.3]]]) / sd
    np.testing.assert_allclose(np.asarray(a.segments), want, rtol=1e-5)
    np.testing.assert_allclose(np.asarray(a.tokens), want, rtol=1e-5)  # one token per segment


def test_the_prompt_by_hand_with_path_masses():
    """Prompt 0 of PATHS, gamma = 0 (no shaping), centred only, mass-weighted: leaf masses 1/8, 1/8, 1/4, 1/2, so
    V(1) = (1/8 + 1/4) / (1/2) = 0.75, V(2) = V(5) = V(8) = 0, V(3) = 0.5, V(4) = 1, V(6) = 1, V(7) = 0; node
    masses 1/2, 1/2, 1/4, 1/4, 1/2, 1/8, 1/8, 1/2 sum to 2.75; mu = (0.375 + 0.125 + 0.25 + 0.125) / 2.75."""
    a = mars2(_forest(), REWARDS, MARS2Options(gamma=0.0, scale=False))
    mu = 0.875 / 2.75
    v = {1: 0.75, 2: 0.0, 3: 0.5, 4: 1.0, 5: 0.0, 6: 1.0, 7: 0.0, 8: 0.0}
    want = [[v[int(n)] - mu if n >= 0 else 0.0 for n in path[1:]] for path in PATHS[0]]
    np.testing.assert_allclose(np.asarray(a.segments)[0], np.array(want), rtol=1e-6, atol=1e-7)


def test_equal_rewards_give_exactly_zero():
    r = np.full((2, 4), 0.7, np.float32)
    for opt in OPTIONS:
        assert np.all(np.asarray(mars2(_forest(), r, opt).tokens) == 0.0)


def test_registered_with_its_options():
    spec = estimator_spec("mars2")
    assert spec.options_cls is MARS2Options and spec.inputs == () and get_estimator("mars2") is mars2


# ------------------------------------------------------------------------------- agents
def test_agent_masks_by_depth_and_by_branch():
    f = _forest()
    depth = np.asarray(agent_token_masks(f, MARS2Options(agents=2)))
    branch = np.asarray(agent_token_masks(f, MARS2Options(agents=2, assignment="branch")))
    mask = np.asarray(f.loss_mask)
    assert depth.shape == branch.shape == (2, 2, 4, 6)
    for m in (depth, branch):  # every trained token is one agent's, and no other token is
        np.testing.assert_array_equal(m.sum(axis=0), mask)
    # depth: agent 0 writes segments 1 and 3 (tokens 0-1, 4-5), agent 1 segment 2 (tokens 2-3)
    np.testing.assert_array_equal(depth[0, 0, 0], [1, 1, 0, 0, 1, 1])
    np.testing.assert_array_equal(depth[1, 0, 2], [0, 0, 1, 1, 0, 0])  # leaf of length 4
    # branch: prompt 0's first segments are nodes 1 (agent 0) and 2 (agent 1); prompt 1's are 1 and 4
    np.testing.assert_array_equal(branch[0, 0, :, 0], [1, 1, 1, 0])
    np.testing.assert_array_equal(branch[1, 0, 3], [1, 1, 1, 1, 1, 0])  # leaf 3 of prompt 0: length 5
    np.testing.assert_array_equal(branch[1, 1, :, 0], [0, 0, 1, 1])
    _, agent = _reference_prompt(PATHS[1], REWARDS[1], MARS2Options(agents=2, assignment="branch"))
    assert agent == {1: 0, 2: 0, 3: 0, 4: 1, 5: 1, 6: 1, 7: 1}


def test_agent_groups_normalise_each_agent_apart():
    """With group = 'agent' each agent's nodes of a prompt have mass-weighted mean 0 and std 1."""
    opt = MARS2Options(agents=2, group="agent", eps=1e-12)
    f = _forest()
    adv = np.asarray(mars2(f, REWARDS, opt).segments)
    for p in range(2):
        _, agent = _reference_prompt(PATHS[p], REWARDS[p], opt)
        leaves, *_, omega, _ = _reference_nodes(PATHS[p], REWARDS[p], 2, "depth")
        node_adv = {int(PATHS[p, w, k + 1]): adv[p, w, k]
                    for w in range(4) for k in range(3) if PATHS[p, w, k + 1] >= 0}
        for k in range(2):
            nodes = [n for n in agent if agent[n] == k]
            u = np.array([sum(omega[w] for w in leaves[n]) for n in nodes])
            x = np.array([node_adv[n] for n in nodes])
            assert abs(np.sum(u * x) / u.sum()) < 1e-5
            assert abs(np.sqrt(np.sum(u * x ** 2) / u.sum()) - 1.0) < 1e-4


# ------------------------------------------------------------------------------- checks
@pytest.mark.parametrize("kw, text", [
    ({"assignment": "turns"}, "MARS2Options.assignment = 'depth'"), ({"group": "node"}, "MARS2Options.group"),
    ({"node_weight": "count"}, "node_weight"), ({"agents": 0}, "MARS2Options.agents = 2"),
    ({"lam": 1.5}, "MARS2Options.lam = 0.5"), ({"gamma": -1.0}, "gamma = 0.5"), ({"eps": 0.0}, "eps = 1e-6"),
    ({"group": "agent"}, "MARS2Options.agents = 2 (or group = 'tree')"),
])
def test_option_errors_name_the_fix(kw, text):
    with pytest.raises(ConfigError, match="fix:") as err:
        MARS2Options(**kw)
    assert text in str(err.value)


@pytest.mark.parametrize("params, text", [
    (["MARS2Options.agents = 9"], "fix: TreeConfig.max_depth = 9 (or more)"),
    (["MARS2Options.assignment = 'branch'", "MARS2Options.agents = 3"], "fix: TreeConfig.init_divergence = 3"),
])
def test_the_shipped_config_parses_and_refuses_trees_without_room_for_every_agent(params, text):
    from treejax import train

    path = os.path.join(CONFIGS, "efficacy_mars2.gin")
    cfg = train.parse([path], [])
    assert cfg.estimator == "mars2" and cfg.estimator_options.agents == 2
    with pytest.raises(ConfigError) as err:
        train.parse([path], params)
    assert text in str(err.value)


# ------------------------------------------------------------------------------- the whole loop
@pytest.mark.slow  # one step of the shipped config through treejax.train.main on the tiny model; the estimator,
# its masks and checks are covered by the default tests above
def test_one_loop_step_of_the_shipped_config(tiny_checkpoint, tmp_path):
    from treejax.testing.runs import run_shipped

    row = run_shipped("efficacy_mars2.gin", tiny_checkpoint, tmp_path / "run",
                      extra=("RunConfig.dynamic_sampling = False",))
    assert np.isfinite(row["update/grad_norm"])
