"""FAPO and SSL as judge stages of the rollout chain: their rewards against hand-computed numbers, their config
checks, the wrapper on a hand-made forest, gin, and one step of the whole loop with the judge on."""

import dataclasses
import math
import os

import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.rl.judges.fapo import FAPOConfig, fapo_rewards
from treejax.rl.judges.ssl import SSLConfig, ssl_rewards, tier_rewards
from treejax.scorers import ScorerConfig

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
nan = math.nan


def test_fapo_hand_computed():
    # +-1 rewards, lambda = 0.5 x 2 = 1: a flawed positive gets 0; a wrong leaf and an unparsed verdict keep theirs
    rewards = np.array([[1.0, 1.0, -1.0, 1.0], [0.75, -1.0, 1.0, 1.0]], np.float32)  # 0.75: an overlong penalty
    correct = np.array([[True, True, False, True], [True, False, True, True]])
    judge = np.array([[0.2, 0.8, 0.1, nan], [0.49, nan, 0.5, 0.51]], np.float32)
    out, flawed = fapo_rewards(rewards, correct, judge, "pm1")
    np.testing.assert_allclose(out, [[0.0, 1.0, -1.0, 1.0], [-0.25, -1.0, 1.0, 1.0]])
    assert flawed.tolist() == [[True, False, False, False], [True, False, False, False]]
    out, _ = fapo_rewards(np.array([[1, 1, 0, 1]], np.float32), correct[:1], judge[:1], "01")
    np.testing.assert_allclose(out, [[0.5, 1.0, 0.0, 1.0]])  # "01": lambda = 0.5
    out, _ = fapo_rewards(rewards[:1], correct[:1], judge[:1], "pm1", penalty=1.0, threshold=0.9)
    np.testing.assert_allclose(out, [[-1.0, -1.0, -1.0, 1.0]])  # penalty 1: a flawed positive counts as wrong


def test_ssl_hand_computed():
    # L = 2, alpha = 2, +-1: K = 3, g(k) = (2^k - 1) / 7 = 0, 1/7, 3/7, 1 -> r = -1, -5/7, -1/7, 1
    np.testing.assert_allclose(tier_rewards(2, 2.0, "pm1"), [-1.0, -5 / 7, -1 / 7, 1.0], rtol=1e-6)
    rewards = np.array([[-1.0, -1.0, 1.0, 1.0, 0.5, 1.0]], np.float32)  # 0.5: a correct leaf with penalty -0.5
    correct = np.array([[False, False, True, True, True, True]])
    judge = np.array([[0.2, 0.9, 0.3, 0.7, 1.0, nan]], np.float32)
    out, tiers = ssl_rewards(rewards, correct, judge, "pm1", levels=2, amplification=2.0)
    assert tiers.tolist() == [[0, 1, 2, 3, 3, 2]]
    np.testing.assert_allclose(out, [[-1.0, -5 / 7, -1 / 7, 1.0, 0.5, -1 / 7]], rtol=1e-6)
    # alpha = 1: equal gaps; "01": from 0 to 1; L = 3 -> K = 5
    np.testing.assert_allclose(tier_rewards(3, 1.0, "01"), [0, 0.2, 0.4, 0.6, 0.8, 1.0], atol=1e-7)
    # gaps grow by alpha, and every correct tier is above every wrong one
    r = tier_rewards(4, 1.5, "pm1")
    np.testing.assert_allclose(np.diff(r)[1:] / np.diff(r)[:-1], 1.5, rtol=1e-5)
    assert r[4:].min() > r[:4].max()


def test_ssl_with_one_level_is_the_verifier_reward():
    correct = np.array([[True, False, True]])
    out, _ = ssl_rewards(np.where(correct, 1.0, -1.0), correct, np.array([[0.1, 0.9, nan]]), "pm1", levels=1)
    np.testing.assert_allclose(out, [[1.0, -1.0, 1.0]])


def test_config_checks_refuse_what_does_not_fit():
    from treejax.rl.config import RunConfig

    with pytest.raises(ConfigError, match=r"FAPOConfig.penalty must be in \(0, 1\].*fix: FAPOConfig.penalty = 0.5"):
        FAPOConfig(penalty=1.5)
    with pytest.raises(ConfigError, match="FAPOConfig.threshold"):
        FAPOConfig(threshold=1.0)
    with pytest.raises(ConfigError, match="SSLConfig.levels must be in"):
        SSLConfig(levels=1)
    with pytest.raises(ConfigError, match="SSLConfig.amplification"):
        SSLConfig(amplification=0.5)
    with pytest.raises(ConfigError, match="scope must be one of"):
        RunConfig(rollouts=[FAPOConfig(scope="tokens")])
    with pytest.raises(ConfigError, match="FAPOConfig needs verifier rewards"):
        RunConfig(rollouts=[FAPOConfig()], reward_source="majority")
    with pytest.raises(ConfigError, match=r"estimator 'remax' reads \['greedy_reward_P'\].*fix: an estimator"):
        RunConfig(rollouts=[SSLConfig()], estimator="remax")
    cfg = RunConfig(rollouts=[FAPOConfig()], estimator="grpo")
    assert [type(s).__name__ for s in cfg.chain()] == ["TaskSource", "FAPOConfig"]


def test_gin_builds_the_shipped_configs():
    from treejax.gin_surface import parse

    for name, cls in (("efficacy_fapo.gin", FAPOConfig), ("efficacy_ssl.gin", SSLConfig)):
        cfg = parse([os.path.join(CONFIGS, name)], [], check_mesh=False)
        (stage,) = cfg.rollouts
        assert isinstance(stage, cls) and stage.scorer == ScorerConfig(model="smollm2-135m-instruct", batch_size=16)


