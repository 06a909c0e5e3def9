"""What a new user hits: log folders (refuse / resume / overwrite / lock), over-long prompts measured at start,
divergence detection, and RunConfig's defaults equal to the quickstart."""

import dataclasses
import json
import logging
import os
import re
import socket

import numpy as np
import pytest

from treejax.errors import ConfigError, DataError, DeviceMemoryError, DivergenceError, UserError
from treejax.rl import health, loop, setup
from treejax.run_dir import RunLock, prepare_log_dir

@pytest.fixture
def treejax_caplog(caplog, monkeypatch):
    """caplog that sees treejax's records even after a CLI test gave the treejax logger its own handler
    (``configure_logging``: no propagation, WARNING with ``--quiet``)."""
    monkeypatch.setattr(logging.getLogger("treejax"), "propagate", True)
    caplog.set_level(logging.INFO, logger="treejax")
    return caplog


CONFIGS = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "configs")


def test_finished_run_is_refused_unless_resume_or_overwrite(tmp_path):
    d = tmp_path / "run"
    prepare_log_dir(str(d), "new")  # nothing there yet
    (d / "checkpoints").mkdir(parents=True)
    prepare_log_dir(str(d), "new")  # unfinished (preempted) run: resumes
    (d / "summary.json").write_text("{}")
    with pytest.raises(ConfigError, match="finished run; pass --resume .* --overwrite"):
        prepare_log_dir(str(d), "new")
    prepare_log_dir(str(d), "resume")
    assert (d / "summary.json").exists()
    prepare_log_dir(str(d), "overwrite")
    assert os.listdir(d) == []


def test_overwrite_refuses_a_folder_that_is_not_a_run(tmp_path):
    (tmp_path / "thesis.tex").write_text("x")
    with pytest.raises(ConfigError, match="does not look like a treejax run folder"):
        prepare_log_dir(str(tmp_path), "overwrite")
    assert (tmp_path / "thesis.tex").exists()


def test_second_run_in_one_folder_fails_at_once(tmp_path):
    with RunLock(str(tmp_path)):
        holder = re.escape(f"(pid {os.getpid()} on {socket.gethostname()})")
        with pytest.raises(ConfigError, match=f"another treejax run {holder}"):
            RunLock(str(tmp_path)).acquire()
    RunLock(str(tmp_path)).acquire().release()  # released: free again


def test_run_config_defaults_are_the_quickstart():
    from treejax import train

    parsed = train.parse([os.path.join(CONFIGS, "quickstart.gin")], [])
    assert parsed == loop.RunConfig(), [f.name for f in dataclasses.fields(parsed)
                                        if getattr(parsed, f.name) != getattr(loop.RunConfig(), f.name)]


def test_run_config_default_task_data_exists():
    """The default task options ask for problems the generator has (the old default asked for 1000 distinct
    chain_sum_2x1 problems; about 160 exist)."""
    task, train, evals = setup.load_task_data(loop.RunConfig())
    assert len(train) == 128 and len(evals) == 32
    assert not {r["question"] for r in train} & {e.metadata["question"] for e in evals}


class _Tok:
    """Whitespace tokenizer with a trivial chat template (enough for prompt measurement)."""

    eos_ids = (0,)

    def encode(self, text):
        return [1] * len(text.split())

    def apply_chat_template(self, messages, **kw):
        return " ".join(m["content"] for m in messages)


def _task(tmp_path, lengths):
    path = tmp_path / "train.jsonl"
    with open(path, "w") as f:
        for i, n in enumerate(lengths):
            f.write(json.dumps({"question": " ".join(["w"] * n) + f" q{i}", "answer": f"#### {i}"}) + "\n")
    from treejax.data import get_task

    return get_task("gsm8k_file", path=str(path), instruction="", system_prompt=None)


def test_overlong_prompts_are_filtered_with_a_count_or_refused(tmp_path, treejax_caplog, monkeypatch):
    caplog = treejax_caplog
    from treejax.data import prompts

    monkeypatch.setattr(prompts, "format_prompt", lambda tok, msgs, **kw: " ".join(m["content"] for m in msgs))
    task = _task(tmp_path, [50, 60, 55, 1000, 291, 57])
    cfg = loop.RunConfig(task="gsm8k_file", max_prompt_length=128, prompts_per_step=2)
    records, evals, width = setup.filter_prompts(_Tok(), task, task.records("train"), [], cfg)
    assert len(records) == 4 and width == 64  # the 291- and 1000-word questions are gone; the width follows
    assert "2 of 6 training" in caplog.text
    with pytest.raises(DataError, match="2 of 6 training .* longer than max_prompt_length=128"):
        setup.filter_prompts(_Tok(), task, task.records("train"), [],
                             dataclasses.replace(cfg, overlong_prompts="error"))


