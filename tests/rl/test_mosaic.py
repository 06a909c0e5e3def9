"""MOSAIC (treejax.envs.guarded_user, treejax.rl.advantages.mosaic): the requests that must be refused (deterministic
from the seed, ground truth, the verifier on refusals), the guarded user's reset / step / clone (a clone's future
equals a fresh replay), the plan -> check -> act-or-refuse format checker on hand-made turns, episode verdicts,
the pairwise judge and both objectives against hand-computed cases (numbers in the tests), option and config errors
naming the fix, and one RL step of the shipped config on tiny random models (slow)."""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
import types

import jax
import numpy as np
import pytest

from treejax.data.tasks import get_task
from treejax.envs import get_env
from treejax.envs.guarded_user import (GUARDED_INSTRUCTION, HAZARDS, VERDICT_COLUMNS, GuardedUserEnv, episode_verdict,
                                       parse_turn, safety_verdicts)
from treejax.envs.simulated_user import DOMAINS, INSTRUCTION
from treejax.errors import ConfigError, DataError
from treejax.rl.advantages import MOSAICOptions, estimator_spec, mosaic
from treejax.rl.advantages.mosaic import bradley_terry, mosaic_leaves, pairwise_preferences
from treejax.testing.forests import slot_turn_forest


@pytest.fixture(scope="module")
def task():
    return get_task("user_goals", user="scripted", size=60, eval_size=20, seed=3, unsafe=0.5)


def _same(a: list, b: list) -> bool:
    """Step results equal but for the measured ``tool_seconds``."""
    def strip(r):
        return r.observation, r.reward, r.done, {k: v for k, v in r.info.items() if k != "tool_seconds"}
    return [strip(x) for x in a] == [strip(x) for x in b]


# ----------------------------------------------------------------------------------------------- the world
def test_requests_to_refuse_are_deterministic_with_ground_truth(task):
    plain = get_task("user_goals", user="scripted", size=60, eval_size=20, seed=3)
    assert all("must_refuse" not in m for m in plain.goals("train")) and plain.instruction == INSTRUCTION
    assert get_task("user_goals", user="scripted", size=60, eval_size=20, seed=3, unsafe=0.0).records(
        "train") == plain.records("train")  # unsafe = 0: the goals of before, bit for bit
    again = get_task("user_goals", user="scripted", size=60, eval_size=20, seed=3, unsafe=0.5)
    assert task.records("train") == again.records("train") and task.instruction == GUARDED_INSTRUCTION
    metas, records = task.goals("train"), task.records("train")
    for m, p in zip(metas, plain.goals("train")):  # the hazard is drawn after the goal: same goals, personas
        assert (m["goal"], m["persona"], m["revealed"]) == (p["goal"], p["persona"], p["revealed"])
    refuse = [m for m in metas if m["must_refuse"]]
    assert 20 <= len(refuse) <= 40 and {m["hazard_at"] for m in refuse} == {"request", "reply"}
    for m, r in zip(metas, records):
        if m["must_refuse"]:
            assert m["hazard"] in HAZARDS[m["domain"]]
            assert (m["hazard"] in r["question"]) == (m["hazard_at"] == "request")
        else:
            assert "hazard" not in m and "I also want you to" not in r["question"]
    with pytest.raises(DataError, match=r"unsafe .* must be in \[0, 1\), got 1.5; fix: "
                                        r"RunConfig.task_options\['unsafe'\] = 0.25"):
        get_task("user_goals", user="scripted", unsafe=1.5)


def test_the_verifier_scores_refusals(task):
    exs = list(task.examples("train"))
    bad = next(e for e in exs if e.metadata["must_refuse"])
    good = next(e for e in exs if not e.metadata["must_refuse"])
    refusal = "<plan>p</plan><check>unsafe: fraud</check><refuse>I cannot help with that.</refuse>"
    answer = f"<plan>p</plan><check>safe: ok</check>Booked.\nAnswer: {good.ground_truth}"
    assert task.score(refusal, bad) == 1.0 and task.score(refusal, good) == 0.0  # over-refusal earns nothing
    assert task.score(answer, good) == 1.0
    assert task.score(f"Answer: {bad.ground_truth}", bad) == 0.0  # complying with a harmful request


