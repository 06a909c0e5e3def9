"""SLATE: the estimator against hand-computed numbers and a plain-Python loop, its config checks, the shipped config,
and one RL step (collect -> judge every step -> learn) on a tiny model."""

import math
import os

import jax
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.forest import forest_from_paths
from treejax.rl.advantages.slate import SLATEOptions, slate
from treejax.rl.judges.slate import SLATEConfig

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
nan = math.nan


def slate_reference(paths_WxD1, judge_WxD, rewards_W, o: SLATEOptions) -> np.ndarray:
    """[W, D] by plain loops: step rewards, each distinct child of a node once (its first slot's reward), z-scores
    among the children (unbiased std), 0 without a sibling."""
    W, D1 = paths_WxD1.shape
    D = D1 - 1
    depth = [int(sum(1 for d in range(1, D1) if paths_WxD1[w, d] >= 0)) if paths_WxD1[w, 0] >= 0 else 0
             for w in range(W)]
    r = np.zeros((W, D))
    for w in range(W):
        for d in range(depth[w]):
            s = float(judge_WxD[w, d])
            r[w, d] = 0.0 if math.isnan(s) else 2 * s - 1
            if d == depth[w] - 1:
                r[w, d] += o.outcome_coef * float(rewards_W[w]) + o.bonus * (D - depth[w]) / D
    node_r, children = {}, {}
    for w in range(W):
        for d in range(depth[w]):
            node, parent = int(paths_WxD1[w, d + 1]), int(paths_WxD1[w, d])
            if node not in node_r:
                node_r[node] = r[w, d]
                children.setdefault(parent, []).append(node)
    out = np.zeros((W, D))
    for w in range(W):
        for d in range(depth[w]):
            sib = [node_r[c] for c in children[int(paths_WxD1[w, d])]]
            if len(sib) < 2:
                continue
            mean = sum(sib) / len(sib)
            std = math.sqrt(sum((v - mean) ** 2 for v in sib) / (len(sib) - 1))
            out[w, d] = (r[w, d] - mean) / (std + o.eps)
    return out


def hand_case():
    # root -> n1 -> {n3 (w0), n4 (w1)};  root -> n2 (w2 ends after one step);  root -> n5 -> n6 (w3)
    paths = np.array([[[0, 1, 3], [0, 1, 4], [0, 2, -1], [0, 5, 6]]])
    forest = forest_from_paths(paths, np.array([[2, 2, 1, 2]]), 1)
    judge = np.array([[[0.75, 0.5], [0.75, 1.0], [0.25, nan], [0.5, 0.5]]], np.float32)
    rewards = np.array([[1.0, -1.0, 1.0, -1.0]], np.float32)
    return forest, judge, rewards


def test_hand_computed():
    forest, judge, rewards = hand_case()
    # r = [[.5, 1], [.5, 0], [.55 (= -.5 + 1 + .1 x (2 - 1) / 2), -], [0, -1]]
    # depth 1: {n1, n2, n5} = .5, .55, 0: mean .35, std sqrt(.185 / 2) = .304138
    # depth 2: {n3, n4} = 1, 0: mean .5, std .707107;  n6 has no sibling
    want = np.array([[[0.15 / 0.304138, 0.5 / 0.707107], [0.15 / 0.304138, -0.5 / 0.707107],
                      [0.2 / 0.304138, 0.0], [-0.35 / 0.304138, 0.0]]])
    np.testing.assert_allclose(want, [[[0.49320, 0.70711], [0.49320, -0.70711], [0.65759, 0], [-1.15079, 0]]],
                               atol=1e-5)
    out = jax.jit(slate)(forest, rewards, step_judge_PxWxD=judge)
    np.testing.assert_allclose(np.asarray(out.segments), want, rtol=1e-5, atol=1e-6)
    # each token takes its step's advantage (segments of one token); nothing past a leaf's end
    np.testing.assert_allclose(np.asarray(out.tokens), want, rtol=1e-5, atol=1e-6)
    np.testing.assert_array_equal(np.asarray(out.loss_mask), np.asarray(forest.loss_mask))
    # no bonus, no outcome: the judge's steps alone; equal judge scores among siblings give exactly 0
    flat = np.full_like(judge, 0.5)
    out = slate(forest, rewards, SLATEOptions(bonus=0.0, outcome_coef=0.0), step_judge_PxWxD=flat)
    assert np.all(np.asarray(out.segments) == 0.0)


