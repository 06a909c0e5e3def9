"""DART (treejax.rl.dart, treejax.rl.allocation.dart, treejax.rl.shaping.dart): hand-computed checks of each piece
and one RL step of configs/efficacy_dart.gin on a tiny random model."""

import json
import os

import jax.numpy as jnp
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.rl.allocation.base import Budget, PromptStats
from treejax.rl.allocation.dart import (DARTAllocator, dart_length_cap, dart_rollouts, length_cap_mask,
                                        running_success)
from treejax.rl.dart import DARTConfig, injection_targets, load_solutions
from treejax.rl.losses import LossConfig, policy_loss
from treejax.rl.shaping.apply import apply_shapers
from treejax.rl.shaping.base import ShapingInputs
from treejax.rl.shaping.dart import DARTEntropyMask, top_fraction_mask

CONFIGS = os.path.join(os.path.dirname(__file__), "..", "..", "configs")


# ------------------------------------------------------------------------------------- 1. allocation and length
def test_running_success_is_an_ema_seeded_by_the_first_sight():
    s, rates = running_success({"a": 0.5}, ["a", "b"], [1.0, 0.25], ema=0.5)
    np.testing.assert_allclose(s, [0.75, 0.25])  # a: 0.5 * 0.5 + 0.5 * 1; b: first sight
    assert rates == {"a": 0.75, "b": 0.25}


def test_rollout_count_and_length_cap_from_success_rates():
    s = [0.0, 0.25, 0.5, 1.0]
    # N = 8 + ceil(56 (1 - s)): 64, 8 + 42, 8 + 28, 8
    np.testing.assert_array_equal(dart_rollouts(s, 8, 64), [64, 50, 36, 8])
    # L = 64 + round(64 (1 - s)): 128, 112, 96, 64
    np.testing.assert_array_equal(dart_length_cap(s, 64, 128), [128, 112, 96, 64])


def test_allocator_asks_for_the_missing_rollouts_and_keeps_the_rates():
    alloc = DARTAllocator(ema=1.0, min_length=16, max_length=0)
    stats = PromptStats(rollouts_P=np.array([8, 8, 8]), accuracy_P=np.array([0.0, 0.5, 1.0]),
                        reward_mean_P=np.zeros(3), reward_std_P=np.zeros(3), keys=("x", "y", "z"))
    extra, state = alloc.extra_rollouts(stats, alloc.init_state(), Budget(extra=64, chunk=8, max_rollouts=32))
    np.testing.assert_array_equal(extra, [24, 12, 0])  # N = 8 + ceil(24 (1 - s)) - 8
    assert state["rate"] == {"x": 0.0, "y": 0.5, "z": 1.0} and state["last"] == [0.0, 0.5, 1.0]
    np.testing.assert_array_equal(alloc.length_caps(np.array(state["last"]), 64), [64, 40, 16])


def test_length_cap_masks_tokens_past_the_cap_and_truncates_long_leaves():
    mask = np.ones((2, 2, 5), np.float32)
    lengths = np.array([[5, 2], [3, 4]])
    rewards = np.array([[1.0, 1.0], [1.0, -1.0]], np.float32)
    new, r, trunc = length_cap_mask(mask, lengths, rewards, np.array([3, 5]), truncated_reward=-1.0)
    np.testing.assert_array_equal(new[0], [[1, 1, 1, 0, 0]] * 2)
    np.testing.assert_array_equal(new[1], np.ones((2, 5)))
    np.testing.assert_array_equal(trunc, [[True, False], [False, False]])
    np.testing.assert_array_equal(r, [[-1.0, 1.0], [1.0, -1.0]])


@pytest.mark.parametrize("kw", [dict(ema=0.0), dict(min_length=0), dict(min_length=64, max_length=32)])
def test_allocator_refuses_bad_values(kw):
    with pytest.raises(ConfigError):
        DARTAllocator(**kw)


