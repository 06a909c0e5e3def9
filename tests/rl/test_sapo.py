"""SAPO (treejax.rl.sapo): the batch assembly as pure functions on hand-computed cases (zero-advantage filter,
uniform draws, the local + external batch with re-scored log-probs and fillers), the config errors, and the
exchange between 2 CPU processes of one jax.distributed job (each trains on the rows the other sent)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from treejax.errors import ConfigError
from treejax.rl.replay import _host_rows
from treejax.rl.sapo import (SAPOConfig, SAPORollouts, choose_external, encode_rows, pool_of, zero_advantage_G)

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)
from sapo_fakes import FAKE_LOGP, FakeSource, fake_score  # noqa: E402

REWARDS = np.array([[1.0, -1.0, -1.0], [-1.0, -1.0, -1.0], [1.0, 1.0, -1.0]])


def test_zero_advantage_and_draws():
    assert zero_advantage_G(REWARDS).tolist() == [False, True, False]
    # informative: the candidates are rows 0 and 2; asking for 2 or more takes both
    assert choose_external(REWARDS, 2, "informative", 0, 5, 1).tolist() == [0, 2]
    assert choose_external(REWARDS, 5, "informative", 0, 5, 1).tolist() == [0, 2]
    assert choose_external(REWARDS, 3, "uniform", 0, 5, 1).tolist() == [0, 1, 2]
    two = choose_external(REWARDS, 2, "uniform", 7, 3, 0)
    assert len(set(two.tolist())) == 2 and two.tolist() == choose_external(REWARDS, 2, "uniform", 7, 3, 0).tolist()
    draws = {tuple(choose_external(REWARDS, 1, "uniform", s, 0, 0)) for s in range(40)}
    assert draws == {(0,), (1,), (2,)}  # every row can be drawn
    assert choose_external(np.ones((2, 3)), 2, "informative", 0, 0, 0).size == 0  # nothing informative
    assert choose_external(np.zeros((0, 3)), 2, "uniform", 0, 0, 0).size == 0
    assert pool_of({0: ["a"], 1: ["b", "c"], 2: ["d"]}, 1) == ["a", "d"]


class _OneShotExchange:
    """What node 1 published at each step (its FakeSource rows), returned to node 0."""

    def __init__(self, other: int):
        self.other, self.sent = other, {}

    def __call__(self, step, blob):
        self.sent[step] = blob
        return {self.other: encode_rows(_host_rows(FakeSource(self.other).sample(None, None, step), step))}


@pytest.mark.parametrize("J", [2, 3])
def test_batch_is_local_rows_then_informative_external_rows_rescored(J):
    src = SAPORollouts(FakeSource(0), SAPOConfig(external_rows=J, sampling="informative"), None,
                       _OneShotExchange(1), process=0, score_fn=fake_score)
    ro = src.sample(None, jax.random.key(0), 4)
    other = FakeSource(1).sample(None, None, 4)
    tok, rew = np.asarray(ro.forest.tokens), np.asarray(ro.rewards_PxW)
    assert ro.num_rows == 3 + J and ro.main_rows == 3
    np.testing.assert_array_equal(tok[:3], np.asarray(src.base.last.forest.tokens))  # local rows first, unchanged
    np.testing.assert_array_equal(np.asarray(ro.forest.logprobs)[:3], -1.0)
    # node 1's informative rows are 0 and 2 (row 1's rewards are all equal): they are rows 3 and 4
    np.testing.assert_array_equal(tok[3:5], np.asarray(other.forest.tokens)[[0, 2]])
    np.testing.assert_array_equal(rew[3:5], np.asarray(other.rewards_PxW)[[0, 2]])
    np.testing.assert_array_equal(ro.prompts_PxLp[3:5], other.prompts_PxLp[[0, 2]])
    assert ro.examples[3:5] == ["n1s4p0", "n1s4p2"]
    np.testing.assert_array_equal(np.asarray(ro.forest.logprobs)[3:5], FAKE_LOGP)  # re-scored under the local policy
    mask = np.asarray(ro.forest.loss_mask)
    assert np.all(mask[:5] == 1) and np.all(mask[5:] == 0)  # J = 3: one filler that trains on nothing
    m = ro.extra_metrics
    assert (m["sapo/external_rows"], m["sapo/filler_rows"], m["sapo/pool_rows"], m["sapo/pool_informative_rows"]) \
        == (2, J - 2, 3, 2)
    # hand-computed: node 1's rows 0 and 2 are (1, -1, -1) + 0.01 and (1, 1, -1) + 0.01: mean 0.01
    assert m["sapo/external_reward_mean"] == pytest.approx(0.01)
    assert m["sapo/external_accuracy"] == pytest.approx(0.5)
    assert m["sapo/external_logp_shift"] == pytest.approx(abs(-2.0 - FAKE_LOGP))  # node 1's log q = -2


def test_config_errors():
    from treejax.rl.config import RunConfig
    from treejax.rl.sources.base import chain_process_local

    with pytest.raises(ConfigError, match="external_rows must be an int >= 1"):
        SAPOConfig(external_rows=0)
    with pytest.raises(ConfigError, match="sampling must be one of"):
        SAPOConfig(sampling="best")
    with pytest.raises(ConfigError, match="timeout_s must be >= 1"):
        SAPOConfig(timeout_s=0)
    with pytest.raises(ConfigError, match="fix: RunConfig.checkpoint_every = 0 and RunConfig.save_final = False"):
        RunConfig(rollouts=[SAPOConfig()])
    with pytest.raises(ConfigError, match="fix: RunConfig.checkpoint_every = 0"):
        RunConfig(rollouts=[SAPOConfig()], save_final=False, checkpoint_every=5)
    with pytest.raises(ConfigError, match="SAPOConfig needs synchronous rollouts"):
        from treejax.rl.async_config import AsyncConfig
        RunConfig(rollouts=[SAPOConfig()], save_final=False, async_rollouts=AsyncConfig(enabled=True))
    cfg = RunConfig(rollouts=[SAPOConfig(external_rows=3)], save_final=False)
    assert cfg.step_rows() == cfg.prompts_per_step + 3
    assert chain_process_local(cfg.rollouts) and not chain_process_local(())
    with pytest.raises(ConfigError, match="this run has one process; fix: python -m treejax.launch"):
        SAPOConfig().build(None, None)
    with pytest.raises(ConfigError, match="fix: one of"):  # it wraps rows a replay buffer could store
        from treejax.rl.multiturn import MultiTurnConfig
        RunConfig(rollouts=[MultiTurnConfig(), SAPOConfig()], save_final=False)


def test_two_processes_train_on_each_others_rows(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)
    env["PYTHONPATH"] = os.pathsep.join([ROOT, HERE] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run([sys.executable, "-m", "treejax.launch", "-n", "2", "--devices_per_process", "1",
                          "--module", "sapo_worker", "--timeout_s", "120", "--", str(tmp_path)],
                         env=env, cwd=ROOT, timeout=180, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr[-4000:]
    res = [json.loads((tmp_path / f"sapo{i}.json").read_text()) for i in range(2)]
    for me in (0, 1):
        other = res[1 - me]
        for step, (mine, theirs) in enumerate(zip(res[me]["steps"], other["steps"])):
            tok, rew = np.array(mine["tokens"]), np.array(mine["rewards"])
            np.testing.assert_array_equal(tok[:3], mine["sent_tokens"])  # its own rows
            # uniform draw of 2 of the other's 3 rows: exactly what the other sent (tokens, rewards, prompts)
            sent_tok, sent_rew = np.array(theirs["sent_tokens"]), np.array(theirs["sent_rewards"])
            rows = [int(np.flatnonzero((sent_tok == t).all(axis=(1, 2)))[0]) for t in tok[3:]]
            assert len(set(rows)) == 2
            np.testing.assert_array_equal(tok[3:], sent_tok[rows])
            np.testing.assert_array_equal(rew[3:], sent_rew[rows])
            np.testing.assert_array_equal(np.array(mine["prompts"])[3:], np.array(theirs["sent_prompts"])[rows])
            assert np.all(tok[3:] // 1000 == 1 - me) and np.all(tok[3:] // 100 % 10 == step)
            np.testing.assert_array_equal(np.array(mine["logprobs"])[3:], FAKE_LOGP)
            assert mine["metrics"]["sapo/external_rows"] == 2 and mine["metrics"]["sapo/pool_rows"] == 3


@pytest.mark.slow
def test_two_process_trainer_runs_sapo(tiny_checkpoint, tmp_path):
    """The whole loop on 2 CPU processes x 1 device, each its own policy: 2 steps of the quickstart on the tiny
    model with SAPO (2 local + 2 external rows). Step 0: both nodes hold the same initial weights, so the re-scored
    log-probs of the other's rows equal the sender's sampler log-probs (``sapo/external_logp_shift`` ~ 0)."""
    tiny = ["RunConfig.num_steps = 2", "RunConfig.prompts_per_step = 2", "TreeConfig.num_leaves = 4",
            "TreeConfig.max_depth = 2", "TreeConfig.segment_length = 4", "EvalConfig.num_problems = 2",
            "EvalConfig.max_new_tokens = 2", "EvalConfig.batch_size = 2", "RunConfig.rollouts = [@SAPOConfig()]",
            "SAPOConfig.external_rows = 2", "SAPOConfig.sampling = 'uniform'", "RunConfig.checkpoint_every = 0",
            "RunConfig.save_final = False", "RunConfig.export_hf = False", "RunConfig.dynamic_sampling = False",
            f"RunConfig.model = '{tiny_checkpoint}'", f"RunConfig.log_dir = '{tmp_path / 'run'}'"]
    args = ["--gin_file", os.path.join(ROOT, "configs", "quickstart.gin")] + sum((["--gin_param", p] for p in tiny), [])
    env = {k: v for k, v in os.environ.items()
           if k not in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID")}
    env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                                if "xla_force_host_platform_device_count" not in f)
    env["PYTHONPATH"] = os.pathsep.join([ROOT] + [p for p in [os.environ.get("PYTHONPATH")] if p])
    env["JAX_PLATFORMS"] = "cpu"
    out = subprocess.run([sys.executable, "-m", "treejax.launch", "-n", "2", "--devices_per_process", "1",
                          "--timeout_s", "900", "--", *args], env=env, cwd=ROOT, timeout=960, capture_output=True,
                         text=True)
    assert out.returncode == 0, (out.stdout + out.stderr)[-5000:]
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    hist = summary["history"]
    assert summary["num_processes"] == 2 and len(hist) == 2
    for h in hist:
        assert (h["sapo/external_rows"], h["sapo/pool_rows"], h["sapo/filler_rows"]) == (2, 2, 0)
    assert hist[0]["sapo/external_logp_shift"] < 1e-3, hist[0]["sapo/external_logp_shift"]
