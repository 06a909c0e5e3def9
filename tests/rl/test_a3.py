"""A³ (treejax.rl.advantages.a3): the three terms and their sum on a hand-made turn tree with the numbers written
out, the sub-chain scopes, the bounds and the balance, the multi-turn source's ``action_signatures``, and the config
checks' one-line errors."""

from __future__ import annotations

import functools
import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.forest import forest_from_spans
from treejax.rl.advantages import A3Options, a3, estimator_spec
from treejax.rl.advantages.a3 import a3_turns, subchain_residuals
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
    raw = A3Options(scopes=(1,), scope_weights=(1.0,), term_bound=0.0, adv_bound=0.0, balance=False)
    adv, episode, residual, margin = (np.asarray(x) for x in a3_turns(forest, R, raw, sig))
    # episode: R = 1, 0, 1, 0, 0 has median 0 and MAD 0, so the scale is the floor 0.5 (+ 1e-6): E = R / 0.500001
    np.testing.assert_allclose(episode, [[1.999996, 0.0, 1.999996, 0.0, 0.0]], atol=1e-5)
    # residuals, leave one out within (depth, chain): depth 1: grep {slots 0, 1, 4: R 1, 0, 0} -> 1, -0.5, -0.5;
    # find|wc {2, 3} -> 1, -1; depth 2: wc {0, 4} -> 1, -1, find|wc {1} alone -> 0 (not grouped with depth 1's).
    # Robust over these 8: median -0.25, MAD 0.75, scale 1.4826 * 0.75 + 1e-6 = 1.111951 -> (x + 0.25) / 1.111951
    a, b, c, d = 1.124150, -0.224830, -0.674490, 0.224830  # x = 1, -0.5, -1, 0
    np.testing.assert_allclose(residual, [[[a, a, 0], [b, d, 0], [a, 0, 0], [c, 0, 0], [b, c, 0]]], atol=1e-5)
    # margins (support_prior 0.1, decision_gamma 0.9): the root forks into node 1 (slots 0, 1, 4: V 1/3) and node
    # 6 (slots 2, 3: V 1/2) around V(root) = 0.4: gains 3/3.1 (1/3 - 0.4) = -0.064516 and 2/2.1 (0.1) = 0.095238;
    # node 1 forks into node 2 (slots 0, 4: V 1/2; gain 2/2.1 (1/2 - 1/3) = 0.158730) and node 4 (slot 1: V 0;
    # gain 1/1.1 (-1/3) = -0.303030); node 6 into 7 and 8 (+-1/1.1 * 0.5 = +-0.454545), node 2 into 3 and 9
    # (+-0.454545). Slot 0: return 0.454545, 0.158730 + 0.9 * 0.454545 = 0.567821, -0.064516 + 0.9 * 0.567821 =
    # 0.446523; support 0.909091, 1.770563, 2.561249; gate S / (S + 0.1) = 0.900901, 0.946540, 0.962423
    np.testing.assert_allclose(margin, [[[0.429744, 0.537465, 0.4095], [-0.319361, -0.273, 0.0],
                                         [0.477367, 0.4095, 0.0], [-0.297074, -0.4095, 0.0],
                                         [-0.278949, -0.236976, -0.4095]]], atol=1e-5)
    # A = E + 0.65 Rho + M (no balance, no bounds)
    expected = [[[3.160437, 3.268158, 2.409496], [-0.4655, -0.12686, 0.0], [3.208061, 2.409496, 0.0],
                 [-0.735492, -0.4095, 0.0], [-0.425089, -0.675395, -0.4095]]]
    np.testing.assert_allclose(adv, expected, atol=1e-5)
    out = jax.jit(lambda f, r, s: a3(f, r, raw, action_signature_PxWxD=s))(forest, R, sig)
    np.testing.assert_allclose(np.asarray(out.segments), expected, atol=1e-5)
    tokens, mask = np.asarray(out.tokens), np.asarray(forest.loss_mask)
    np.testing.assert_allclose(tokens[0, 4], [-0.425089, 0.0, -0.675395, 0.0, -0.4095], atol=1e-5)
    assert np.all(tokens[mask == 0] == 0)


