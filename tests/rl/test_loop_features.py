"""Every estimator and loss feature the docs list, run through the whole loop from the CLI (tiny model, CPU).

Each case is one RL step of ``treejax-train`` (quickstart config, a tiny random Llama with SmolLM2's tokenizer).
With the trainer recomputing old log-probs (the default), the first mini-batch's PPO ratio must be 1 to fp32
precision: the old-logp forward and the update's forward run the same program shapes on the same rows.
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from treejax import train
from treejax.rl.advantages import list_estimators

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")
BUILT_IN = ("grpo", "rloo", "reinforce_pp_baseline", "treepo", "treepo_segment", "spo_tree", "mc_grpo", "remax")


def _argv(model, tmp_path, *extra) -> list[str]:
    params = [f"RunConfig.model = '{model}'", f"RunConfig.log_dir = '{tmp_path / 'run'}'",
              "RunConfig.num_steps = 1", "RunConfig.prompts_per_step = 2", "TreeConfig.num_leaves = 4",
              "TreeConfig.max_depth = 2", "TreeConfig.segment_length = 4", "EvalConfig.num_problems = 2",
              "EvalConfig.max_new_tokens = 2", "RunConfig.export_hf = False", "RunConfig.tree_picture_every = 0",
              "OptimizerConfig.learning_rate = 1e-3", *extra]
    return ["--gin_file", os.path.join(CONFIGS, "quickstart.gin"), "--quiet"] + sum((["--gin_param", p] for p in params),
                                                                                   [])


def _run(tiny_checkpoint, tmp_path, *extra):
    return train.main(_argv(tiny_checkpoint, tmp_path, *extra))


def _run_on_one_device(model, tmp_path, *extra) -> dict:
    """:func:`_run` as ``treejax-train`` in a process of its own on ONE CPU device (this suite's other XLA flags
    kept), returning the run's summary.json. Measured on the 2-core machine for SmolLM2's grpo case: 4.7 GB peak RSS
    and 84 s, against 14.6 GB and ~190 s under the suite's 8 fake devices (NudgeRL's case: 21.4 GB), where the
    full slow run died for memory; the multi-device paths have their own tests (tests/parallel)."""
    flags = re.sub(r"--xla_force_host_platform_device_count=\d+", "", os.environ.get("XLA_FLAGS", ""))
    env = dict(os.environ, XLA_FLAGS=f"{flags} --xla_force_host_platform_device_count=1".strip())
    subprocess.run([sys.executable, "-m", "treejax.train", *_argv(model, tmp_path, *extra)], env=env, check=True,
                   cwd=os.path.dirname(CONFIGS))
    return json.load(open(tmp_path / "run" / "summary.json"))


def test_builtin_list_is_complete():
    assert set(BUILT_IN) <= set(list_estimators())


FAST_CLI = ()  # every case is slow here; the default run covers them through rl_step
# (test_every_estimator_and_loss_term_through_rl_step; the packed update and the shapers:
# tests/rl/test_packing.py::test_rl_step_packed_equals_expanded; SPO-chain's source: tests/sampling/test_continuation.py
# and tests/rl/test_spo_chain.py; the whole CLI: tests/test_train_cli.py)
SHAPER_CASES = ("shaper_echo", "shaper_ear", "shaper_rose_prl_packed", "decs", "shaper_verl", "shaper_arrol",
                "rose_branching", "spo_chain", "nudge")
ALLOCATION_CASES = ("alloc_dars", "alloc_xrpo_packed", "alloc_gdro_treepo", "replay", "dots_replay", "april",
                    "prompt_gdro", "exemplars", "multiturn")
CLI_CASES = [*BUILT_IN, "kl_k1", "kl_k3_tis", "dynamic_sampling", "sampler_old_logp", "packed_update",
             "majority_reward", "test_time", *SHAPER_CASES, *ALLOCATION_CASES]


def _check_row(case, row):
    assert row["update/skipped"] == 0.0 and np.isfinite(row["update/loss"])
    if case == "dynamic_sampling":  # a random model solves nothing: every slot is a masked-out filler
        assert row["rollout/rollout_calls"] == 2 and row["rollout/filler_prompts"] == 2
        assert row["update/grad_norm"] == 0.0
        return
    assert row["update/grad_norm"] > 0
    if case.startswith("kl_"):
        assert row["update/kl"] == pytest.approx(0.0, abs=1e-6)  # the reference equals the policy at step 1
    if case.endswith("tis"):
        assert 0.0 <= row["update/tis_clip_frac"] <= 1.0 and "update/tis_weight_mean" in row
    if case == "packed_update":  # the tree-packed batch really ran: the shared prompts were stored once
        assert 0 < row["packing/unique_tokens"] <= row["packing/row_tokens"]
        assert row["packing/unique_tokens"] < row["packing/expanded_tokens"]
    if case in ("majority_reward", "test_time"):  # pseudo-labels: the verifier only measures the samples and the labels
        assert 0.0 <= row["reward/label_accuracy"] <= 1.0 and "reward/accuracy" in row
    if case.startswith("shaper_"):  # the shapers ran on the trainer pass and reported
        assert np.isfinite(row["shaping/adv_abs_mean_after"])
        for name in case.split("_")[1:]:
            if name != "packed":
                assert any(k.startswith(f"shaping/{name}") for k in row), (name, sorted(row))
    if case == "decs":
        assert 0.0 <= row["rollout/redundant_token_frac"] <= 1.0
    if case == "nudge":  # 2 problems x 4 rollouts, and their 8 plain-prompt distillation rows
        assert row["rollout/decoded_tokens"] > 0 and row["reward/mean"] == row["reward/mean"]
    if case == "spo_chain":  # the Monte-Carlo continuations ran and count in the decoded tokens
        assert 0 < row["rollout/continuation_tokens"] < row["rollout/decoded_tokens"]
    if case.startswith("alloc_"):  # 2 prompts, 2 extra rows of 4 leaves: the budget is spent or left unused
        assert row["alloc/extra_rows"] + row["alloc/unused_rows"] == 2
        assert row["rollout/rollout_calls"] == 1 + row["alloc/extra_rows"]  # one prompt row per extra call
        assert row["alloc/rollouts_per_prompt_max"] <= 12
    if case == "replay":  # step 1 has nothing to replay (its 2 replay rows are masked copies)
        assert row["replay/replayed_rows"] == 0 and row["replay/buffer_rows"] == 0
    if case == "dots_replay":  # 1 reference row + 1 selected row of 3 x 2 candidates; a random model solves nothing
        assert row["dots/reference_difficulty"] == 1.0 and row["dots/measured_difficulty"] == 1.0
        assert row["rollout/rollout_calls"] == 2 and row["replay/replayed_rows"] == 0
    if case == "prompt_gdro":  # step 1: every candidate is unseen
        assert row["prompt_gdro/picked_unseen"] == 2 and row["prompt_gdro/q_unseen"] == 1.0
    if case == "exemplars":  # a random model solves nothing: the bank stays empty, nothing is injected
        assert row["exemplars/injected"] == 0 and row["exemplars/bank_size"] == 0
    if case == "multiturn":  # a random model writes no code: one answer turn per episode, nothing appended
        assert row["multiturn/turns_mean"] == 1.0 and row["multiturn/appended_tokens"] == 0
    if case == "april":  # 2 of 4 launched groups train; the others are carried
        assert row["rollout/rollout_calls"] == 1 and row["partial/carried_groups"] <= 3
    if case == "alloc_dars":  # a random model solves nothing: a = 0.5 / N, every prompt asks for more
        assert row["alloc/extra_rows"] == 2 and row["alloc/prompts_with_extra"] == 2
    if case == "sampler_old_logp":
        assert "mismatch/abs_max" not in row
    else:
        # the first ratio is 1 to fp32 precision, and sampler vs trainer log-probs are reported
        assert abs(row["update/first_ratio_min"] - 1) < 1e-5 and abs(row["update/first_ratio_max"] - 1) < 1e-5
        assert 0.0 <= row["mismatch/abs_mean"] <= row["mismatch/abs_max"] < 1e-3


def _extra(case):
    return {"kl_k1": ["LossConfig.kl_coef = 0.1", "LossConfig.kl_estimator = 'k1'"],
            "kl_k3_tis": ["LossConfig.kl_coef = 0.1", "LossConfig.kl_estimator = 'k3'", "LossConfig.tis_cap = 2.0"],
            "dynamic_sampling": ["RunConfig.dynamic_sampling = True", "RunConfig.max_refills = 1"],
            "sampler_old_logp": ["RunConfig.old_logp = 'sampler'"],
            "majority_reward": ["RunConfig.reward_source = 'majority'"],
            "test_time": ["RunConfig.reward_source = 'majority'", "RunConfig.train_split = 'eval'"],
            "shaper_echo": ["RunConfig.shapers = [@EchoShaping()]"],
            "shaper_ear": ["RunConfig.shapers = [@EntropyAdvantageReshaping()]", "RunConfig.estimator = 'grpo'"],
            "shaper_rose_prl_packed": ["RunConfig.shapers = [@RoseLengthPenalty(), @ProcessRewardShaping()]",
                                       "ProcessRewardShaping.step_length = 2", "RunConfig.packed_update = True",
                                       "RunConfig.packing = @PackingConfig()", "PackingConfig.granule = 16"],
            "shaper_verl": ["RunConfig.shapers = [@EffectiveRankBonus()]", "EffectiveRankBonus.stride = 2"],
            # ARRoL: the head trains on the first step; its probe reaches the sampler (pruning waits for ready)
            "shaper_arrol": ["RunConfig.num_steps = 2", "RunConfig.shapers = [@QualityHead()]",
                             "TreeConfig.branching = @QualityPrune()", "EvalConfig.k = 2",
                             "EvalConfig.vote_probe = 'arrol_head'",
                             "QualityPrune.prune_depth = 1"],
            "rose_branching": ["TreeConfig.branching = @RoseBranching()", "RoseBranching.epsilon = 0.5",
                               "RunConfig.shapers = [@RoseLengthPenalty()]"],
            "spo_chain": ["RunConfig.estimator = 'spo_chain'", "RunConfig.estimator_options = @SPOChainOptions()",
                          "SPOChainOptions.samples = 2", "SPOChainOptions.max_cuts = 2", "SPOChainOptions.interval = 2",
                          "TreeConfig.branch_factor = 1", "TreeConfig.init_divergence = 4",
                          "TreeConfig.fallback = False"],
            "nudge": ["RunConfig.estimator = 'nudge'", "RunConfig.rollouts = [@NudgeConfig()]",
                      "NudgeConfig.hints = ['Add the ones first.', 'Add the tens first.']",
                      "NudgeConfig.rollouts_per_hint = 2", "TreeConfig.num_leaves = 1", "TreeConfig.branch_factor = 1",
                      "LossConfig.aggregation = 'seq-mean-token-mean'"],
            "packed_update": ["RunConfig.packed_update = True", "RunConfig.packing = @PackingConfig()",
                              "PackingConfig.granule = 16"],  # KL, TIS, micro-batches: tests/rl/test_packing.py
            "alloc_dars": [*ALLOCATION, "RunConfig.estimator = 'grpo'", "AllocationConfig.allocator = @DARS()"],
            "alloc_xrpo_packed": [*ALLOCATION, "RunConfig.estimator = 'rloo'",
                                  "AllocationConfig.allocator = @XRPOAllocator()", "RunConfig.packed_update = True",
                                  "RunConfig.packing = @PackingConfig()", "PackingConfig.granule = 16"],
            "alloc_gdro_treepo": [*ALLOCATION, "AllocationConfig.allocator = @RolloutGDRO()"],
            "dots_replay": ["RunConfig.rollouts = [@DOTSConfig(), @ReplayConfig()]", "DOTSConfig.pool = 3",
                            "DOTSConfig.reference = 1", "ReplayConfig.rows = 2", "LossConfig.tis_cap = 2.0"],
            "april": APRIL,
            "multiturn": ["RunConfig.rollouts = [@MultiTurnConfig()]", "MultiTurnConfig.turn_tokens = 4",
                          "RunConfig.estimator = 'grpo'", "TreeConfig.branch_factor = 1",
                          "TreeConfig.init_divergence = 4"],
            "exemplars": ["RunConfig.rollouts = [@ExemplarConfig()]"],
            "prompt_gdro": ["RunConfig.rollouts = [@PromptGDROConfig()]", "PromptGDROConfig.pool = 2"],
            "replay": ["RunConfig.rollouts = [@ReplayConfig()]", "ReplayConfig.rows = 2", "ReplayConfig.informative_only = False",
                       "LossConfig.tis_cap = 2.0", "RunConfig.num_steps = 2"],
            }.get(case, [f"RunConfig.estimator = '{case}'"])


APRIL = ["RunConfig.rollouts = [@PartialConfig()]", "PartialConfig.over_sample = 2", "RunConfig.estimator = 'grpo'",
         "TreeConfig.branch_factor = 1", "TreeConfig.init_divergence = 4", "LossConfig.tis_cap = 2.0",
         "RunConfig.num_steps = 2"]
ALLOCATION = ["RunConfig.rollouts = [@AllocationConfig()]", "AllocationConfig.max_rollouts = 12",
              "AllocationConfig.extra_rows = 2", "AllocationConfig.call_prompts = 1"]


@pytest.mark.parametrize("case", [c if c in FAST_CLI else pytest.param(c, marks=pytest.mark.slow) for c in CLI_CASES])
def test_feature_runs_through_the_cli(case, tiny_checkpoint, tmp_path):
    # an entropy bonus gives every case a gradient although a random model solves nothing (all rewards equal)
    summary = _run(tiny_checkpoint, tmp_path, "LossConfig.entropy_coef = 0.01", *_extra(case))
    _check_row(case, summary["history"][0])
    if case == "replay":  # step 2 replays step 1's two rows (every row enters: informative_only = False)
        assert summary["history"][1]["replay/replayed_rows"] == 2 and summary["history"][1]["replay/max_age"] == 1
    if case == "shaper_arrol":  # ARRoL's test-time vote, weighted by the trained head
        assert 0.0 <= summary["evals"][-1]["wmaj@k"] <= 1.0


# Measured 2026-11-28 on SmolLM2 (the bound below is 1e-5): multi-turn's first ratio max 1 + 1.14e-5 (min
# 1 + 5.7e-6), identically at a533ec3: the conversation's observation tokens make the row longer than the
# single-turn cases'. Most likely (not verified op by op) fp32 rounding: the trainer's no-gradient log-prob pass and
# the update's gradient pass are different XLA programs summing over long rows (XRPO's exemplars, at twice the
# prompt width, gave 1 - 1.34e-5, ~14 ulps at |log p| ~ 11, when that case ran on SmolLM2). Kept strict and marked,
# not loosened; the tiny-model case above passes the same check. Those numbers were under the suite's 8 fake
# devices; on one device (_run_on_one_device, 2026-12-02) the multi-turn case passed the bound once (XPASS).
_SMOLLM2_XFAIL = {"multiturn": "first ratio 1 + 1.14e-5 (fp32 rounding over the longer conversation rows)"}


#: The cases run on SmolLM2 as well: one per code path of the loop (a group estimator, the tree estimator, the
#: packed update, the sampler's log-probs as old policy, KL + TIS, a shaper on packed rows, an allocator on packed
#: rows, replay, NudgeRL's injected rows, multi-turn). Under the suite's 8 fake devices each took 2-3 min and up to
#: 21 GB of memory on the 2-core machine (all 33 cases: ~80 min of the slow run); they now run on one device
#: (_run_on_one_device); the other cases run on the tiny model above (slow) and bit for bit in the golden runs
#: (tests/golden), whose code paths these cases share.
SMOLLM2_CASES = ("grpo", "treepo", "packed_update", "sampler_old_logp", "kl_k3_tis", "shaper_rose_prl_packed",
                 "alloc_xrpo_packed", "replay", "nudge", "multiturn")


@pytest.mark.slow
@pytest.mark.parametrize("case", [pytest.param(c, marks=pytest.mark.xfail(reason=_SMOLLM2_XFAIL[c], strict=False))
                                  if c in _SMOLLM2_XFAIL else c for c in SMOLLM2_CASES])
def test_feature_runs_on_smollm2(case, tmp_path):
    """Cases of the CLI test on the embedded SmolLM2-135M-Instruct (real task, real rewards): SMOLLM2_CASES."""
    summary = _run_on_one_device("smollm2-135m-instruct", tmp_path, "LossConfig.entropy_coef = 0.01", *_extra(case))
    row = summary["history"][0]
    assert row["update/skipped"] == 0.0 and np.isfinite(row["update/loss"])
    if case not in ("sampler_old_logp", "dynamic_sampling"):
        assert abs(row["update/first_ratio_min"] - 1) < 1e-5 and abs(row["update/first_ratio_max"] - 1) < 1e-5


def test_every_estimator_and_loss_term_through_rl_step():
    """All 8 built-in estimators, KL k1/k3 and TIS through the loop's own step function on one tiny model,
    sharing the rollout, log-prob and update programs (the CLI test above covers the same cases end to end, slow)."""
    import dataclasses

    import jax

    from treejax.models import presets, transformer
    from treejax.precision import Precision
    from treejax.rl.losses import LossConfig
    from treejax.rl.optimizer import OptimizerConfig, make_optimizer
    from treejax.rl.config import StepConfig
    from treejax.rl.layouts import Expanded
    from treejax.rl.step import initial_reference, make_learner, rl_step
    from treejax.rl.train_state import TrainState
    from treejax.rl.update import make_update_fn
    from treejax.sampling.decode import generate
    from treejax.sampling.strategies import Greedy
    from treejax.sampling.tree import TreeConfig, make_tree_rollout
    from treejax.testing.sources import FixedPromptRollouts

    cfg = presets.tiny_config("smollm2-135m", vocab_size=64)
    tree = TreeConfig(num_leaves=4, max_depth=2, segment_length=4, branch_factor=2, stop_ids=(5,))
    prompts, lens = np.array([[1, 5, 9, 2], [1, 11, 3, 4]], np.int32), np.array([3, 4], np.int32)
    reward = lambda f: jax.numpy.mean((f.tokens % 3 == 0) * f.loss_mask, -1)  # noqa: E731  (varied rewards)
    source = FixedPromptRollouts(
        make_tree_rollout(cfg, tree), prompts, lens, reward,
        greedy=lambda p, t, n: generate(p, cfg, t, n, jax.random.key(0), 8, Greedy(), stop_ids=(5,)),
        greedy_reward_fn=lambda tok, n: np.mean(np.asarray(tok) % 3 == 0, -1))
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-3, warmup_steps=0, total_steps=10))
    params = transformer.init_params(cfg, jax.random.key(0))
    precision = Precision().resolve("cpu")
    layout = Expanded(cfg, attention_impl="xla")
    cases = [(name, LossConfig()) for name in BUILT_IN]
    cases += [("treepo", LossConfig(kl_coef=0.1, kl_estimator="k1")),
              ("treepo", LossConfig(kl_coef=0.1, kl_estimator="k3", tis_cap=2.0))]
    updates = {}  # one update program per loss configuration, shared by the estimators
    first = None  # the log-prob pass (make_logprob_fn of the layout, the same for every case): compiled once
    for name, loss in cases:
        state = TrainState.create(jax.tree.map(jax.numpy.copy, params), optimizer)
        if loss not in updates:
            updates[loss] = jax.jit(make_update_fn(layout, loss, optimizer), donate_argnames=("state",))
        fns = make_learner(cfg, StepConfig(estimator=name, loss=loss), precision, updates[loss], layout)
        first = first or fns
        fns = dataclasses.replace(fns, logprobs=first.logprobs)
        ref = initial_reference(state.params, loss)
        steps = 2 if loss.kl_coef > 0 else 1  # the KL term is 0 at the first step (reference = policy)
        for step in range(steps):
            state, _, m, host = rl_step(fns, state, source, jax.random.key(step), step, ref)
            m = jax.device_get(m)
            assert m["update/skipped"] == 0.0 and np.isfinite(m["update/loss"]), (name, loss)
            assert abs(m["update/first_ratio_min"] - 1) < 1e-5 and abs(m["update/first_ratio_max"] - 1) < 1e-5
            if loss.kl_coef > 0:
                assert (abs(m["update/kl"]) < 1e-6) == (step == 0), (loss, step, m["update/kl"])
                assert loss.kl_estimator == "k1" or m["update/kl"] >= 0.0  # k3 >= 0 token by token
            if loss.tis_cap is not None:
                assert 0.0 <= m["update/tis_clip_frac"] <= 1.0
        assert int(state.step) == steps


def test_clip_scale_fn_reaches_the_loss():
    """``RunConfig.clip_scale_fn`` / ``StepConfig.clip_scale_fn`` sets each sample's clip range: a scale of 0 clips
    every ratio that moved after the first mini-batch's update, a scale of 1 (the default range) clips fewer."""
    import jax

    from treejax.models import presets, transformer
    from treejax.precision import Precision
    from treejax.rl.losses import LossConfig
    from treejax.rl.optimizer import OptimizerConfig, make_optimizer
    from treejax.rl.config import StepConfig
    from treejax.rl.layouts import Expanded
    from treejax.rl.step import make_learner, rl_step
    from treejax.rl.train_state import TrainState
    from treejax.rl.update import make_update_fn
    from treejax.sampling.tree import TreeConfig, make_tree_rollout
    from treejax.testing.sources import FixedPromptRollouts

    cfg = presets.tiny_config("smollm2-135m", vocab_size=64)
    tree = TreeConfig(num_leaves=4, max_depth=2, segment_length=4, branch_factor=2, stop_ids=())
    source = FixedPromptRollouts(make_tree_rollout(cfg, tree), np.array([[1, 5, 9, 2], [1, 11, 3, 4]], np.int32),
                                 np.array([3, 4], np.int32),
                                 lambda f: jax.numpy.mean((f.tokens % 3 == 0) * f.loss_mask, -1))
    optimizer = make_optimizer(OptimizerConfig(learning_rate=1e-2, warmup_steps=0, total_steps=10))
    params = transformer.init_params(cfg, jax.random.key(0))
    layout = Expanded(cfg, attention_impl="xla")
    update = jax.jit(make_update_fn(layout, LossConfig(), optimizer), donate_argnames=("state",))
    clipped = {}
    for scale in (0.0, 1.0):
        fns = make_learner(cfg, StepConfig(mini_batches=2, clip_scale_fn=lambda f, r, s=scale: s * np.ones(r.shape)),
                           Precision().resolve("cpu"), update, layout)
        state = TrainState.create(jax.tree.map(jax.numpy.copy, params), optimizer)
        _, _, m, _ = rl_step(fns, state, source, jax.random.key(0), 0)
        m = jax.device_get(m)
        clipped[scale] = float(m["update/clip_frac_low"] + m["update/clip_frac_high"])
    assert clipped[0.0] > 0.0 and clipped[0.0] > clipped[1.0]
