"""MatchTIR (treejax.rl.tool_match, treejax.rl.advantages.matchtir): the per-call score, the maximum-weight matching
against hand-computed cases (one where matching calls in order would pick worse pairs), the dual-level advantage
on a hand-made turn forest with the numbers written out, the multi-turn source supplying ``tool_match_PxWxD``, and
the config checks' one-line errors."""

from __future__ import annotations

import functools
import types

import jax
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.forest import forest_from_spans
from treejax.rl.advantages import MatchTIROptions, estimator_spec, matchtir
from treejax.rl.tool_match import (call_score, match_calls, reference_calls, sinkhorn_plan, token_f1,
                                  tool_match_rewards)


def search(q):
    return {"name": "search", "args": {"query": q}}


REF = [search("Velor Systems"), search("Ana Brik"), {"name": "calculate", "args": {"expression": "1987 - 1950"}}]


def test_call_score_by_hand():
    assert token_f1("Ana Brik painter", "ana brik") == pytest.approx(0.8)  # P = 2/3, R = 1
    assert token_f1("", "") == 1.0 and token_f1("x", "") == 0.0
    assert call_score(search("Velor Systems"), REF[0]) == 1.0
    assert call_score(search("Ana Brik painter"), REF[1]) == pytest.approx(0.5 + 0.5 * 0.8)
    assert call_score(search("Velor"), REF[0]) == pytest.approx(0.5 + 0.5 * 2 / 3)
    assert call_score(search("nothing alike"), REF[0]) == 0.5  # the right tool, other arguments
    assert call_score({"name": "calculate", "args": {"expression": "1987-1950"}}, REF[2]) == 1.0
    assert call_score(search("1987 - 1950"), REF[2]) == 0.0  # the wrong tool scores 0 whatever its arguments
    assert call_score(search("Velor"), REF[0], name_weight=0.0) == pytest.approx(2 / 3)
    assert call_score({"name": "search", "args": {}}, REF[0]) == 0.5  # a missing argument is the empty text


def test_matching_by_hand():
    # S = [[1.0, 0.5, 0], [0.5, 0.9, 0], [0, 0, 1.0], [0.8333, 0.5, 0]]: the best assignment is the diagonal
    # (1.0 + 0.9 + 1.0); the 4th call is left unmatched (3 references) and earns 0
    pred = [REF[0], search("Ana Brik painter"), {"name": "calculate", "args": {"expression": "1987-1950"}},
            search("Velor")]
    rewards, pairs = match_calls(pred, REF)
    np.testing.assert_allclose(rewards, [1.0, 0.9, 1.0, 0.0])
    assert sorted(pairs) == [(0, 0), (1, 1), (2, 2)]
    # in order, call 0 would take "Velor Systems" (0.9 > 0.7) and leave call 1 "Ana Brik" (0.5): total 1.4; the
    # matching gives call 0 "Ana Brik" (F1 0.4 -> 0.7) and call 1 "Velor Systems" (1.0): total 1.7
    rewards, pairs = match_calls([search("Velor Systems Ana"), search("Velor Systems")], REF[:2])
    np.testing.assert_allclose(rewards, [0.7, 1.0])
    assert sorted(pairs) == [(0, 1), (1, 0)]
    assert match_calls([], REF)[0].shape == (0,) and list(match_calls([REF[0]], [])[0]) == [0.0]


def test_soft_assignment_by_hand():
    # one predicted call, two references: the marginals fix the plan at [1/2, 1/2], so r = (S11 + S12) / 2
    rewards, pairs = match_calls([search("Velor")], REF[:2], assignment="soft")
    np.testing.assert_allclose(rewards, [(0.5 + 0.5 * 2 / 3 + 0.5) / 2], rtol=1e-9)
    # S = [[1, 0.5], [0.5, 1]] (cost 1 - S), epsilon 0.5: the symmetric plan [[a, 1/2 - a], [1/2 - a, a]] has
    # a^2 / (1/2 - a)^2 = exp((0.5 + 0.5) / 0.5) = e^2, so a = e / (2 (1 + e)) = 0.365529 and
    # r = 2 (a * 1 + (1/2 - a) * 0.5) = 0.865529 for both calls
    plan = sinkhorn_plan(np.array([[1.0, 0.5], [0.5, 1.0]]), 0.5)
    np.testing.assert_allclose(plan, [[0.365529, 0.134471], [0.134471, 0.365529]], atol=1e-6)
    np.testing.assert_allclose(match_calls(REF[:2], REF[:2], assignment="soft", epsilon=0.5)[0], [0.865529] * 2,
                               atol=1e-6)
    pred = [search("Velor Systems"), search("Ana Brik Velor Systems")]  # S = [[1, 0.5], [0.8333, 0.8333]]
    rewards, pairs = match_calls(pred, REF[:2], assignment="soft", epsilon=0.5)
    S = np.array([[1.0, 0.5], [0.5 + 0.5 * 2 / 3, 0.5 + 0.5 * 2 / 3]])
    plan = sinkhorn_plan(S, 0.5)
    np.testing.assert_allclose(rewards, 2 * np.sum(plan * S, axis=1), rtol=1e-12)
    assert pairs[0] == (0, 0) and plan.sum() == pytest.approx(1.0)
    # a small epsilon approaches the hard assignment's rewards
    np.testing.assert_allclose(match_calls(pred, REF[:2], assignment="soft", epsilon=0.005)[0],
                               match_calls(pred, REF[:2])[0], atol=1e-3)


