"""DOTS's prompt selection (treejax.rl.selection): the attention predictor against a slow reference, the
selection rule, the embeddings, and the config checks."""

from __future__ import annotations

import math

import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.rl.selection import DOTSConfig, ngram_embeddings, predict_difficulty, select


def test_predictor_matches_a_slow_reference():
    rng = np.random.default_rng(0)
    e = rng.normal(size=(9, 16))
    e /= np.linalg.norm(e, axis=1, keepdims=True)
    d_ref = rng.random(4)
    got = predict_difficulty(e[4:], e[:4], d_ref, 0.1)
    for q in range(5):
        logits = [sum(a * b for a, b in zip(e[4 + q], e[r])) / 0.1 for r in range(4)]
        z = [math.exp(x - max(logits)) for x in logits]
        want = sum(zi / sum(z) * d for zi, d in zip(z, d_ref))
        assert got[q] == pytest.approx(want, rel=1e-12)
    # a query equal to one reference prompt, at a low temperature, takes that prompt's difficulty
    assert predict_difficulty(e[:1], e[:4], d_ref, 1e-3)[0] == pytest.approx(d_ref[0])


def test_selection_picks_the_closest_to_the_target_in_order():
    pred = np.array([0.9, 0.5, 0.1, 0.45, 0.55, 0.0])
    assert select(pred, 3, 0.5).tolist() == [1, 3, 4]
    assert select(pred, 2, 0.5).tolist() == [1, 3]  # 0.45 and 0.55 tie: the earlier index
    assert select(pred, 1, 1.0).tolist() == [0]


def test_ngram_embeddings():
    e = ngram_embeddings(["12 + 34 =", "12 + 34 =", "98 - 7 =", "12 + 35 ="], 256)
    np.testing.assert_allclose(np.linalg.norm(e, axis=1), 1.0)
    assert e[0] @ e[1] == pytest.approx(1.0) and e[0] @ e[2] < e[0] @ e[3] < 1.0


def test_config_checks():
    from treejax.rl.config import RunConfig

    with pytest.raises(ConfigError, match="reference"):
        RunConfig(prompts_per_step=2, rollouts=[DOTSConfig(reference=2)])
    with pytest.raises(ConfigError, match="dynamic_sampling"):
        RunConfig(prompts_per_step=4, rollouts=[DOTSConfig()], dynamic_sampling=True)
    with pytest.raises(ConfigError, match="temperature"):
        DOTSConfig(temperature=0)
