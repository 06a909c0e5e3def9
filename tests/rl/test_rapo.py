"""RAPO (issue 48; reconstructed): the estimator's reward-aware scaled outcome advantage and step-level tool-call
term by hand, the wrapper's curriculum pruning and per-prompt replay on a scripted source (no model), the rebuilt
rows against the originals, the checkpoint round trip, the config checks' one-line errors, the learner on a
replayed group (tiny random model), and the shipped config for one loop step (slow)."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.forest import forest_from_spans
from treejax.rl.advantages import RAPOOptions, estimator_spec, rapo
from treejax.rl.advantages.rapo import rapo_turns, reward_aware_scale
from treejax.rl.allocation.base import prompt_key
from treejax.rl.rapo import RAPOConfig, RAPORollouts, episodes_forest, splice_rows
from treejax.rl.spear import Trajectory

NAN = np.nan


def _forest():
    """One prompt, 4 chains: slot 0 = search, search, answer; slot 1 = search, answer; slots 2, 3 = answer. Each
    turn one action token then (after a search) one observation token."""
    paths = np.array([[[0, 1, 2, 3], [0, 4, 5, -1], [0, 6, -1, -1], [0, 7, -1, -1]]])
    length = np.array([[0, 2, 2, 1, 2, 1, 1, 1]])
    tok = np.array([[[1, 9, 2, 9, 3], [4, 9, 5, 0, 0], [6, 0, 0, 0, 0], [7, 0, 0, 0, 0]]], np.int32)
    pm = np.array([[[1, 0, 1, 0, 1], [1, 0, 1, 0, 0], [1, 0, 0, 0, 0], [1, 0, 0, 0, 0]]], np.float32)
    return forest_from_spans(paths, length, tok, policy_mask=pm)


MATCH = np.array([[[1.0, 0.5, NAN], [0.0, NAN, NAN], [NAN] * 3, [NAN] * 3]], np.float32)


# ------------------------------------------------------------------------------------------------ the estimator
def test_rapo_advantages_by_hand():
    # R = 1, -1, -1, -1: mean -0.5, population std sqrt(0.75) = 0.866025 -> z = 1.732051, -0.577350 (x3);
    # success rate p = 1/4: g = (4 * 1/4 * 3/4)^0.25 = 0.75^0.25 = 0.930605 -> A^o = 1.611855, -0.537285.
    # tool turns' matched scores 1.0, 0.5 (slot 0), 0.0 (slot 1): mean 0.5, std sqrt(0.5 / 3) = 0.408248 ->
    # A^s = 1.224745, 0, -1.224745. A = A^o + 0.5 A^s on tool turns, A^o on the answer turns.
    forest, rewards = _forest(), np.array([[1.0, -1.0, -1.0, -1.0]], np.float32)
    expected = np.array([[[2.224227, 1.611855, 1.611855], [-1.149657, -0.537285, 0.0], [-0.537285, 0.0, 0.0],
                          [-0.537285, 0.0, 0.0]]])
    spec = estimator_spec("rapo")
    assert spec.inputs == ("tool_match_PxWxD",) and spec.options_cls is RAPOOptions
    out = jax.jit(lambda f, r, m: rapo(f, r, RAPOOptions(), tool_match_PxWxD=m))(forest, rewards, MATCH)
    np.testing.assert_allclose(np.asarray(out.segments), expected, atol=1e-5)
    np.testing.assert_allclose(np.asarray(out.tokens)[0, 0], [2.224227, 0.0, 1.611855, 0.0, 1.611855], atol=1e-5)
    assert np.all(np.asarray(out.tokens)[np.asarray(forest.loss_mask) == 0] == 0)
    # alpha = 0 is GRPO's z-score for the outcome; beta = 0 drops the step term
    _, _, outcome, g = rapo_turns(forest, rewards, RAPOOptions(scale_power=0.0, step_weight=0.0), MATCH)
    np.testing.assert_allclose(np.asarray(outcome)[0], [1.732051, -0.577350, -0.577350, -0.577350], atol=1e-5)
    assert float(np.asarray(g)[0]) == 1.0
    # one outcome for every slot: g = 0 and the outcome term is exactly 0, the step term stays
    adv, step, outcome, g = rapo_turns(forest, -np.ones((1, 4), np.float32), RAPOOptions(), MATCH)
    assert float(np.asarray(g)[0]) == 0.0 and np.all(np.asarray(outcome) == 0.0)
    np.testing.assert_allclose(np.asarray(adv)[0, :2, 0], [0.612372, -0.612372], atol=1e-5)


def test_reward_aware_scale_by_hand():
    # 1 success in 8 with +-1 rewards: GRPO gives it (1 + 0.75) / (2 sqrt(7 / 64)) = 2.645751; g = 0.4375^0.25 =
    # 0.813288 -> 2.151759 (the docstring's example); alpha = 0.5 with +-1 rewards makes g the group's std, so
    # the outcome term is R - mean (Dr.GRPO): 1.75
    R = np.array([[1.0] + [-1.0] * 7], np.float32)
    used, w = np.ones((1, 8), bool), np.ones((1, 8), np.float32)
    np.testing.assert_allclose(np.asarray(reward_aware_scale(R, used, w, 1.0, 0.25)), [0.813288], atol=1e-6)
    paths = np.stack([np.zeros((8,), int), np.arange(1, 9)], axis=-1)[None]
    f = forest_from_spans(paths, np.array([[0] + [1] * 8]), np.ones((1, 8, 1), np.int32))
    m = np.full((1, 8, 1), NAN, np.float32)
    for alpha, want in ((0.0, 2.645751), (0.25, 2.151759), (0.5, 1.75)):
        _, _, outcome, _ = rapo_turns(f, R, RAPOOptions(scale_power=alpha), m)
        assert float(np.asarray(outcome)[0, 0]) == pytest.approx(want, abs=1e-4)
    # leaf weights count: a success slot of weight 3 among 4 slots of weight 1/3 is p = 3 / 4
    wt = np.array([[3.0, 1.0 / 3, 1.0 / 3, 1.0 / 3]], np.float32)
    np.testing.assert_allclose(np.asarray(reward_aware_scale(R[:, :4], used[:, :4], wt, 1.0, 1.0)), [0.75], atol=1e-6)


# ------------------------------------------------------------------------------------ the wrapper, scripted
W, D, T = 3, 2, 8


def _episode(step, p, w, turns: int) -> Trajectory:
    """A scripted episode: ``turns`` turns of 2 tokens (an action, then an observation), token ``10 + 10 step +
    3 p + w`` (< 64, the tiny model's vocabulary), sampler log-prob ``-0.1 (1 + w)`` on the actions."""
    tok = 10 + 10 * step + 3 * p + w
    return Trajectory(step=step, prompt=np.zeros(3, np.int32), prompt_length=3,
                      node_lengths=np.full(turns, 2, np.int32), tokens=np.full(2 * turns, tok, np.int32),
                      logprobs=np.tile([-0.1 * (1 + w), 0.0], turns).astype(np.float32),
                      policy_mask=np.tile([1.0, 0.0], turns).astype(np.float32), status=1, reward=0.0, score=0.0)


class _Pipeline:
    def get_state(self):
        return {}


class ScriptedTurns:
    """A multi-turn-shaped source (the ``draw`` seam, turn forests, ``tool_match_PxWxD``) whose scores come from a
    script ``{question: [scores of the W slots]}`` per step (default all 0); ``batches``: the pipeline's batches of
    questions, in order."""

    pipeline = _Pipeline()
    estimator_inputs = ("tool_match_PxWxD",)

    def __init__(self, batches, script):
        self.batches, self.script, self.drawn = iter(batches), script, []
        self.draw = self._draw

    def _draw(self):
        qs = next(self.batches)
        self.drawn.append(list(qs))
        examples = [types.SimpleNamespace(metadata={"question": q}) for q in qs]
        return examples, np.array([[1, 2, 3]] * len(qs), np.int32), np.full(len(qs), 3, np.int32)

    def sample(self, params, key, step):
        from treejax.rl.rollouts import Rollouts

        examples, prompts, lens = self.draw()
        qs = [e.metadata["question"] for e in examples]
        scores = np.array([self.script.get(step, {}).get(q, [0.0] * W) for q in qs], np.float32)
        rows = [[_episode(step, p, w, 1 + (w % 2)) for w in range(W)] for p in range(len(qs))]
        match = np.full((len(qs), W, D), NAN, np.float32)
        for p in range(len(qs)):
            for w in range(W):
                match[p, w, :len(rows[p][w].node_lengths) - 1] = 0.1 * (step + 1) + 0.01 * w  # tool turns
        return Rollouts(forest=episodes_forest(rows, T, 1 + W * D, D), rewards_PxW=2.0 * scores - 1.0,
                        scores_PxW=scores, prompts_PxLp=prompts, lengths_P=lens, examples=examples,
                        estimator_inputs={"tool_match_PxWxD": match},
                        tool_calls_PxW=np.ones((len(qs), W), np.int32))


def test_replay_puts_the_prompts_newest_solved_episode_into_its_all_fail_group():
    src = ScriptedTurns([["a", "b"]] * 4, {0: {"b": [0.0, 1.0, 0.0]}, 1: {"b": [0.0, 0.0, 1.0]}})
    rapo_src = RAPORollouts(src, RAPOConfig(prune_after=0))
    ro0 = rapo_src.sample(None, None, 0)
    assert ro0.extra_metrics["rapo/replayed"] == 0 and ro0.extra_metrics["rapo/bank_size"] == 1
    assert ro0.extra_metrics["rapo/zero_success_prompts"] == 1  # "a": nothing stored, nothing to replay
    ro1 = rapo_src.sample(None, None, 1)  # "b" solved again: its stored episode becomes step 1's slot 2
    assert ro1.extra_metrics["rapo/replayed"] == 0 and rapo_src.bank[prompt_key({"question": "b"})].episode.step == 1
    ro2 = rapo_src.sample(None, None, 2)  # "b" all-fail now: step 1's slot 2 (token 10 + 10 + 3 + 2 = 25) replayed
    m = ro2.extra_metrics
    assert m["rapo/replayed"] == 1 and m["rapo/replay_mean_age"] == 1.0 and m["rapo/zero_success_prompts"] == 2
    f = jax.device_get(ro2.forest)
    assert int(f.leaf_length[1, 2]) == 2 and np.all(np.asarray(f.tokens)[1, 2, :2] == 25)
    np.testing.assert_allclose(np.asarray(f.logprobs)[1, 2, :2], [-0.3, 0.0])  # the behaviour log-probs, kept
    np.testing.assert_allclose(np.asarray(f.loss_mask)[1, 2, :3], [1.0, 0.0, 0.0])  # its observation stays out
    assert float(np.asarray(ro2.rewards_PxW)[1, 2]) == 1.0 and float(np.asarray(ro2.scores_PxW)[1, 2]) == 0.0
    np.testing.assert_allclose(np.asarray(ro2.estimator_inputs["tool_match_PxWxD"])[1, 2], [NAN, NAN])  # 1 turn
    # the other slots and the other row are the policy's own, unchanged
    fresh = src.sample(None, None, 2)
    for name in ("tokens", "logprobs", "loss_mask", "leaf_length", "segment_index"):
        a, b = np.asarray(getattr(f, name)), np.asarray(getattr(fresh.forest, name))
        np.testing.assert_array_equal(a[0], b[0])
        np.testing.assert_array_equal(a[1, :2], b[1, :2])
    # the group is no longer all-fail: the replayed slot gets a positive advantage, the others a negative one
    adv = rapo(ro2.forest, ro2.rewards_PxW, tool_match_PxWxD=ro2.estimator_inputs["tool_match_PxWxD"])
    seg = np.asarray(adv.segments)[1]
    assert seg[2, 0] > 0 and seg[0, 0] < 0 and seg[1, 0] < 0
    # max_age: a stored episode older than that is not replayed
    old = RAPORollouts(ScriptedTurns([["b"], ["b"]], {0: {"b": [1.0, 0.0, 0.0]}}), RAPOConfig(prune_after=0,
                                                                                             max_age=1))
    old.sample(None, None, 0)
    assert old.sample(None, None, 2).extra_metrics["rapo/replayed"] == 0 and not old.bank


def test_curriculum_pruning_skips_mastered_prompts_in_the_draw():
    solved = [1.0] * W
    batches = [["a", "b"], ["a", "b"], ["a", "c"], ["d", "e"], ["a", "a"], ["a", "a"], ["a", "a"], ["a", "a"]]
    src = ScriptedTurns(batches, {0: {"a": solved, "b": solved}, 1: {"a": solved}})
    rapo_src = RAPORollouts(src, RAPOConfig(prune_after=2, max_draws=4))
    rapo_src.sample(None, None, 0)  # streaks a = 1, b = 1
    ro = rapo_src.sample(None, None, 1)  # a = 2: pruned; b failed: back to 0
    assert ro.extra_metrics["rapo/pruned_prompts"] == 1 and rapo_src.streak[prompt_key({"question": "b"})] == 0
    ro = rapo_src.sample(None, None, 2)  # "a" skipped; "c" kept, then "d" from a second batch; "e" dropped
    assert src.drawn[2:] == [["a", "c"], ["d", "e"]]
    assert [e.metadata["question"] for e in ro.examples] == ["c", "d"]
    assert {k: ro.extra_metrics[f"rapo/{k}"] for k in ("skipped", "refilled", "draws")} == \
        {"skipped": 1, "refilled": 0, "draws": 2}
    ro = rapo_src.sample(None, None, 3)  # only "a" left in the stream: 4 draws, then the pruned fill the step
    assert [e.metadata["question"] for e in ro.examples] == ["a", "a"]
    assert (ro.extra_metrics["rapo/refilled"], ro.extra_metrics["rapo/draws"]) == (2, 4)
    # the checkpoint round trip: streaks, pruned set and bank come back, and the draw reads the restored set
    again = RAPORollouts(ScriptedTurns([["a", "f"], ["g", "h"]], {}), RAPOConfig(prune_after=2))
    again.restore_state(rapo_src.checkpoint_state())
    assert again.pruned == rapo_src.pruned and again.streak == rapo_src.streak
    assert sorted(again.bank) == sorted(rapo_src.bank)
    assert [e.metadata["question"] for e in again.sample(None, None, 4).examples] == ["f", "g"]


def test_rebuilt_rows_equal_the_originals():
    """A forest numbered as the turn sampler numbers nodes (each round's new turns in slot order), rebuilt row by
    row from its episodes with nothing replaced: every per-token array and the estimator's advantages are equal."""
    from treejax.rl.spear import _trajectory

    paths = np.array([[[0, 1, 4], [0, 2, -1], [0, 3, 5]]])  # round 1: nodes 1-3; round 2: nodes 4, 5
    length = np.array([[0, 3, 2, 1, 2, 3, 0]])
    tok = np.arange(1, 1 + 3 * T).reshape(1, 3, T).astype(np.int32)
    pm = np.tile(np.array([1, 1, 0, 1, 0, 1, 1, 0], np.float32), (1, 3, 1))
    orig = jax.device_get(forest_from_spans(paths, length, tok, logprobs=-tok / 100.0, policy_mask=pm,
                                            leaf_status=np.array([[1, 2, 1]]), max_response_length=T))
    rows = [[_trajectory(orig, np.zeros(3), 3, 0, w, 0, 0.0, 0.0, None) for w in range(3)]]
    built = episodes_forest(rows, T, 7, D).replace(segment_length=orig.segment_length)
    out = splice_rows(orig.replace(leaf_weight=np.asarray(orig.leaf_weights())), built, [0])
    for name in ("tokens", "logprobs", "loss_mask", "leaf_length", "segment_index", "leaf_status", "policy_mask",
                 "leaf_weight"):
        np.testing.assert_array_equal(np.asarray(getattr(out, name)), np.asarray(getattr(orig, name)), err_msg=name)
    m = np.array([[[0.5, NAN], [NAN, NAN], [1.0, NAN]]], np.float32)
    r = np.array([[1.0, -1.0, 1.0]], np.float32)
    np.testing.assert_allclose(np.asarray(rapo(out, r, tool_match_PxWxD=m).tokens),
                               np.asarray(rapo(orig, r, tool_match_PxWxD=m).tokens), atol=1e-6)


# ------------------------------------------------------------------------------------------------ config errors
def test_option_and_config_errors_name_the_fix():
    from treejax.rl.config import RunConfig
    from treejax.rl.losses import LossConfig
    from treejax.rl.multiturn import MultiTurnConfig
    from treejax.rl.spear import SpearConfig
    from treejax.sampling import tree

    with pytest.raises(ConfigError, match="scale_power must be a finite number >= 0, got -1.0; fix: "):
        RAPOOptions(scale_power=-1.0)
    with pytest.raises(ConfigError, match="step_weight must be a finite number >= 0.*fix:"):
        RAPOOptions(step_weight=float("nan"))
    with pytest.raises(ConfigError, match="eps must be a finite number > 0.*fix:"):
        RAPOOptions(eps=0.0)
    with pytest.raises(ConfigError, match="prune_after must be an integer >= 0, got -1; fix: RAPOConfig.prune_after"):
        RAPOConfig(prune_after=-1)
    with pytest.raises(ConfigError, match=r"min_score must be in \(0, 1\].*fix:"):
        RAPOConfig(min_score=0.0)
    with pytest.raises(ConfigError, match="does nothing; fix: RAPOConfig.prune_after = 2"):
        RAPOConfig(prune_after=0, replay=False)
    chains = tree.independent_config(4, 64, 16)
    mt = MultiTurnConfig(environment="retrieval")
    world = dict(rollout=chains, task="retrieval_multihop", estimator="rapo", old_logp="trainer",
                 loss=LossConfig(tis_cap=2.0))
    RunConfig(rollouts=[mt, RAPOConfig()], **world)
    RunConfig(rollouts=[mt, RAPOConfig(replay=False)], **{**world, "loss": LossConfig()})  # pruning is on-policy
    with pytest.raises(ConfigError, match=r"RAPOConfig \(replay\) needs decoupled PPO's importance correction.*fix: "
                                          r"RunConfig.old_logp = 'trainer'.*\(or RAPOConfig.replay = False\)"):
        RunConfig(rollouts=[mt, RAPOConfig()], **{**world, "loss": LossConfig()})
    with pytest.raises(ConfigError, match="needs the expanded update.*fix: RunConfig.packed_update = False"):
        RunConfig(rollouts=[mt, RAPOConfig()], packed_update=True, **world)
    with pytest.raises(ConfigError, match=r"reads \['truth_logp_PxN'\]; fix: RunConfig.estimator = 'rapo'"):
        RunConfig(rollouts=[mt, RAPOConfig()], **{**world, "estimator": "igpo"})
    with pytest.raises(ConfigError, match="RAPOConfig wraps rows with \\['turn_forest'\\].*fix: .*MultiTurnConfig"):
        RunConfig(rollouts=[RAPOConfig()], **{**world, "estimator": "grpo"})
    with pytest.raises(ConfigError, match="SpearConfig wraps rows with \\['turn_forest'\\]"):
        RunConfig(rollouts=[mt, RAPOConfig(), SpearConfig()], **world)
    with pytest.raises(ConfigError, match="does not ship; fix: MultiTurnConfig.environment = 'retrieval'"):
        RunConfig(rollouts=[MultiTurnConfig(), RAPOConfig()], **{**world, "task": "chain_sum_2x1"})
    ctx = types.SimpleNamespace(cfg=types.SimpleNamespace(rollout=chains))
    inner = types.SimpleNamespace(config=MultiTurnConfig(roots=2), draw=None)
    with pytest.raises(ConfigError, match="needs independent episodes .*fix: MultiTurnConfig.roots = None"):
        RAPOConfig().build(inner, ctx)
    assert isinstance(RAPOConfig(replay=False).build(inner, ctx), RAPORollouts)


# ------------------------------------------------------------------------------------------------ the learner
def test_the_learner_trains_on_a_replayed_group():
    """The real RL step (``make_learner`` + ``learn`` with the trainer's old log-probs and TIS, tiny random model)
    on the wrapper's rollouts with a replayed slot: the learner's estimator gives :func:`rapo`'s advantages, and
    one update is finite and moves the parameters."""
    from treejax.models import presets, transformer
    from treejax.precision import Precision
    from treejax.rl.config import StepConfig
    from treejax.rl.layouts import Expanded
    from treejax.rl.losses import LossConfig
    from treejax.rl.optimizer import OptimizerConfig, make_optimizer
    from treejax.rl.step import learn, make_learner
    from treejax.rl.train_state import TrainState
    from treejax.rl.update import make_update_fn

    src = RAPORollouts(ScriptedTurns([["b"], ["b"]], {0: {"b": [1.0, 0.0, 0.0]}}), RAPOConfig(prune_after=0))
    src.sample(None, None, 0)
    ro = src.sample(None, None, 1)
    assert ro.extra_metrics["rapo/replayed"] == 1
    cfg = presets.tiny_config("smollm2-135m", vocab_size=64)
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3, warmup_steps=0, total_steps=2, weight_decay=0.0))
    layout = Expanded(cfg, attention_impl="xla")
    loss = LossConfig(tis_cap=2.0)
    update = jax.jit(make_update_fn(layout, loss, optimizer), donate_argnames=("state",))
    learner = make_learner(cfg, StepConfig(estimator="rapo", old_logp="trainer", loss=loss),
                           Precision().resolve("cpu"), update, layout)
    adv = learner.estimator(ro.forest, ro.rewards_PxW, ro.estimator_inputs)
    want = rapo(ro.forest, ro.rewards_PxW, tool_match_PxWxD=ro.estimator_inputs["tool_match_PxWxD"])
    np.testing.assert_allclose(np.asarray(adv.tokens), np.asarray(want.tokens), atol=1e-6)
    params = transformer.init_params(cfg, jax.random.key(5))
    before = jax.tree.map(np.asarray, params)
    state, metrics, _ = learn(learner, TrainState.create(params, optimizer), ro, jax.random.key(3))
    metrics = jax.device_get(metrics)
    assert float(metrics["update/skipped"]) == 0.0
    assert all(np.all(np.isfinite(np.asarray(v))) for v in metrics.values())
    moved = jax.tree.leaves(jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()), state.params, before))
    assert max(moved) > 0