def test_divergence_rules():
    V = 49152
    assert health.divergence({"update/entropy": 2.0, "update/param_norm": 100.0}, 100.5, V) is None
    assert "uniform" in health.divergence({"update/entropy": 0.99 * np.log(V)}, None, V)
    assert "uniform" in health.divergence({"update/entropy": 0.99 * np.log(V)}, None, V, initial_entropy=1.5)
    # a model that started uniform (a random initialisation) has not diverged by staying there
    assert health.divergence({"update/entropy": 0.99 * np.log(V)}, None, V, initial_entropy=0.99 * np.log(V)) is None
    assert "jumped" in health.divergence({"update/param_norm": 400.0}, 100.0, V)
    assert "norm is nan" in health.divergence({"update/param_norm": float("nan")}, 100.0, V)


def test_invalid_sampled_ids_stop_the_run():
    from treejax.testing.forests import random_forest

    forest = random_forest(np.random.default_rng(0), 2, 4, 2, 3)
    health.check_sampled_ids(forest, 10**6, 0)
    valid = np.argwhere(np.asarray(forest.segment_index) >= 0)[0]
    bad = forest.replace(tokens=forest.tokens.at[tuple(valid)].set(10**6 + 5))
    with pytest.raises(DivergenceError, match="outside the vocabulary"):
        health.check_sampled_ids(bad, 10**6, 0)
    nan = forest.replace(logprobs=forest.logprobs.at[tuple(valid)].set(np.nan))
    with pytest.raises(DivergenceError, match="1 non-finite log-probs"):
        health.check_sampled_ids(nan, 10**6, 0)


def _jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def _no_model_load(monkeypatch):
    """Makes loading weights fail loudly: what is checked before it must not get that far."""
    from treejax.models import registry

    def load_model(*args, **kwargs):
        raise AssertionError("the model's weights were loaded before the task data was checked")

    monkeypatch.setattr(registry, "load_model", load_model)


@pytest.mark.parametrize("rows, message", [
    ([], "task file .*train.jsonl holds no problems"),
    ([{"question": "2+3?", "answer": 5}, {"question": "2+4?", "answer": "#### 6"}],
     "has no held-out [(]eval[)] problems, and the run evaluates EvalConfig.num_problems=32 .* "
     "eval_path='<held-out file>' .* or eval_fraction=0.05"),
    ([{"question": "2+3?", "answer": [5]}], "train.jsonl:1: field 'answer' must be a string or a number"),
])
def test_task_file_problems_stop_the_run_before_the_model_loads(tmp_path, monkeypatch, rows, message):
    _no_model_load(monkeypatch)
    path = _jsonl(tmp_path / "train.jsonl", rows)
    cfg = loop.RunConfig(task="gsm8k_file", task_options={"path": path}, log_dir=str(tmp_path / "run"),
                         model=str(tmp_path / "no_model_here"))
    with pytest.raises(DataError, match=message):
        loop.run(cfg)


def test_overlong_prompts_are_refused_before_the_model_loads(tiny_checkpoint, tmp_path, monkeypatch):
    _no_model_load(monkeypatch)
    question = " ".join(["word"] * 400) + "?"
    path = _jsonl(tmp_path / "train.jsonl", [{"question": question, "answer": 1}, {"question": "1+1?", "answer": 2}])
    evals = _jsonl(tmp_path / "eval.jsonl", [{"question": "2+2?", "answer": 4}])
    cfg = loop.RunConfig(model=tiny_checkpoint, task="gsm8k_file", log_dir=str(tmp_path / "run"),
                         task_options={"path": path, "eval_path": evals}, max_prompt_length=128,
                         overlong_prompts="error")
    with pytest.raises(DataError, match="1 of 2 training and 0 of 1 evaluation prompts .* longer than "
                                        "max_prompt_length=128 tokens"):
        loop.run(cfg)
    with pytest.raises(DataError, match="1 usable training prompts, fewer than prompts_per_step=2"):
        loop.run(dataclasses.replace(cfg, overlong_prompts="filter"))


def _tiny_run(tiny_checkpoint, tmp_path, learning_rate, nonfinite, export_hf=True):
    """One RL step of a tiny random model through the real loop, at the smallest sizes (compiles dominate)."""
    from treejax.rl.evaluation import EvalConfig

    base = loop.RunConfig()
    return dataclasses.replace(
        base, model=tiny_checkpoint, log_dir=str(tmp_path / "run"), num_steps=1, prompts_per_step=1,
        rollout=dataclasses.replace(base.rollout, num_leaves=2, max_depth=1, segment_length=2),
        eval=EvalConfig(num_problems=1, max_new_tokens=1), tree_picture_every=0, export_hf=export_hf,
        old_logp="sampler", nonfinite=nonfinite,
        optimizer=dataclasses.replace(base.optimizer, learning_rate=learning_rate))