def test_reset_step_and_clone_contract(task):
    ex = next(e for e in task.examples("train") if e.metadata.get("hazard_at") == "reply")
    env = get_env("guarded_user").from_config(types.SimpleNamespace(max_turns=4), task, None)
    assert isinstance(env, GuardedUserEnv) and env.stop_strings == ("</ask>", "</refuse>") and env.max_calls == 3
    assert env.reset(ex) == ""
    first = DOMAINS[ex.metadata["domain"]].slots[0]
    r = env.step(f"<plan>ask</plan><ask>What {first.cues[0]}?</ask>")
    assert ex.metadata["goal"][first.name] in r.observation and ex.metadata["hazard"] in r.observation  # revealed
    assert r.info["guarded_turn"] == {"action": "ask", "well_formed": True, "checked": False, "must_refuse": True}
    fork = env.clone()
    actions = [f"<plan>more</plan><check>safe: so far</check><ask>And the {first.cues[0]}?</ask>",
               "<plan>stop</plan><check>unsafe: fraud</check><refuse>I can't do that.</refuse>"]
    a, b = [env.step(x) for x in actions], [fork.step(x) for x in actions]
    fresh = GuardedUserEnv(task, max_calls=3)
    fresh.reset(ex)
    c = [fresh.step(x) for x in [f"<plan>ask</plan><ask>What {first.cues[0]}?</ask>"] + actions][1:]
    assert _same(a, b) and _same(a, c)
    assert ex.metadata["hazard"] not in a[0].observation  # only the first reply states it
    assert a[-1].done and a[-1].reward == 1.0 and a[-1].info["verifier_score"] == 1.0
    assert a[-1].info["guarded_turn"]["action"] == "refuse" and env.history == fork.history
    plain = get_task("user_goals", user="scripted", size=8, eval_size=4)
    with pytest.raises(ConfigError, match=r"no request to refuse .*; fix: RunConfig.task_options\['unsafe'\] = 0.25"):
        GuardedUserEnv(plain)


@pytest.mark.parametrize("text, action, well_formed", [
    ("<plan>find the day</plan><ask>Which day?</ask>", "ask", True),
    ("<plan>p</plan>\n<check>safe: a booking</check>\n<ask>Which day?</ask>\n", "ask", True),
    ("<plan>p</plan><check>unsafe: stolen card</check><refuse>No.</refuse>", "refuse", True),
    ("<plan>p</plan><check>safe: fine</check>Here it is.\nAnswer: day=friday", "answer", True),
    ("<ask>Which day?</ask>", "ask", False),                                         # no plan
    ("<plan> </plan><ask>Which day?</ask>", "ask", False),                           # empty plan
    ("<plan>p</plan><check>maybe</check><ask>q</ask>", "ask", False),               # no verdict word
    ("<plan>p</plan>then <ask>q</ask>", "ask", False),                               # text between the tags
    ("<plan>p</plan><ask>a</ask><ask>b</ask>", "ask", False),                        # two actions
    ("<plan>p</plan><refuse>No.</refuse>", "refuse", False),                         # a decision unchecked
    ("<plan>p</plan><check>safe: ok</check><refuse>No.</refuse>", "refuse", False),  # check disagrees
    ("<plan>p</plan><check>unsafe: x</check>Answer: day=friday", "answer", False),  # check disagrees
    ("<plan>p</plan>Answer: day=friday", "answer", False),                           # a decision unchecked
    ("<plan>p</plan><check>safe: ok</check>I am done.", "none", False),              # no action
])
def test_the_format_checker_on_hand_made_turns(text, action, well_formed):
    t = parse_turn(text)
    assert (t.action, t.well_formed) == (action, well_formed)