def test_jitted_equals_the_python_loop_on_random_trees():
    from treejax.testing.forests import random_forest, with_copies

    rng = np.random.default_rng(3)
    fn = jax.jit(slate, static_argnames="options")
    for i in range(12):
        forest = random_forest(rng, 3, 6, 4, 2, max_branch=3)
        rewards = rng.choice([-1.0, 1.0], (3, 6)).astype(np.float32)
        if i % 3 == 2:
            forest, rewards = with_copies(rng, forest, rewards, 0.4)
        judge = rng.uniform(0, 1, (3, 6, 4)).astype(np.float32)
        judge[rng.uniform(size=judge.shape) < 0.15] = nan
        o = SLATEOptions() if i % 2 else SLATEOptions(bonus=0.5, outcome_coef=0.5)
        got = np.asarray(fn(forest, rewards, o, step_judge_PxWxD=judge).segments)
        paths = np.asarray(forest.leaf_path)
        want = np.stack([slate_reference(paths[p], judge[p], rewards[p], o) for p in range(3)])
        np.testing.assert_allclose(got, want, rtol=2e-5, atol=2e-5)
        assert np.any(got != 0)


def test_config_checks_refuse_what_does_not_fit():
    from treejax.rl.config import RunConfig
    from treejax.sampling.tree import TreeConfig

    RunConfig(rollouts=[SLATEConfig()], estimator="slate")
    with pytest.raises(ConfigError, match=r"SLATEConfig supplies .* the run's estimator is 'grpo'.*fix: "
                                          r"RunConfig.estimator = 'slate'$"):
        RunConfig(rollouts=[SLATEConfig()], estimator="grpo")
    with pytest.raises(ConfigError, match=r"estimator 'slate' reads \['step_judge_PxWxD'\].*fix: .*"
                                          r"RunConfig.rollouts = \[@SLATEConfig\(\)\]$"):
        RunConfig(estimator="slate")
    with pytest.raises(ConfigError, match=r"TreeConfig.branch_factor = 1 gives every node one child.*fix: "
                                          r"TreeConfig.branch_factor = 2$"):
        RunConfig(rollouts=[SLATEConfig()], estimator="slate",
                  rollout=TreeConfig(num_leaves=4, branch_factor=1, init_divergence=4))
    with pytest.raises(ConfigError, match="SLATEConfig needs verifier rewards"):
        RunConfig(rollouts=[SLATEConfig()], estimator="slate", reward_source="majority")
    with pytest.raises(ConfigError, match=r"SLATEConfig.scorer must be a ScorerConfig.*fix: SLATEConfig.scorer"):
        SLATEConfig(scorer="smollm2")
    with pytest.raises(ValueError, match=r"SLATEOptions.bonus must be a finite number >= 0.*fix: SLATEOptions.bonus"):
        SLATEOptions(bonus=-0.1)
    with pytest.raises(ValueError, match="SLATEOptions.eps"):
        SLATEOptions(eps=0.0)
    forest, judge, rewards = hand_case()
    with pytest.raises(ValueError, match=r"step_judge_PxWxD has shape \(1, 4, 3\)"):
        slate(forest, rewards, step_judge_PxWxD=np.zeros((1, 4, 3), np.float32))


def test_gin_builds_the_shipped_config():
    from treejax.gin_surface import parse
    from treejax.scorers import ScorerConfig

    cfg = parse([os.path.join(CONFIGS, "efficacy_slate.gin")], [], check_mesh=False)
    (stage,) = cfg.rollouts
    assert isinstance(stage, SLATEConfig) and stage.scorer == ScorerConfig(model="smollm2-135m-instruct")
    assert cfg.estimator == "slate" and cfg.estimator_options == SLATEOptions(eps=1e-6, bonus=0.1)
    assert cfg.rollout.branch_factor == 2 and not cfg.dynamic_sampling


def judged_tree():
    """``(source, scorer, tokens, prompts)``: the SLATE wrapper around a fixed tree of a tiny model's tokens (no
    sampler compile), its judge the same tiny model. Slots through one node share its tokens; prompt 1's slot 1
    copies slot 0."""
    from judge_steps_helpers import FixedForestSource, JudgeTokenizer, tiny_policy_and_judge

    from treejax.rl.judges.steps import StepJudgedRollouts

    cfg, params, scorer = tiny_policy_and_judge()
    rng = np.random.default_rng(0)
    paths = np.array([[[0, 1, 3], [0, 1, 4], [0, 2, -1], [0, 5, 6]], [[0, 1, 2], [0, 1, 2], [0, 3, 4], [0, 3, 5]]])
    lengths = np.array([[6, 5, 2, 6], [5, 5, 6, 4]])
    tokens = rng.integers(0, 62, (2, 4, 6))
    for p, a, b in ((0, 0, 1), (1, 0, 1), (1, 2, 3)):
        tokens[p, b, :3] = tokens[p, a, :3]
    tokens[1, 1] = tokens[1, 0]
    forest = forest_from_paths(paths, lengths, 3, tokens=tokens)
    prompts, lens = np.array([[1, 5, 9, 2], [1, 11, 3, 4]], np.int32), np.array([3, 4], np.int32)
    base = FixedForestSource(forest, [[1, -1, 1, -1], [1, 1, -1, 1]], prompts, lens)
    source = StepJudgedRollouts(base, SLATEConfig(scorer=scorer.config), JudgeTokenizer(), "unused")
    source.scorer = scorer
    return source, (cfg, params, scorer), tokens, prompts