@pytest.mark.parametrize("learning_rate, why", [
    (1e3, "the parameter norm jumped from .* to .* in one step"),
    pytest.param(1e30, "the parameter norm is inf", marks=pytest.mark.slow),
])
def test_divergence_stops_the_run_before_export(tiny_checkpoint, tmp_path, learning_rate, why):
    """The issue's cases: learning_rate=1e3 (AdamW's decay alone multiplies every weight by 1 - 1e3 * 0.1 = -99;
    a random tiny model gets no reward, so no gradient) and 1e30, with nonfinite='raise': a DivergenceError at
    step 1, nothing exported, no summary, no checkpoint."""
    cfg = _tiny_run(tiny_checkpoint, tmp_path, learning_rate, "raise")
    with pytest.raises(DivergenceError, match=f"step 1: {why}; stopped before export"):
        loop.run(cfg)
    run_dir = tmp_path / "run"
    assert not (run_dir / "hf_export").exists() and not (run_dir / "summary.json").exists()
    assert not [d for d in os.listdir(run_dir / "checkpoints") if d.isdigit()]
    failure = json.load(open(run_dir / "failure.json"))
    assert failure["user_error"] and failure["type"] == "treejax.errors.DivergenceError"


@pytest.mark.slow
def test_divergence_without_raise_is_reported_in_the_log_and_summary(tiny_checkpoint, tmp_path, treejax_caplog):
    caplog = treejax_caplog
    from treejax.rl.report import format_summary

    summary = loop.run(_tiny_run(tiny_checkpoint, tmp_path, 1e3, "skip"))
    assert [d["step"] for d in summary["divergence"]] == [1] and "jumped" in summary["divergence"][0]["why"]
    assert "step 1: the parameter norm jumped" in caplog.text
    assert "training looked diverged at step(s) 1" in caplog.text
    assert "WARNING: training looked diverged at step(s) 1 (the parameter norm jumped" in format_summary(summary)


def test_summary_of_a_healthy_run_has_no_divergence_warning():
    from treejax.rl.report import format_summary

    ev = {"accuracy": 0.25, "n": 4}
    summary = {"model": "m", "task": "t", "estimator": "treepo", "steps": 1, "total_s": 1.0, "eval_before": ev,
               "eval_after": ev, "history": [], "decoded_tokens": 0, "log_dir": "l", "checkpoint_dir": "c",
               "precision": {"param_dtype": "float32", "compute_dtype": "float32"}, "divergence": []}
    assert "diverged" not in format_summary(summary)
    summary["divergence"] = [{"step": 2, "why": "the policy entropy 10.79 is at ..."}]
    assert "WARNING: training looked diverged at step(s) 2 (the policy entropy" in format_summary(summary)


def test_summary_of_a_multiturn_run_gives_the_accuracy_with_the_tools():
    from treejax.rl.report import format_summary

    ev = lambda acc, tools, calls: {"accuracy": acc, "n": 128, "tool_accuracy": tools, "tool_calls_mean": calls}  # noqa: E731
    summary = {"model": "m", "task": "retrieval_multihop", "estimator": "grpo", "steps": 40, "total_s": 1.0,
               "eval_before": ev(0.0, 0.75, 2.34), "eval_after": ev(0.0, 0.883, 2.54), "history": [],
               "decoded_tokens": 0, "log_dir": "l", "checkpoint_dir": "c",
               "precision": {"param_dtype": "float32", "compute_dtype": "float32"}, "divergence": []}
    assert ("held-out with the tools (one greedy episode each): 75.0% before -> 88.3% after, 2.54 calls an episode"
            in format_summary(summary))
    del summary["eval_after"]["tool_accuracy"]
    assert "with the tools" not in format_summary(dict(summary, eval_before={"accuracy": 0.0, "n": 128}))


_OOM = ("RESOURCE_EXHAUSTED: Out of memory while trying to allocate 133.85GiB with allocator GPU_0_bfc on device 0. "
        "[tf-allocator-allocation-error=''] [executable_name='{}']")


