"""Prompt-GDRO's bucket sampler (treejax.rl.prompt_gdro): buckets, weights and the sampling law against slow
references, the source's history / score updates on a scripted task, its checkpoint round trip, config checks."""

from __future__ import annotations

import math
import types

import jax.numpy as jnp
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.forest import forest_from_paths
from treejax.rl.prompt_gdro import PromptGDROConfig, PromptGDRORollouts, bucket_of, bucket_weights, pick
from treejax.rl.rollouts import RolloutCounters, ScoredRows

EDGES = (0.1, 0.2, 0.4, 0.6, 0.8, 0.9)


def test_buckets():
    assert bucket_of(None, EDGES) == bucket_of([], EDGES) == 7  # unseen
    assert bucket_of([0.0, 0.0], EDGES) == 0
    assert bucket_of([1.0, 0.0, 0.0, 0.0, 0.0], EDGES) == 2  # 0.2 falls in [0.2, 0.4)
    assert bucket_of([1.0], EDGES) == 6
    assert PromptGDROConfig().bucket_names == ["0-0.1", "0.1-0.2", "0.2-0.4", "0.4-0.6", "0.6-0.8", "0.8-0.9",
                                               "0.9-1", "unseen"]


def test_weights_match_the_formula():
    scores = {"0": 0.9, "3": 0.4, "7": 0.7}
    present = [0, 3, 5, 7]
    got = bucket_weights(scores, present, eta=2.0, gamma=0.2)
    s = [0.9, 0.4, 0.0, 0.7]
    z = sum(math.exp(2.0 * x) for x in s)
    for b, x in zip(present, s):
        assert got[b] == pytest.approx(0.8 * math.exp(2.0 * x) / z + 0.2 / 4, rel=1e-12)
    assert sum(got.values()) == pytest.approx(1.0)


def test_one_pick_draws_a_bucket_with_probability_q():
    buckets = np.array([0, 0, 0, 3, 7, 7])
    q = {0: 0.2, 3: 0.5, 7: 0.3}
    rng = np.random.default_rng(0)
    n = 20000
    hits = np.bincount([buckets[pick(buckets, q, 1, rng)[0]] for _ in range(n)], minlength=8)
    for b, p in q.items():  # 4.5 binomial standard deviations
        assert abs(hits[b] / n - p) < 4.5 * math.sqrt(p * (1 - p) / n)
    many = pick(buckets, q, 4, rng)
    assert len(set(many.tolist())) == 4 and list(many) == sorted(many)


class _Base:
    """Prompts q0, q1, ... drawn 2 at a time; prompt qN is solved by all its 2 leaves when N is even, by none when
    N is odd (a scripted verifier)."""

    def __init__(self):
        self.pipeline, self.estimator_inputs, self.drawn = None, (), 0

    def draw(self):
        ids = [self.drawn, self.drawn + 1]
        self.drawn += 2
        return ([types.SimpleNamespace(metadata={"question": f"q{i % 6}"}) for i in ids],
                np.array([[i, 1] for i in ids], np.int32), np.full(2, 2, np.int32))

    def roll_and_score(self, params, examples, prompts, lens, key, step):
        n = len(examples)
        solved = np.array([int(e.metadata["question"][1:]) % 2 == 0 for e in examples], np.float32)
        scores = np.repeat(solved[:, None], 2, axis=1)
        f = forest_from_paths(np.tile([[[0, 1], [0, 2]]], (n, 1, 1)), np.full((n, 2), 2), 2)
        return ScoredRows(f, 2 * scores - 1, scores, examples, prompts, lens, RolloutCounters(), None,
                          {"reward_scores": scores})

    def checkpoint_state(self):
        return {}

    def restore_state(self, data_state):
        pass


def test_source_learns_the_hard_bucket_and_round_trips():
    cfg = PromptGDROConfig(pool=3, eta=4.0, gamma=0.1, ema=0.5)
    src = PromptGDRORollouts(_Base(), cfg, prompts_per_step=2, seed=1)
    for step in range(6):
        ro = src.sample(None, None, step)
        assert ro.num_rows == 2 and isinstance(ro.rewards_PxW, jnp.ndarray)
        for e, s in zip(ro.examples, np.asarray(ro.scores_PxW)):  # rows hold their own prompts
            assert s[0] == float(int(e.metadata["question"][1:]) % 2 == 0)
    names = cfg.bucket_names
    # odd prompts always fail: their bucket ("0-0.1") scores loss 1; even ones ("0.9-1") loss 0
    assert src.scores["0"] == 1.0 and src.scores["6"] == 0.0
    for k, v in src.passes.items():
        assert len(set(v)) == 1
    q = bucket_weights(src.scores, [0, 6], cfg.eta, cfg.gamma)
    assert q[0] > 0.9 > 0.1 > q[6]  # the failing bucket gets the batch
    assert ro.extra_metrics[f"prompt_gdro/loss_{names[0]}"] == 1.0
    b = PromptGDRORollouts(_Base(), cfg, prompts_per_step=2, seed=1)
    b.base.drawn = src.base.drawn
    b.restore_state(src.checkpoint_state())
    x, y = src.sample(None, None, 6), b.sample(None, None, 6)
    assert [e.metadata for e in x.examples] == [e.metadata for e in y.examples] and x.extra_metrics == y.extra_metrics


def test_config_checks():
    from treejax.rl.config import RunConfig

    with pytest.raises(ConfigError, match="edges"):
        PromptGDROConfig(edges=(0.5, 0.2))
    with pytest.raises(ConfigError, match="gamma"):
        PromptGDROConfig(gamma=1.5)
    with pytest.raises(ConfigError, match=r"PromptGDROConfig.*dynamic_sampling"):
        RunConfig(prompts_per_step=4, rollouts=[PromptGDROConfig()], dynamic_sampling=True)