# ------------------------------------------------------------------------------------- 2. high-entropy steps
def test_top_fraction_mask_selects_exactly_the_top_tokens():
    h = jnp.array([0.1, 0.9, 0.5, 0.7, 0.3, 2.0])
    valid = jnp.array([True, True, True, True, True, False])  # the masked 2.0 never counts
    keep = np.asarray(top_fraction_mask(h, valid, 0.4))  # floor(0.4 * 5) = 2: 0.9 and 0.7
    np.testing.assert_array_equal(keep, [False, True, False, True, False, False])
    assert np.asarray(top_fraction_mask(h, valid, 0.1)).sum() == 1  # at least one
    assert not np.asarray(top_fraction_mask(h, valid & False, 0.5)).any()


def _inputs(entropy, loss_mask):
    P, W, T = loss_mask.shape
    return ShapingInputs(advantages=jnp.ones((P, W, T)) * loss_mask, loss_mask=jnp.asarray(loss_mask),
                         old_logp=jnp.zeros((P, W, T)), rewards=jnp.zeros((P, W)), scores=jnp.zeros((P, W)),
                         leaf_length=jnp.full((P, W), T), eps_scale=jnp.ones((P, W)),
                         leaf_path=jnp.zeros((P, W, 2), jnp.int32), entropy=jnp.asarray(entropy))


def test_step_mask_keeps_the_highest_mean_entropy_responses():
    # 2 prompts x 2 leaves x 3 tokens; leaf means: 1.0, 0.2, 0.6, (masked leaf)
    ent = np.array([[[1.0, 1.0, 1.0], [0.2, 0.2, 0.2]], [[0.6, 0.6, 0.6], [9.0, 9.0, 9.0]]], np.float32)
    mask = np.ones((2, 2, 3), np.float32)
    mask[1, 1] = 0.0
    mask[0, 0, 2] = 0.0  # its mean is still over its trained tokens
    adv, _, metrics, _, new_mask = apply_shapers((DARTEntropyMask(top_ratio=0.7, unit="step"),),
                                                 _inputs(ent, mask), with_mask=True)
    # n = 3 steps, k = floor(2.1) = 2: leaves (0, 0) and (1, 0)
    want = np.zeros((2, 2, 3), np.float32)
    want[0, 0, :2] = 1.0
    want[1, 0] = 1.0
    np.testing.assert_array_equal(np.asarray(new_mask).reshape(2, 2, 3), want)
    np.testing.assert_array_equal(np.asarray(adv).reshape(2, 2, 3), want)
    np.testing.assert_allclose(float(metrics["shaping/dart_entropy/kept_frac"]), 5 / 8)  # tokens
    np.testing.assert_allclose(float(metrics["shaping/dart_entropy/kept_response_frac"]), 2 / 3)  # responses


def test_token_mask_and_the_loss_denominator():
    ent = np.array([[[0.1, 0.8, 0.3, 0.9]]], np.float32)
    mask = np.ones((1, 1, 4), np.float32)
    _, _, _, _, new_mask = apply_shapers((DARTEntropyMask(top_ratio=0.5, unit="token"),), _inputs(ent, mask),
                                         with_mask=True)
    np.testing.assert_array_equal(np.asarray(new_mask), [[0, 1, 0, 1]])
    # the masked pairs leave the token-mean's denominator too: the loss is the mean over the 2 kept tokens
    logp = jnp.log(jnp.array([[0.5, 0.5, 0.5, 0.5]]))
    adv = jnp.array([[1.0, 2.0, 3.0, 4.0]])
    loss, _ = policy_loss(logp, logp, adv, new_mask, LossConfig(aggregation="token-mean"))
    np.testing.assert_allclose(float(loss), -(2.0 + 4.0) / 2, rtol=1e-6)


@pytest.mark.parametrize("kw", [dict(top_ratio=0.0), dict(top_ratio=1.5), dict(unit="turn")])
def test_entropy_mask_refuses_bad_values(kw):
    with pytest.raises(ConfigError):
        DARTEntropyMask(**kw)


