"""DeepTravel (treejax.rl.deeptravel, arXiv 2509.21842): the failure replay buffer over a scripted multi-turn
source (who joins, who is replayed with which key, who leaves recovered or after max_attempts, filler rows, the
period, counters, the checkpoint round trip), the hierarchical reward's GRPO advantages by hand, the config errors,
and one step of the shipped config on a tiny random model (slow)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.forest import forest_from_paths
from treejax.rl.deeptravel import REPLAY_STREAM, FailureReplayConfig, FailureReplayRollouts
from treejax.rl.rollouts import RolloutCounters, Rollouts
from treejax.rl.sources.requirements import VERIFIER

W = 2


class FakeTurnSource:
    """A multi-turn source's shape: ``sample`` rolls the next prompts of ``script`` (uids per step); ``roll`` any
    given ones. A prompt's slots succeed as ``wins[uid][k]`` says on its k-th rollout (``[0, 0]`` once the list is
    used up); prompt tokens ``[index of uid] * 3``. Records each roll's uids and key."""

    pipeline = None
    estimator_inputs = ()

    def __init__(self, script: list[list[str]], wins: dict):
        self.script, self.wins, self.calls, self.rolled = script, wins, {}, []

    def sample(self, params, key, step):
        uids = self.script[step]
        exs = [types.SimpleNamespace(metadata={"uid": u}) for u in uids]
        prompts = np.array([[ord(u)] * 3 for u in uids], np.int32)
        return self.roll(params, key, exs, prompts, np.full(len(uids), 3, np.int32))

    def roll(self, params, key, examples, prompts, lens):
        uids = [e.metadata["uid"] for e in examples]
        self.rolled.append((uids, key))
        scores = []
        for u in uids:
            k = self.calls.get(u, 0)
            self.calls[u] = k + 1
            scores.append(self.wins.get(u, [])[k] if k < len(self.wins.get(u, [])) else [0, 0])
        scores = np.asarray(scores, np.float32)
        P = len(uids)
        f = forest_from_paths(np.array([[[0, 1], [0, 2]]] * P), np.full((P, W), 2), 2,
                              tokens=np.asarray(prompts)[:, None, :2].repeat(W, 1))
        return Rollouts(forest=f, rewards_PxW=jnp.asarray(scores), scores_PxW=scores, prompts_PxLp=np.asarray(prompts),
                        lengths_P=np.asarray(lens), counters=RolloutCounters(decoded_tokens=10 * P),
                        examples=list(examples), reward_scores_PxW=scores)


def uids(ro) -> list[str]:
    return [e.metadata["uid"] for e in ro.examples]