def test_episode_verdicts():
    def turn(action, ok=True, refuse=True):
        return {"guarded_turn": {"action": action, "well_formed": ok, "checked": True, "must_refuse": refuse}}

    refused = [turn("ask"), dict(turn("refuse"), answered=True, verifier_score=1.0)]
    complied = [turn("ask", ok=False), dict(turn("answer"), answered=True, verifier_score=0.0)]
    over = [dict(turn("refuse", refuse=False), answered=True, verifier_score=0.0)]
    solved = [turn("ask", refuse=False), dict(turn("answer", refuse=False), answered=True, verifier_score=1.0)]
    wrong = [dict(turn("answer", refuse=False), answered=True, verifier_score=0.0)]
    undecided = [turn("ask"), turn("ask", ok=False), dict(turn("ask"), answered=False, call_limit=True)]
    assert episode_verdict(refused) == (1.0, 1.0, 1.0) and episode_verdict(complied) == (-1.0, 0.0, 0.5)
    assert episode_verdict(over) == (-1.0, 0.0, 1.0) and episode_verdict(solved) == (1.0, 1.0, 1.0)
    assert episode_verdict(wrong) == (1.0, 0.0, 1.0) and episode_verdict(undecided) == (0.0, 0.0, 2 / 3)
    assert episode_verdict([{"tool_calls": 0}]) is None
    trees = [types.SimpleNamespace(slot_episode=[types.SimpleNamespace(infos=i) for i in (refused, complied)]),
             types.SimpleNamespace(slot_episode=[types.SimpleNamespace(infos=i) for i in (over, [{}])])]
    metrics = {}
    v = safety_verdicts(trees, metrics)
    assert v.shape == (2, 2, len(VERDICT_COLUMNS)) and np.all(np.isnan(v[1, 1]))
    np.testing.assert_array_equal(v[0], [[1.0, 1.0, 1.0], [-1.0, 0.0, 0.5]])
    assert metrics["multiturn/guarded/refusal_frac"] == pytest.approx(2 / 3)
    assert metrics["multiturn/guarded/harmful_frac"] == pytest.approx(1 / 3)
    assert metrics["multiturn/guarded/over_refusal_frac"] == pytest.approx(1 / 3)
    assert metrics["multiturn/guarded/format_frac"] == pytest.approx(2.5 / 3)


# ----------------------------------------------------------------------------------------------- the estimator
def _hand():
    """4 slots: 0 asks then answers right (2 policy tokens), 1 answers right at once (1), 2 complies with a
    harmful request after two questions (3, two thirds well formed), 3 runs out without deciding (1)."""
    forest = slot_turn_forest([[[True, False], [False], [True, True, False], [False]]])
    verdict = np.array([[[1, 1, 1], [1, 1, 1], [-1, 0, 2 / 3], [0, 0, 1]]], np.float32)
    return forest, verdict


def test_mosaic_win_rates_by_hand():
    forest, verdict = _hand()
    R = np.zeros((1, 4), np.float32)  # checked for shape only
    # decision, success, format, brevity (-tokens after a right decision: -2, -1, 0, 0):
    #   0 vs 1: tied to format, 1 is shorter -> 1;  0, 1 beat 2 and 3 on decision;  3 beats 2 on decision
    #   win rates r = [2/3, 1, 0, 1/3], mean 1/2, std sqrt(5/36) = 0.372678
    #   A = [1/6, 1/2, -1/2, -1/6] / 0.372678 = [0.447213, 1.341641, -1.341641, -0.447213]
    spec = estimator_spec("mosaic")
    assert spec.inputs == ("safety_verdict_PxWxC",) and spec.options_cls is MOSAICOptions
    out = jax.jit(lambda f, r, v: mosaic(f, r, MOSAICOptions(), safety_verdict_PxWxC=v))(forest, R, verdict)
    np.testing.assert_allclose(np.asarray(out.leaves), [[0.447213, 1.341641, -1.341641, -0.447213]], atol=1e-5)
    _, score, pref = mosaic_leaves(forest, R, MOSAICOptions(), verdict)
    np.testing.assert_allclose(np.asarray(score), [[2 / 3, 1.0, 0.0, 1 / 3]], atol=1e-6)
    np.testing.assert_array_equal(np.asarray(pref)[0], [[0, -1, 1, 1], [1, 0, 1, 1], [-1, -1, 0, -1],
                                                        [-1, -1, 1, 0]])
    tokens, mask = np.asarray(out.tokens), np.asarray(forest.loss_mask)
    np.testing.assert_allclose(tokens[0, 2][mask[0, 2] > 0], [-1.341641] * 3, atol=1e-5)
    assert np.all(tokens[mask == 0] == 0)
    # without brevity 0 and 1 tie: r = [5/6, 5/6, 0, 1/3], std sqrt(1/8) -> [0.942809, 0.942809, -1.414214, -0.471405]
    no_len = MOSAICOptions(criteria=("decision", "success", "format"))
    np.testing.assert_allclose(np.asarray(mosaic(forest, R, no_len, safety_verdict_PxWxC=verdict).leaves),
                               [[0.942809, 0.942809, -1.414214, -0.471405]], atol=1e-5)
    # a group of equal verdicts and lengths: exactly 0; a slot without a verdict (NaN) takes no part
    same = np.broadcast_to(verdict[:, 3:], (1, 4, 3)).copy()
    flat = slot_turn_forest([[[False]] * 4])
    assert np.all(np.asarray(mosaic(flat, R, MOSAICOptions(), safety_verdict_PxWxC=same).leaves) == 0.0)
    partial = verdict.copy()
    partial[0, 3] = np.nan
    adv = np.asarray(mosaic(forest, R, no_len, safety_verdict_PxWxC=partial).leaves)
    # r = [3/4 (tie with 1, beats 2), 3/4, 0] over 3 members, mean 1/2, std sqrt(1/8)
    np.testing.assert_allclose(adv, [[0.707106, 0.707106, -1.414213, 0.0]], atol=1e-5)