# ------------------------------------------------------------------------------------- 3. truncated IS
def test_tis_weights_are_truncated_at_the_cap():
    old = jnp.log(jnp.array([[0.5, 0.5, 0.5]]))
    sampler = jnp.log(jnp.array([[0.5, 0.25, 0.05]]))  # w = 1, 2, 10 -> min(w, 3) = 1, 2, 3
    adv, mask = jnp.ones((1, 3)), jnp.ones((1, 3))
    loss, m = policy_loss(old, old, adv, mask, LossConfig(aggregation="token-mean", tis_cap=3.0),
                          sampler_logp=sampler)
    np.testing.assert_allclose(float(loss), -(1 + 2 + 3) / 3, rtol=1e-5)  # ratio 1: the loss is -mean(w A)
    np.testing.assert_allclose(float(m["tis_weight_mean"]), (1 + 2 + 10) / 3, rtol=1e-5)
    np.testing.assert_allclose(float(m["tis_clip_frac"]), 1 / 3, rtol=1e-6)


# ------------------------------------------------------------------------------------- 4. injection
def test_injection_only_for_zero_success_prompts():
    success = np.array([[0, 0, 0, 0], [0, 1, 0, 0], [0, 0, 0, 0], [0, 0, 0, 0], [0, 0, 1, 0]], bool)
    valid = np.ones_like(success)
    valid[4, 2] = False  # an unused slot's success does not count
    rate = np.array([0.0, 0.0, 0.5, 0.1, 0.0])
    avail = np.array([True, True, True, False, True])
    np.testing.assert_array_equal(injection_targets(success, valid, rate, 0.25, avail),
                                  [True, False, False, False, True])


def test_solutions_jsonl(tmp_path):
    from treejax.rl.allocation.base import prompt_key

    path = tmp_path / "sol.jsonl"
    path.write_text(json.dumps({"question": "What is 2 + 2?", "solution": "Answer: 4"}) + "\n\n")
    assert load_solutions(str(path)) == {prompt_key({"question": "What is 2 + 2?"}): "Answer: 4"}
    path.write_text(json.dumps({"question": "q"}) + "\n")
    with pytest.raises(ConfigError, match="solution"):
        load_solutions(str(path))
    with pytest.raises(ConfigError, match="no such file"):
        load_solutions(str(tmp_path / "missing.jsonl"))


def test_dart_config_refuses_bad_values():
    from treejax.rl.allocation.dars import DARS

    with pytest.raises(ConfigError, match="DARTAllocator"):
        DARTConfig(allocator=DARS())
    with pytest.raises(ConfigError, match="max_inject_rate"):
        DARTConfig(allocator=DARTAllocator(), max_inject_rate=2.0)


def test_shipped_config_parses_and_the_chain_refuses_trees():
    from treejax import train

    cfg = train.parse([os.path.join(CONFIGS, "efficacy_dart.gin")], [])
    (stage,) = cfg.rollouts
    assert isinstance(stage, DARTConfig) and isinstance(stage.allocator, DARTAllocator)
    assert cfg.shapers == (DARTEntropyMask(top_ratio=0.8, unit="step"),) and cfg.loss.tis_cap == 2.0
    with pytest.raises(ConfigError, match="branch_factor = 1"):
        train.parse([os.path.join(CONFIGS, "efficacy_dart.gin")], ["TreeConfig.branch_factor = 2"])


class _FakeBase:
    """What :class:`DARTRollouts.curate` reads of the task's rollout service."""

    def __init__(self, P, W):
        import types

        self.cfg = types.SimpleNamespace(prompts_per_step=P, rollout=types.SimpleNamespace(num_leaves=W))
        self.pipeline = None
        self.tokenizer = None
        self.sampler_fns = None


