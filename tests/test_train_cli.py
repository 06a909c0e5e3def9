"""The main job's CLI: gin parsing with name checks, and a full (tiny) run writing every artifact."""

import glob
import json
import os

import pytest

from treejax import train
from treejax.data import task_names
from treejax.errors import ConfigError, UserError, UserFileError

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


def test_efficacy_configs_share_one_budget():
    """The efficacy study's methods differ in the rollout's tree shape and the estimator, never in the budget."""
    cfgs = {m: train.parse([os.path.join(CONFIGS, f"efficacy_{m}.gin")], [])
            for m in ("grpo", "treepo", "treepo_segment", "treepo_no_transfer")}
    budget = {(c.prompts_per_step, c.rollout.num_leaves, c.rollout.max_length, c.num_steps, c.optimizer,
               c.loss, c.task, tuple(sorted(c.task_options.items())), c.eval) for c in cfgs.values()}
    assert len(budget) == 1
    assert cfgs["grpo"].rollout.branch_factor == 1 and cfgs["grpo"].estimator == "grpo"
    assert cfgs["treepo"].rollout.branch_factor == 2 and cfgs["treepo"].rollout.budget_transfer
    assert cfgs["treepo_segment"].estimator == "treepo_segment"
    assert not cfgs["treepo_no_transfer"].rollout.budget_transfer
    assert len({c.log_dir for c in cfgs.values()}) == 4
    assert cfgs["treepo"].eval.num_problems >= 200 and cfgs["treepo"].task_options["eval_size"] >= 200


def test_misspelled_binding_names_closest(tmp_path):
    with pytest.raises(ConfigError, match="did you mean RunConfig.num_steps[?]$"):
        train.parse([], ["RunConfig.num_stpes = 3"])
    with pytest.raises(ValueError, match="TreeConfig.segment_length"):
        train.parse([], ["TreeConfig.segment_lenght = 3"])
    # the closest first (treejax-sft's SFTConfig.num_steps may follow as a second suggestion)
    with pytest.raises(ConfigError, match="'RunConfg.num_steps'; did you mean RunConfig.num_steps( or SFTConfig.num_steps)?[?]"):
        train.parse([], ["RunConfg.num_steps = 3"])
    with pytest.raises(ConfigError, match=r"did you mean OptimizerConfig.learning_rate\b"):  # the wrong class first
        train.parse([], ["RunConfig.learning_rate = 1e-5"])
    with pytest.raises(ConfigError, match="unknown configurable @Temprature in TreeConfig.strategy; did you mean "
                                          "Temperature[?]"):
        train.parse([], ["TreeConfig.strategy = @Temprature()"])
    path = tmp_path / "typo.gin"
    path.write_text("RunConfig:\n    num_steps = 2\n    prompts_per_stp = 2\n")  # a binding block
    with pytest.raises(ConfigError, match=f"^{path}:3: unknown gin binding 'RunConfig.prompts_per_stp'; did you "
                                          "mean RunConfig.prompts_per_step[?]"):
        train.parse([str(path)], [])