class _Base:
    """A rollout source of one hand-made forest of 2 prompts x 4 leaves (random tokens of SmolLM2's vocabulary)."""

    def __init__(self, correct):
        from treejax.testing.forests import random_forest

        self.forest = random_forest(np.random.default_rng(0), 2, 4, 2, 4, vocab_size=2000)
        self.correct = np.asarray(correct)
        self.pipeline = None

    def sample(self, params, key, step):
        import jax.numpy as jnp

        from treejax.data.task_base import Example
        from treejax.rl.rollouts import Rollouts

        ex = [Example([], "42", {"uid": str(i), "question": f"What is {i} + 40?"}) for i in range(2)]
        return Rollouts(self.forest, jnp.asarray(np.where(self.correct, 1.0, -1.0), jnp.float32),
                        self.correct.astype(np.float32), np.zeros((2, 3), np.int32), np.array([3, 3], np.int32),
                        examples=ex, extra_metrics={"base/x": 1.0})


@pytest.mark.parametrize("stage", [FAPOConfig(), SSLConfig(levels=3, amplification=1.5)])
def test_the_wrapper_judges_the_leaves_and_rewrites_rewards(stage, tiny_checkpoint):
    from treejax.rl.judges.base import JudgedRollouts
    from treejax.rl.scoring import leaf_texts
    from treejax.scorers.judge import judge_scores
    from treejax.scorers.model import load_scorer

    correct = np.array([[True, False, True, True], [False, False, True, False]])
    scorer = load_scorer(ScorerConfig(model=tiny_checkpoint, batch_size=4))
    src = JudgedRollouts(_Base(correct), stage, scorer.tokenizer, "pm1", tiny_checkpoint)
    src.scorer = scorer
    ro = src.sample(None, None, 0)
    texts = leaf_texts(scorer.tokenizer, src.base.forest)
    judged = correct if isinstance(stage, FAPOConfig) else np.ones_like(correct)
    want_judge = np.full(correct.shape, np.nan, np.float32)
    for p, w in np.argwhere(judged):
        want_judge[p, w] = judge_scores(scorer, [f"What is {p} + 40?"], [texts[p][w]], ["42"])[0]
    want, _ = stage.shape(np.where(correct, 1.0, -1.0), correct, want_judge, "pm1")
    np.testing.assert_allclose(np.asarray(ro.rewards_PxW), want, rtol=1e-5, atol=1e-6)
    assert ro.extra_metrics["base/x"] == 1.0 and ro.extra_metrics["judge/scored"] == int(judged.sum())
    assert 0.0 <= ro.extra_metrics["judge/agreement"] <= 1.0


@pytest.mark.slow  # one step of the whole loop with the judge on the tiny model (~60 s on 2 cores)
@pytest.mark.parametrize("name,sharding", [("efficacy_fapo.gin", "device"), ("efficacy_ssl.gin", "device"),
                                           ("efficacy_ssl.gin", "mesh")])
def test_one_loop_step_with_the_judge_on(name, sharding, tiny_checkpoint, tmp_path):
    """The suite's 8 fake devices: the learner's mesh is fsdp = 8; with ``sharding = "mesh"`` the judge's weights
    are laid out on it too."""
    from treejax import train

    params = [f"RunConfig.model = '{tiny_checkpoint}'", f"RunConfig.log_dir = '{tmp_path / 'run'}'",
              "ScorerConfig.model = 'policy'", "ScorerConfig.batch_size = 8", f"ScorerConfig.sharding = '{sharding}'",
              "RunConfig.num_steps = 1", "RunConfig.prompts_per_step = 2", "TreeConfig.num_leaves = 4",
              "TreeConfig.init_divergence = 4", "TreeConfig.max_depth = 2", "TreeConfig.segment_length = 4",
              "EvalConfig.num_problems = 2", "EvalConfig.max_new_tokens = 2", "EvalConfig.batch_size = 2",
              "RunConfig.eval_every = 0", "RunConfig.mini_batches = 1", "LossConfig.entropy_coef = 0.01"]
    summary = train.main(["--gin_file", os.path.join(CONFIGS, name), "--quiet"]
                         + sum((["--gin_param", p] for p in params), []))
    row = summary["history"][0]
    assert np.isfinite(row["update/loss"]) and "time/judge_s" in row
    if name == "efficacy_ssl.gin":  # every leaf is judged (2 prompts x 4 leaves)
        assert row["judge/scored"] == 8 and "ssl/tier_mean" in row
    else:  # only the correct leaves are
        assert "fapo/flawed_rate" in row and row["judge/scored"] <= 8


def test_scope_steps_is_the_least_prm_step_score(tiny_checkpoint):
    from treejax.rl.judges.base import score_leaves
    from treejax.scorers.model import load_scorer
    from treejax.scorers.prm import line_steps, step_scores

    scorer = load_scorer(ScorerConfig(model=tiny_checkpoint, batch_size=4))
    texts = ["12 + 30 = 42\nAnswer: 42", "Answer: 7", "\n\n"]
    got = score_leaves(scorer, "steps", ["What is 12 + 30?"] * 3, texts, ["42"] * 3)
    steps = step_scores(scorer, ["What is 12 + 30?"] * 2, [line_steps(t) for t in texts[:2]])
    np.testing.assert_allclose(got[:2], [np.nanmin(steps[0]), steps[1, 0]], rtol=1e-6)
    assert np.isnan(got[2])  # no step: no score (FAPO: not flawed; SSL: the lowest bin)
