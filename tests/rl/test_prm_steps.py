"""PRM step scores as a per-step reward for any estimator: the PRMStepReward shaper against hand-computed numbers
and a plain-Python loop, its config checks and the stage's, the shipped config, the stage's scores on a fixed tree
of a tiny model, and (slow) one RL step and one loop step with GRPO."""

import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.rl.judges.prm_steps import PRMStepsConfig
from treejax.rl.shaping import PRMStepReward, ShapingInputs, apply_shapers

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")
nan = math.nan


def inputs(adv_PxWxT, mask_PxWxT, scores_PxWxD, S: int) -> ShapingInputs:
    P, W, T = np.shape(adv_PxWxT)
    z = jnp.zeros((P, W), jnp.float32)
    return ShapingInputs(advantages=jnp.asarray(adv_PxWxT, jnp.float32), loss_mask=jnp.asarray(mask_PxWxT, jnp.float32),
                         old_logp=jnp.zeros((P, W, T)), rewards=z, scores=z,
                         leaf_length=jnp.asarray(np.sum(mask_PxWxT, -1), jnp.int32), eps_scale=z + 1,
                         leaf_path=jnp.zeros((P, W, 2), jnp.int32), step_scores=jnp.asarray(scores_PxWxD, jnp.float32),
                         segment_length=S)


