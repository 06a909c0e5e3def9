"""Reward mapping, DAPO overlong penalty, dynamic-sampling filter."""

import numpy as np
import pytest

from treejax.rl.rewards import dynamic_sampling_keep, overlong_penalty, verifier_reward, zero_std_prompts


def test_verifier_reward_styles():
    c = np.array([[True, False], [False, False]])
    assert verifier_reward(c).tolist() == [[1.0, -1.0], [-1.0, -1.0]]
    assert verifier_reward(c.astype(int), "01").tolist() == [[1.0, 0.0], [0.0, 0.0]]
    with pytest.raises(ValueError, match="style"):
        verifier_reward(c, "binary")


def test_overlong_penalty_matches_formula():
    lmax, lbuf = 7168, 512
    lengths = np.arange(0, lmax + 600, 37)
    got = np.asarray(overlong_penalty(lengths, lmax, lbuf))
    for L, g in zip(lengths, got):
        want = max(min(-(L - (lmax - lbuf)) / lbuf, 0.0), -1.0)
        assert abs(g - want) < 1e-6
    assert float(overlong_penalty(np.array(6656), lmax, lbuf)) == 0.0
    assert float(overlong_penalty(np.array(6912), lmax, lbuf)) == -0.5
    assert float(overlong_penalty(np.array(lmax), lmax, lbuf, factor=2.0)) == -2.0
    with pytest.raises(ValueError, match="buffer"):
        overlong_penalty(lengths, 100, 0)


def test_dynamic_sampling_filter():
    r = np.array([[1.0, 1.0, 1.0], [0.0, 1.0, 0.0], [-1.0, -1.0, -1.0], [0.3, 0.3, 0.3]], np.float32)
    assert zero_std_prompts(r).tolist() == [True, False, True, True]
    assert dynamic_sampling_keep(r).tolist() == [False, True, False, False]