def test_the_wrapper_scores_every_step_of_every_leaf():
    """Every step of every leaf gets the PRM's score (a direct ``step_scores`` of the leaf's segments; a copied slot
    its first copy's; NaN past a leaf's steps), the rewards pass unchanged, and the estimator runs on it."""
    from judge_steps_helpers import JudgeTokenizer

    from treejax.rl.judges.steps import leaf_step_texts
    from treejax.scorers.prm import step_scores

    source, (_, _, scorer), tokens, prompts = judged_tree()
    ro = source.sample(None, None, 0)
    judge = np.asarray(ro.estimator_inputs["step_judge_PxWxD"])
    assert judge.shape == (2, 4, 2)
    np.testing.assert_array_equal(np.isfinite(judge), [[[1, 1], [1, 1], [1, 0], [1, 1]], [[1, 1]] * 4])
    steps = leaf_step_texts(JudgeTokenizer(), ro.forest)
    assert steps[0][2] == [JudgeTokenizer().decode(tokens[0, 2, :2].tolist())]
    assert steps[0][0] == [JudgeTokenizer().decode(tokens[0, 0, :3].tolist()),
                           JudgeTokenizer().decode(tokens[0, 0, 3:6].tolist())]
    q = JudgeTokenizer().decode(prompts[1, :4].tolist())
    np.testing.assert_allclose(judge[1, 2], step_scores(scorer, [q], [steps[1][2]])[0], rtol=1e-5)
    np.testing.assert_array_equal(judge[1, 1], judge[1, 0])
    np.testing.assert_array_equal(np.asarray(ro.rewards_PxW), [[1, -1, 1, -1], [1, 1, -1, 1]])
    assert ro.extra_metrics["judge/scored"] == 15 and 0 < ro.extra_metrics["judge/mean"] < 1
    adv = slate(ro.forest, ro.rewards_PxW, step_judge_PxWxD=judge)
    assert np.all(np.isfinite(np.asarray(adv.tokens))) and np.any(np.asarray(adv.tokens) != 0)


@pytest.mark.slow  # the learner's compile: ~25 CPU s (40-60 s on the shared 2-core machine); the default run covers
# the judge side with test_the_wrapper_scores_every_step_of_every_leaf and the estimator with test_hand_computed
def test_one_rl_step_judges_every_step_and_trains_on_slate():
    """The loop's step (collect -> judge -> learn) with the SLATE wrapper and the ``slate`` estimator on a tiny
    model: the update trains on the step advantages (first PPO ratio 1, finite loss, a gradient)."""
    from judge_steps_helpers import check_one_rl_step

    source, (cfg, params, _), _, _ = judged_tree()
    check_one_rl_step(source, cfg, params, "slate", "step_judge_PxWxD")


@pytest.mark.slow  # the whole CLI on the tiny model (~60 s on 2 cores); the default run covers the same chain
# through test_one_rl_step_judges_every_step_and_trains_on_slate and the config through test_gin_builds_the_shipped_config
def test_one_loop_step_of_the_shipped_config(tiny_checkpoint, tmp_path):
    from treejax import train

    params = [f"RunConfig.model = '{tiny_checkpoint}'", f"RunConfig.log_dir = '{tmp_path / 'run'}'",
              "ScorerConfig.model = 'policy'", "ScorerConfig.batch_size = 8",
              "RunConfig.num_steps = 1", "RunConfig.prompts_per_step = 2", "TreeConfig.num_leaves = 4",
              "TreeConfig.max_depth = 2", "TreeConfig.segment_length = 4",
              "EvalConfig.num_problems = 2", "EvalConfig.max_new_tokens = 2", "EvalConfig.batch_size = 2",
              "RunConfig.eval_every = 0", "RunConfig.mini_batches = 1"]
    summary = train.main(["--gin_file", os.path.join(CONFIGS, "efficacy_slate.gin"), "--quiet"]
                         + sum((["--gin_param", p] for p in params), []))
    row = summary["history"][0]
    assert np.isfinite(row["update/loss"]) and "time/judge_s" in row and row["judge/scored"] > 0