def test_mosaic_bradley_terry_by_hand():
    # two episodes, 0 preferred: theta = (d/2, -d/2) with sigmoid(-d) = prior d / 2; prior 0.1 -> d = 2.128035
    # (the root of 1 / (1 + e^d) = 0.05 d, found by bisection outside the test)
    pref = np.array([[[0.0, 1.0], [-1.0, 0.0]]], np.float32)
    pair = np.array([[[False, True], [True, False]]])
    theta = np.asarray(bradley_terry(pref, pair, 0.1, 25))
    np.testing.assert_allclose(theta, [[1.064017, -1.064017]], atol=1e-5)
    d = theta[0, 0] - theta[0, 1]
    assert abs(1.0 / (1.0 + math.exp(d)) - 0.05 * d) < 1e-6
    # a tie: both 0
    assert np.all(np.asarray(bradley_terry(np.zeros_like(pref), pair, 0.1, 25)) == 0.0)
    # the hand group of 4: the gradient sum_v (y_wv - sigmoid(theta_w - theta_v)) - prior theta_w vanishes, the
    # strengths sum to 0 and keep the win-rate order (1 > 0 > 3 > 2)
    forest, verdict = _hand()
    R = np.zeros((1, 4), np.float32)
    opts = MOSAICOptions(objective="bradley_terry", scale_by_std=False)
    adv, score, p = mosaic_leaves(forest, R, opts, verdict)
    th, p = np.asarray(score, np.float64)[0], np.asarray(p, np.float64)[0]
    y = np.where(np.eye(4) > 0, 0.0, (p + 1) / 2)
    s = 1 / (1 + np.exp(-(th[:, None] - th[None, :])))
    grad = np.sum(np.where(np.eye(4) > 0, 0.0, y - s), axis=1) - 0.1 * th
    assert np.max(np.abs(grad)) < 1e-5 and abs(th.sum()) < 1e-5
    assert list(np.argsort(-th)) == [1, 0, 3, 2]
    np.testing.assert_allclose(np.asarray(adv)[0], th, atol=1e-5)  # centred already: A = theta


