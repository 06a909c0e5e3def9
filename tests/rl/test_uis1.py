"""UI-S1 (arXiv 2509.11543): the semi-online rollout's Patch Module on the retrieval world with a scripted policy,
the discounted step returns and the step- plus episode-level advantages by hand, the config checks, and the shipped
config for one step (slow)."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from treejax.data import get_task
from treejax.envs.retrieval import RetrievalEnv
from treejax.envs.semi_online import SemiOnlineConfig, SemiOnlineEnv, semi_online_arrays
from treejax.errors import ConfigError
from treejax.forest import forest_from_spans
from treejax.rl.advantages import UIS1Options, estimator_spec, ui_s1
from treejax.rl.advantages.ui_s1 import step_returns, ui_s1_turns
from treejax.testing.envs import run_shipped_multiturn

NAN = np.nan


@pytest.fixture(scope="module")
def task():
    return get_task("retrieval_multihop", size=16, eval_size=4, seed=3)


def _example(task, hops: int):
    return next(ex for ex in task.examples("train") if len(ex.metadata["reference_calls"]) == hops)


def _search(call) -> str:
    return RetrievalEnv.render_call(call)


def _expert_obs(task, example, calls) -> list[str]:
    """The plain world's observations for the expert's calls (the states the semi-online episode must reach)."""
    env = RetrievalEnv(task, max_calls=3)
    env.reset(example)
    return [env.step(_search(c)).observation for c in calls]


# ------------------------------------------------------------------------------------------- the Patch Module
def test_match_continues_from_the_expert_state_and_a_mismatch_is_patched(task):
    ex = _example(task, 3)
    ref = ex.metadata["reference_calls"]
    expert = _expert_obs(task, ex, ref)
    env = SemiOnlineEnv(RetrievalEnv(task, max_calls=3), SemiOnlineConfig(patch_limit=1))
    assert env.reset(ex) == "" and env.stop_strings == RetrievalEnv(task).stop_strings
    # step 1 matches (same tool, same query up to case): the expert's next state; reward 0.1 * 1 + 0.9 * 1
    r1 = env.step(f"First the company.\n<search>{ref[0]['args']['query'].upper()}</search>")
    assert r1.observation == expert[0] and not r1.done and r1.reward == pytest.approx(1.0)
    assert r1.info["semi_online"] == {"step": 0, "match": True, "type_match": True, "patched": False,
                                      "step_reward": pytest.approx(1.0)}
    assert r1.info["episode_score"] == pytest.approx(1 / 4)  # 1 of 3 calls + the answer
    # step 2: the right tool, a wrong query, no reasoning text: reward 0.9 * 0.5 = 0.45; patched: the expert's call
    # runs instead, the observation names it, then the expert's state
    r2 = env.step(f"<search>{'Zorblax Quux'}</search>")
    assert r2.reward == pytest.approx(0.45) and not r2.done
    assert r2.observation == f"\n[patched: {_search(ref[1])}]" + expert[1]
    assert r2.info["semi_online"]["patched"] and not r2.info["semi_online"]["match"]
    # a clone goes on independently of the original
    twin = env.clone()
    # step 3: an early answer (wrong action type, no reasoning line): reward 0; the patch limit (1) is spent: ends
    r3 = env.step("Answer: Tolsa")
    assert r3.done and r3.reward == 0.0 and r3.observation == "" and r3.info["patch_limit"]
    assert r3.info["episode_score"] == pytest.approx(1 / 4)
    with pytest.raises(RuntimeError, match="after the end"):
        env.step("Answer: x")
    r3b = twin.step(f"Then the city.\n{_search(ref[2])}")  # the clone matches step 3 and reaches the answer step
    assert r3b.observation == expert[2] and not r3b.done and r3b.info["semi_online"]["match"]


def test_a_fully_matched_trajectory_and_the_answer_step(task):
    ex = _example(task, 2)
    ref = ex.metadata["reference_calls"]
    env = SemiOnlineEnv(RetrievalEnv(task, max_calls=3), SemiOnlineConfig(patch_limit=0))
    env.reset(ex)
    for c in ref:
        assert env.step(f"Look it up.\n{_search(c)}").info["semi_online"]["match"]
    last = env.step(f"So it is this one.\nAnswer: {ex.ground_truth}")
    assert last.done and last.reward == pytest.approx(1.0) and last.info["answered"]
    assert last.info["semi_online"]["match"] and last.info["episode_score"] == pytest.approx(1.0)
    # a tool call at the answer step: no state to patch to, the episode ends unmatched (same tool type: none)
    env.reset(ex)
    for c in ref:
        env.step(_search(c))
    end = env.step(f"<search>{ex.ground_truth}</search>")
    assert end.done and end.reward == 0.0 and not end.info["semi_online"]["match"]
    assert end.info["episode_score"] == pytest.approx(2 / 3)
    # patch_limit 0: the first mismatch ends the episode; -1: every mismatch is patched
    env.reset(ex)
    assert env.step("<calculate>1 + 1</calculate>").done
    free = SemiOnlineEnv(RetrievalEnv(task, max_calls=3), SemiOnlineConfig(patch_limit=-1))
    free.reset(ex)
    assert not any(free.step("<calculate>1 + 1</calculate>").done for _ in ref)
    assert free.patches == len(ref)


def test_semi_online_arrays_read_the_turn_infos():
    class Ep:
        def __init__(self, steps):
            self.infos = [{"semi_online": {"step_reward": r, "match": m}} for r, m in steps]

    class Tree:
        slot_episode = [Ep([(1.0, True), (0.45, False)]), Ep([(0.1, False)])]

    out = semi_online_arrays([Tree()], depth=3)
    np.testing.assert_allclose(out["step_reward_PxWxD"], [[[1.0, 0.45, NAN], [0.1, NAN, NAN]]])
    np.testing.assert_array_equal(out["step_match_PxWxD"], [[[1.0, 0.0, NAN], [0.0, NAN, NAN]]])


# ----------------------------------------------------------------------------------- returns and advantages
def _forest():
    """One prompt, 3 slots: slot 0 has 3 turns, slot 1 two, slot 2 one (one action token and one observation token
    per turn but the last)."""
    paths = np.array([[[0, 1, 2, 3], [0, 4, 5, -1], [0, 6, -1, -1]]])
    length = np.array([[0, 2, 2, 1, 2, 1, 1]])
    tok = np.array([[[1, 9, 2, 9, 3], [4, 9, 5, 0, 0], [6, 0, 0, 0, 0]]], np.int32)
    pm = np.array([[[1, 0, 1, 0, 1], [1, 0, 1, 0, 0], [1, 0, 0, 0, 0]]], np.float32)
    return forest_from_spans(paths, length, tok, policy_mask=pm)


REWARD = np.array([[[1.0, 0.5, 0.1], [1.0, 1.0, NAN], [0.1, NAN, NAN]]], np.float32)
MATCH = np.array([[[1.0, 1.0, 0.0], [1.0, 1.0, NAN], [0.0, NAN, NAN]]], np.float32)


def test_discounted_returns_by_hand():
    valid = np.isfinite(REWARD)
    r, m = np.where(valid, REWARD, 0.0), np.where(valid, MATCH, 0.0) > 0.5
    # gamma 0.5, cut at mismatches: slot 0: t=2 mismatched -> R = 0.1 (and the run restarts at 0); t=1 -> 0.5;
    # t=0 -> 1 + 0.5 * 0.5 = 1.25. Slot 1: 1.0, then 1 + 0.5 * 1 = 1.5. Slot 2: mismatched -> its own 0.1.
    cut = step_returns(r, m, valid, 0.5, cut_at_mismatch=True)
    np.testing.assert_allclose(cut, [[[1.25, 0.5, 0.1], [1.5, 1.0, 0.0], [0.1, 0.0, 0.0]]], atol=1e-6)
    # the paper's plain sum_k gamma^(k-t) r_k: slot 0: 0.1, 0.5 + 0.05 = 0.55, 1 + 0.275 = 1.275
    plain = step_returns(r, m, valid, 0.5, cut_at_mismatch=False)
    np.testing.assert_allclose(plain, [[[1.275, 0.55, 0.1], [1.5, 1.0, 0.0], [0.1, 0.0, 0.0]]], atol=1e-6)


def test_ui_s1_advantages_by_hand():
    forest, rewards = _forest(), np.zeros((1, 3), np.float32)
    # Step level (R above): t=0 over [1.25, 1.5, 0.1]: mean 0.95, population std sqrt(1.115 / 3) = 0.609645 ->
    # 0.492089, 0.902163, -1.394252; t=1 over [0.5, 1.0]: mean 0.75, std 0.25 -> -1, 1; t=2: slot 0 alone -> 0.
    # Episode level ("return"): S = sum_t r = 1.6, 2.0, 0.1: mean 1.233333, std sqrt(2.006667 / 3) = 0.817856 ->
    # 0.448326, 0.937409, -1.385735. A = A^E + 1.0 * A^S.
    expected = np.array([[[0.448326 + 0.492089, 0.448326 - 1.0, 0.448326],
                          [0.937409 + 0.902163, 0.937409 + 1.0, 0.0],
                          [-1.385735 - 1.394252, 0.0, 0.0]]])
    spec = estimator_spec("ui_s1")
    assert spec.inputs == ("step_reward_PxWxD", "step_match_PxWxD") and spec.options_cls is UIS1Options
    run = jax.jit(lambda f, r, a, b: ui_s1(f, r, UIS1Options(), step_reward_PxWxD=a, step_match_PxWxD=b))
    out = run(forest, rewards, REWARD, MATCH)
    np.testing.assert_allclose(np.asarray(out.segments), expected, atol=1e-5)
    tokens, mask = np.asarray(out.tokens), np.asarray(forest.loss_mask)
    np.testing.assert_allclose(tokens[0, 0], [0.940415, 0.0, -0.551674, 0.0, 0.448326], atol=1e-5)
    assert np.all(tokens[mask == 0] == 0)
    # step_weight 0: the episode term alone on every turn of a slot
    ep = ui_s1(forest, rewards, UIS1Options(step_weight=0.0), step_reward_PxWxD=REWARD, step_match_PxWxD=MATCH)
    np.testing.assert_allclose(np.asarray(ep.segments)[0, :, 0], [0.448326, 0.937409, -1.385735], atol=1e-5)
    # episode_level "steps" (the released code): each step's r over all 6 steps [1, .5, .1, 1, 1, .1]: mean
    # 0.616667, std sqrt(0.988333 / 6) = 0.405860 -> slot 0, t=0: 0.383333 / 0.405860 = 0.944494
    _, _, term, _ = ui_s1_turns(forest, rewards, UIS1Options(episode_level="steps"), REWARD, MATCH)
    np.testing.assert_allclose(np.asarray(term)[0, 0], [0.944494, -0.287455, -1.273014], atol=1e-5)
    # scale_by_std False (the code's mean_norm): A^S at t=1 is R - mean = -0.25, 0.25; A^E = S - mean
    mean = ui_s1(forest, rewards, UIS1Options(scale_by_std=False), step_reward_PxWxD=REWARD, step_match_PxWxD=MATCH)
    np.testing.assert_allclose(np.asarray(mean.segments)[0, 1], [0.766667 + 0.55, 0.766667 + 0.25, 0.0], atol=1e-5)


# ---------------------------------------------------------------------------------------------- config errors
def test_option_and_config_errors_name_the_fix(task):
    from treejax.rl.config import RunConfig
    from treejax.rl.multiturn import MultiTurnConfig
    from treejax.sampling import tree

    with pytest.raises(ConfigError, match=r"UIS1Options.gamma must be in \[0, 1\], got 1.5; fix:"):
        UIS1Options(gamma=1.5)
    with pytest.raises(ConfigError, match="step_weight must be a finite number >= 0.*fix:"):
        UIS1Options(step_weight=-1.0)
    with pytest.raises(ConfigError, match="episode_level must be one of.*fix:"):
        UIS1Options(episode_level="trajectory")
    with pytest.raises(ConfigError, match="patch_limit must be an integer >= -1.*fix:"):
        SemiOnlineConfig(patch_limit=-2)
    with pytest.raises(ConfigError, match=r"patch must be one of \('thought_free',\).*fix:"):
        SemiOnlineConfig(patch="expert_thought")
    with pytest.raises(ConfigError, match=r"match_f1 must be in \[0, 1\]"):
        SemiOnlineConfig(match_f1=1.5)
    with pytest.raises(ValueError, match=r"step_match_PxWxD has shape \(1, 3, 2\), the forest has"):
        ui_s1(_forest(), np.zeros((1, 3), np.float32), step_reward_PxWxD=REWARD,
              step_match_PxWxD=np.zeros((1, 3, 2), np.float32))
    chains = tree.independent_config(4, 64, 16)
    world = dict(rollout=chains, task="retrieval_multihop", estimator="ui_s1")
    RunConfig(rollouts=[MultiTurnConfig(environment="retrieval", semi_online=SemiOnlineConfig())], **world)
    with pytest.raises(ConfigError, match=r"reads the semi-online rollout's step_reward_PxWxD, which is off; fix: "
                                          r"MultiTurnConfig.semi_online = @SemiOnlineConfig\(\)"):
        RunConfig(rollouts=[MultiTurnConfig(environment="retrieval")], **world)
    with pytest.raises(ConfigError, match="environment 'code_tool' cannot .*fix: MultiTurnConfig.environment = "
                                          "'retrieval'"):
        RunConfig(rollouts=[MultiTurnConfig(semi_online=SemiOnlineConfig())], rollout=chains, estimator="grpo")
    # the environment itself: no expert trajectory in the example, or a world that cannot replay one
    env = SemiOnlineEnv(RetrievalEnv(task))
    with pytest.raises(ConfigError, match="needs an expert trajectory .*fix: .*retrieval_multihop"):
        env.reset(type("Ex", (), {"metadata": {}})())
    from treejax.testing.envs import ToyToolEnv

    with pytest.raises(ConfigError, match="ToyToolEnv cannot replay expert steps.*fix:"):
        SemiOnlineEnv(ToyToolEnv())


# ---------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow  # one RL step of the whole loop on a tiny random model: 154 s on the shared 2-core machine
def test_the_shipped_uis1_config_runs_one_step(tiny_checkpoint, tmp_path):
    """configs/multiturn_retrieval_uis1.gin end to end (task, world, semi-online wrapper, step rewards, estimator,
    update, evaluation with the environment) for one step on a tiny random model with SmolLM2's tokenizer."""
    last = run_shipped_multiturn("multiturn_retrieval_uis1.gin", tiny_checkpoint, tmp_path / "run")
    assert 0.0 <= last["multiturn/semi_online/match_frac"] <= 1.0
    assert last["multiturn/semi_online/patches_mean"] >= 0.0
    assert np.isfinite(last["multiturn/semi_online/step_reward_mean"])


