"""SPEAR (treejax.rl.spear): the tool-call bonus schedule, the buffer of wins, advantage recalibration that drops
stale wins, the self-imitation rows' masks / log-probs / fixed advantages, checkpoints, config checks; and one run
over the real MultiTurnRollouts with a tiny model and a learning step."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.forest import NodeStatus, forest_from_spans
from treejax.rl.rollouts import RolloutCounters, Rollouts
from treejax.rl.spear import SpearConfig, SpearRollouts

P, W, D, T = 2, 2, 3, 16
N = 1 + W * D


def _slot_tokens(p, w, step):
    """Slot (p, w): turn 1 = 3 policy tokens + 2 observation tokens, turn 2 = 3 policy tokens (the answer)."""
    base = 10 + 20 * p + 5 * w + step
    toks = np.array([base, base + 1, base + 2, 60, 61, base + 3, base + 4, base + 5], np.int32)
    pm = np.array([1, 1, 1, 0, 0, 1, 1, 1], np.float32)
    lp = np.where(pm > 0, -0.1 * (1 + np.arange(8)) - 0.01 * (p + w + step), 0.0).astype(np.float32)
    return toks, pm, lp


class _Scripted:
    """A MultiTurnRollouts-like source: ``scores[step]`` [P, W] and ``calls[step]`` [P, W]; independent chains of
    two turns; rewards ``2 s - 1`` (pm1)."""

    def __init__(self, scores, calls):
        self.scores, self.calls = scores, calls
        self.pipeline, self.estimator_inputs = None, ()

    def sample(self, params, key, step):
        path = np.full((P, W, D + 1), -1, np.int32)
        path[:, :, 0] = 0
        nl = np.zeros((P, N), np.int64)
        toks, pms, lps = (np.zeros((P, W, T), np.int32), np.zeros((P, W, T), np.float32),
                          np.zeros((P, W, T), np.float32))
        for p in range(P):
            for w in range(W):
                path[p, w, 1:3] = [1 + D * w, 2 + D * w]
                nl[p, 1 + D * w], nl[p, 2 + D * w] = 5, 3
                t, pm, lp = _slot_tokens(p, w, step)
                toks[p, w, :8], pms[p, w, :8], lps[p, w, :8] = t, pm, lp
        forest = forest_from_spans(path, nl, toks, logprobs=lps, policy_mask=pms,
                                   leaf_status=np.full((P, W), int(NodeStatus.FINISHED)), max_response_length=T,
                                   leaf_weight=np.ones((P, W), np.float32))
        s = np.asarray(self.scores[step], np.float32)
        return Rollouts(forest=forest, rewards_PxW=jax.numpy.asarray(2 * s - 1), scores_PxW=s,
                        prompts_PxLp=np.array([[1, 2, 3], [1, 4, 0]], np.int32), lengths_P=np.array([3, 2]),
                        counters=RolloutCounters(), examples=[f"ex{p}" for p in range(P)], reward_scores_PxW=s,
                        extra_metrics={"multiturn/tool_calls_mean": 0.0},
                        tool_calls_PxW=np.asarray(self.calls[step], np.int32))


def test_schedules():
    c = SpearConfig()
    np.testing.assert_allclose(c.tool_bonus([0, 1, 3, 20], 0), [0.0, 0.1, 0.3, 1.0], rtol=1e-6)
    np.testing.assert_allclose(c.tool_bonus([0, 1, 3, 20], 100), [0.0, 0.05, 0.15, 0.5], rtol=1e-6)
    np.testing.assert_allclose(c.tool_bonus([2], 50), [0.2 * (1 + math.cos(math.pi / 4)) / 2], rtol=1e-6)
    assert c.bonus_decay(200) == pytest.approx(0.0, abs=1e-12) and c.bonus_decay(201) == 0.0
    assert [c.sil_weight(s) for s in (0, 50, 100, 500)] == pytest.approx([0.0, 0.5, 1.0, 1.0])
    assert SpearConfig(sil_warmup_steps=0, sil_coef=0.5).sil_weight(0) == 0.5
    assert SpearConfig(bonus_steps=0).bonus_decay(0) == 0.0


def test_bonus_buffer_and_sil_rows():
    scores = [[[1, 0], [0, 0]], [[0, 0], [0, 0]]]
    calls = [[[2, 0], [1, 0]], [[0, 0], [0, 0]]]
    cfg = SpearConfig(sil_rows=2, sil_warmup_steps=4)
    src = SpearRollouts(_Scripted(scores, calls), cfg)
    key = jax.random.key(0)
    ro = src.sample(None, key, 0)
    # (1) the bonus the estimator sees
    np.testing.assert_allclose(np.asarray(ro.rewards_PxW)[:P], [[1.2, -1.0], [-0.9, -1.0]], rtol=1e-6)
    assert ro.extra_metrics["spear/tool_bonus"] == pytest.approx(0.1)
    assert ro.extra_metrics["spear/bonus_mean"] == pytest.approx(0.3 / 4)
    # nothing to replay at step 0: two filler rows that train on nothing
    assert ro.num_rows == P + 2 and ro.fresh_rows == P and ro.main_rows == P
    assert np.all(np.asarray(ro.forest.loss_mask)[P:] == 0)
    assert np.all(np.isnan(ro.fixed_advantage_PxW[:P])) and np.all(ro.fixed_advantage_PxW[P:] == 0)
    # (2) only slot (0, 0) is a win (score 1 and above its prompt's mean); (1, 0) is above its mean but scored 0
    assert ro.extra_metrics["spear/added"] == 1 and len(src.buffer) == 1
    t = src.buffer[0]
    toks, pm, lp = _slot_tokens(0, 0, 0)
    np.testing.assert_array_equal(t.tokens, toks)
    np.testing.assert_array_equal(t.policy_mask, pm)
    np.testing.assert_array_equal(t.logprobs, lp)
    np.testing.assert_array_equal(t.node_lengths, [5, 3])
    assert t.reward == 1.0 and t.step == 0 and t.example == "ex0" and t.prompt_length == 3

    ro = src.sample(None, key, 1)
    # the baseline: p50 of the group means so far, [0, -1] (step 0) and [-1, -1] (step 1)
    assert ro.extra_metrics["spear/baseline"] == pytest.approx(-1.0)
    assert ro.extra_metrics["spear/replayed_rows"] == 1 and len(src.buffer) == 0  # replayed once
    f = ro.forest
    mask, lps, tokens = (np.asarray(f.loss_mask), np.asarray(f.logprobs), np.asarray(f.tokens))
    np.testing.assert_array_equal(mask[P, 0, :8], pm)  # the observations stay out of the loss
    assert np.all(mask[P, 0, 8:] == 0) and np.all(mask[P, 1] == 0) and np.all(mask[P + 1] == 0)
    np.testing.assert_array_equal(lps[P, 0, :8], lp)  # the behaviour policy's log-probs
    np.testing.assert_array_equal(tokens[P, 1, :8], toks)  # every slot holds the chain
    np.testing.assert_array_equal(np.asarray(f.policy_mask)[P, 0, :8], pm)
    np.testing.assert_array_equal(np.asarray(f.spans())[P, 1:3], [[0, 5], [5, 3]])
    w = cfg.sil_weight(1)
    assert ro.fixed_advantage_PxW[P, 0] == pytest.approx(w * (1.0 - (-1.0)))
    assert ro.extra_metrics["spear/sil_adv_mean"] == pytest.approx(2.0)
    np.testing.assert_array_equal(ro.prompts_PxLp[P], [1, 2, 3])
    assert ro.lengths_P[P] == 3 and ro.examples[P] == "ex0"
    assert ro.extra_metrics["spear/mean_age"] == 1.0


def test_learner_applies_fixed_advantages():
    from treejax.rl.advantages.registry import estimator_spec
    from treejax.rl.step import with_fixed_advantages

    src = SpearRollouts(_Scripted([[[1, 0], [0, 0]]] * 2, [[[0, 0], [0, 0]]] * 2), SpearConfig(sil_rows=2))
    src.sample(None, jax.random.key(0), 0)
    ro = src.sample(None, jax.random.key(0), 1)
    spec = estimator_spec("grpo")
    adv = spec.fn(ro.forest, ro.rewards_PxW, spec.default_options())
    out = with_fixed_advantages(adv, ro.forest, ro.fixed_advantage_PxW)
    tok, m = np.asarray(out.tokens), np.asarray(out.loss_mask)
    np.testing.assert_array_equal(tok[:P], np.asarray(adv.tokens)[:P])  # the fresh rows: the estimator's
    fixed = ro.fixed_advantage_PxW[P, 0]
    assert fixed > 0
    np.testing.assert_allclose(tok[P, 0], fixed * np.asarray(ro.forest.loss_mask)[P, 0])
    assert np.all(tok[P, 1] == 0) and np.all(tok[P + 1] == 0) and np.all(m[P + 1] == 0)


def test_recalibration_drops_stale_wins_and_eviction():
    # step 0: one win (reward 1); steps 1..3: every slot correct, so the baseline (p50 of group means) becomes 1
    scores = [[[1, 0], [0, 0]]] + [[[1, 1], [1, 1]]] * 3
    calls = [[[0, 0], [0, 0]]] * 4
    src = SpearRollouts(_Scripted(scores, calls), SpearConfig(sil_rows=1, capacity=1, baseline_window=4))
    src.sample(None, jax.random.key(0), 0)
    assert len(src.buffer) == 1
    src.buffer[0].step = 1  # keep it young
    ro = src.sample(None, jax.random.key(0), 2)  # window: [0, -1, 1, 1] -> p50 = 0.5: still a win, replayed
    assert ro.extra_metrics["spear/replayed_rows"] == 1 and ro.extra_metrics["spear/stale_dropped"] == 0
    # all-correct groups store no wins (no slot above its prompt's mean)
    assert ro.extra_metrics["spear/added"] == 0 and len(src.buffer) == 0
    src2 = SpearRollouts(_Scripted(scores, calls), SpearConfig(sil_rows=1, capacity=1, baseline_window=4))
    src2.sample(None, jax.random.key(0), 0)
    src2.window.extend([1.0, 1.0, 1.0])  # the policy now wins everywhere: baseline 1, A = 1 - 1 = 0
    ro = src2.sample(None, jax.random.key(0), 1)
    assert ro.extra_metrics["spear/baseline"] == pytest.approx(1.0)
    assert ro.extra_metrics["spear/stale_dropped"] == 1 and ro.extra_metrics["spear/replayed_rows"] == 0
    assert np.all(np.asarray(ro.forest.loss_mask)[P:] == 0)
    # ageing: an entry older than max_age leaves; capacity keeps the newest
    src3 = SpearRollouts(_Scripted([[[1, 0], [1, 0]]] * 10, [[[0, 0], [0, 0]]] * 10),
                         SpearConfig(sil_rows=1, capacity=1, max_age=2))
    src3.sample(None, jax.random.key(0), 0)
    assert len(src3.buffer) == 1 and src3.buffer[0].prompt_length == 2  # capacity 1: (1, 0) replaced (0, 0)
    ro = src3.sample(None, jax.random.key(0), 5)
    assert ro.extra_metrics["spear/aged_out"] == 1 and ro.extra_metrics["spear/replayed_rows"] == 0


def test_checkpoint_round_trip():
    scores = [[[1, 0], [0, 1]]] * 4
    calls = [[[1, 0], [0, 2]]] * 4
    cfg = SpearConfig(sil_rows=1, capacity=8)
    a = SpearRollouts(_Scripted(scores, calls), cfg)
    for s in range(2):
        a.sample(None, jax.random.fold_in(jax.random.key(0), s), s)
    state = a.checkpoint_state()
    assert "spear_state" in state
    b = SpearRollouts(_Scripted(scores, calls), cfg)
    b.restore_state(state)
    assert len(b.buffer) == len(a.buffer) > 0 and list(b.window) == list(a.window)
    k = jax.random.fold_in(jax.random.key(0), 2)
    ra, rb = a.sample(None, k, 2), b.sample(None, k, 2)
    np.testing.assert_array_equal(ra.fixed_advantage_PxW, rb.fixed_advantage_PxW)
    np.testing.assert_array_equal(np.asarray(ra.forest.tokens), np.asarray(rb.forest.tokens))
    assert ra.extra_metrics == rb.extra_metrics
    c = SpearRollouts(_Scripted(scores, calls), cfg)
    c.restore_state({})
    assert c.buffer == [] and len(c.window) == 0


def test_config_checks():
    from treejax.rl.config import RunConfig
    from treejax.rl.losses import LossConfig
    from treejax.rl.multiturn import MultiTurnConfig
    from treejax.sampling import tree

    for bad in (dict(sil_rows=0), dict(capacity=2, sil_rows=4), dict(max_age=0), dict(baseline_window=0),
                dict(baseline_percentile=101.0), dict(bonus_per_call=-0.1), dict(bonus_steps=-1),
                dict(sil_coef=-1.0), dict(sil_warmup_steps=-2)):
        with pytest.raises(ConfigError, match="SpearConfig"):
            SpearConfig(**bad)
    chains = tree.independent_config(4, 64, 16)
    ok = dict(rollout=chains, estimator="grpo", loss=LossConfig(tis_cap=2.0), dynamic_sampling=False)
    cfg = RunConfig(rollouts=[MultiTurnConfig(), SpearConfig(sil_rows=4)], **ok)
    assert cfg.step_rows() == cfg.prompts_per_step + 4
    with pytest.raises(ConfigError, match=r"RunConfig.rollouts = \[@MultiTurnConfig\(\), @SpearConfig\(\)\]"):
        RunConfig(rollouts=[SpearConfig()], **ok)
    with pytest.raises(ConfigError, match="tis_cap"):
        RunConfig(rollouts=[MultiTurnConfig(), SpearConfig()], **{**ok, "loss": LossConfig()})
    with pytest.raises(ConfigError, match="packed_update"):
        RunConfig(rollouts=[MultiTurnConfig(), SpearConfig()], packed_update=True, **ok)
    with pytest.raises(ValueError, match="SpearConfig 3"):
        RunConfig(rollouts=[MultiTurnConfig(), SpearConfig(sil_rows=3)], mini_batches=8, **ok)  # (P + 3) x 4 rows


def test_gin_config_parses():
    import os

    from treejax.rl.multiturn import MultiTurnConfig
    from treejax.train import parse

    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    cfg = parse([os.path.join(root, "configs", "multiturn_code_tool_spear.gin")], [], check_mesh=False)
    assert [type(s) for s in cfg.rollouts] == [MultiTurnConfig, SpearConfig] and cfg.rollouts[1] == SpearConfig()
    assert cfg.loss.tis_cap == 2.0


@pytest.mark.slow
def test_over_multiturn_source_with_a_learning_step():
    """SpearRollouts over the real MultiTurnRollouts (tiny model, scripted environment): wins are stored with the
    episodes' own tokens, the next step replays them as rows the learner trains on, with a finite update."""
    import types

    from treejax.testing.envs import ScriptedToolEnv
    from treejax.models import presets, transformer
    from treejax.precision import Precision
    from treejax.rl.config import StepConfig
    from treejax.rl.layouts import Expanded
    from treejax.rl.losses import LossConfig
    from treejax.rl.multiturn import MultiTurnConfig, MultiTurnRollouts
    from treejax.rl.optimizer import OptimizerConfig, make_optimizer
    from treejax.rl.step import learn, make_learner
    from treejax.rl.train_state import TrainState
    from treejax.rl.update import make_update_fn
    from treejax.sampling import decode, tree
    from treejax.sampling.strategies import Temperature
    from treejax.testing.tokenizers import CharTokenizer

    cfg_m = presets.tiny_config("smollm2-135m", vocab_size=64)
    fns = decode.make_model_fns(cfg_m, attention="dense", cache_dtype="float32")
    tc = tree.independent_config(2, 32, 8, strategy=Temperature(1.0), stop_ids=(63,))

    count = iter(range(10**6))  # slot 0 of each prompt wins; the second tool call of every episode fails

    def make_env():
        return ScriptedToolEnv(error_turns=(2,), win=next(count) % 2 == 0)

    class Base:
        def __init__(self):
            self.cfg, self.pipeline = types.SimpleNamespace(), None
            self.rollout = types.SimpleNamespace(tree_config=tc)
            self.sampler_fns, self.tokenizer, self.task = fns, CharTokenizer(), None

        def draw(self):
            return ["a", "b"], np.array([[1, 2, 3], [1, 4, 0]], np.int32), np.array([3, 2], np.int32)

        def rewards(self, scores, lengths):
            return (2.0 * scores - 1.0).astype(np.float32)

    params = transformer.init_params(cfg_m, jax.random.key(5))
    mt = MultiTurnRollouts(Base(), MultiTurnConfig(max_turns=3, turn_tokens=10, chunk=4), make_env=make_env)
    src = SpearRollouts(mt, SpearConfig(sil_rows=2, sil_warmup_steps=0))
    ro0 = src.sample(params, jax.random.key(0), 0)
    calls = ro0.tool_calls_PxW[:P]
    assert np.all(calls <= 1)  # the second call of each episode fails: not counted
    np.testing.assert_allclose(np.asarray(ro0.rewards_PxW)[:P] - (2 * ro0.scores_PxW[:P] - 1), 0.1 * calls,
                               rtol=1e-6)
    wins = int(((ro0.scores_PxW[:P] >= 1) & (np.asarray(ro0.rewards_PxW)[:P]
                                             > np.asarray(ro0.rewards_PxW)[:P].mean(1, keepdims=True))).sum())
    assert len(src.buffer) == wins > 0
    stored = src.buffer[0]
    f0 = ro0.forest
    match = [(p, w) for p in range(P) for w in range(W)
             if int(f0.leaf_length[p, w]) == len(stored.tokens)
             and np.array_equal(np.asarray(f0.tokens)[p, w, :len(stored.tokens)], stored.tokens)]
    assert match
    p, w = match[0]
    L = len(stored.tokens)
    np.testing.assert_array_equal(stored.policy_mask, np.asarray(f0.loss_mask)[p, w, :L])
    np.testing.assert_array_equal(stored.logprobs, np.asarray(f0.logprobs)[p, w, :L])

    ro = src.sample(params, jax.random.key(1), 1)
    k = ro.extra_metrics["spear/replayed_rows"]
    assert k >= 1 and ro.num_rows == P + 2
    m = np.asarray(ro.forest.loss_mask)
    assert 0 < m[P:P + k, 0].sum() < sum(int(ro.forest.leaf_length[P + i, 0]) for i in range(k))  # obs masked
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3, warmup_steps=0, total_steps=2, weight_decay=0.0))
    layout = Expanded(cfg_m, attention_impl="xla")
    update = jax.jit(make_update_fn(layout, LossConfig(tis_cap=2.0), optimizer), donate_argnames=("state",))
    learner = make_learner(cfg_m, StepConfig(estimator="grpo", loss=LossConfig(tis_cap=2.0)),
                           Precision().resolve("cpu"), update, layout)
    state = TrainState.create(params, optimizer)
    state, metrics, _ = learn(learner, state, ro, jax.random.key(3))
    metrics = jax.device_get(metrics)
    assert float(metrics["update/skipped"]) == 0.0
    assert all(np.all(np.isfinite(np.asarray(v))) for v in metrics.values())