# ---------------------------------------------------------------------------------------------- end to end
@pytest.mark.slow  # one RL step of the whole loop on a tiny random model: about 120 s (passed) on the shared 2-core
# machine under load; the default run covers its parts: test_the_learner_trains_on_a_replayed_group (the learner on
# the wrapper's rows), test_replay_puts_the_prompts_newest_solved_episode_into_its_all_fail_group and
# test_curriculum_pruning_skips_mastered_prompts_in_the_draw (the wrapper), test_matchtir.py (the matched scores)
def test_the_shipped_rapo_config_runs_one_step(tiny_checkpoint, tmp_path):
    """configs/multiturn_retrieval_rapo.gin end to end (task, world, the RAPO wrapper's draw and bank, matched
    tool-call scores, estimator, decoupled-PPO update, evaluation with the environment) for one step on a tiny
    random model with SmolLM2's tokenizer."""
    from treejax.testing.envs import run_shipped_multiturn

    last = run_shipped_multiturn("multiturn_retrieval_rapo.gin", tiny_checkpoint, tmp_path / "run")
    assert last["rapo/draws"] == 1 and last["rapo/pruned_prompts"] == 0
    assert 0 <= last["rapo/zero_success_prompts"] <= 2 and last["rapo/replayed"] == 0  # nothing stored at step 0