@pytest.mark.parametrize("world", ["shell", "travel"])
def test_semi_online_on_the_shell_and_travel_worlds(world):
    """The shell and travel worlds replay expert steps too: the expert's own calls match at every step and its
    answer is verified (episode score 1); a wrong call is patched to the expert's state, whose observation follows
    the patch note."""
    from treejax.data import get_task
    from treejax.envs import get_env

    task = get_task({"shell": "shell_files", "travel": "travel_plans"}[world], size=4, eval_size=2, seed=1,
                    system_prompt=None, extraction="answer_line")
    env_cls = get_env(world)
    ex = task.make_example(task.records("train")[0])
    ref = ex.metadata["reference_calls"]
    env = SemiOnlineEnv(env_cls(task, max_calls=len(ref) + 1), SemiOnlineConfig(patch_limit=1))
    env.reset(ex)
    assert all(env.step(env_cls.render_call(c)).info["semi_online"]["match"] for c in ref)
    last = env.step(f"Answer: {ex.ground_truth}")
    assert last.done and last.info["semi_online"]["match"] and last.info["episode_score"] == pytest.approx(1.0)
    env.reset(ex)
    wrong = {"shell": "<shell>pwd</shell>", "travel": "<hotels>Nowhere</hotels>"}[world]
    patched = env.step(wrong)
    assert patched.info["semi_online"]["patched"] and not patched.info["semi_online"]["match"]
    assert patched.observation.startswith(f"\n[patched: {env_cls.render_call(ref[0])}]")