def test_matching_errors():
    with pytest.raises(ValueError, match="predicted call 0: a tool call is"):
        match_calls(["search Velor"], REF)
    with pytest.raises(ValueError, match="name_weight must be in"):
        match_calls([REF[0]], REF, name_weight=1.5)
    with pytest.raises(ValueError, match="assignment must be one of \\('hard', 'soft'\\) and epsilon > 0"):
        match_calls([REF[0]], REF, assignment="greedy")
    with pytest.raises(ValueError, match="fix: a task that ships them"):
        reference_calls(types.SimpleNamespace(metadata={"question": "q"}))


def test_tool_match_rewards_from_episodes():
    ep = lambda infos: types.SimpleNamespace(infos=infos)  # noqa: E731
    trees = [types.SimpleNamespace(slot_episode=[
        ep([{"tool_call": REF[0]}, {"tool_call": search("Ana Brik painter")}, {"answered": True}]),
        ep([{"tool_call": search("Ana Brik")}, {"call_limit": True}]),  # a refused call is no call
        ep([{"answered": True}])])]
    out = tool_match_rewards(trees, [types.SimpleNamespace(metadata={"reference_calls": REF})], depth=3)
    np.testing.assert_allclose(out, [[[1.0, 0.9, np.nan], [1.0, np.nan, np.nan], [np.nan] * 3]])


def _forest():
    """One prompt, 3 chains: slot 0 = search, search, answer; slot 1 = search, answer; slot 2 = answer. Each turn
    one action token then (after a search) one observation token."""
    paths = np.array([[[0, 1, 2, 3], [0, 4, 5, -1], [0, 6, -1, -1]]])
    length = np.array([[0, 2, 2, 1, 2, 1, 1]])
    tok = np.array([[[1, 9, 2, 9, 3], [4, 9, 5, 0, 0], [6, 0, 0, 0, 0]]], np.int32)
    pm = np.array([[[1, 0, 1, 0, 1], [1, 0, 1, 0, 0], [1, 0, 0, 0, 0]]], np.float32)
    return forest_from_spans(paths, length, tok, policy_mask=pm)


def _jitted(options):
    return jax.jit(lambda f, r, m: matchtir(f, r, options, tool_match_PxWxD=m))


def test_matchtir_advantages_by_hand():
    forest = _forest()
    rewards = np.array([[1.0, 0.0, 0.0]], np.float32)
    match = np.array([[[1.0, 0.9, np.nan], [0.5, np.nan, np.nan], [np.nan] * 3]], np.float32)
    # G (gamma 1) on the tool turns: 1.9, 0.9 (slot 0), 0.5 (slot 1); mean 1.1, population std sqrt(1.04 / 3) =
    # 0.588784 -> A_turn = 1.358730, -0.339683, -1.019048. R = 1, 0, 0: mean 1/3, std sqrt(6 / 27) = 0.471405 ->
    # A_traj = 1.414211, -0.707105, -0.707105. A = A_traj + A_turn on tool turns, A_traj on answer turns.
    expected = np.array([[[2.772941, 1.074528, 1.414211], [-1.726153, -0.707105, 0.0], [-0.707105, 0.0, 0.0]]])
    spec = estimator_spec("matchtir")
    assert spec.inputs == ("tool_match_PxWxD",) and spec.options_cls is MatchTIROptions
    out = _jitted(MatchTIROptions())(forest, rewards, match)
    np.testing.assert_allclose(np.asarray(out.segments), expected, atol=1e-5)
    tokens, mask = np.asarray(out.tokens), np.asarray(forest.loss_mask)
    np.testing.assert_allclose(tokens[0, 0], [2.772941, 0.0, 1.074528, 0.0, 1.414211], atol=1e-5)
    assert np.all(tokens[mask == 0] == 0)
    # turn_weight 0 is the outcome's GRPO advantage on every turn; gamma 0 drops the later matches from G
    flat = _jitted(MatchTIROptions(turn_weight=0.0))(forest, rewards, match)
    np.testing.assert_allclose(np.asarray(flat.segments)[0, :, 0], [1.414211, -0.707105, -0.707105], atol=1e-5)
    g0 = _jitted(MatchTIROptions(gamma=0.0))(forest, rewards, match)  # G = 1.0, 0.9, 0.5
    std = np.sqrt(np.mean((np.array([1.0, 0.9, 0.5]) - 0.8) ** 2))
    np.testing.assert_allclose(np.asarray(g0.segments)[0, 0, 0], 1.414211 + 0.2 / std, atol=1e-4)