def test_curate_banks_a_success_and_injects_it_when_the_group_fails(monkeypatch):
    from treejax.forest import Forest
    from treejax.rl import dart as dart_mod
    from treejax.rl.allocation.base import prompt_key
    from treejax.rl.rollouts import Rollouts
    from treejax.sampling import decode

    P, W, T = 2, 2, 6
    cfg = DARTConfig(allocator=DARTAllocator(ema=0.5, min_length=4, max_length=0), max_rollouts=2, extra_rows=0,
                     drop_equal_groups=True, truncated_reward=-1.0, max_inject_rate=0.25)
    src = dart_mod.DARTRollouts(_FakeBase(P, W), cfg)
    examples = [{"question": "a"}, {"question": "b"}]

    def rollouts(tokens, lengths, scores, rate):
        f = Forest(node_parent=jnp.zeros((P, 2), jnp.int32), node_depth=jnp.zeros((P, 2), jnp.int32),
                   node_status=jnp.zeros((P, 2), jnp.int32), leaf_path=jnp.zeros((P, W, 2), jnp.int32),
                   leaf_status=jnp.zeros((P, W), jnp.int32), leaf_length=jnp.asarray(lengths, jnp.int32),
                   tokens=jnp.asarray(tokens, jnp.int32), logprobs=jnp.full((P, W, T), -1.0),
                   segment_index=jnp.zeros((P, W, T), jnp.int32),
                   loss_mask=jnp.asarray(np.arange(T)[None, None] < np.asarray(lengths)[..., None], jnp.float32),
                   segment_length=T)
        src.state = {"rate": {}, "last": list(rate)}
        return Rollouts(forest=f, rewards_PxW=jnp.asarray(np.where(np.asarray(scores) >= 1, 1.0, -1.0)),
                        scores_PxW=np.asarray(scores, np.float32), prompts_PxLp=np.ones((P, 3), np.int32),
                        lengths_P=np.full(P, 3), examples=examples, groups_PxC=np.arange(P)[:, None])

    # step 1: prompt a succeeds on leaf 1 (tokens 7 7 7), prompt b fails everywhere with rate 0.5: nothing injected;
    # b's group is all-equal and dropped; a's leaf 0 (length 6) is over a's cap (s = 1: L = 4) and truncated
    toks = np.zeros((P, W, T), np.int32)
    toks[0, 1, :3] = 7
    ro = src.curate(None, rollouts(toks, [[6, 3], [2, 2]], [[1, 1], [0, 0]], rate=[1.0, 0.5]))
    assert src.bank == {prompt_key(examples[0]): [7, 7, 7]} and ro.extra_metrics["dart/injected"] == 0
    np.testing.assert_array_equal(np.asarray(ro.rewards_PxW), [[-1, 1], [-1, -1]])
    np.testing.assert_array_equal(np.asarray(ro.forest.loss_mask)[0, 0], [1, 1, 1, 1, 0, 0])
    assert not np.asarray(ro.forest.loss_mask)[1].any() and ro.extra_metrics["dart/dropped_prompts"] == 1

    # step 2: a's whole group fails with rate 0.2 <= 0.25: its banked success replaces its last leaf; b (rate 0.3)
    # fails too but is above the rate, and has no success to inject
    monkeypatch.setattr(decode, "score_tokens", lambda w, fns, pr, ln, tok, n: np.full(tok.shape, -0.5, np.float32))
    monkeypatch.setattr("treejax.sampling.probe.detach", lambda params: (params, {}))
    ro = src.curate(None, rollouts(np.ones((P, W, T), np.int32), [[2, 2], [2, 2]], [[0, 0], [0, 0]], rate=[0.2, 0.3]))
    assert ro.extra_metrics["dart/injected"] == 1 and ro.extra_metrics["dart/injected_from_bank"] == 1
    np.testing.assert_array_equal(np.asarray(ro.forest.tokens)[0, 1], [7, 7, 7, 0, 0, 0])
    np.testing.assert_array_equal(np.asarray(ro.forest.loss_mask)[0, 1], [1, 1, 1, 0, 0, 0])
    np.testing.assert_allclose(np.asarray(ro.forest.logprobs)[0, 1], [-0.5, -0.5, -0.5, 0, 0, 0])
    assert int(ro.forest.leaf_length[0, 1]) == 3
    np.testing.assert_array_equal(np.asarray(ro.rewards_PxW), [[-1, 1], [-1, -1]])
    np.testing.assert_array_equal(ro.scores_PxW, [[0, 0], [0, 0]])  # the policy's own accuracy is unchanged
    assert np.asarray(ro.forest.loss_mask)[0, 0].any() and ro.extra_metrics["dart/dropped_prompts"] == 1