def test_device_out_of_memory_becomes_an_error_that_names_the_fix():
    """XLA's out-of-memory error (the text of the real one a 14 x 512 packed update without remat raised on an
    H200; XLA:CPU's, which names no program, as efficacy_nudge raised it on a 20 GB host) becomes one
    DeviceMemoryError line: the allocation, the program, and the settings bounding its memory; other errors are
    left alone."""
    packed = health.out_of_memory_error(RuntimeError(_OOM.format("jit_update")), remat=False, micro_batches=1,
                                        packed=True, row_length=131072)
    assert isinstance(packed, DeviceMemoryError) and isinstance(packed, UserError)
    assert str(packed) == (
        "the tree-packed update ran out of device memory in jit_update: Out of memory while trying to allocate "
        "133.85GiB with allocator GPU_0_bfc on device 0. Its rows of 131072 tokens hold whole trees, which "
        "RunConfig.micro_batches (now 1) cannot split; fixes: RunConfig.remat = 'full' (now False); or smaller "
        "trees (TreeConfig.max_depth, segment_length, num_leaves); or RunConfig.packed_update = False with more "
        "RunConfig.micro_batches")
    full = health.out_of_memory_error(RuntimeError(_OOM.format("jit_update")), remat="full", micro_batches=2,
                                      packed=True)
    assert "remat" not in str(full) and "Its rows hold whole trees" in str(full)
    expanded = health.out_of_memory_error(RuntimeError(_OOM.format("jit_update")), remat="dots", micro_batches=4)
    assert str(expanded).endswith("fixes: more RunConfig.micro_batches (now 4); or RunConfig.remat = 'full' "
                                  "(now 'dots')")
    sampler = health.out_of_memory_error(RuntimeError(_OOM.format("jit_decode")), remat=False, micro_batches=1)
    assert str(sampler).startswith("the device ran out of memory in jit_decode: Out of memory while trying")
    assert "RunConfig.prompts_per_step" in str(sampler)
    cpu = health.out_of_memory_error(RuntimeError("INTERNAL: Error dispatching computation: Out of memory "
                                                  "allocating 17614855432 bytes."), remat=False, micro_batches=2)
    assert isinstance(cpu, DeviceMemoryError) and str(cpu) == (
        "the run ran out of memory in a compiled program: Out of memory allocating 17614855432 bytes (16.4 GiB of "
        "host memory); fixes: smaller RunConfig.prompts_per_step / TreeConfig.num_leaves / EvalConfig.batch_size; "
        "or more RunConfig.micro_batches (now 2); or RunConfig.remat = 'full' (now False)")
    assert health.out_of_memory_error(RuntimeError("INTERNAL: something else"), remat=False, micro_batches=1) is None
    assert health.out_of_memory_error(ValueError(_OOM.format("jit_update")), remat=False, micro_batches=1) is None


def test_the_loop_reads_the_run_settings_into_the_memory_error():
    """``loop.memory_error``: the run's remat, micro-batches and packed layout's row length reach the message."""
    from types import SimpleNamespace

    floor = SimpleNamespace(shape=(4, 98304, 16))
    r = SimpleNamespace(cfg=SimpleNamespace(remat=False, micro_batches=1, packed_update=True),
                        learner=SimpleNamespace(layout=SimpleNamespace(floor=floor)))
    assert "Its rows of 98304 tokens" in str(loop.memory_error(r, RuntimeError(_OOM.format("jit_update"))))
    r.learner.layout = SimpleNamespace()  # the expanded layout has no floor
    r.cfg.packed_update = False
    assert "more RunConfig.micro_batches (now 1)" in str(loop.memory_error(r, RuntimeError(_OOM.format("jit_update"))))
    assert loop.memory_error(r, RuntimeError("INTERNAL: other")) is None


def test_nonfinite_update_in_the_jitted_step_becomes_a_divergence_error():
    """nonfinite='raise' inside the update raises in a host callback; jax hands the loop a JaxRuntimeError whose
    text holds the FloatingPointError: the loop turns it into one DivergenceError line."""
    import jax
    import jax.numpy as jnp

    from treejax.rl.update import _raise_nonfinite

    @jax.jit
    def update(loss):
        jax.debug.callback(_raise_nonfinite, jnp.isfinite(loss), 3, loss, loss)
        return loss

    with pytest.raises(Exception) as err:
        jax.block_until_ready(update(jnp.float32(np.nan)))
    error = health.nonfinite_update_error(err.value)
    assert isinstance(error, DivergenceError)
    assert str(error) == ("non-finite update at step 3: loss=nan, grad_norm=nan; stopped before export "
                          "(nonfinite='raise'); lower OptimizerConfig.learning_rate")
    assert health.nonfinite_update_error(RuntimeError("INTERNAL: something else")) is None
    assert health.nonfinite_update_error(ValueError("FloatingPointError: non-finite update at step 1")) is None
