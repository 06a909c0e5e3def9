"""The main job's CLI: gin parsing with name checks, and a full (tiny) run writing every artifact."""

import glob
import json
import os

import pytest

from treejax import train

CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "configs")


@pytest.mark.parametrize("name", ["quickstart.gin", "treepo_smollm2.gin", "grpo_smollm2.gin",
                                  "treepo_qwen2.5_math.gin"])
def test_shipped_configs_parse(name):
    cfg = train.parse([os.path.join(CONFIGS, name)], [])
    assert cfg.rollout.num_leaves >= 8
    if name == "grpo_smollm2.gin":
        treepo = train.parse([os.path.join(CONFIGS, "treepo_smollm2.gin")], [])
        assert cfg.estimator == "grpo" and cfg.rollout.branch_factor == 1
        # same rollout budget: leaves per prompt and tokens per leaf
        assert cfg.rollout.num_leaves == treepo.rollout.num_leaves
        assert cfg.rollout.max_length == treepo.rollout.max_length


def test_misspelled_binding_names_closest():
    with pytest.raises(ValueError, match="did you mean RunConfig.num_steps"):
        train.parse([], ["RunConfig.num_stpes = 3"])
    with pytest.raises(ValueError, match="TreeConfig.segment_length"):
        train.parse([], ["TreeConfig.segment_lenght = 3"])


def test_missing_gin_file():
    with pytest.raises(FileNotFoundError, match="nope.gin"):
        train.parse(["nope.gin"], [])


def test_tiny_run_writes_all_artifacts_and_resumes(tiny_checkpoint, tmp_path):
    log_dir = str(tmp_path / "run")
    params = [
        f"RunConfig.model = '{tiny_checkpoint}'", f"RunConfig.log_dir = '{log_dir}'", "RunConfig.num_steps = 2",
        "RunConfig.prompts_per_step = 2", "TreeConfig.num_leaves = 4", "TreeConfig.max_depth = 2",
        "TreeConfig.segment_length = 4", "EvalConfig.num_problems = 4", "EvalConfig.max_new_tokens = 8",
        "RunConfig.checkpoint_every = 1",
    ]
    summary = train.main(["--gin_file", os.path.join(CONFIGS, "quickstart.gin"), "--quiet"]
                         + sum((["--gin_param", p] for p in params), []))
    assert len(summary["history"]) == 2
    assert glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))
    assert os.path.exists(os.path.join(log_dir, "operative_config.gin"))
    assert os.path.exists(summary["tree_picture"]) and summary["tree_picture"].endswith(".png")
    assert os.path.exists(os.path.join(summary["hf_export"], "config.json"))
    assert os.path.exists(os.path.join(summary["hf_export"], "model.safetensors"))
    with open(os.path.join(log_dir, "summary.json")) as f:
        assert json.load(f)["steps"] == 2
    steps = sorted(int(d) for d in os.listdir(summary["checkpoint_dir"]) if d.isdigit())
    assert steps[-1] == 2
    # A longer run in the same folder resumes at step 2 and trains only the missing step.
    resumed = train.main(["--gin_file", os.path.join(CONFIGS, "quickstart.gin"), "--quiet"]
                         + sum((["--gin_param", p] for p in params[:2] + ["RunConfig.num_steps = 3"] + params[3:]),
                               []))
    # the history is kept across the resume and the run appends to it; "before" stays the original evaluation
    assert [row["step"] for row in resumed["history"]] == [1, 2, 3]
    assert resumed["eval_before"] == summary["eval_before"]


def _export_bytes(summary):
    with open(os.path.join(summary["hf_export"], "model.safetensors"), "rb") as f:
        return f.read()


def test_sigterm_saves_and_resume_equals_uninterrupted(tiny_checkpoint, tmp_path, monkeypatch):
    """SIGTERM during step 1 -> the loop finishes the step, saves and returns; rerunning resumes, and the final
    params equal those of an uninterrupted run bit for bit (CPU)."""
    import signal

    from treejax import viz

    def params_for(log_dir):
        return [f"RunConfig.model = '{tiny_checkpoint}'", f"RunConfig.log_dir = '{log_dir}'",
                "RunConfig.num_steps = 2", "RunConfig.prompts_per_step = 2", "TreeConfig.num_leaves = 4",
                "TreeConfig.max_depth = 2", "TreeConfig.segment_length = 4", "EvalConfig.num_problems = 2",
                "EvalConfig.max_new_tokens = 4", 
                "OptimizerConfig.learning_rate = 1e-3",
                # an entropy bonus gives gradients that depend on the sampled rollouts even when every reward
                # is equal (a tiny random model solves nothing): resume must reproduce data order and keys
                "LossConfig.entropy_coef = 0.01"]

    def main(log_dir):
        return train.main(["--gin_file", os.path.join(CONFIGS, "quickstart.gin"), "--quiet"]
                          + sum((["--gin_param", p] for p in params_for(log_dir)), []))

    straight = main(str(tmp_path / "straight"))
    assert all(row["update/grad_norm"] > 0 for row in straight["history"])
    original = viz.draw_tree
    calls = []

    def draw_and_preempt(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            os.kill(os.getpid(), signal.SIGTERM)  # arrives during step 1, handled by the loop's handler
        return original(*args, **kwargs)

    monkeypatch.setattr(viz, "draw_tree", draw_and_preempt)
    interrupted = main(str(tmp_path / "resumed"))
    assert interrupted["preempted_at"] == 1
    monkeypatch.setattr(viz, "draw_tree", original)
    resumed = main(str(tmp_path / "resumed"))
    assert len(resumed["history"]) == 2
    assert resumed["history"][1] == {**straight["history"][1], **{k: v for k, v in resumed["history"][1].items()
                                                                   if k.startswith("time/") or k.endswith("per_s")}}
    assert _export_bytes(resumed) == _export_bytes(straight)


def test_dynamic_sampling_masks_degenerate_prompts(tiny_checkpoint, tmp_path):
    """A tiny random model solves nothing: every prompt has zero reward std, the refills find none either, and
    the slots are filled with masked-out prompts — the update then has no gradient (no entropy/KL terms)."""
    log_dir = str(tmp_path / "ds")
    params = [f"RunConfig.model = '{tiny_checkpoint}'", f"RunConfig.log_dir = '{log_dir}'", "RunConfig.num_steps = 1",
              "RunConfig.prompts_per_step = 2", "TreeConfig.num_leaves = 4", "TreeConfig.max_depth = 2",
              "TreeConfig.segment_length = 4", "EvalConfig.num_problems = 2", "EvalConfig.max_new_tokens = 4",
              "RunConfig.dynamic_sampling = True",
              "RunConfig.max_refills = 1", "RunConfig.export_hf = False"]
    summary = train.main(["--gin_file", os.path.join(CONFIGS, "quickstart.gin"), "--quiet"]
                         + sum((["--gin_param", p] for p in params), []))
    row = summary["history"][0]
    assert row["reward/mean"] == -1.0
    assert row["update/grad_norm"] == 0.0 and row["update/loss"] == 0.0
