"""APRIL's partial rollouts as the loop's source (treejax.rl.partial): each step trains exactly
``prompts_per_step`` complete groups, the rest are carried and resumed first, every launched group trains once
(or is dropped by dynamic sampling), behaviour log-probs travel with the tokens, the carry round-trips through
the checkpoint state, and the config checks."""

from __future__ import annotations

import types

import jax
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.forest import NodeStatus
from treejax.models import presets, transformer
from treejax.rl.partial import PartialConfig, PartialRollouts
from treejax.sampling import decode, tree
from treejax.sampling.strategies import Temperature

CFG = presets.tiny_config("smollm2-135m", vocab_size=64)
FNS = decode.make_model_fns(CFG, attention="dense", cache_dtype="float32")
W, S, D = 4, 4, 6
TC = tree.independent_config(W, S * D, S, strategy=Temperature(1.0), stop_ids=(7, 8, 9, 10))


class _Tokenizer:
    def decode(self, ids, skip_special_tokens=True):
        return " ".join(map(str, ids))


class _Task:
    def score(self, text, example):  # "correct" when the response holds token 5
        return float("5" in text.split())


class _Base:
    """The parts of TaskRollouts PartialRollouts reads: prompts drawn in batches of P (each prompt's first token
    is its number), the tokenizer, the task, the rewards and the sampler fns."""

    def __init__(self, P, dynamic_sampling=False):
        self.cfg = types.SimpleNamespace(prompts_per_step=P, dynamic_sampling=dynamic_sampling, max_refills=2)
        self.rollout = types.SimpleNamespace(tree_config=TC)
        self.sampler_fns, self.tokenizer, self.task = FNS, _Tokenizer(), _Task()
        self.pipeline, self.drawn = None, 0

    def draw(self):
        P = self.cfg.prompts_per_step
        ids = np.arange(self.drawn, self.drawn + P)
        self.drawn += P
        prompts = np.stack([[11 + i % 40, 3, 4, 2] for i in ids]).astype(np.int32)
        return [f"q{i}" for i in ids], prompts, np.full(P, 4, np.int32)

    def rewards(self, scores, lengths):
        return (2.0 * scores - 1.0).astype(np.float32)


@pytest.fixture(scope="module")
def params():
    return transformer.init_params(CFG, jax.random.key(3))


def _trained(ro):
    mask = np.asarray(ro.forest.loss_mask)
    return [e for e, m in zip(ro.examples, mask) if m.any()]


def test_steps_train_complete_groups_and_carry_the_rest(params):
    src = PartialRollouts(_Base(P=2), PartialConfig(over_sample=2))
    seen, stale_seen = [], False
    for step in range(6):
        ro = src.sample(params, jax.random.key(step), step)
        f = ro.forest
        assert ro.num_rows == 2 and ro.counters.filler_prompts == 0 and ro.counters.scoring_s > 0
        status = np.asarray(f.leaf_status)
        assert not (status == int(NodeStatus.ALIVE)).any()  # only complete groups train
        length = np.asarray(f.leaf_length)
        t = np.arange(f.tokens.shape[-1])
        np.testing.assert_array_equal(np.asarray(f.loss_mask), (t < length[..., None]).astype(np.float32))
        assert np.all(np.asarray(f.logprobs)[t[None, None] >= length[..., None]] == 0)
        assert np.all(np.asarray(f.logprobs)[t[None, None] < length[..., None]] < 0)
        assert len(src.carry) <= 3  # G - 1
        ages = [step - g.born for g in src.carry]
        assert ro.extra_metrics["partial/carried_groups"] == len(src.carry) and min(ages, default=0) >= 0
        stale_seen |= ro.extra_metrics["partial/stale_token_frac"] > 0
        seen += ro.examples
    assert len(set(seen)) == len(seen)  # every group trains once
    launched = {f"q{i}" for i in range(src.base.drawn)} - {e for e, *_ in src.queue}
    assert set(seen) | {g.example for g in src.carry} == launched  # nothing launched is lost
    assert stale_seen  # some trained group was resumed from an earlier step


def test_carried_groups_are_resumed_first(params):
    src = PartialRollouts(_Base(P=2), PartialConfig(over_sample=2))
    calls = []
    call = src._call

    def spy(params, groups, need, key):
        calls.append(([g.example for g in groups], [g.length_W.copy() for g in groups], need))
        return call(params, groups, need, key)

    src._call = spy
    for step in range(4):
        carried = [(g.example, g.born) for g in src.carry]
        assert [b for _, b in carried] == sorted(b for _, b in carried)  # oldest first
        src.sample(params, jax.random.key(step), step)
        order, lengths, need = calls[step]  # one call per step without dynamic sampling
        assert order[:len(carried)] == [e for e, _ in carried]  # the call's first slots
        assert need == 2 and len(order) == 4
        assert all(np.all(n == 0) for n in lengths[len(carried):])  # then fresh prompts
    assert any(np.any(n > 0) for _, ls, _ in calls for n in ls)  # some call resumed a stored prefix


