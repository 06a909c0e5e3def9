"""SAGE (treejax.rl.advantages.sage, treejax.rl.chains): the skill-integrated reward and per-problem advantages on a
hand-made turn forest with the numbers written out, against a slow plain-Python reference on random chains, the
per-link arrays from episodes, the option errors, and one step of the real learner on the multi-turn source over a
task chain (tiny random model)."""

from __future__ import annotations

import json
import math
import re
import types

import jax
import numpy as np
import pytest

from treejax.rl.advantages import SAGEOptions, estimator_spec, sage
from treejax.rl.advantages.sage import later_weights, sage_turns
from treejax.rl.chains import CHAIN_INPUTS, chain_arrays
from treejax.testing.forests import slot_turn_forest

NAN = np.nan


def _hand():
    """Slot 0: problem 1 (answer), problem 2 (answer); slot 1: problem 1 (a tool turn, then the answer), problem 2;
    slot 2: problem 1, problem 2. A chain of 2 problems, 3 turns at most."""
    forest = slot_turn_forest([[[True, False], [True, True, False], [True, False]]])
    link = np.array([[[0, 1, -1], [0, 0, 1], [0, 1, -1]]], np.int32)
    outcome = np.array([[[1.0, 1.0, NAN], [1.0, 0.0, NAN], [0.5, 1.0, NAN]]], np.float32)
    skill = np.array([[[1, 0, 0], [0, 0, 0], [1, 0, 0]]], np.float32)
    return forest, link, outcome, skill


def test_sage_by_hand():
    forest, link, outcome, skill = _hand()
    R = np.array([[1.0, 0.5, 0.75]], np.float32)  # the chains' scores: not read
    # lambda 1, mu 0.5, gamma 0 (c_k = o_{k+1}); a_1 = u_0:
    #   slot 0: r_0 = 1 + 1*1*1*1 = 2,        r_1 = 1 + 0.5*1*1 = 1.5
    #   slot 1: r_0 = 1 + 1*0*1*0 = 1 (no skill passed on),   r_1 = 0
    #   slot 2: r_0 = 0.5 + 1*1*0.5*1 = 1.0,  r_1 = 1 + 0.5*1*1 = 1.5
    # problem 1: r = [2, 1, 1], mean 4/3, std sqrt(2/9) = 0.4714045 -> A = 1.414211, -0.707105, -0.707105
    # problem 2: r = [1.5, 0, 1.5], mean 1, std sqrt(0.5) = 0.7071068 -> A = 0.707106, -1.414212, 0.707106
    # (the outcomes alone, [1, 1, 0.5] on problem 1, could not tell slot 0's helpful skill from slot 1's none)
    spec = estimator_spec("sage")
    assert spec.inputs == CHAIN_INPUTS and spec.options_cls is SAGEOptions
    fn = jax.jit(lambda f, r, a, b, c: sage(f, r, SAGEOptions(), chain_link_PxWxD=a, chain_outcome_PxWxD=b,
                                            chain_skill_PxWxD=c))
    out = fn(forest, R, link, outcome, skill)
    expected = [[[1.414211, 0.707106, 0.0], [-0.707105, -0.707105, -1.414212], [-0.707105, 0.707106, 0.0]]]
    np.testing.assert_allclose(np.asarray(out.segments), expected, atol=1e-5)
    _, per_link, r = sage_turns(forest, R, SAGEOptions(), link, outcome, skill)
    np.testing.assert_allclose(np.asarray(r)[0, :, :2], [[2.0, 1.5], [1.0, 0.0], [1.0, 1.5]], atol=1e-6)
    tokens, mask = np.asarray(out.tokens), np.asarray(forest.loss_mask)
    np.testing.assert_allclose(tokens[0, 1], [-0.707105, 0.0, -0.707105, 0.0, -1.414212], atol=1e-5)
    assert np.all(tokens[mask == 0] == 0)
    # skill_weight = use_weight = 0: GRPO on each problem's outcome; problem 1 = [1, 1, 0.5] -> 0.707, 0.707, -1.414
    plain = sage_turns(forest, R, SAGEOptions(skill_weight=0.0, use_weight=0.0), link, outcome, skill)[0]
    np.testing.assert_allclose(np.asarray(plain)[0, :, 0], [0.707106, 0.707106, -1.414212], atol=1e-5)