def test_failure_replay_by_hand():
    """Steps of 2 fresh prompts, 1 replayed row, failures = no slot solved, 2 attempts at most:
    step 0: a fails, b half-solved -> nothing to replay (a filler row), a joins;
    step 1: a replayed, fails again (attempt 1) -> back of the buffer, then fresh failures c, d join: [a, c, d];
    step 2: a replayed and now solved -> recovered: [c, d]; fresh e, f solved;
    step 3: c replayed, fails (attempt 1): [d, c]; the fresh c is already held, not added twice;
    step 4: d replayed, fails (attempt 1): [c, d];  step 5: c replayed, fails its 2nd attempt -> dropped: [d]."""
    script = [["a", "b"], ["c", "d"], ["e", "f"], ["c", "g"], ["h", "i"], ["j", "k"]]
    wins = {"a": [[0, 0], [0, 0], [1, 0]], "b": [[1, 0]], "e": [[1, 1]], "f": [[0, 1]], "g": [[1, 1]],
            "h": [[1, 1]], "i": [[1, 0]], "j": [[1, 1]], "k": [[0, 1]]}
    base = FakeTurnSource(script, wins)
    src = FailureReplayRollouts(base, FailureReplayConfig(rows=1, capacity=8, max_attempts=2))
    key = jax.random.key(3)
    ro = src.sample(None, key, 0)
    assert ro.num_rows == 3 and ro.fresh_rows == 2 and uids(ro) == ["a", "b", "a"]  # the filler copies row 0
    mask = np.asarray(ro.forest.loss_mask)
    assert float(mask[2].sum()) == 0.0 and float(mask[0].sum()) > 0
    m = ro.extra_metrics
    assert (m["deeptravel/replayed_prompts"], m["deeptravel/added"], m["deeptravel/buffer_prompts"]) == (0, 1, 1)
    assert [f.uid for f in src.buffer] == ["a"] and ro.counters.decoded_tokens == 20

    ro = src.sample(None, key, 1)
    assert uids(ro) == ["c", "d", "a"] and float(np.asarray(ro.forest.loss_mask)[2].sum()) > 0
    assert base.rolled[-1][0] == ["a"]
    assert jnp.array_equal(jax.random.key_data(base.rolled[-1][1]),
                           jax.random.key_data(jax.random.fold_in(key, REPLAY_STREAM)))
    np.testing.assert_array_equal(np.asarray(ro.prompts_PxLp)[2], [ord("a")] * 3)
    assert ro.counters.decoded_tokens == 30
    assert [(f.uid, f.attempts) for f in src.buffer] == [("a", 1), ("c", 0), ("d", 0)]

    ro = src.sample(None, key, 2)
    m = ro.extra_metrics
    assert uids(ro)[2] == "a" and np.asarray(ro.scores_PxW)[2].tolist() == [1.0, 0.0]
    assert (m["deeptravel/recovered"], m["deeptravel/replay_success"], m["deeptravel/added"]) == (1, 0.5, 0)
    assert [f.uid for f in src.buffer] == ["c", "d"]

    src.sample(None, key, 3)
    assert [(f.uid, f.attempts) for f in src.buffer] == [("d", 0), ("c", 1)]
    src.sample(None, key, 4)
    assert [(f.uid, f.attempts) for f in src.buffer] == [("c", 1), ("d", 1)]
    ro = src.sample(None, key, 5)
    assert ro.extra_metrics["deeptravel/dropped"] == 1 and [f.uid for f in src.buffer] == ["d"]


def test_period_capacity_and_checkpoint_round_trip():
    script = [["a", "b"], ["c", "d"], ["e", "f"], ["g", "h"]]
    cfg = FailureReplayConfig(rows=2, capacity=3, period=2)
    src = FailureReplayRollouts(FakeTurnSource(script, {}), cfg)
    src.sample(None, jax.random.key(0), 0)            # nothing held yet: two fillers; a, b join
    ro = src.sample(None, jax.random.key(0), 1)       # odd step: no replay; c, d join, a leaves (capacity 3)
    assert ro.extra_metrics["deeptravel/replayed_prompts"] == 0 and [f.uid for f in src.buffer] == ["b", "c", "d"]
    state = src.checkpoint_state()
    other = FailureReplayRollouts(FakeTurnSource(script, {}), cfg)
    other.restore_state(state)
    assert [(f.uid, f.step) for f in other.buffer] == [(f.uid, f.step) for f in src.buffer]
    for s in (src, other):
        s.base.calls = {}
    a, b = src.sample(None, jax.random.key(0), 2), other.sample(None, jax.random.key(0), 2)
    assert uids(a) == uids(b) == ["e", "f", "b", "c"]
    assert [f.uid for f in src.buffer] == [f.uid for f in other.buffer]