def test_the_bank_and_the_rates_survive_a_checkpoint():
    from treejax.rl import dart as dart_mod

    cfg = DARTConfig(allocator=DARTAllocator(), max_rollouts=2, extra_rows=0)
    src = dart_mod.DARTRollouts(_FakeBase(2, 2), cfg)
    src.bank, src.state = {"k": [1, 2, 3]}, {"rate": {"k": 0.5}, "last": [0.5, 0.0]}
    saved = json.loads(json.dumps(src.checkpoint_state()))  # the data state is JSON
    again = dart_mod.DARTRollouts(_FakeBase(2, 2), cfg)
    again.restore_state(saved)
    assert again.bank == {"k": [1, 2, 3]} and again.state["rate"] == {"k": 0.5}
    again.restore_state({})  # a checkpoint written without DART's state starts fresh
    assert again.bank == {} and again.state == {"rate": {}}


# ------------------------------------------------------------------------------------- the learner's wiring
def test_the_learner_trains_exactly_the_kept_pairs_in_both_layouts():
    """rl_step on a tiny random model: the entropy mask's pairs are what the update trains (``update/num_tokens``:
    floor(0.5 x 12) = 6 of the 12 leaves keep their tokens), the same in the expanded and the tree-packed layout."""
    import jax

    from treejax.models import presets, transformer
    from treejax.precision import Precision
    from treejax.rl import packing
    from treejax.rl.config import StepConfig
    from treejax.rl.layouts import make_layout
    from treejax.rl.optimizer import OptimizerConfig, make_optimizer
    from treejax.rl.step import make_learner, rl_step
    from treejax.rl.train_state import TrainState
    from treejax.rl.update import make_update_fn
    from treejax.sampling import strategies, tree
    from treejax.testing.sources import FixedPromptRollouts

    cfg_m = presets.tiny_config("qwen2.5-0.5b", true_vocab_size=250)
    tc = tree.TreeConfig(num_leaves=4, max_depth=3, segment_length=4, branch_factor=2, row_buckets=1,
                         strategy=strategies.Temperature(1.0), stop_ids=tuple(range(3, 30)), max_response_length=10)
    prompts = np.random.RandomState(1).randint(60, 250, (3, 6)).astype(np.int32)
    lengths = np.array([6, 3, 5], np.int32)
    params = transformer.init_params(cfg_m, jax.random.key(0))
    loss_cfg = LossConfig(tis_cap=2.0)
    opt = make_optimizer(OptimizerConfig(learning_rate=0.1, warmup_steps=0, eps=1.0))
    out = {}
    for name, shapers, packed in (("all", (), False), ("expanded", (DARTEntropyMask(0.5),), False),
                                  ("packed", (DARTEntropyMask(0.5),), True)):
        source = FixedPromptRollouts(tree.make_tree_rollout(cfg_m, tc), prompts, lengths,
                                     lambda f: jnp.mean((f.tokens % 3 == 0) * f.loss_mask, -1))
        pk = packing.PackingConfig(granule=8, attention_impl="xla") if packed else None
        cfg = StepConfig(estimator="grpo", loss=loss_cfg, attention_impl="xla", shapers=shapers, packing=pk)
        layout = make_layout(cfg_m, pk, attention_impl="xla")
        fns = make_learner(cfg_m, cfg, Precision().resolve("cpu"), jax.jit(make_update_fn(layout, loss_cfg, opt)),
                           layout)
        state = TrainState.create(jax.tree.map(jnp.copy, params), opt)
        _, ro, m, _ = rl_step(fns, state, source, jax.random.key(8), 0)
        out[name] = (jax.device_get(m), ro)
    m_all, ro = out["all"]
    ent_free = np.asarray(ro.forest.loss_mask).sum(-1)  # tokens per leaf before the mask
    assert m_all["update/num_tokens"] == ent_free.sum()
    for name in ("expanded", "packed"):
        m = out[name][0]
        kept = round(m["shaping/dart_entropy/kept_frac"] * ent_free.sum())
        assert m["update/num_tokens"] == kept < ent_free.sum(), name
    np.testing.assert_allclose(out["packed"][0]["update/num_tokens"], out["expanded"][0]["update/num_tokens"])
    np.testing.assert_allclose(out["packed"][0]["shaping/dart_entropy/kept_frac"],
                               out["expanded"][0]["shaping/dart_entropy/kept_frac"], rtol=1e-6)