def test_options_and_config_errors_name_the_fix():
    for kw, match in [({"criteria": ("decision", "safety")}, "criteria must be distinct names of .*; fix:"),
                      ({"criteria": ()}, "criteria must be"), ({"criteria": ("format", "format")}, "distinct"),
                      ({"objective": "dpo"}, "objective must be one of .*; fix: MOSAICOptions.objective = 'win_rate'"),
                      ({"bt_prior": 0.0}, "bt_prior must be a finite number > 0 .*; fix: MOSAICOptions.bt_prior"),
                      ({"bt_steps": 0}, "bt_steps must be an int >= 1"), ({"eps": -1.0}, "eps must be")]:
        with pytest.raises(ConfigError, match=match):
            MOSAICOptions(**kw)
    assert MOSAICOptions(criteria=["success", "decision"]).criteria == ("success", "decision")  # gin lists
    forest, verdict = _hand()
    with pytest.raises(ValueError, match=r"safety_verdict_PxWxC has shape \(1, 4, 2\)"):
        mosaic(forest, np.zeros((1, 4), np.float32), safety_verdict_PxWxC=verdict[..., :2])

    from treejax.rl.config import RunConfig
    from treejax.rl.multiturn import MultiTurnConfig
    from treejax.sampling import tree

    chains = tree.independent_config(4, 64, 16)
    RunConfig(rollouts=[MultiTurnConfig(environment="guarded_user")], rollout=chains, task="user_goals",
              estimator="mosaic")
    with pytest.raises(ConfigError, match="compares act-or-refuse verdicts, which environment 'simulated_user' does "
                                          "not give; fix: MultiTurnConfig.environment = 'guarded_user'"):
        RunConfig(rollouts=[MultiTurnConfig(environment="simulated_user")], rollout=chains, task="user_goals",
                  estimator="mosaic")
    with pytest.raises(ConfigError, match="does not supply; fix: .*MultiTurnConfig"):
        RunConfig(rollout=chains, task="user_goals", estimator="mosaic")
    with pytest.raises(ConfigError, match="not 'chain_sum_2x1'; fix: RunConfig.task = 'user_goals'"):
        RunConfig(rollouts=[MultiTurnConfig(environment="guarded_user")], rollout=chains, estimator="mosaic")


MOSAIC_ONE_STEP = ("RunConfig.task_options = {'size': 8, 'eval_size': 4, 'seed': 0, 'revealed': 1, 'unsafe': 0.5, "
                   "'user': 'scripted', 'extraction': 'answer_line'}", "TreeConfig.max_depth = 8",
                   "TreeConfig.segment_length = 16")


def _shipped_mosaic_in_a_process(model, log_dir, devices: int, extra_flags: str = ""):
    """One step of configs/multiturn_user_mosaic.gin as ``treejax-train`` in a process of its own on ``devices``
    CPU devices (the suite's other XLA flags kept); the CompletedProcess."""
    from treejax.testing.envs import shipped_multiturn_argv

    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count={devices} {extra_flags}".strip())
    argv = shipped_multiturn_argv("multiturn_user_mosaic.gin", model, log_dir, MOSAIC_ONE_STEP)
    return subprocess.run([sys.executable, "-m", "treejax.train", *argv], env=env, capture_output=True, text=True,
                          timeout=1200)


@pytest.mark.slow  # one RL step of the whole loop on tiny random models (106 s, 5.1 GB peak RSS on the shared 2-core
# machine); the default run covers its parts: test_reset_step_and_clone_contract, test_episode_verdicts,
# test_mosaic_win_rates_by_hand
# and test_options_and_config_errors_name_the_fix (the source's wiring is the same as the shipped InfoPO/SAGE configs')
def test_the_shipped_mosaic_config_runs_one_step(tiny_checkpoint, tmp_path):
    """configs/multiturn_user_mosaic.gin end to end (goals with requests to refuse, the scripted user, independent
    episodes in the guarded world, the verdicts, the pairwise estimator, the update, the evaluation with the
    environment) for one step on a tiny random policy with SmolLM2's tokenizer, as ``treejax-train`` in a process of
    its own on ONE CPU device. Run in-process (``treejax.train.main``) on the suite's 8 fake devices, the same step
    deadlocked 3 times of 3 (jax 0.10.2): its final evaluation with tools waits forever in an 8-way all-gather of the
    eager layer unstacking (``transformer.unstack_layers`` via ``fuse_projections`` in ``TurnContext.create``), 7 of
    8 device threads arriving; with ``MultiTurnConfig.eval_with_tools = False``, on one device, or as the CLI in a
    fresh process on 8 devices (once), it passes. Not understood yet; kept out of the suite's way here."""
    from treejax.testing.envs import check_shipped_multiturn_row

    out = _shipped_mosaic_in_a_process(tiny_checkpoint, tmp_path / "run", devices=1)
    assert out.returncode == 0, out.stderr[-3000:]
    last = check_shipped_multiturn_row(json.load(open(tmp_path / "run" / "summary.json")))
    assert "multiturn/guarded/decided_frac" in last and math.isfinite(last["multiturn/guarded/format_frac"])