def test_the_hierarchical_reward_and_grpo_advantages_by_hand():
    """Four episodes of one request on the hand database of test_travel: consistent and feasible (r = 1), feasible
    with a wrong price (r = c = 0.5), infeasible (r = 0; turn verifier not run), no plan (0). GRPO (unbiased std,
    eps 1e-6): mean 0.375, std sqrt(0.6875 / 3) = 0.478714, A = (0.625, 0.125, -0.375, -0.375) / (0.478714 + 1e-6)
    = (1.305580, 0.261116, -0.783348, -0.783348)."""
    from tests.envs.test_travel import REQ, hand_db
    from treejax.envs.travel_world import hierarchical_reward
    from treejax.rl.advantages.flat import grpo

    out = ("\n<output>\nTR001 Avel->Borin day 1 dep 07:00 arr 11:00 $60\n</output>\n",
           "\n<output>\nTR002 Borin->Avel day 3 dep 09:00 arr 13:05 $70\n</output>\n",
           "\n<output>\nHT001 Borin 3 stars $100/night\n</output>\n")
    search = ("<trains>Avel Borin 1</trains>", "<trains>Borin Avel 3</trains>", "<hotels>Borin</hotels>")
    answers = ["TR001 $60. Answer: go=TR001; back=TR002; hotel=HT001",
               "TR001 $55. Answer: go=TR001; back=TR002; hotel=HT001",
               "Answer: go=TR001; back=TR003; hotel=HT001", "I could not find one."]
    r = [hierarchical_reward(search + (a,), out, REQ, hand_db(), inconsistent_credit=0.5)[0] for a in answers]
    assert r == [1.0, 0.5, 0.0, 0.0]
    f = forest_from_paths(np.array([[[0, 1], [0, 2], [0, 3], [0, 4]]]), np.full((1, 4), 2), 2)
    adv = grpo(f, jnp.asarray([r], jnp.float32))
    np.testing.assert_allclose(np.asarray(adv.leaves)[0], [1.305580, 0.261116, -0.783348, -0.783348], atol=2e-6)


def test_config_errors_name_the_fix():
    from treejax.rl.config import RunConfig
    from treejax.rl.multiturn import MultiTurnConfig
    from treejax.sampling import tree

    chains = tree.independent_config(4, 64, 16)
    world = dict(rollout=chains, task="travel_plans", estimator="grpo")
    RunConfig(rollouts=[MultiTurnConfig(environment="travel"), FailureReplayConfig()], **world)
    with pytest.raises(ConfigError, match=r"FailureReplayConfig wraps rows with \['turn_forest'\].*fix: one of "
                                          r"\['MultiTurnConfig'\] before it"):
        RunConfig(rollouts=[FailureReplayConfig()], **world)
    with pytest.raises(ConfigError, match="needs verifier rewards.*fix: RunConfig.reward_source = 'verifier'"):
        RunConfig(rollouts=[MultiTurnConfig(environment="travel"), FailureReplayConfig()], reward_source="majority",
                  **world)  # the multi-turn planner says it first; the failure test reads the verifier's scores too
    assert VERIFIER in FailureReplayConfig.requires
    for kw, fix in ((dict(rows=0), "FailureReplayConfig.rows = 2"), (dict(period=0), "FailureReplayConfig.period = 1"),
                    (dict(max_attempts=0), "FailureReplayConfig.max_attempts = 3"),
                    (dict(rows=4, capacity=2), "FailureReplayConfig.capacity = 64"),
                    (dict(max_success=1.0), "FailureReplayConfig.max_success = 0.0")):
        with pytest.raises(ConfigError, match=f"fix: {fix}$"):
            FailureReplayConfig(**kw)
    with pytest.raises(ConfigError, match="can roll given prompts again.*fix: RunConfig.rollouts = "
                                          r"\[@MultiTurnConfig\(\), @FailureReplayConfig\(\)\]"):
        FailureReplayRollouts(types.SimpleNamespace(pipeline=None, sample=None), FailureReplayConfig())


# ---------------------------------------------------------------------------------------------- end to end
# one RL step of the whole loop on a tiny random model: 294 s and ~14 GB RSS on the shared 2-core machine (load 10);
# the default test_failure_replay_by_hand covers the wrapper's logic over a scripted source
@pytest.mark.slow
def test_the_shipped_deeptravel_config_runs_one_step(tiny_checkpoint, tmp_path):
    """configs/multiturn_travel_deeptravel.gin end to end (task, world, verifiers, failure replay, GRPO, update,
    evaluation with the environment) for one step on a tiny random model with SmolLM2's tokenizer."""
    from treejax.testing.envs import run_shipped_multiturn

    last = run_shipped_multiturn("multiturn_travel_deeptravel.gin", tiny_checkpoint, tmp_path / "run")
    assert last["deeptravel/replayed_prompts"] == 0  # nothing failed before step 0
    assert 0 <= last["deeptravel/buffer_prompts"] <= 2