def sage_reference(leaf_path, link, outcome, skill, lam, mu, gamma, eps, scale_by_std=True):
    """Plain Python: r_k per slot and problem, a population z-score per (prompt, problem) over the used slots
    (std 1 for one slot, var + 1e-8 inside the sqrt), then each turn takes its problem's value."""
    P, W, D = link.shape
    r = [[[None] * D for _ in range(W)] for _ in range(P)]
    for p in range(P):
        for w in range(W):
            o = [float(x) for x in outcome[p, w]]
            K = sum(math.isfinite(x) for x in o)
            for k in range(K):
                later = [(gamma ** (j - k - 1), o[j]) for j in range(k + 1, K)]
                c = sum(g * x for g, x in later) / sum(g for g, _ in later) if later else 0.0
                a = max([float(skill[p, w, j]) for j in range(k)], default=0.0)
                r[p][w][k] = o[k] + lam * skill[p, w, k] * o[k] * c + mu * a * o[k]
    adv = np.zeros((P, W, D))
    for p in range(P):
        for k in range(D):
            ws = [w for w in range(W) if leaf_path[p, w, 0] >= 0 and r[p][w][k] is not None]
            if not ws:
                continue
            vals = [r[p][w][k] for w in ws]
            mean = sum(vals) / len(vals)
            std = 1.0 if len(vals) <= 1 else math.sqrt(sum((v - mean) ** 2 for v in vals) / len(vals) + 1e-8)
            for w in range(W):
                for d in range(D):
                    if leaf_path[p, w, d + 1] >= 0 and link[p, w, d] == k and w in ws:
                        adv[p, w, d] = (r[p][w][k] - mean) / ((std + eps) if scale_by_std else 1.0)
    return adv


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_sage_matches_the_reference_on_random_chains(seed):
    rng = np.random.default_rng(seed)
    P, W, D = 2, 4, 5
    turns, links, outcome, skill = [], np.full((P, W, D), -1), np.full((P, W, D), NAN), np.zeros((P, W, D))
    for p in range(P):
        K = int(rng.integers(2, 4))
        turns.append([])
        for w in range(W):
            d = 0
            outcome[p, w, :K] = 0.0  # unfinished problems score 0
            for k in range(K):
                n = int(rng.integers(1, 3))  # the answer turn, after a tool turn or none
                if d + n > D:  # out of turns inside problem k: its turns so far, unfinished
                    links[p, w, d:], d = k, D
                    break
                links[p, w, d:d + n], d = k, d + n
                outcome[p, w, k], skill[p, w, k] = rng.choice([0.0, 0.5, 1.0]), float(rng.integers(2))
            turns[p].append([True] * (d - 1) + [False])
    forest = slot_turn_forest(turns, T=2 * D, D=D)
    R = np.zeros((P, W), np.float32)
    for opts in (SAGEOptions(), SAGEOptions(skill_weight=0.7, use_weight=0.2, gamma=0.5),
                 SAGEOptions(gamma=1.0, scale_by_std=False)):
        got = np.asarray(sage(forest, R, opts, chain_link_PxWxD=links.astype(np.int32),
                              chain_outcome_PxWxD=outcome.astype(np.float32),
                              chain_skill_PxWxD=skill.astype(np.float32)).segments)
        want = sage_reference(np.asarray(forest.leaf_path), links, outcome, skill, opts.skill_weight, opts.use_weight,
                              opts.gamma, opts.eps, opts.scale_by_std)
        np.testing.assert_allclose(got, want, atol=2e-5, err_msg=str(opts))
    assert np.abs(want).sum() > 0