def test_a3_scopes_bounds_and_balance():
    forest, R, sig = _tree()
    used = np.ones((5, 3), bool) & (sig[0] >= 0)
    raw = lambda *scopes: np.asarray(subchain_residuals(  # noqa: E731
        jnp.asarray(R[0]), jnp.asarray(sig[0]), jnp.asarray(used), A3Options(scopes=scopes,
                                                                             scope_weights=(1.0,) * len(scopes))))
    # scope -1 (whole trajectories): depth 1 groups {0, 4} (grep, wc), {1} (grep, find|wc), {2, 3}; equal weights
    # average the two scopes: slot 1's depth-1 residual -0.5 (scope 1) and 0 (scope -1) -> -0.25
    np.testing.assert_allclose(raw(-1)[:, :2], [[1, 1], [0, 0], [1, 0], [-1, 0], [-1, -1]], atol=1e-6)
    np.testing.assert_allclose(raw(1, -1)[:, :2], [[1, 1], [-0.25, 0], [1, 0], [-1, 0], [-0.75, -1]], atol=1e-6)
    np.testing.assert_allclose(raw(2), raw(1), atol=1e-6)  # here the 2-turn windows group as the 1-turn ones
    # the defaults: bounded terms, each balanced by its mean |value| over the 13 turns, bounded sum
    opts = A3Options()
    adv, episode, residual, margin = (np.asarray(x) for x in a3_turns(forest, R, opts, sig))
    np.testing.assert_allclose(episode[0], np.tanh(np.array([1.999996, 0, 1.999996, 0, 0])), atol=1e-5)
    valid = np.asarray(forest.leaf_path[0, :, 1:] >= 0)
    terms = [np.where(valid, episode[0][:, None], 0.0), residual[0], margin[0]]
    terms = [x / (np.abs(x[valid]).mean() + 1e-9) for x in terms]
    total = terms[0] + 0.65 * terms[1] + 1.0 * terms[2]
    np.testing.assert_allclose(adv[0], np.where(valid, 1.1 * np.tanh(total / 1.1), 0.0), atol=1e-5)
    assert np.all(np.abs(adv) < 1.1)
    # the weights: margin only is the margin term; equal rewards make every term exactly 0
    only = np.asarray(a3_turns(forest, R, A3Options(episode_weight=0.0, residual_weight=0.0, balance=False,
                                                     adv_bound=0.0), sig)[0])
    np.testing.assert_allclose(only, margin, atol=1e-6)
    assert np.all(np.asarray(a3_turns(forest, np.ones((1, 5), np.float32), opts, sig)[0]) == 0.0)


def test_a3_option_and_input_errors():
    forest, R, sig = _tree()
    spec = estimator_spec("a3")
    assert spec.inputs == ("action_signature_PxWxD",) and spec.options_cls is A3Options
    with pytest.raises(ValueError, match="margin_weight must be a finite number >= 0"):
        A3Options(margin_weight=-1.0)
    with pytest.raises(ValueError, match="scopes must be integers >= 1 or -1 with one weight"):
        A3Options(scopes=(0,), scope_weights=(1.0,))
    with pytest.raises(ValueError, match="scopes must be integers"):
        A3Options(scopes=(1, 2), scope_weights=(1.0,))
    listed, tupled = A3Options(scopes=[1, -1], scope_weights=[1, 1]), A3Options(scopes=(1, -1), scope_weights=(1, 1))
    assert hash(listed) == hash(tupled) and listed == tupled  # gin lists become tuples: a static jit argument
    with pytest.raises(ValueError, match="decision_gamma must be in"):
        A3Options(decision_gamma=2.0)
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
    RunConfig(rollouts=[MultiTurnConfig(environment="shell")], **{**world, "estimator": "matchtir"})  # ships calls
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


@pytest.mark.slow  # a tiny model's multi-turn rollout: ~40 s on the shared 2-core machine
def test_the_multiturn_source_supplies_action_signatures():
    """The multi-turn source hands A³ ``action_signature_PxWxD`` [P, W, D]: id 0 ("grep", the first signature of
    each prompt) on the first turn wherever the episode made the call, -1 everywhere else; the estimator runs."""
    from treejax.rl.multiturn import MultiTurnConfig, MultiTurnRollouts
    from treejax.testing.envs import ScriptedToolEnv, tiny_multiturn_base

    examples = [types.SimpleNamespace(metadata={}, ground_truth="1") for _ in range(2)]
    base, params = tiny_multiturn_base(examples)
    # one call ("grep"), then the answer
    env = functools.partial(ScriptedToolEnv, 1, win=True, tool_info={"action_signature": "grep"})
    src = MultiTurnRollouts(base, MultiTurnConfig(max_turns=3, turn_tokens=10, chunk=4), make_env=env,
                            estimator_inputs=("action_signature_PxWxD",))
    ro = src.sample(params, jax.random.key(0), 0)
    sig = np.asarray(ro.estimator_inputs["action_signature_PxWxD"])
    assert sig.shape == (2, 2, 3) and sig.dtype == np.int32
    made = sig >= 0
    assert made.sum() == round(ro.extra_metrics["multiturn/tool_calls_mean"] * 4) > 0
    assert np.all(sig[made] == 0) and not made[:, :, 1:].any()
    assert ro.extra_metrics["multiturn/action_signatures_mean"] == np.mean([float(made[p].any()) for p in range(2)])
    out = a3(ro.forest, ro.rewards_PxW, action_signature_PxWxD=sig)
    assert np.all(np.isfinite(np.asarray(out.tokens)))