def test_dynamic_sampling_drops_all_equal_groups(params):
    src = PartialRollouts(_Base(P=2, dynamic_sampling=True), PartialConfig(over_sample=2))
    for step in range(3):
        ro = src.sample(params, jax.random.key(step), step)
        r = np.asarray(ro.rewards_PxW)
        mask = np.asarray(ro.forest.loss_mask).reshape(2, -1).any(-1)
        for p in range(2):  # a trained group is informative; a filler trains on nothing
            assert not mask[p] or not np.all(r[p] == r[p, 0])
        assert ro.counters.rollout_calls <= 3


def test_carry_round_trips_through_the_checkpoint_state(params):
    a = PartialRollouts(_Base(P=2), PartialConfig(over_sample=2))
    for step in range(2):
        a.sample(params, jax.random.key(step), step)
    b = PartialRollouts(_Base(P=2), PartialConfig(over_sample=2))
    b.base.drawn = a.base.drawn  # the pipeline's own state is restored by the loop
    b.restore_state(a.checkpoint_state())
    x, y = a.sample(params, jax.random.key(7), 2), b.sample(params, jax.random.key(7), 2)
    for name in ("tokens", "logprobs", "loss_mask", "leaf_path", "leaf_status"):
        np.testing.assert_array_equal(np.asarray(getattr(x.forest, name)), np.asarray(getattr(y.forest, name)))
    assert x.examples == y.examples and x.extra_metrics == y.extra_metrics


def test_config_checks():
    from treejax.rl.config import RunConfig
    from treejax.rl.losses import LossConfig

    chains = tree.independent_config(4, 8, 4)
    with pytest.raises(ConfigError, match="over_sample"):
        PartialConfig(over_sample=0)
    with pytest.raises(ConfigError, match="tis_cap"):
        RunConfig(rollouts=[PartialConfig()], rollout=chains, estimator="grpo")
    with pytest.raises(ConfigError, match="branch_factor"):
        RunConfig(rollouts=[PartialConfig()], loss=LossConfig(tis_cap=2.0))
    with pytest.raises(ConfigError, match=r"reads \['greedy_reward_P'\], which the chain \['PartialConfig'\]"):
        RunConfig(rollouts=[PartialConfig()], rollout=chains, estimator="remax", loss=LossConfig(tis_cap=2.0))
    RunConfig(rollouts=[PartialConfig()], rollout=chains, estimator="grpo", loss=LossConfig(tis_cap=2.0))


@pytest.mark.slow  # three short runs of the whole loop (~100 s)
def test_a_resumed_run_continues_the_carry(tiny_checkpoint, tmp_path):
    """Killed after step 2 (its checkpoint holds carried groups) and resumed, a run ends where the uninterrupted
    one does: the same history rows and the same carry in the final checkpoint."""
    import os

    from treejax import train
    from treejax.testing.checkpoints import latest_data_state

    gin = os.path.join(os.path.dirname(__file__), "..", "..", "configs", "quickstart.gin")

    def main(log_dir, steps, *flags):
        params = [f"RunConfig.model = '{tiny_checkpoint}'", f"RunConfig.log_dir = '{log_dir}'",
                  "RunConfig.prompts_per_step = 2", "TreeConfig.num_leaves = 4", "TreeConfig.max_depth = 4",
                  "TreeConfig.segment_length = 4", "EvalConfig.num_problems = 2", "EvalConfig.max_new_tokens = 2",
                  "RunConfig.export_hf = False", "RunConfig.tree_picture_every = 0", "RunConfig.estimator = 'grpo'",
                  "OptimizerConfig.learning_rate = 1e-3", "LossConfig.entropy_coef = 0.01",
                  "RunConfig.rollouts = [@PartialConfig()]", "PartialConfig.over_sample = 2",
                  "TreeConfig.branch_factor = 1", "TreeConfig.init_divergence = 4", "LossConfig.tis_cap = 2.0",
                  f"RunConfig.num_steps = {steps}", "RunConfig.checkpoint_every = 1"]
        return train.main(["--gin_file", gin, "--quiet", *flags] + sum((["--gin_param", p] for p in params), []))

    straight = main(str(tmp_path / "straight"), 3)
    main(str(tmp_path / "resumed"), 2)
    assert latest_data_state(tmp_path / "resumed")["partial_rollouts"]  # something is carried
    resumed = main(str(tmp_path / "resumed"), 3, "--resume")
    drop = lambda row: {k: v for k, v in row.items() if not k.startswith("time/") and not k.endswith("per_s")}  # noqa
    assert drop(resumed["history"][-1]) == drop(straight["history"][-1])
    assert resumed["history"][-1]["partial/stale_groups"] > 0
    a, b = (latest_data_state(tmp_path / d)["partial_rollouts"] for d in ("resumed", "straight"))
    assert a == b