def test_missing_gin_file(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.gin"):
        train.parse(["nope.gin"], [])
    path = tmp_path / "a.gin"
    path.write_text('include "missing.gin"\n')
    with pytest.raises(UserFileError, match=f"^{path}:1: included gin file 'missing.gin' not found"):
        train.parse([str(path)], [])


def test_valid_gin_that_a_line_splitter_rejects(tmp_path):
    """A triple-quoted string holding ``=`` and an unindented continuation line of a dict are valid gin."""
    path = tmp_path / "tricky.gin"
    path.write_text(f'include "{os.path.join(CONFIGS, "quickstart.gin")}"\n'
                    'RunConfig.task_options = {"size": 16,\n'
                    '"eval_size": 4}\n'
                    'RunConfig.system_prompt = """Reply as: answer = <number>\n'
                    'x = 1 is not a binding."""\n'
                    'STEPS = 5\n'
                    'RunConfig.num_steps = %STEPS\n')
    cfg = train.parse([str(path)], [])
    assert cfg.task_options == {"size": 16, "eval_size": 4}
    assert cfg.system_prompt == "Reply as: answer = <number>\nx = 1 is not a binding."
    assert cfg.num_steps == 5 and cfg.rollout.num_leaves == 8  # the macro, and quickstart.gin's include


@pytest.mark.parametrize("text, message", [
    ("RunConfig.num_steps = 2\nRunConfig.num_steps = = 3\n",
     "2: gin syntax error in 'RunConfig.num_steps = = 3': Unable to parse value."),
    ('RunConfig.task_options = {"a": 1,\n', "2: gin syntax error: EOF in multi-line statement"),
    ("RunConfig num_steps = 3\n", "1: gin syntax error in 'RunConfig num_steps = 3': Couldn't parse statement, "
                                  "expected ':' or '='."),
])
def test_gin_syntax_error_is_one_line(tmp_path, text, message):
    path = tmp_path / "bad.gin"
    path.write_text(text)
    with pytest.raises(ConfigError) as err:
        train.parse([str(path)], [])
    assert str(err.value) == f"{path}:{message}"
    with pytest.raises(ConfigError, match="^--gin_param: gin syntax error in 'RunConfig.num_steps = = 3': Unable"):
        train.parse([], ["RunConfig.num_steps = = 3"])


@pytest.fixture
def no_run(monkeypatch):
    """The run itself must not be reached (no model is loaded): every case fails while parsing."""
    from treejax.rl import loop

    def run(*args, **kwargs):
        raise AssertionError("treejax.rl.loop.run reached")

    monkeypatch.setattr(loop, "run", run)


@pytest.mark.parametrize("param, message", [
    ("RunConfig.num_steps='two'", "--gin_param: RunConfig.num_steps must be int, got 'two' (str)"),
    ("OptimizerConfig.learning_rate='1e-5'",
     "--gin_param: OptimizerConfig.learning_rate must be float, got '1e-5' (str)"),
    ("RunConfig.num_steps=2.5", "--gin_param: RunConfig.num_steps must be int, got 2.5 (float)"),
    ("RunConfig.dynamic_sampling=1", "--gin_param: RunConfig.dynamic_sampling must be bool, got 1 (int)"),
    ("TreeConfig.init_divergence_range=[2, 8]",
     "--gin_param: TreeConfig.init_divergence_range must be tuple[int, int] | None, got [2, 8] (list)"),
    ("TreeConfig.strategy=@Greedy",  # the class, not an instance: found in the built config
     "TreeConfig.strategy must be Strategy, got <class 'treejax.sampling.strategies.Greedy'> (type)"),
    ("TreeConfig.num_leaves=0", "TreeConfig.num_leaves (W) must be >= 1, got 0"),  # a __post_init__ check
    ("RunConfig.task='gsm8k'",
     "unknown task 'gsm8k'; did you mean 'gsm8k_file'? (all {n} names: treejax.data.task_names())"),
    ("RunConfig.num_stpes=3", "--gin_param: unknown gin binding 'RunConfig.num_stpes'; did you mean "
                              "RunConfig.num_steps?"),
])
def test_user_errors_print_one_line(no_run, capsys, param, message):
    with pytest.raises(SystemExit) as exit_:
        train.console_main(["--quiet", "--gin_param", param])
    assert exit_.value.code == 2
    message = message.replace("{n}", str(len(task_names())))
    assert capsys.readouterr().err == f"treejax-train: error: {message}\n"


def test_bugs_keep_their_traceback(monkeypatch, capsys):
    """A ValueError that is no UserError (e.g. from inside jax) propagates instead of becoming one line."""
    from treejax.rl import loop

    def run(*args, **kwargs):
        raise ValueError("a bug inside the Pallas lowering")

    monkeypatch.setattr(loop, "run", run)
    with pytest.raises(ValueError, match="Pallas") as err:
        train.console_main(["--quiet"])
    assert not isinstance(err.value, UserError)
    assert "treejax-train: error" not in capsys.readouterr().err


def test_default_config_dir_has_the_shipped_configs():
    d = train.default_config_dir()
    assert os.path.isfile(os.path.join(d, "quickstart.gin"))
    assert os.path.isfile(os.path.join(d, "include", "treepo_loss.gin"))


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
    # TensorBoard: the learning rate per step, the tree picture and a few leaves' text (reward, verifier score)
    events = _events(log_dir)
    assert [(s, round(v, 12)) for s, v in events["update/learning_rate"]] == [(1, 1e-5), (2, 1e-5)]
    assert [s for s, _ in events["rollout/tree"]] == [1, 2]
    samples = dict(events["rollout/samples/text_summary"])
    assert sorted(samples) == [1, 2]
    assert "**leaf 0** (reward -1.00, score 0.00)" in samples[1] and "**leaf 2**" in samples[1]
    # Rerunning the same command is refused (it would train nothing and overwrite the summary) ...
    with pytest.raises(ConfigError, match="already holds a finished run; pass --resume"):
        train.main(["--gin_file", os.path.join(CONFIGS, "quickstart.gin"), "--quiet"]
                   + sum((["--gin_param", p] for p in params), []))
    # ... a longer run with --resume continues at step 2 and trains only the missing step.
    resumed = train.main(["--gin_file", os.path.join(CONFIGS, "quickstart.gin"), "--quiet", "--resume"]
                         + sum((["--gin_param", p] for p in params[:2] + ["RunConfig.num_steps = 3"] + params[3:]),
                               []))
    # the history is kept across the resume and the run appends to it; "before" stays the original evaluation
    assert [row["step"] for row in resumed["history"]] == [1, 2, 3]
    assert resumed["eval_before"] == summary["eval_before"]


def _events(log_dir):
    """``{tag: [(step, value)]}`` of every scalar (float), image (encoded bytes) and text (str) in the run's event
    files (tensorboardX's protos; no TensorFlow)."""
    import struct

    from tensorboardX.proto import event_pb2

    out = {}
    for name in sorted(glob.glob(os.path.join(log_dir, "events.out.tfevents.*"))):
        data = open(name, "rb").read()
        pos = 0
        while pos + 12 <= len(data):
            (length,) = struct.unpack("<Q", data[pos:pos + 8])
            event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
            pos += 12 + length + 4
            for v in event.summary.value:
                if v.HasField("simple_value"):
                    value = v.simple_value
                elif v.HasField("image"):
                    value = v.image.encoded_image_string
                elif v.HasField("tensor") and v.tensor.string_val:
                    value = v.tensor.string_val[0].decode("utf-8")
                else:
                    continue
                out.setdefault(v.tag, []).append((int(event.step), value))
    return out


def _export_bytes(summary):
    with open(os.path.join(summary["hf_export"], "model.safetensors"), "rb") as f:
        return f.read()


@pytest.mark.slow  # ~150 s on 2 cores; resume equality runs by default in test_checkpoint (SIGKILL) and the tiny run
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
    # the resumed run kept the interrupted run's "before" evaluation: one step-0 point in TensorBoard, not two
    assert resumed["eval_before"]["step"] == 0 and resumed["evals"][0] == resumed["eval_before"]
    assert [s for s, _ in _events(str(tmp_path / "resumed"))["eval/accuracy"]] == [0, 2]


def test_dynamic_sampling_masks_degenerate_prompts(tiny_checkpoint, tmp_path):
    """A tiny random model solves nothing: every prompt has zero reward std, the refills find none either, and
    the slots are filled with masked-out prompts — the update then has no gradient (no entropy/KL terms)."""
    log_dir = str(tmp_path / "ds")
    params = [f"RunConfig.model = '{tiny_checkpoint}'", f"RunConfig.log_dir = '{log_dir}'", "RunConfig.num_steps = 1",
              "RunConfig.prompts_per_step = 2", "TreeConfig.num_leaves = 4", "TreeConfig.max_depth = 2",
              "TreeConfig.segment_length = 4", "EvalConfig.num_problems = 2", "EvalConfig.max_new_tokens = 4",
              "RunConfig.dynamic_sampling = True",
              "RunConfig.max_refills = 1", "RunConfig.export_hf = False", "RunConfig.save_final = False"]
    summary = train.main(["--gin_file", os.path.join(CONFIGS, "quickstart.gin"), "--quiet"]
                         + sum((["--gin_param", p] for p in params), []))
    # save_final = False: no checkpoint written, none named
    assert summary["checkpoint_dir"] is None and not os.listdir(os.path.join(log_dir, "checkpoints"))
    row = summary["history"][0]
    assert row["reward/mean"] == -1.0
    assert row["update/grad_norm"] == 0.0 and row["update/loss"] == 0.0


def test_branching_rule_from_gin():
    """``TreeConfig.branching`` takes any registered rule, with its own bindings; unknown ones are errors."""
    from treejax.sampling import branching

    cfg = train.parse([os.path.join(CONFIGS, "treepo_smollm2.gin")],
                      ["TreeConfig.branching = @ECHO()", "ECHO.max_branches = 3", "ECHO.pruning = False"])
    assert cfg.rollout.rule == branching.ECHO(max_branches=3, pruning=False)
    cfg = train.parse([os.path.join(CONFIGS, "treepo_smollm2.gin")],
                      ["TreeConfig.branching = @LogProbWeighted()", "LogProbWeighted.schedule = (5.0, 1.0, 100)"])
    assert cfg.rollout.rule == branching.LogProbWeighted(schedule=(5.0, 1.0, 100))
    with pytest.raises(ConfigError, match="LATR"):
        train.parse([os.path.join(CONFIGS, "treepo_smollm2.gin")], ["LATR.look_ahead = (20,)"])