def prm_reference(adv, mask, scores, S, coef, normalise, eps):
    """[P, W, T] by plain loops (the shaper's docstring)."""
    P, W, T = np.shape(adv)
    D = np.shape(scores)[-1]
    k = [min(t // S, D - 1) for t in range(T)]
    valid = {(p, w, d) for p in range(P) for w in range(W) for d in range(D)
             if not math.isnan(scores[p][w][d]) and any(mask[p][w][t] > 0 and k[t] == d for t in range(T))}
    groups = {}
    for p, w, d in valid:
        groups.setdefault(p if normalise == "group" else 0, []).append(float(scores[p][w][d]))
    out = np.zeros((P, W, T))
    for p in range(P):
        for w in range(W):
            for t in range(T):
                if mask[p][w][t] <= 0:
                    continue
                a = 0.0
                if (p, w, k[t]) in valid:
                    g = groups[p if normalise == "group" else 0]
                    mean = sum(g) / len(g)
                    std = math.sqrt(sum((v - mean) ** 2 for v in g) / len(g))
                    a = (scores[p][w][k[t]] - mean) / (std + eps) if std > 0 else 0.0
                out[p, w, t] = adv[p][w][t] + coef * a
    return out


def test_hand_computed():
    # one prompt, two leaves of 4 and 2 tokens, segments of 2: steps (0.8, 0.2) and (0.5, -); mean 0.5,
    # population std sqrt(0.06) = 0.244949, z = (1.224745, -1.224745, 0); coef 0.5 adds (0.612372, -0.612372, 0)
    adv = [[[1, 1, 1, 1], [-1, -1, 0, 0]]]
    mask = [[[1, 1, 1, 1], [1, 1, 0, 0]]]
    scores = [[[0.8, 0.2], [0.5, nan]]]
    out, _, m, _ = apply_shapers((PRMStepReward(coef=0.5, eps=0.0 + 1e-12),), inputs(adv, mask, scores, 2))
    np.testing.assert_allclose(np.asarray(out).reshape(1, 2, 4),
                               [[[1.612372, 1.612372, 0.387628, 0.387628], [-1, -1, 0, 0]]], atol=1e-6)
    assert int(m["shaping/prm_steps/steps"]) == 3
    np.testing.assert_allclose(float(m["shaping/prm_steps/score_mean"]), 0.5, atol=1e-6)
    np.testing.assert_allclose(float(m["shaping/prm_steps/term_abs_mean"]), 4 * 0.612372 / 6, atol=1e-6)


def test_equal_scores_add_nothing_and_untrained_steps_do_not_count():
    adv = [[[0.5, 0.5, -0.5, -0.5], [0.0, 0.0, 0.0, 0.0]]]
    mask = [[[1, 1, 1, 1], [0, 0, 1, 1]]]  # leaf 1's first step has no trained token: its 0.9 is left out
    out, _, m, _ = apply_shapers((PRMStepReward(),), inputs(adv, mask, [[[0.3, 0.3], [0.9, 0.3]]], 2))
    np.testing.assert_allclose(np.asarray(out).reshape(1, 2, 4), [[[0.5, 0.5, -0.5, -0.5], [0, 0, 0, 0]]], atol=1e-7)
    assert int(m["shaping/prm_steps/steps"]) == 3


@pytest.mark.parametrize("normalise", ["group", "batch"])
def test_jitted_equals_the_python_loop(normalise):
    rng = np.random.default_rng(3)
    for _ in range(6):
        P, W, S, D = rng.integers(1, 4), rng.integers(1, 5), rng.integers(1, 4), rng.integers(1, 4)
        T = S * D
        lengths = rng.integers(0, T + 1, (P, W))
        mask = (np.arange(T)[None, None] < lengths[..., None]).astype(np.float32)
        mask *= rng.random((P, W, T)) > 0.15
        adv = rng.normal(size=(P, W, T)) * mask
        scores = rng.random((P, W, D))
        scores[rng.random((P, W, D)) < 0.2] = nan
        coef = float(rng.uniform(0.1, 2.0))
        out, *_ = apply_shapers((PRMStepReward(coef=coef, normalise=normalise),), inputs(adv, mask, scores, S))
        np.testing.assert_allclose(np.asarray(out).reshape(P, W, T),
                                   prm_reference(adv, mask, scores, S, coef, normalise, 1e-6), atol=1e-5)


def test_config_checks_refuse_what_does_not_fit():
    from treejax.gin_surface import parse

    for bad, fix in (({"coef": 0.0}, "PRMStepReward.coef = 0.5"), ({"normalise": "leaf"}, "normalise = 'group'"),
                     ({"eps": 0.0}, "PRMStepReward.eps = 1e-6")):
        with pytest.raises(ConfigError, match=fix):
            PRMStepReward(**bad)
    shipped = os.path.join(CONFIGS, "efficacy_prm_steps.gin")
    with pytest.raises(ConfigError, match=r"fix: RunConfig.shapers = \[@PRMStepReward\(\)\]"):
        parse([shipped], ["RunConfig.shapers = []"], check_mesh=False)
    with pytest.raises(ConfigError, match=r"fix: add @PRMStepsConfig\(\) to RunConfig.rollouts"):
        parse([shipped], ["RunConfig.rollouts = []"], check_mesh=False)
    with pytest.raises(ValueError, match="no PRM step scores"):
        x = inputs([[[1.0]]], [[[1.0]]], [[[0.5]]], 1).replace(step_scores=None)
        PRMStepReward().shape(x)


def test_gin_builds_the_shipped_config():
    from treejax.gin_surface import parse
    from treejax.scorers import ScorerConfig

    cfg = parse([os.path.join(CONFIGS, "efficacy_prm_steps.gin")], [], check_mesh=False)
    (stage,) = cfg.rollouts
    assert isinstance(stage, PRMStepsConfig) and stage.scorer == ScorerConfig(model="smollm2-135m-instruct",
                                                                             batch_size=16)
    assert cfg.shapers == (PRMStepReward(coef=0.5, normalise="group"),) and cfg.estimator == "grpo"


def prm_tree():
    """The step-judge tests' fixed tree of a tiny model's tokens (``test_slate.judged_tree``) wrapped by the
    PRMStepsConfig stage, its PRM the same tiny model."""
    from judge_steps_helpers import JudgeTokenizer
    from test_slate import judged_tree

    from treejax.rl.judges.steps import StepJudgedRollouts

    source, (cfg, params, scorer), tokens, prompts = judged_tree()
    wrapped = StepJudgedRollouts(source.base, PRMStepsConfig(scorer=scorer.config), JudgeTokenizer(), "unused")
    wrapped.scorer = scorer
    return wrapped, (cfg, params, scorer), tokens, prompts


def test_the_stage_hands_every_step_score_to_the_shaper():
    """The stage's scores are the step judge's (SLATE's, tested against direct ``step_scores`` in test_slate),
    under the shaper's input name, the rewards unchanged; the shaper reads them."""
    from test_slate import judged_tree

    wrapped, *_ = prm_tree()
    ro = wrapped.sample(None, None, 0)
    ref = judged_tree()[0].sample(None, None, 0)
    np.testing.assert_array_equal(np.asarray(ro.estimator_inputs["prm_steps_PxWxD"]),
                                  np.asarray(ref.estimator_inputs["step_judge_PxWxD"]))
    np.testing.assert_array_equal(np.asarray(ro.rewards_PxW), np.asarray(ref.rewards_PxW))
    assert ro.extra_metrics["judge/scored"] == 15


@pytest.mark.slow  # the learner's compile (~25 CPU s); the default run covers the shaper's math
# (test_hand_computed, test_jitted_equals_the_python_loop) and the stage (test_the_stage_hands_every_step_score_to_the_shaper)
def test_one_rl_step_with_grpo_adds_the_prm_term():
    from judge_steps_helpers import tiny_learner

    from treejax.rl.step import rl_step

    wrapped, (cfg, params, _), _, _ = prm_tree()
    learner, state = tiny_learner(cfg, params, "grpo", shapers=(PRMStepReward(),))
    state, ro, m, _ = rl_step(learner, state, wrapped, jax.random.key(1), 0)
    m = jax.device_get(m)
    assert m["update/skipped"] == 0.0 and np.isfinite(m["update/loss"]) and m["update/grad_norm"] > 0
    assert int(m["shaping/prm_steps/steps"]) > 0 and m["shaping/prm_steps/term_abs_mean"] > 0


@pytest.mark.slow  # the whole CLI on the tiny model (~60 s on 2 cores); the default run covers the config
# (test_gin_builds_the_shipped_config) and the stage and shaper (the tests above)
def test_one_loop_step_of_the_shipped_config(tiny_checkpoint, tmp_path):
    from treejax.testing.runs import run_shipped

    row = run_shipped("efficacy_prm_steps.gin", tiny_checkpoint, tmp_path / "run", extra=(
        "ScorerConfig.model = 'policy'", "ScorerConfig.batch_size = 8", "RunConfig.dynamic_sampling = False",
        "TreeConfig.init_divergence = 4"))
    assert row["judge/scored"] > 0 and row["shaping/prm_steps/steps"] > 0