def test_later_weights_and_option_errors():
    np.testing.assert_array_equal(later_weights(3, 0.0), [[0, 1, 0], [0, 0, 1], [0, 0, 0]])
    np.testing.assert_allclose(later_weights(3, 0.5), [[0, 1, 0.5], [0, 0, 1], [0, 0, 0]])
    with pytest.raises(ValueError, match="skill_weight and use_weight must be finite numbers >= 0.*fix"):
        SAGEOptions(skill_weight=-1.0)
    with pytest.raises(ValueError, match=r"gamma must be in \[0, 1\].*fix: SAGEOptions.gamma = 0.0"):
        SAGEOptions(gamma=2.0)
    with pytest.raises(ValueError, match="eps must be"):
        SAGEOptions(eps=0.0)
    forest, link, outcome, skill = _hand()
    with pytest.raises(ValueError, match=r"chain_skill_PxWxD has shape \(1, 3, 2\), the forest has"):
        sage(forest, np.zeros((1, 3), np.float32), chain_link_PxWxD=link, chain_outcome_PxWxD=outcome,
             chain_skill_PxWxD=skill[:, :, :2])


def test_chain_arrays_from_episodes():
    ep = lambda infos: types.SimpleNamespace(infos=infos)  # noqa: E731
    base = {"chain_length": 2}
    trees = [types.SimpleNamespace(slot_episode=[
        ep([{**base, "chain_link": 0, "tool_seconds": 0.0}, {**base, "chain_link": 0, "chain_outcome": 1.0,
                                                            "skill": True},
            {**base, "chain_link": 1, "chain_outcome": 0.5, "skill": False, "answered": True}]),
        ep([{**base, "chain_link": 0, "tool_seconds": 0.0}, {**base, "chain_link": 0, "tool_seconds": 0.0}])])]
    out = chain_arrays(trees, depth=3)
    np.testing.assert_array_equal(out["chain_link_PxWxD"], [[[0, 0, 1], [0, 0, -1]]])
    np.testing.assert_array_equal(out["chain_outcome_PxWxD"], [[[1.0, 0.5, NAN], [0.0, 0.0, NAN]]])  # unfinished: 0
    np.testing.assert_array_equal(out["chain_skill_PxWxD"], [[[1, 0, 0], [0, 0, 0]]])
    with pytest.raises(ValueError, match="does not fit 1 turns; fix: MultiTurnConfig.max_turns = 2"):
        chain_arrays(trees, depth=1)


def _digit_chain():
    """A chain of 2 problems of a tiny inner task whose questions and observations the tiny model's character
    tokenizer can write; an answer turn scores 1 when it holds a digit."""
    from treejax.data.task_base import Task
    from treejax.envs.task_chain_task import TaskChain

    class Digits(Task):
        name = "digits"

        def records(self, split):
            return [{"uid": f"{split}{i}", "question": f"Q{i}", "answer": "3", "metadata": json.dumps({})}
                    for i in range(4)]

        def score(self, text, example):
            return float(bool(re.search(r"\d", text)))

    return TaskChain(inner=Digits(), chain_length=2, size=2, eval_size=0, feedback="none",
                     next_format="<{index}>{question}")


def _learner(estimator_options=None):
    from treejax.models import presets
    from treejax.precision import Precision
    from treejax.rl.config import StepConfig
    from treejax.rl.layouts import Expanded
    from treejax.rl.losses import LossConfig
    from treejax.rl.optimizer import OptimizerConfig, make_optimizer
    from treejax.rl.step import make_learner
    from treejax.rl.update import make_update_fn

    cfg = presets.tiny_config("smollm2-135m", vocab_size=64)
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3, warmup_steps=0, total_steps=2, weight_decay=0.0))
    layout = Expanded(cfg, attention_impl="xla")
    update = jax.jit(make_update_fn(layout, LossConfig(), optimizer), donate_argnames=("state",))
    step = StepConfig(estimator="sage", **({} if estimator_options is None else
                                           {"estimator_options": estimator_options}))
    return cfg, optimizer, make_learner(cfg, step, Precision().resolve("cpu"), update, layout)


def _learn_once(learner, optimizer, params, ro):
    """One ``learn`` call; asserts a finite, applied update that moves the parameters."""
    from treejax.rl.step import learn
    from treejax.rl.train_state import TrainState

    before = jax.tree.map(np.asarray, params)
    state, metrics, _ = learn(learner, TrainState.create(params, optimizer), ro, jax.random.key(3))
    metrics = jax.device_get(metrics)
    assert float(metrics["update/skipped"]) == 0.0
    assert all(np.all(np.isfinite(np.asarray(v))) for v in metrics.values())
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), state.params, before))
    assert max(moved) > 0
    return metrics


