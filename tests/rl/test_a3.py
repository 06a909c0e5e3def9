"""A³ (treejax.rl.advantages.a3): the three terms and their sum on a hand-made turn tree with the numbers written
out, both sub-chain groupings, the reward scale, the multi-turn source's ``action_signatures``, and the config
checks' one-line errors."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.forest import forest_from_spans
from treejax.rl.advantages import A3Options, a3, estimator_spec
from treejax.rl.advantages.a3 import a3_turns
from treejax.rl.multiturn import action_signatures

GREP, WC, FIND_WC = 0, 1, 2


def _tree():
    """One prompt, 5 slots, two trees. Tree A: turn 1 (node 1, ``grep``) forks into node 2 (``wc``, slots 0 and 4,
    which fork again into answers 3 and 9) and node 4 (``find|wc``, slot 1, answer 5). Tree B: node 6
    (``find|wc``, slots 2 and 3) forks into answers 7 and 8. A command turn is one action token and one
    observation token; an answer turn one action token."""
    paths = np.array([[[0, 1, 2, 3], [0, 1, 4, 5], [0, 6, 7, -1], [0, 6, 8, -1], [0, 1, 2, 9]]])
    length = np.array([[0, 2, 2, 1, 2, 1, 2, 1, 1, 1]])
    tok = np.array([[[1, 9, 2, 9, 3], [1, 9, 4, 9, 5], [6, 9, 7, 0, 0], [6, 9, 8, 0, 0], [1, 9, 2, 9, 10]]],
                   np.int32)
    pm = np.array([[[1, 0, 1, 0, 1], [1, 0, 1, 0, 1], [1, 0, 1, 0, 0], [1, 0, 1, 0, 0], [1, 0, 1, 0, 1]]],
                  np.float32)
    sig = np.array([[[GREP, WC, -1], [GREP, FIND_WC, -1], [FIND_WC, -1, -1], [FIND_WC, -1, -1], [GREP, WC, -1]]],
                   np.int32)
    return forest_from_spans(paths, length, tok, policy_mask=pm), np.array([[1.0, 0.0, 1.0, 0.0, 0.0]], np.float32), sig


def test_a3_terms_by_hand():
    forest, R, sig = _tree()
    raw = A3Options(scale_by_std=False)
    adv, episode, residual, margin = (np.asarray(x) for x in a3_turns(forest, R, raw, sig))
    # episode: R - mean R = R - 0.4
    np.testing.assert_allclose(episode, [[0.6, -0.4, 0.6, -0.4, -0.4]], atol=1e-6)
    # residuals (gamma 1: every turn's return is R): grep {slot 0: 1, slot 1: 0, slot 4: 0}, mean 1/3;
    # wc {slot 0: 1, slot 4: 0}, mean 1/2; find|wc {slot 1 turn 2: 0, slot 2: 1, slot 3: 0}, mean 1/3; answers 0
    t = 1 / 3
    np.testing.assert_allclose(residual, [[[2 * t, 0.5, 0], [-t, -t, 0], [2 * t, 0, 0], [-t, 0, 0], [-t, -0.5, 0]]],
                               atol=1e-6)
    # margins: node 1's children are node 2 (slots 0, 4: V = 0.5) and node 4 (V = 0), each once: mean 0.25 (the
    # slot-weighted mean would be 1/3); node 6's children 7 (V 1) and 8 (V 0); node 2's children 3 (V 1) and 9
    # (V 0); node 4 has one child (0); depth-1 turns 0
    np.testing.assert_allclose(margin, [[[0, 0.25, 0.5], [0, -0.25, 0], [0, 0.5, 0], [0, -0.5, 0], [0, 0.25, -0.5]]],
                               atol=1e-6)
    expected = [[[1.266667, 1.35, 1.1], [-0.733333, -0.983333, -0.4], [1.266667, 1.1, 0.0], [-0.733333, -0.9, 0.0],
                 [-0.733333, -0.65, -0.9]]]
    np.testing.assert_allclose(adv, expected, atol=1e-5)
    out = jax.jit(lambda f, r, s: a3(f, r, raw, action_signature_PxWxD=s))(forest, R, sig)
    np.testing.assert_allclose(np.asarray(out.segments), expected, atol=1e-5)
    tokens, mask = np.asarray(out.tokens), np.asarray(forest.loss_mask)
    np.testing.assert_allclose(tokens[0, 4], [-0.733333, 0.0, -0.65, 0.0, -0.9], atol=1e-5)
    assert np.all(tokens[mask == 0] == 0)


def test_a3_prefix_groups_weights_and_scale():
    forest, R, sig = _tree()
    _, _, residual, _ = a3_turns(forest, R, A3Options(scale_by_std=False, residual_group="prefix"), sig)
    # depth 1: {0, 1, 4} share grep (2/3, -1/3, -1/3), {2, 3} share find|wc (1/2, -1/2); depth 2: grep>wc holds
    # slots 0 and 4 (1/2, -1/2), grep>find|wc slot 1 alone (0)
    t = 1 / 3
    np.testing.assert_allclose(np.asarray(residual)[0, :, :2], [[2 * t, 0.5], [-t, 0], [0.5, 0], [-0.5, 0], [-t, -0.5]],
                               atol=1e-6)
    only = lambda **w: np.asarray(a3_turns(forest, R, A3Options(scale_by_std=False, **w), sig)[0])  # noqa: E731
    episode_only = only(residual_weight=0.0, margin_weight=0.0)
    np.testing.assert_allclose(episode_only[0, 0], [0.6, 0.6, 0.6], atol=1e-6)
    np.testing.assert_allclose(only(episode_weight=0.0, residual_weight=0.0)[0, 4], [0.0, 0.25, -0.5], atol=1e-6)
    np.testing.assert_allclose(only(episode_weight=2.0, margin_weight=0.0)[0, 1], [-0.8 - t, -0.8 - t, -0.8],
                               atol=1e-6)
    # scale_by_std: every term over std(R) + eps; R = 1, 0, 1, 0, 0 has population std sqrt(0.24) = 0.489898
    scaled = np.asarray(a3_turns(forest, R, A3Options(), sig)[0])
    raw = np.asarray(a3_turns(forest, R, A3Options(scale_by_std=False), sig)[0])
    np.testing.assert_allclose(scaled, raw / (np.sqrt(0.24) + 1e-6), atol=1e-5)
    # gamma 0.5: slot 0's grep turn returns 0.25 (two turns before the end), its group {0.25, 0, 0}
    g = np.asarray(a3_turns(forest, R, A3Options(scale_by_std=False, gamma=0.5), sig)[2])
    np.testing.assert_allclose(g[0, 0, 0], 0.25 - 0.25 / 3, atol=1e-6)
    # equal rewards: every term is exactly 0
    assert np.all(np.asarray(a3_turns(forest, np.ones((1, 5), np.float32), A3Options(), sig)[0]) == 0.0)


def test_a3_option_and_input_errors():
    forest, R, sig = _tree()
    spec = estimator_spec("a3")
    assert spec.inputs == ("action_signature_PxWxD",) and spec.options_cls is A3Options
    with pytest.raises(ValueError, match="margin_weight must be a finite number >= 0"):
        A3Options(margin_weight=-1.0)
    with pytest.raises(ValueError, match="residual_group must be one of"):
        A3Options(residual_group="command")
    with pytest.raises(ValueError, match="gamma must be in"):
        A3Options(gamma=2.0)
    with pytest.raises(ValueError, match=r"must be integers of shape \[P, W, D\] = \(1, 5, 3\), got int32 \(1, 5, 2\)"):
        a3(forest, R, action_signature_PxWxD=sig[:, :, :2])
    with pytest.raises(ValueError, match="must be integers"):
        a3(forest, R, action_signature_PxWxD=sig.astype(np.float32))


def test_action_signatures_from_episodes():
    ep = lambda *infos: types.SimpleNamespace(infos=list(infos))  # noqa: E731
    trees = [types.SimpleNamespace(slot_episode=[
        ep({"action_signature": "grep"}, {"action_signature": "wc"}, {"answered": True}),
        ep({"action_signature": "find|wc"}, {"call_limit": True}),
        ep({"action_signature": "grep"}, {"action_signature": "<syntax error>"}, {"answered": True})]),
        types.SimpleNamespace(slot_episode=[ep({"action_signature": "wc"}), ep(), ep({"answered": True})])]
    sig, names = action_signatures(trees, depth=3)
    np.testing.assert_array_equal(sig, [[[0, 1, -1], [2, -1, -1], [0, 3, -1]], [[0, -1, -1], [-1] * 3, [-1] * 3]])
    assert names == [["grep", "wc", "find|wc", "<syntax error>"], ["wc"]]


def test_config_checks_name_the_fix():
    from treejax.rl.config import RunConfig
    from treejax.rl.multiturn import MultiTurnConfig
    from treejax.sampling import tree

    chains = tree.independent_config(4, 64, 16)
    world = dict(rollout=chains, task="shell_files", estimator="a3")
    RunConfig(rollouts=[MultiTurnConfig(environment="shell")], **world)
    with pytest.raises(ConfigError, match="groups turns by the AST of their actions, which environment 'code_tool' "
                                          "does not parse; fix: MultiTurnConfig.environment = 'shell' \\(with "
                                          "RunConfig.task = 'shell_files'\\)"):
        RunConfig(rollouts=[MultiTurnConfig()], **world)
    with pytest.raises(ConfigError, match="does not supply; fix: .*MultiTurnConfig"):
        RunConfig(**world)
    with pytest.raises(ConfigError, match="not 'retrieval_multihop'; fix: RunConfig.task = 'shell_files'"):
        RunConfig(rollouts=[MultiTurnConfig(environment="shell")], rollout=chains, estimator="grpo",
                  task="retrieval_multihop")
    with pytest.raises(ConfigError, match="groups turns by the AST.*environment 'retrieval' does not parse"):
        RunConfig(rollouts=[MultiTurnConfig(environment="retrieval")], rollout=chains, estimator="a3",
                  task="retrieval_multihop")
