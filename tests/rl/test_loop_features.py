"""Every estimator and loss feature the README lists, run through the whole loop from the CLI (tiny model, CPU).

Each case is one RL step of ``treejax-train`` (quickstart config, a tiny random Llama with SmolLM2's tokenizer).
With the trainer recomputing old log-probs (the default), the first mini-batch's PPO ratio must be 1 to fp32
precision: the old-logp forward and the update's forward run the same program shapes on the same rows.
"""

import os

import numpy as np
import pytest

from treejax import train
from treejax.rl.advantages import list_estimators

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")
BUILT_IN = ("grpo", "rloo", "reinforce_pp_baseline", "treepo", "treepo_segment", "spo_tree", "mc_grpo", "remax")


def _run(tiny_checkpoint, tmp_path, *extra):
    params = [f"RunConfig.model = '{tiny_checkpoint}'", f"RunConfig.log_dir = '{tmp_path / 'run'}'",
              "RunConfig.num_steps = 1", "RunConfig.prompts_per_step = 2", "TreeConfig.num_leaves = 4",
              "TreeConfig.max_depth = 2", "TreeConfig.segment_length = 4", "EvalConfig.num_problems = 2",
              "EvalConfig.max_new_tokens = 2", "RunConfig.export_hf = False", "RunConfig.tree_picture_every = 0",
              "OptimizerConfig.learning_rate = 1e-3", *extra]
    return train.main(["--gin_file", os.path.join(CONFIGS, "quickstart.gin"), "--quiet"]
                      + sum((["--gin_param", p] for p in params), []))


def test_builtin_list_is_complete():
    assert set(BUILT_IN) <= set(list_estimators())


@pytest.mark.parametrize("case", [*BUILT_IN, "kl_k1", "kl_k3", "tis", "dynamic_sampling", "sampler_old_logp"])
def test_feature_runs_through_the_loop(case, tiny_checkpoint, tmp_path):
    extra = {"kl_k1": ["LossConfig.kl_coef = 0.1", "LossConfig.kl_estimator = 'k1'"],
             "kl_k3": ["LossConfig.kl_coef = 0.1", "LossConfig.kl_estimator = 'k3'"],
             "tis": ["LossConfig.tis_cap = 2.0"],
             "dynamic_sampling": ["RunConfig.dynamic_sampling = True", "RunConfig.max_refills = 1"],
             "sampler_old_logp": ["RunConfig.old_logp = 'sampler'"]}.get(case, [f"RunConfig.estimator = '{case}'"])
    # an entropy bonus gives every case a gradient although a random model solves nothing (all rewards equal)
    summary = _run(tiny_checkpoint, tmp_path, "LossConfig.entropy_coef = 0.01", *extra)
    row = summary["history"][0]
    assert row["update/skipped"] == 0.0 and np.isfinite(row["update/loss"]) and row["update/grad_norm"] > 0
    if case.startswith("kl_"):
        assert "update/kl" in row and row["update/kl"] == pytest.approx(0.0, abs=1e-6)  # ref == old at step 1
    if case == "tis":
        assert row["update/tis_clip_frac"] >= 0.0 and "mismatch/abs_max" in row
    if case == "dynamic_sampling":
        assert row["rollout/rollout_calls"] == 2 and row["rollout/filler_prompts"] == 2
    if case == "sampler_old_logp":
        assert "mismatch/abs_max" not in row
    else:
        # the first ratio is 1 to fp32 precision, and sampler vs trainer log-probs are reported
        assert abs(row["update/first_ratio_min"] - 1) < 1e-5 and abs(row["update/first_ratio_max"] - 1) < 1e-5
        assert 0.0 <= row["mismatch/abs_mean"] <= row["mismatch/abs_max"] < 1e-3
