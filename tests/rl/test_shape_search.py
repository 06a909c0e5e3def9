"""The shape search (treejax.rl.shape_search): the chooser on synthetic policies with known sibling correlation and
token costs, its config checks, and the calibration / checkpoint / resume plumbing on a tiny model."""

import os

import jax
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.rl.shape_search import ShapeSearchConfig, choose_shape, measure_arm


def synthetic_batches(k, W, rho, shared, tail, P=64, batches=2, seed=0):
    """``batches`` batches of a slot tree with ``k`` root paths under a synthetic policy: a leaf's reward is
    ``1[sqrt(rho) z_subtree + sqrt(1 - rho) e_leaf > c_prompt]`` (siblings correlate through ``z``), a root path
    decodes ``shared`` tokens once, then every leaf ``tail`` tokens of its own (``k = W``: independent
    sampling). ``seconds`` is proportional to tokens."""
    rng = np.random.default_rng(seed * 1000 + k)
    out = []
    for b in range(batches):
        sub = np.arange(W) * k // W  # the depth-1 subtree of each slot (W // k slots each)
        path = np.full((P, W, 4), -1, np.int32)
        path[:, :, 0] = 0
        path[:, :, 1] = 1 + sub[None, :]
        path[:, :, 2] = 1 + k + np.arange(W)[None, :]
        z = rng.standard_normal((P, k))[:, sub]
        e = rng.standard_normal((P, W))
        c = rng.standard_normal((P, 1)) * 0.7
        reward = (np.sqrt(rho) * z + np.sqrt(1 - rho) * e > c).astype(np.float64)
        tokens = P * (k * shared + W * tail)
        out.append({"path": path, "weight": np.ones((P, W)), "reward": reward, "decoded": tokens,
                    "seconds": 1e-4 * tokens, "timed": b > 0})
    return out


def arms_for(W, rho_of_k, shared, tail, candidates=(2, 4, 8)):
    ks = sorted(set(candidates) | {W})
    return {k: measure_arm(k, W, synthetic_batches(k, W, rho_of_k(k) if k < W else 0.0, shared if k < W else 0,
                                                   tail + (shared if k == W else 0))) for k in ks}


@pytest.mark.parametrize("objective", ["ess_per_token", "ess_per_second"])
def test_independent_like_policy_picks_no_tree(objective):
    """The short-answer regime: a short shared prefix (40 tokens) and strongly correlated siblings (latent 0.9)
    -- a tree saves few tokens and its leaves repeat each other: independent sampling (k = W) has the most
    information per token."""
    arms = arms_for(16, lambda k: 0.9, shared=40, tail=40)
    assert all(arms[k].rho > 0.6 for k in (2, 4, 8))
    assert choose_shape(arms, objective) == 16


@pytest.mark.parametrize("objective", ["ess_per_token", "ess_per_second"])
def test_weakly_correlated_siblings_behind_long_prefixes_pick_a_tree(objective):
    """Long shared prefixes (300 tokens) and weakly correlated siblings (rho 0.1): a tree's leaves are nearly
    independent samples at a fraction of the tokens -- the chooser must take a tree."""
    arms = arms_for(16, lambda k: 0.1, shared=300, tail=200)
    assert arms[4].ess / arms[4].prompts > 10  # close to 16 / (1 + 0.1 * 3) = 12.3
    k = choose_shape(arms, objective)
    assert k < 16
    # the chosen tree's predicted ESS per token beats independent sampling's
    assert arms[k].score(objective) > arms[16].score(objective)


def test_correlation_that_grows_with_sharing_picks_the_middle():
    """rho falls as k grows (fewer slots share a subtree): k = 2 is too correlated, k = 8 saves too little."""
    arms = arms_for(16, {2: 0.9, 4: 0.15, 8: 0.1}.get, shared=200, tail=60)
    assert choose_shape(arms, "ess_per_token") == 4


def test_undefined_correlation_counts_as_full_for_trees():
    """No reward spread (every leaf fails): rho is undefined; trees are scored as copies, independent wins."""
    W = 8
    arms = {}
    for k in (2, 8):
        batches = synthetic_batches(k, W, 0.0, 100 if k < W else 0, 20 + (100 if k == W else 0))
        for b in batches:
            b["reward"] = np.zeros_like(b["reward"])
        arms[k] = measure_arm(k, W, batches)
    assert np.isnan(arms[2].rho) and arms[2].ess / arms[2].prompts == pytest.approx(2.0)
    assert choose_shape(arms, "ess_per_token") == 8


def test_config_checks():
    with pytest.raises(ConfigError, match="objective"):
        ShapeSearchConfig(objective="tokens")
    with pytest.raises(ConfigError, match="calibration_batches >= 2"):
        ShapeSearchConfig(objective="ess_per_second", calibration_batches=1)
    with pytest.raises(ConfigError, match="exceed TreeConfig.num_leaves=8"):
        ShapeSearchConfig(candidates=(2, 16)).shapes(8)
    assert ShapeSearchConfig(candidates=[4, 2]).shapes(8) == (2, 4, 8)
    from treejax.rl.config import RunConfig
    from treejax.sampling.tree import TreeConfig

    with pytest.raises(ConfigError, match="allocation = 'slots'"):
        RunConfig(rollouts=[ShapeSearchConfig(candidates=(2,))],
                  rollout=TreeConfig(num_leaves=4, max_depth=2, segment_length=4, allocation="transfer"))