def test_matchtir_option_and_shape_errors():
    with pytest.raises(ValueError, match="turn_weight must be a finite number >= 0"):
        MatchTIROptions(turn_weight=-1.0)
    with pytest.raises(ValueError, match="gamma must be in"):
        MatchTIROptions(gamma=1.5)
    with pytest.raises(ValueError, match="eps must be"):
        MatchTIROptions(eps=0.0)
    with pytest.raises(ValueError, match=r"tool_match_PxWxD has shape \(1, 3, 2\), the forest has"):
        matchtir(_forest(), np.zeros((1, 3), np.float32), tool_match_PxWxD=np.zeros((1, 3, 2), np.float32))


def test_config_checks_name_the_fix():
    from treejax.rl.config import RunConfig
    from treejax.rl.multiturn import MultiTurnConfig
    from treejax.sampling import tree

    chains = tree.independent_config(4, 64, 16)
    world = dict(rollout=chains, task="retrieval_multihop", estimator="matchtir")
    RunConfig(rollouts=[MultiTurnConfig(environment="retrieval")], **world)
    with pytest.raises(ConfigError, match="environment 'code_tool' does not ship; fix: MultiTurnConfig.environment = "
                                          "'retrieval'"):
        RunConfig(rollouts=[MultiTurnConfig()], **world)
    with pytest.raises(ConfigError, match="does not supply; fix: .*MultiTurnConfig"):
        RunConfig(**world)
    with pytest.raises(ConfigError, match="not 'chain_sum_2x1'; fix: RunConfig.task = 'retrieval_multihop'"):
        RunConfig(rollouts=[MultiTurnConfig(environment="retrieval")], rollout=chains, estimator="grpo")
    with pytest.raises(ConfigError, match="tool_match_name_weight must be in"):
        MultiTurnConfig(tool_match_name_weight=2.0)
    with pytest.raises(ConfigError, match="tool_match_assignment must be 'hard' .* or 'soft'"):
        MultiTurnConfig(tool_match_assignment="greedy")


@pytest.mark.slow  # a tiny model's multi-turn rollout: ~40 s on the shared 2-core machine
def test_the_multiturn_source_supplies_tool_matches():
    """The multi-turn source hands the estimator ``tool_match_PxWxD`` [P, W, D]: the first turn's call matches
    the first reference call exactly (1.0) wherever the episode made it, every other entry is NaN; the estimator
    runs on it."""
    from treejax.rl.multiturn import MultiTurnConfig, MultiTurnRollouts
    from treejax.testing.envs import ScriptedToolEnv, tiny_multiturn_base

    examples = [types.SimpleNamespace(metadata={"reference_calls": REF}, ground_truth="1") for _ in range(2)]
    base, params = tiny_multiturn_base(examples)
    env = functools.partial(ScriptedToolEnv, 1, win=True, tool_info={"tool_call": REF[0]})  # one call, then the answer
    src = MultiTurnRollouts(base, MultiTurnConfig(max_turns=3, turn_tokens=10, chunk=4), make_env=env,
                            estimator_inputs=("tool_match_PxWxD",))
    ro = src.sample(params, jax.random.key(0), 0)
    match = np.asarray(ro.estimator_inputs["tool_match_PxWxD"])
    assert match.shape == (2, 2, 3)
    made = np.isfinite(match)
    assert made.sum() == round(ro.extra_metrics["multiturn/tool_calls_mean"] * 4) > 0
    assert np.all(match[made] == 1.0) and not made[:, :, 1:].any()
    assert ro.extra_metrics["multiturn/tool_match_mean"] == 1.0
    out = matchtir(ro.forest, ro.rewards_PxW, tool_match_PxWxD=match)
    assert np.all(np.isfinite(np.asarray(out.tokens)))