def test_the_learner_trains_on_sage_advantages():
    """The real RL step (``make_learner`` + ``learn``, tiny random model) on the hand forest's rollouts: the
    learner's estimator program gives the hand advantages (gin options reach it), and one update is finite and
    moves the parameters."""
    from treejax.models import transformer
    from treejax.rl.rollouts import Rollouts

    forest, link, outcome, skill = _hand()
    cfg, optimizer, learner = _learner(SAGEOptions(skill_weight=1.0, use_weight=0.5))
    inputs = {"chain_link_PxWxD": link, "chain_outcome_PxWxD": outcome, "chain_skill_PxWxD": skill}
    ro = Rollouts(forest=forest, rewards_PxW=np.array([[1.0, 0.5, 0.75]], np.float32), scores_PxW=None,
                  prompts_PxLp=np.array([[5, 6, 7]], np.int32), lengths_P=np.array([3], np.int32),
                  estimator_inputs=inputs)
    adv = learner.estimator(ro.forest, ro.rewards_PxW, ro.estimator_inputs)
    np.testing.assert_allclose(np.asarray(adv.segments)[0, 1], [-0.707105, -0.707105, -1.414212], atol=1e-5)
    _learn_once(learner, optimizer, transformer.init_params(cfg, jax.random.key(5)), ro)


@pytest.mark.slow  # a tiny model's multi-turn rollout and update: 53-87 s on the shared 2-core machine; the default
# run covers its parts: test_the_learner_trains_on_sage_advantages (the learner on SAGE's inputs),
# test_chain_arrays_from_episodes (the source's arrays) and tests/envs/test_task_chain.py (the environment)
def test_one_learner_step_on_chain_episodes():
    """The multi-turn source over a task chain (tiny random model, turns end on '5') supplies SAGE's inputs from
    the episodes; the learner's estimator gives :func:`sage`'s advantages on them, exactly 0 on observations; one
    update through ``learn`` is finite and moves the parameters."""
    from treejax.envs.task_chain import TaskChainEnv
    from treejax.rl.multiturn import MultiTurnConfig, MultiTurnRollouts
    from treejax.testing.envs import tiny_multiturn_base

    chain = _digit_chain()
    examples = list(chain.examples("train"))
    base, params = tiny_multiturn_base(examples)
    src = MultiTurnRollouts(base, MultiTurnConfig(max_turns=3, turn_tokens=6, chunk=6),
                            make_env=lambda: TaskChainEnv(chain, stop_strings=("5",)), estimator_inputs=CHAIN_INPUTS)
    ro = src.sample(params, jax.random.key(2), 0)
    inputs = {k: np.asarray(v) for k, v in ro.estimator_inputs.items()}
    assert sorted(inputs) == sorted(CHAIN_INPUTS) and all(v.shape == (2, 2, 3) for v in inputs.values())
    o = inputs["chain_outcome_PxWxD"]
    assert np.all(np.isfinite(o[:, :, :2])) and np.all(np.isnan(o[:, :, 2]))
    np.testing.assert_allclose(ro.scores_PxW, o[:, :, :2].mean(-1))  # the episode's score: its problems' mean
    went_on = inputs["chain_link_PxWxD"].max(-1) >= 1  # problem 1 finished: in context mode it passed a skill on
    assert np.all(inputs["chain_skill_PxWxD"][:, :, 0][went_on] == 1.0) and went_on.any()
    assert len(np.unique(o[:, :, :2])) > 1  # this key's episodes solve some problems and miss others
    assert ro.extra_metrics["multiturn/chain_solved_mean"] == pytest.approx(float(np.mean(o[:, :, :2])))
    cfg, optimizer, learner = _learner()
    adv = learner.estimator(ro.forest, ro.rewards_PxW, ro.estimator_inputs)
    want = sage(ro.forest, ro.rewards_PxW, **{k: ro.estimator_inputs[k] for k in CHAIN_INPUTS})
    np.testing.assert_allclose(np.asarray(adv.tokens), np.asarray(want.tokens), atol=1e-6)
    mask = np.asarray(ro.forest.loss_mask)
    assert np.all(np.asarray(adv.tokens)[mask == 0] == 0) and np.abs(np.asarray(adv.tokens)).sum() > 0
    _learn_once(learner, optimizer, params, ro)