def _params(model, log_dir, *extra):
    return [f"RunConfig.model = '{model}'", f"RunConfig.log_dir = '{log_dir}'", "RunConfig.num_steps = 1",
            "RunConfig.prompts_per_step = 2", "TreeConfig.num_leaves = 4", "TreeConfig.max_depth = 2",
            "TreeConfig.segment_length = 4", "TreeConfig.allocation = 'slots'", "EvalConfig.num_problems = 2",
            "EvalConfig.max_new_tokens = 2", "RunConfig.export_hf = False", "RunConfig.tree_picture_every = 0",
            "RunConfig.estimator = 'grpo'", "RunConfig.rollouts = [@ShapeSearchConfig()]",
            "ShapeSearchConfig.candidates = [2]", "ShapeSearchConfig.calibration_batches = 1", *extra]


def test_calibration_runs_once_is_checkpointed_and_restored(tiny_checkpoint, tmp_path, monkeypatch):
    """On a tiny model: the first sample calibrates k = 2 and k = W = 4 on the same prompts and uses the choice;
    the next sample does not calibrate again; a new run restored from the source's checkpoint state uses the saved
    shape without calibrating."""
    from treejax import train
    from treejax.rl import shape_search
    from treejax.rl.setup import build_run

    gin = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.gin")
    cfg = train.parse([gin], _params(tiny_checkpoint, tmp_path / "run"))
    r = build_run(cfg)
    params = r.learner.sampler_params(r.state.params)
    calls = []
    real = shape_search.ShapeSearchRollouts.calibrate
    monkeypatch.setattr(shape_search.ShapeSearchRollouts, "calibrate",
                        lambda self, *a: calls.append(a[-1]) or real(self, *a))
    ro = r.source.sample(params, jax.random.key(0), 0)
    assert calls == [0] and r.source.k in (2, 4) and r.source.base.rollout is r.source.rollout_for(r.source.k)
    # the calibration's tokens are rollout compute: counted in the step's decoded tokens
    calibration = sum(row["tokens"] for row in r.source.table)
    assert ro.extra_metrics["shape/calibration_tokens"] == calibration > 0
    assert ro.counters.decoded_tokens > calibration
    assert ro.extra_metrics["shape/k"] == r.source.k and ro.forest.leaf_path.shape[:2] == (2, 4)
    assert sorted(row["k"] for row in r.source.table) == [2, 4]
    r.source.sample(params, jax.random.key(1), 1)
    assert calls == [0]  # every = 0: once
    saved = r.source.checkpoint_state()["shape_search"]

    # a new source over the same task source (as a resumed run builds it), restored from that state
    r.source.base.rollout = None
    fresh = shape_search.ShapeSearchRollouts(r.source.base, cfg.rollouts[0],  # the compiled shapes, reused
                                             lambda tc: r.source.rollout_for(tc.init_divergence))
    monkeypatch.setattr(shape_search.ShapeSearchRollouts, "calibrate",
                        lambda self, *a: pytest.fail("a restored run must not calibrate again"))
    fresh.restore_state({"shape_search": saved})
    ro2 = fresh.sample(params, jax.random.key(2), 1)
    assert fresh.k == saved["k"] and ro2.extra_metrics["shape/chosen_at"] == 0
    assert ro2.extra_metrics["shape/calibration_tokens"] == 0
    assert ro2.forest.leaf_path.shape[:2] == (2, 4)


def test_every_n_steps_recalibrates(monkeypatch):
    """``every = 2``: calibrations at steps 0, 2, 4 (a stand-in task source: only the schedule is tested)."""
    import dataclasses

    from treejax.rl import shape_search
    from treejax.rl.config import RunConfig
    from treejax.rl.rollouts import Rollouts
    from treejax.sampling.tree import TreeConfig

    class Base:
        cfg = RunConfig(rollout=TreeConfig(num_leaves=4, max_depth=2, segment_length=4, allocation="slots"))
        rollout = None

        def sample(self, params, key, step):
            return Rollouts(forest=None, rewards_PxW=np.zeros((1, 4)), scores_PxW=None, prompts_PxLp=None,
                            lengths_P=None)

    src = shape_search.ShapeSearchRollouts(Base(), ShapeSearchConfig(candidates=(2,), every=2),
                                           lambda tc: tc.init_divergence)
    calls = []
    monkeypatch.setattr(shape_search.ShapeSearchRollouts, "calibrate",
                        lambda self, params, key, step: calls.append(step) or {
                            k: shape_search.ArmMeasurement(k, 0.0, float(k), 100, 1.0, 1, 2) for k in self.shapes})
    for step in range(5):
        ro = src.sample(None, jax.random.key(step), step)
        assert ro.extra_metrics["shape/k"] == 4 and src.base.rollout == 4  # ESS/token 4/100 beats 2/100
    assert calls == [0, 2, 4]
    assert dataclasses.replace(Base.cfg.rollout, init_divergence=2) == src.tree_config(2)