# ------------------------------------------------------------------------------------- the whole loop
@pytest.mark.slow  # one step of the shipped config through treejax.train.main (24-35 s on 2 shared cores)
def test_one_loop_step_of_the_shipped_config(tiny_checkpoint, tmp_path):
    """One step through treejax.train.main: the allocation's extra rows, the entropy mask's pairs
    reaching the update (update/num_tokens), TIS, and a solution from a jsonl injected into each all-fail group
    (the random model solves nothing; the solutions are the task's answers in the instruction's format)."""
    from treejax import train
    from treejax.data.tasks import get_task

    task = get_task("chain_sum_2x2", size=1024, eval_size=256, seed=0, extraction="last_number")
    sol = tmp_path / "solutions.jsonl"
    sol.write_text("".join(json.dumps({"question": r["question"], "solution": f"Answer: {r['answer']}"}) + "\n"
                           for r in task.records("train")))
    params = [f"DARTConfig.solutions = '{sol}'", "DARTConfig.max_inject_rate = 1.0",
              f"RunConfig.model = '{tiny_checkpoint}'", f"RunConfig.log_dir = '{tmp_path / 'run'}'",
              "RunConfig.num_steps = 1", "RunConfig.prompts_per_step = 2", "TreeConfig.num_leaves = 4",
              "TreeConfig.init_divergence = 4", "TreeConfig.max_depth = 2", "TreeConfig.segment_length = 4",
              "DARTConfig.max_rollouts = 8", "DARTConfig.extra_rows = 2", "DARTConfig.call_prompts = 2",
              "DARTAllocator.min_length = 4", "DARTConfig.drop_equal_groups = False",
              "EvalConfig.num_problems = 2", "EvalConfig.max_new_tokens = 2", "EvalConfig.batch_size = 2",
              "RunConfig.eval_every = 0", "RunConfig.mini_batches = 1", "OptimizerConfig.total_steps = 1",
              "RunConfig.tree_picture_every = 0", "RunConfig.export_hf = False"]
    summary = train.main(["--gin_file", os.path.join(CONFIGS, "efficacy_dart.gin"), "--quiet"]
                         + sum((["--gin_param", p] for p in params), []))
    row = summary["history"][0]
    assert np.isfinite(row["update/loss"])
    assert "dart/injected" in row and "alloc/extra_rows" in row
    assert "update/tis_weight_mean" in row or any(k.endswith("tis_weight_mean") for k in row)
    assert row["dart/injected"] == row["dart/zero_success_prompts"] == 2 and row["dart/injected_from_bank"] == 0
    # 12 of the 16 responses keep their tokens (floor(0.8 x 16)), about 3/4 of the pairs; the update trains only them
    assert 0.6 < row["shaping/dart_entropy/kept_frac"] < 0.9
    assert row["update/num_tokens"] < row["rollout/decoded_tokens"]
    assert row["reward/accuracy"] == 0.0  # the injected successes are not counted as the policy's
